"""The fast path: normalization, exact rationals, and soundness against math-verify."""

import time
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.rewards.normalize import MAX_NUMBER_CHARS, brace_shorthand_arguments, fast_compare, normalize_answer


def verdict(pred: str, gold: str) -> bool | None:
    return fast_compare(normalize_answer(pred), normalize_answer(gold))


@pytest.mark.parametrize(
    ("answer", "text", "value"),
    [
        ("\\dfrac{3}{4}", "\\frac{3}{4}", Fraction(3, 4)),
        ("\\tfrac12", "\\frac12", Fraction(1, 2)),
        ("-\\frac{1}{2}", "-\\frac{1}{2}", Fraction(-1, 2)),
        ("\\frac{-1}{2}", "\\frac{-1}{2}", Fraction(-1, 2)),
        ("$ 1/2 $", "1/2", Fraction(1, 2)),
        ("\\text{(A)}", "A", None),
        ("\\textbf{(B)}", "B", None),
        ("x = 2.", "2", Fraction(2)),
        ("\\left( 0 , 1 \\right]", "(0,1]", None),
        ("1{,}000", "1,000", Fraction(1000)),  # thousands separators, also LaTeX's {,}
        ("1,2", "1,2", None),  # a list, not a thousands separator
        ("\\frac9{19}", "\\frac9{19}", Fraction(9, 19)),  # MATH's brace-free shorthand
        ("\\frac 59", "\\frac59", Fraction(5, 9)),
        ("\\frac 3 4", "\\frac3 4", Fraction(3, 4)),  # the two one-digit arguments may be spaced
        ("\\dfrac 1 2", "\\frac1 2", Fraction(1, 2)),
        ("\\frac1 23", "\\frac1 23", None),  # \frac{1}{2} times 3, not a fraction literal
        ("\\boxed{1}, \\boxed{234}", "1,234", None),  # several boxes: a list, never the number 1234
        ("\\boxed{1} \\text{ and } \\boxed{2}", "1,2", None),
        ("32, 349", "32,349", None),
        ("\\frac{3}{-4}", "\\frac{3}{-4}", Fraction(-3, 4)),
        (".75", ".75", Fraction(3, 4)),
        ("1.\\overline{3}", "1.\\overline{3}", Fraction(4, 3)),  # repeating decimals are exact
        ("0.1\\bar{6}", "0.1\\bar{6}", Fraction(1, 6)),
        ("18 miles", "18", Fraction(18)),  # unit words carry no value
        ("5 miles per hour", "5", Fraction(5)),
        ("12\\text{ cm}^2", "12", Fraction(12)),
        ("3 hundred", "3hundred", None),  # words that change the value are not units
        ("2 pi", "2pi", None),
        ("2x", "2x", None),  # one letter is a variable
        ("1\\,000", "1000", Fraction(1000)),  # a thin space is only spacing
        ("\\pi r^2", "\\pi r^2", None),  # "\pir" would be another macro
        ("2 3", "2 3", None),  # digits are not glued together
        ("{{7}}", "7", Fraction(7)),
        ("(-5)", "-5", Fraction(-5)),
        ("\u22123", "-3", Fraction(-3)),  # unicode minus
        ("007", "007", Fraction(7)),
        ("1/0", "1/0", None),  # no division by zero
        ("9" * (MAX_NUMBER_CHARS + 1), "9" * (MAX_NUMBER_CHARS + 1), None),  # no huge ints
    ],
)
def test_normalize_answer(answer, text, value):
    normalized = normalize_answer(answer)
    assert normalized.text == text
    assert normalized.value == value


def test_an_answer_written_as_several_boxes_reaches_math_verify_as_one_list():
    normalized = normalize_answer("$\\boxed{1}$ and $\\boxed{x = 2}$")
    assert normalized.is_list and normalized.for_math_verify == "1, x = 2"
    assert not normalize_answer("1,234").is_list and normalize_answer("1, 234").is_list


@pytest.mark.parametrize(
    ("text", "braced"),
    [
        ("\\frac3{3}", "\\frac{3}{3}"),
        ("\\frac{3}3", "\\frac{3}{3}"),
        ("\\dfrac34", "\\dfrac{3}{4}"),
        ("-\\tfrac12", "-\\tfrac{1}{2}"),
        ("\\frac 3 4", "\\frac{3}{4}"),  # spaces only separate the arguments
        ("\\frac\\pi2", "\\frac{\\pi}{2}"),  # a command without arguments is one token
        ("\\frac{1}x", "\\frac{1}{x}"),
        ("\\frac12x", "\\frac{1}{2}x"),  # one token each: (1/2) x
        ("2 + \\frac{3}\\pi", "2 + \\frac{3}{\\pi}"),
        ("\\frac{\\frac1x}2", "\\frac{\\frac{1}{x}}{2}"),
        ("\\sqrt\\pi", "\\sqrt{\\pi}"),
        ("\\sqrt[3]8", "\\sqrt[3]{8}"),
        ("2^\\frac12", "2^{\\frac{1}{2}}"),  # a script's argument is the whole fraction
        ("e^\\frac{x}{2}", "e^{\\frac{x}{2}}"),
        ("\\frac{1}{2}", "\\frac{1}{2}"),  # nothing to brace
        ("\\frac\\sqrt23", "\\frac\\sqrt{2}3"),  # \\sqrt takes an argument: no one-token argument of \\frac
        ("\\\\frac12", "\\\\frac12"),  # a line break, then the word "frac"
        ("\\frac1", "\\frac1"),  # a missing argument: left as written
        ("\\frac{1", "\\frac{1"),
    ],
)
def test_brace_shorthand_arguments_reads_them_as_tex_does(text, braced):
    assert brace_shorthand_arguments(text) == braced


def test_brace_less_arguments_reach_math_verify_braced():
    assert normalize_answer("\\frac\\pi2").for_math_verify == "\\frac{\\pi}{2}"
    assert normalize_answer("\\frac{\\pi}{2}").for_math_verify is None
    assert normalize_answer("\\boxed{\\frac\\pi2}, \\boxed{1}").for_math_verify == "\\frac{\\pi}{2}, 1"
    # The fast path's reading is unchanged: a brace-less quotient is still a quotient.
    assert normalize_answer("\\frac3{3}").form == normalize_answer("\\frac{3}{3}").form == "quotient"


@pytest.mark.parametrize(
    "text",
    ["\\frac{" * 150_000, "\\sqrt[" * 150_000, "\\frac" * 150_000, "\\frac12" * 100_000, "x^\\frac12" * 80_000,
     "\\frac" + " " * 1_000_000 + "1"],
)
def test_brace_shorthand_arguments_is_linear_on_megabyte_inputs(text):
    start = time.perf_counter()
    brace_shorthand_arguments(text)
    assert time.perf_counter() - start < 2.0


@pytest.mark.parametrize(
    ("answer", "marks"),
    [
        ("10\\%", {"percent"}),
        ("90^\\circ", {"degrees"}),
        ("90^{\\circ}", {"degrees"}),
        ("x=2", {"assign:x"}),
        ("\\$5", {"currency"}),
        ("$5$", set()),  # math delimiters are not currency
        ("\\sin 30^\\circ", {"degrees"}),
        ("30°", {"degrees"}),
        ("30 degrees", {"degrees"}),
        ("28 percent", {"percent"}),
        ("12 cm", set()),
    ],
)
def test_lossy_steps_are_marked(answer, marks):
    assert normalize_answer(answer).marks == frozenset(marks)


@pytest.mark.parametrize(
    ("pred", "gold"),
    [
        ("1/2", "0.5"),
        ("\\frac{1}{2}", "0.5"),
        ("\\frac12", "1/2"),
        ("0.50", "\\dfrac{1}{2}"),
        ("-0.5", "-\\frac{1}{2}"),
        ("x=2", "2"),
        ("2", "x = 2"),
        ("10\\%", "10"),
        ("10", "10\\%"),
        ("90^\\circ", "90"),
        ("\\text{(A)}", "A"),
        ("(A)", "\\textbf{A}"),
        ("\\left(0,1\\right]", "(0, 1]"),
        ("5.", "5"),
        ("\\$5", "5"),
        ("\\frac 3 4", "0.75"),
        ("\\frac 3 4", "\\frac34"),
        ("1, 234", "\\boxed{1}, \\boxed{234}"),
    ],
)
def test_true_equalities_are_decided_equal(pred, gold):
    assert verdict(pred, gold) is True


@pytest.mark.parametrize(
    ("pred", "gold"),
    [("0.333", "1/3"), ("2", "-2"), ("12", "1.2"), ("3", "\\frac{1}{3}"), ("0", "1"), ("x=3", "2"),
     (".0000673", ".0000672"), ("0.0000014", "0.000001"), ("0.08333", "\\frac{1}{12}"), ("\\frac 3 4", "3/5"),
     # A list is never one number, though both read "1,234" once spaces are gone.
     ("1,234", "\\boxed{1}, \\boxed{234}"), ("1234", "\\boxed{1}, \\boxed{234}"), ("32,349", "32, 349"),
     ("32, 349", "32349")],
)
def test_plain_number_near_misses_are_decided_unequal(pred, gold):
    assert verdict(pred, gold) is False


@pytest.mark.parametrize(
    ("pred", "gold", "agree"),
    [
        ("0.333333", "1/3", True),  # 6 decimal places, as math-verify rounds
        ("0.166667", "1/6", True),
        ("1.000001", "1", True),  # |a - g| = 1e-6: the absolute bound from 0.01 up
        ("1.0000011", "1", False),
        ("0.00006721", "0.0000672", False),  # relative below 0.01: 1e-4 |g| = 6.72e-9
        ("0.000067200006", "0.0000672", True),
        ("0", "0.0000001", False),
    ],
)
def test_decimal_tolerance_is_relative_for_small_magnitudes(pred, gold, agree):
    assert verdict(pred, gold) is agree


@pytest.mark.parametrize(
    ("pred", "gold"),
    [
        ("10\\%", "0.1"),  # percent may be a fraction
        ("10\\%", "10^\\circ"),  # different lossy steps never compare equal here
        ("2\\sqrt{2}", "\\sqrt{8}"),
        ("\\{1,2\\}", "\\{2,1\\}"),
        ("1,2", "12"),
    ],
)
def test_everything_else_is_left_to_math_verify(pred, gold):
    assert verdict(pred, gold) is None


# Soundness: whenever the fast path decides, math-verify agrees. Numbers are written
# in every notation the fast path understands.
def _written(value: Fraction, style: int) -> str:
    if style == 3:
        return f"{float(value):.6f}"
    if value.denominator == 1:
        return str(value.numerator)
    if style == 0:
        return f"{value.numerator}/{value.denominator}"
    if style == 1:
        sign = "-" if value < 0 else ""
        return f"{sign}\\frac{{{abs(value.numerator)}}}{{{value.denominator}}}"
    return f"\\dfrac{{{value.numerator}}}{{{value.denominator}}}"


_fractions = st.fractions(min_value=-1000, max_value=1000, max_denominator=12)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    a=_fractions,
    b=_fractions,
    style_a=st.integers(0, 3),
    style_b=st.integers(0, 3),
    same=st.booleans(),
)
def test_fast_path_never_contradicts_math_verify(a, b, style_a, style_b, same):
    from math_verify import parse, verify

    if same:
        b = a
    pred, gold = _written(a, style_a), _written(b, style_b)
    decided = verdict(pred, gold)
    if decided is None:
        return
    reference = verify(
        parse("\\boxed{" + gold + "}", parsing_timeout=None),
        parse("\\boxed{" + pred + "}", parsing_timeout=None),
        timeout_seconds=None,
    )
    assert decided == reference, (pred, gold)
