"""Last-box extraction from model responses: balanced braces, lists of boxes, plain-text expressions, linear time."""

import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.rewards.extract import box_list, enclosing_expression, final_boxed, find_closing_brace, last_boxed


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so $x = \\boxed{2}$.", "2"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("first \\boxed{1}, then \\boxed{7}", "7"),  # the last box wins
        ("\\boxed {17}.", "17"),
        ("\\boxed\n{17}", "17"),
        ("so the answer is $\\boxed 2$.", "2"),  # brace-less form
        ("\\fbox{5}", "5"),
        ("\\boxed{1} then \\fbox{3}", "3"),
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),  # escaped braces do not close the group
        ("\\boxed{a} \\boxedsomething", "a"),  # another macro
        ("\\boxed{a}\\\\{b}", "a"),  # \\ is a line break, not an escaped brace
        ("\\boxed{\\boxed{4}}", "4"),  # the inner box starts last
        ("}}}} \\boxed{ 12 } }}}}", " 12 "),  # raw substring, whitespace kept
    ],
)
def test_last_boxed_returns_the_raw_content_of_the_last_box(text, expected):
    boxed = last_boxed(text)
    assert boxed is not None
    assert boxed.content == expected


@pytest.mark.parametrize(
    "text",
    [
        "\\boxed{\\frac{1}{2}",  # truncated at the generation limit
        "\\boxed{1} and finally \\boxed{2",  # an earlier complete box is not used
        "\\boxed",
        "\\boxed{\\}",  # the only brace after the box is escaped
    ],
)
def test_an_unclosed_last_box_has_no_content(text):
    boxed = last_boxed(text)
    assert boxed is not None
    assert boxed.content is None


@pytest.mark.parametrize("text", ["no box, answer 5", "\\boxedsomething{3}", ""])
def test_no_box_is_none(text):
    assert last_boxed(text) is None


def test_find_closing_brace_skips_escapes_and_reports_unbalanced():
    text = "{a\\}{b}c}"
    assert find_closing_brace(text, 0) == len(text) - 1
    assert find_closing_brace("{{}", 0) is None


@given(st.text(alphabet=st.characters(blacklist_characters="{}\\"), max_size=50))
def test_any_brace_free_content_round_trips(content):
    boxed = last_boxed("prefix \\boxed{x} more " + "\\boxed{" + content + "} suffix")
    assert boxed is not None
    assert boxed.content == content


@pytest.mark.parametrize(
    "text",
    ["{" * 1_000_000, "\\boxed{" * 150_000, "\\boxed{" + "{" * 1_000_000, "\\" * 1_000_000],
)
def test_adversarial_megabyte_inputs_are_linear(text):
    start = time.perf_counter()
    last_boxed(text)
    assert time.perf_counter() - start < 2.0


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so \\boxed{1}, \\boxed{2}.", "\\boxed{1}, \\boxed{2}"),  # one answer written as two boxes
        ("The roots are $\\boxed{1}$ and $\\boxed{2}$.", "\\boxed{1}$ and $\\boxed{2}"),
        ("$\\boxed{1}$ \\quad\\text{and}\\quad $\\boxed{2}$", "\\boxed{1}$ \\quad\\text{and}\\quad $\\boxed{2}"),
        # "or" joins two forms of one answer, not a list
        ("$\\boxed{15\\frac{39}{40}},$ or $\\boxed{\\frac{639}{40}}$", "\\frac{639}{40}"),
        ("\\boxed{1};\\boxed{2}, and \\boxed{3}", "\\boxed{1};\\boxed{2}, and \\boxed{3}"),
        ("\\boxed{\\boxed{1}, \\boxed{2}}", "\\boxed{1}, \\boxed{2}"),  # the enclosing box is not part of the list
        ("first \\boxed{1}, then \\boxed{7}", "7"),  # a word between boxes: an intermediate result
        ("\\boxed{3} for part (a) and \\boxed{1}", "1"),
        ("$y_1 = \\boxed{2}$ and $y_2 = \\boxed{3}$", "3"),
        ("\\boxed{2}\\quad\\boxed{3}", "3"),  # no comma, semicolon, "and" or "or": not a list
        ("\\boxed{2}\\boxed{3}", "3"),
        ("\\boxed{}, \\boxed{3}", "3"),  # an empty box is no item
        ("\\boxed{2}, \\boxed{}", ""),
        ("\\boxed{5}", "5"),
    ],
)
def test_final_boxed_joins_the_boxes_the_last_one_lists_with(text, expected):
    boxed = final_boxed(text)
    assert boxed is not None and boxed.content == expected
    assert boxed.content in text


def test_final_boxed_keeps_an_unclosed_last_box_unread():
    assert final_boxed("\\boxed{1}, \\boxed{2").content is None
    assert final_boxed("no box") is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("\\boxed{1}, \\boxed{234}", ["1", "234"]),
        ("\\boxed{1} \\text{ and } \\boxed{2}", ["1", "2"]),
        ("\\(\\boxed{1}\\) and \\(\\boxed{-2}\\).", ["1", "-2"]),
        ("$$\\boxed{2}, \\boxed{3}, \\boxed{5}$$", ["2", "3", "5"]),
        ("\\boxed{1}$ and $\\boxed{2}", ["1", "2"]),
        ("\\boxed{1}$ or $\\boxed{2}", None),
        ("\\boxed{1}", None),  # one box is not a list
        # Nothing but boxes: a list whatever spacing joins them (a gold written this way is never 12).
        ("\\boxed{1}\\boxed{2}", ["1", "2"]),
        ("\\boxed{-1}\\ \\boxed{4}", ["-1", "4"]),
        ("$\\boxed{1}$ $\\boxed{2}$", ["1", "2"]),
        ("\\boxed{1} papers and \\boxed{2} bins", None),
        ("\\boxed{1}, 2", None),
        ("x = \\boxed{1}, \\boxed{2}", None),
        ("\\boxed{1}, \\boxed{}", None),
        ("1, 2", None),
    ],
)
def test_box_list_reads_a_whole_answer_written_as_several_boxes(text, expected):
    assert box_list(text) == expected


@pytest.mark.parametrize(
    ("text", "number", "expected"),
    [
        ("So the answer is 2x+1", "2", "2x+1"),  # math-verify reads only the "2"
        ("the answer is 2x+1.", "2", "2x+1"),
        ("Thus we get 2x + 1", "1", "2x + 1"),  # ... or only the last term
        ("the answer is 3x^2 - 2x + 1.", "3", "3x^2 - 2x + 1"),
        ("the answer is -2x+1", "-2", "-2x+1"),
        ("the answer is 2\\sqrt{3}", "2", "2\\sqrt{3}"),
        ("the answer is 2(x+3) now", "2", "2(x+3)"),  # a coefficient: the expression needs no sentence end
        ("(the answer is x + 1)", "1", "x + 1"),  # the unmatched bracket is not part of it
        ("y = 2x+1", "2", "2x+1"),  # the right-hand side only
        ("The answer is 5 - a classic result", "5", None),  # prose, not an expression
        ("The answer is 12cm", "12", None),  # a word (a unit) is not a variable
        ("The answer is 12 cm", "12", None),
        ("The answer is 3 + 4", "4", None),  # numbers only: math-verify's reading stands
        ("The answer is 42.", "42", None),
        ("the answer is 2(x+3", "2", None),  # an unclosed bracket
        # Written in LaTeX, which prose never is: spaces before a command or its argument,
        # powers, and words after it do not cut the expression.
        ("The answer is 2 \\pi", "2", "2 \\pi"),
        ("So the volume is 288 \\pi cubic units.", "288", "288 \\pi"),
        ("The answer is 10 \\sqrt{2}.", "10", "10 \\sqrt{2}"),
        ("The answer is 3 + \\sqrt 5", "3", "3 + \\sqrt 5"),
        ("The answer is 2^{10}", "2", "2^{10}"),
        ("x = 2 + \\sqrt{3} and we are done", "2", "2 + \\sqrt{3}"),
        ("The answer is 2\\times 10^5", "2", "2\\times 10^5"),  # an operator command is no term
        ("The answer is 12\\frac{1}{2}", "\\frac{1}{2}", "12\\frac{1}{2}"),  # math-verify's bare fraction
        ("The answer is 1 + \\frac{1}{2}", "\\frac{1}{2}", "1 + \\frac{1}{2}"),
        ("Since y \\le 1, the maximum is 1.", "1", None),  # a relation, like "=", separates
        ("The answer is 5 \\text{ cm}.", "5", None),  # a unit in \\text{} is no term
        ("The answer is 5 \\quad and more", "5", None),
    ],
)
def test_enclosing_expression_finds_the_expression_a_number_is_a_term_of(text, number, expected):
    start = text.rindex(number)
    span = enclosing_expression(text, start, start + len(number))
    assert (None if span is None else text[span[0] : span[1]]) == expected


@pytest.mark.parametrize(
    "text",
    [
        "\\boxed{1}, " * 100_000,
        "\\boxed{" * 150_000 + "1" + "}" * 150_000,
        "\\boxed{a}" * 100_000,
        "\\boxed{1} and " * 50_000 + "\\boxed{" * 50_000,
    ],
)
def test_box_lists_are_linear_on_adversarial_megabyte_inputs(text):
    start = time.perf_counter()
    final_boxed(text)
    box_list(text)
    assert time.perf_counter() - start < 2.0


def test_enclosing_expression_is_bounded_on_a_megabyte_expression():
    text = "the answer is 2x" + "+1" * 500_000
    start = time.perf_counter()
    assert enclosing_expression(text, 14, 15) is None  # longer than any answer: left to math-verify's reading
    assert time.perf_counter() - start < 2.0


@pytest.mark.parametrize(
    "text",
    [
        "the answer is 2" + " \\pi" * 250_000,
        "the answer is 2" + " " * 1_000_000 + "\\pi",
        "the answer is 2 " + "\\sqrt " * 150_000 + "5",
        "the answer is 2" + " \\le" * 250_000,
    ],
)
def test_enclosing_expression_is_linear_on_spaced_commands(text):
    # _PLAIN_EXPRESSION nests quantifiers (spaces, then a command, repeated): possessive, so linear.
    start = time.perf_counter()
    enclosing_expression(text, 14, 15)
    assert time.perf_counter() - start < 2.0
