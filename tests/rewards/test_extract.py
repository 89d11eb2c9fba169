"""Last-box extraction from model responses: balanced braces, linear time."""

import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.rewards.extract import find_closing_brace, last_boxed


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
