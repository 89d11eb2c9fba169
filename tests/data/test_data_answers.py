"""Reference-answer extraction: last balanced \\boxed{}, GSM8K ####."""

import pytest

from pipeline.data.answers import gsm8k_final_answer, last_boxed


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so $x = \\boxed{2}$.", "2"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # nested braces kept
        ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}.", "\\left( 3, \\frac{\\pi}{2} \\right)"),
        ("first \\boxed{1}, then \\boxed{7}", "7"),  # the last box wins
        ("\\boxed{ 12 }", "12"),  # stripped
        ("\\boxed {17}.$$- OR -", "17"),  # a space before the brace (MATH train)
        ("so the answer is $\\boxed 2$.", "2"),  # brace-less form (MATH train)
        ("\\fbox{5}", "5"),
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),  # escaped braces do not close the group
        ("\\boxed{a} \\boxedsomething", "a"),  # \boxedsomething is another command
        ("\\boxed{a}\\\\{b}", "a"),  # \\ is a line break, not an escaped brace
    ],
)
def test_last_boxed_extracts_the_last_balanced_box(text, expected):
    assert last_boxed(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "no box here, answer 5",
        "\\boxed{\\frac{1}{2}",  # unbalanced: truncated solution
        "\\boxed{1} and finally $\\boxed{}$",  # empty last box: do not fall back to an earlier one
        "\\boxed",
        "\\boxed{   }",
    ],
)
def test_last_boxed_returns_none_without_a_usable_last_box(text):
    assert last_boxed(text) is None


@pytest.mark.parametrize(
    ("solution", "expected"),
    [
        ("She makes 9 * 2 = $<<9*2=18>>18 every day.\n#### 18", "18"),
        ("... \n#### 1,080", "1080"),
        ("#### -3", "-3"),
        ("a #### 1\n#### 2", "2"),
    ],
)
def test_gsm8k_final_answer(solution, expected):
    assert gsm8k_final_answer(solution) == expected


@pytest.mark.parametrize("solution", ["no marker 18", "#### ", "####"])
def test_gsm8k_final_answer_none(solution):
    assert gsm8k_final_answer(solution) is None
