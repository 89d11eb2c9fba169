"""An answer graded correct must be an answer: not the question copied, not unevaluated arithmetic."""

from __future__ import annotations

import pytest

from pipeline.rewards import GradingPool, Reason, grade
from pipeline.rewards.answer_rules import number_literal, rejection, restates_problem

PROBLEM = "What is 30 * 69?"


@pytest.mark.parametrize(("text", "expected"), [
    ("2070", True), ("-41", True), ("2,070", True), ("3.25", True), ("\\frac{1}{2}", True), ("-\\dfrac{3}{4}", True),
    ("7/2", True), ("x=2", True), ("x_1 = -3", True), ("x=y", False), ("\\$18", True), ("25\\%", True), ("1\\,000", True), ("12.", True),
    ("90^\\circ", True), ("5\\text{ cm}", True), ("\\mathrm{(B)}", False),
    ("\\frac 3 4", True), ("\\dfrac 1 2", True), ("\\frac3{4}", True), ("\\frac 3 3", False), ("\\frac3{3}", False),
    ("\\boxed{1}, \\boxed{234}", False), ("1, 234", False),
    ("30 * 69", False), ("2^{10}", False), ("\\sqrt{2}", False), ("x + 1", False), ("", False), ("1e3", False),
])
def test_number_literals(text, expected):
    assert number_literal(text) is expected


def test_an_expression_copied_from_the_question_restates_it():
    assert restates_problem("30*69", problem=PROBLEM, gold="2070")
    assert restates_problem(" 30 *  69 ", problem=PROBLEM, gold="2070")  # whitespace does not matter
    assert not restates_problem("69*30", problem=PROBLEM, gold="2070")  # not a copy (the literal rule catches it)
    assert not restates_problem("2070", problem="What is 2070 - 0?", gold="2070")  # bare numbers never
    # A choice among options named in the question: the gold is there too, so it still counts.
    assert not restates_problem("2^{10}", problem="Which is larger, 2^{10} or 10^3?", gold="2^{10}")
    # Simplify-type questions: the unsimplified form is a copy.
    assert restates_problem("\\sqrt{8}", problem="Simplify \\sqrt{8}.", gold="2\\sqrt{2}")
    # Shorthand is compared braced, however it is spaced.
    assert restates_problem("\\frac34", problem="Write $\\frac 3 4$ as a decimal.", gold="0.75")
    assert restates_problem("\\frac 3 4", problem="Write $\\frac{3}{4}$ as a decimal.", gold="0.75")
    assert restates_problem("\\frac\\pi2", problem="Convert $\\frac{\\pi}{2}$ radians to degrees.", gold="90")
    assert restates_problem("\\frac{1}x", problem="Write $\\frac1x$ with a positive exponent.", gold="x^{-1}")
    # A list written as boxes is compared as the list.
    problem = "Order 1, 2, 3 from largest to smallest."
    assert restates_problem("\\boxed{1}, \\boxed{2}, \\boxed{3}", problem=problem, gold="3, 2, 1")
    assert not restates_problem("\\boxed{3}$, $\\boxed{2}$ and $\\boxed{1}", problem=problem, gold="3, 2, 1")


@pytest.mark.parametrize(("response", "reason"), [
    ("30 * 69 =}", Reason.RESTATES_PROBLEM),  # the hack our GRPO run found (no box; math-verify's fallback)
    ("\\boxed{30 * 69}", Reason.RESTATES_PROBLEM),
    ("\\boxed{69 * 30}", Reason.NOT_A_NUMBER),
    ("\\boxed{2000 + 70}", Reason.NOT_A_NUMBER),
    ("\\boxed{2070}", Reason.CORRECT),
    ("so 30 * 69 = \\boxed{2,070}", Reason.CORRECT),
    ("\\boxed{2071}", Reason.WRONG),
])
def test_grade_applies_the_rules_to_correct_answers_only(response, reason):
    result = grade(response, "2070", problem=PROBLEM, format_reward=0.1)
    assert result.reason is reason
    has_box = "\\boxed" in response
    expected = (1.0 if reason is Reason.CORRECT else 0.0) + (0.1 if has_box else -0.1)
    assert result.score == pytest.approx(expected)


def test_symbolic_mode_keeps_math_verify_equality_but_still_rejects_copies():
    assert grade("\\boxed{69 * 30}", "2070", numeric_answers="symbolic").reason is Reason.CORRECT
    assert grade("\\boxed{2^{10}}", "1024", numeric_answers="symbolic").reason is Reason.CORRECT
    assert grade("\\boxed{30*69}", "2070", problem=PROBLEM, numeric_answers="symbolic").reason is Reason.RESTATES_PROBLEM


def test_non_numeric_golds_keep_symbolic_equality():
    assert grade("\\boxed{\\frac{\\pi}{3}}", "\\frac{\\pi}{3}").is_correct
    assert grade("\\boxed{0.5}", "\\frac{1}{2}").is_correct
    assert rejection(None, gold="2070", problem=PROBLEM, numeric_answers="literal") is None


def test_the_pool_applies_the_rules_with_and_without_problems():
    with GradingPool(1) as pool:
        grades = pool.grade_batch([("\\boxed{30*69}", "2070", PROBLEM), ("\\boxed{30*69}", "2070"),
                                   ("\\boxed{2070}", "2070", PROBLEM)])
    assert [g.reason for g in grades] == [Reason.RESTATES_PROBLEM, Reason.NOT_A_NUMBER, Reason.CORRECT]


def test_unknown_numeric_mode_is_rejected():
    with pytest.raises(ValueError, match="numeric_answers"):
        grade("x", "1", numeric_answers="exact")
