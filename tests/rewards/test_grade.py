"""grade(): equivalent forms, near misses, format reward, bounds, and never raising."""

import pickle
import signal
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.rewards import Grade, Reason, grade
from pipeline.rewards.grader import GradeOptions, PendingGrade, prepare

# (response, gold): equal answers written differently. Those the fast path cannot
# decide (radicals, sets, intervals, expressions) exercise math-verify.
EQUIVALENT = [
    ("so \\boxed{\\frac{1}{2}}", "0.5"),
    ("\\boxed{1/2}", "\\frac{1}{2}"),
    ("\\boxed{0.5}", "\\dfrac{1}{2}"),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}"),
    ("\\boxed{\\{1,2\\}}", "\\{2,1\\}"),
    ("\\boxed{(0, 1]}", "(0,1]"),
    ("\\boxed{x=2}", "2"),
    ("\\boxed{x = 2}", "x=2"),
    ("The answer is \\boxed{\\text{(A)}}.", "A"),
    ("\\boxed{10\\%}", "10"),
    ("\\boxed{90^\\circ}", "90"),
    ("\\boxed{-3}", "-3"),
    ("\\boxed{(x+1)^2}", "x^2+2x+1"),
    ("\\boxed{\\frac{\\pi}{2}}", "\\pi/2"),
    ("\\boxed{5\\text{ cm}}", "5"),
    ("$\\boxed{1,000}$", "1000"),
    ("\\fbox{7}", "7"),
    ("\\boxed{\\frac 3 4}", "3/4"),
    ("The roots are $\\boxed{1}$ and $\\boxed{2}$.", "1, 2"),  # one answer in several boxes
    ("\\boxed{1, 234}", "\\boxed{1} \\text{ and } \\boxed{234}"),
    ("So the answer is 2x+1", "2x+1"),  # unboxed: the whole expression, not its first term
    ("\\boxed{\\frac\\pi2}", "\\frac{\\pi}{2}"),  # brace-less arguments read as TeX reads them
    ("\\boxed{\\frac{\\pi}{2}}", "\\frac\\pi2"),  # ... in the gold too
    ("\\boxed{\\frac{1}x}", "\\frac{1}{x}"),
    ("\\boxed{2^\\frac12}", "\\sqrt{2}"),
    ("$\\boxed{1,2}$", "$\\boxed{1}\\boxed{2}$"),  # a gold of boxes is a list, commas or not
    ("The answer is 2 \\pi", "2\\pi"),  # unboxed LaTeX: a space before a command does not cut it
    ("The answer is 12\\frac{1}{2}", "12\\frac12"),
]

NOT_EQUIVALENT = [
    ("\\boxed{0.333}", "1/3"),
    ("\\boxed{2}", "-2"),
    ("\\boxed{12}", "1.2"),
    ("\\boxed{\\sqrt{2}}", "2"),
    ("\\boxed{\\{1,3\\}}", "\\{1,2\\}"),
    ("\\boxed{[0,1]}", "(0,1]"),
    ("\\boxed{x^2+1}", "x^2-1"),
    ("\\boxed{\\text{(B)}}", "A"),
    ("\\boxed{1} so finally \\boxed{2}", "1"),  # the last box is the answer
    ("\\boxed{1}, \\boxed{2}", "2"),  # a list of boxes is not its last item
    ("\\boxed{1234}", "\\boxed{1}, \\boxed{234}"),
    ("So the answer is 2x+1", "2"),
    ("So the answer is 2x+2", "2x+1"),
    ("\\boxed{2^\\frac{\\pi}{2}}", "\\frac{\\pi}{2}"),  # the power of 2, not the fraction after "2^"
    ("\\boxed{12}", "\\boxed{1}\\boxed{2}"),  # not the number the digits of the boxes spell
    ("The answer is 2 \\pi", "2"),
    ("The final answer is 70 \\sqrt{2}", "70"),
    ("The answer is 1 + \\frac{1}{2}", "\\frac{1}{2}"),
]


@pytest.mark.parametrize(("response", "gold"), EQUIVALENT)
def test_equivalent_forms_are_correct(response, gold):
    result = grade(response, gold)
    assert result == Grade(1.0, Reason.CORRECT, result.extracted)
    assert result.extracted is not None and result.extracted in response


@pytest.mark.parametrize(("response", "gold"), NOT_EQUIVALENT)
def test_wrong_answers_and_near_misses_are_wrong(response, gold):
    result = grade(response, gold)
    assert result.reason is Reason.WRONG
    assert result.score == 0.0
    assert result.extracted in response


def test_without_a_box_math_verify_extracts_the_answer():
    right = grade("Adding them up, the final answer is 42.", "42")
    assert right.reason is Reason.CORRECT and right.extracted == "42"
    wrong = grade("Adding them up, the final answer is 41.", "42")
    assert wrong.reason is Reason.WRONG
    assert grade("I do not know.", "42").reason is Reason.NO_ANSWER


def test_truncated_last_box_falls_back_to_math_verify_extraction():
    # The last box never closes, so there is no boxed answer (and no format bonus).
    response = "first \\boxed{3}, so the final answer is 5, i.e. \\boxed{5"
    result = grade(response, "5", format_reward=0.1)
    assert result.reason is Reason.CORRECT
    assert result.score == pytest.approx(0.9)


@pytest.mark.parametrize(
    ("response", "expected_score", "reason"),
    [
        ("\\boxed{4}", 1.0 + 0.1, Reason.CORRECT),
        ("\\boxed{5}", 0.0 + 0.1, Reason.WRONG),
        ("the final answer is 4", 1.0 - 0.1, Reason.CORRECT),
        ("no idea", 0.0 - 0.1, Reason.NO_ANSWER),
        ("\\boxed{}", 0.0 - 0.1, Reason.NO_ANSWER),  # an empty box is no answer
    ],
)
def test_format_reward_is_a_bonus_with_a_box_and_a_penalty_without(
    response, expected_score, reason
):
    result = grade(response, "4", format_reward=0.1)
    assert result.reason is reason
    assert result.score == pytest.approx(expected_score)


def test_format_reward_defaults_to_zero():
    assert grade("no idea", "4").score == 0.0


def test_grader_failures_score_exactly_zero_even_with_format_reward():
    assert grade("\\boxed{4}", "", format_reward=0.5) == Grade(0.0, Reason.INVALID_GOLD, None)
    slow = grade("\\boxed{9^{9^{9^9}}}", "4", format_reward=0.5, timeout_s=0.3)
    assert slow == Grade(0.0, Reason.TIMEOUT, "9^{9^{9^9}}")


@pytest.mark.parametrize("gold", ["", "   ", "$$", None, 4, "\\,", "x" * 2000])
def test_invalid_gold(gold):
    assert grade("\\boxed{4}", gold).reason is Reason.INVALID_GOLD


@pytest.mark.parametrize("response", [None, b"\\boxed{4}", 4, ""])
def test_non_text_or_empty_response_is_no_answer(response):
    assert grade(response, "4").reason is Reason.NO_ANSWER


def test_overlong_boxed_answer_is_a_parse_error_without_parsing():
    result = grade("\\boxed{" + "1+" * 600 + "1}", "1201", max_answer_chars=1024)
    assert result == Grade(0.0, Reason.PARSE_ERROR, None)


def test_only_the_tail_of_a_long_response_is_searched():
    response = "\\boxed{1} " + "filler " * 2000 + "\\boxed{2}"
    assert grade(response, "2", max_response_chars=100).reason is Reason.CORRECT
    # The only box is outside the tail: no box, and math-verify finds no answer there.
    assert grade("\\boxed{2}" + " " * 200, "2", max_response_chars=100).reason is Reason.NO_ANSWER


def test_in_process_deadline_stops_a_runaway_sympy_computation():
    start = time.monotonic()
    result = grade("\\boxed{(10^8)!}", "5", timeout_s=0.5)
    assert time.monotonic() - start < 3.0
    assert result.reason is Reason.TIMEOUT


def test_in_process_deadline_restores_an_outer_interval_timer():
    fired = []
    previous = signal.signal(signal.SIGALRM, lambda *_: fired.append(True))
    try:
        signal.setitimer(signal.ITIMER_REAL, 30.0)
        assert grade("\\boxed{9^{9^{9^9}}}", "5", timeout_s=0.2).reason is Reason.TIMEOUT
        remaining, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 25.0 < remaining <= 30.0
        assert not fired
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_grade_works_off_the_main_thread():
    # math-verify's own signal.alarm timeouts would raise ValueError in a thread.
    results = []
    thread = threading.Thread(
        target=lambda: results.append(grade("\\boxed{2\\sqrt{2}}", "\\sqrt{8}"))
    )
    thread.start()
    thread.join()
    assert results[0].reason is Reason.CORRECT


@pytest.mark.parametrize(
    "response",
    [
        "__import__('os').system('touch {marker}')",
        "The answer is __import__('os').system('touch {marker}')",
        '\\boxed{{__import__("os").system("touch {marker}")}}',
        "\\boxed{{eval(\"open('{marker}', 'w')\")}}",
        "final answer is 1+__import__('os').system('touch {marker}')",
    ],
)
def test_model_output_is_never_executed(response, tmp_path):
    marker = tmp_path / "pwned"
    result = grade(response.format(marker=marker), "5")
    assert result.reason is not Reason.CORRECT and result.score == 0.0
    assert not marker.exists()


@pytest.mark.parametrize(
    "response",
    [
        "\\boxed{1\x00}",
        "\x00\x01\x02\\boxed{\x1b[31m5}",
        "\\boxed{5}\x00" * 3,
        "\x00" * 100_000,
        "\ud800\\boxed{5}",  # lone surrogate
    ],
)
def test_nul_and_control_characters_never_raise(response):
    result = grade(response, "5", timeout_s=2.0)
    assert isinstance(result, Grade)
    assert result.extracted is None or result.extracted in response


@pytest.mark.parametrize(
    "response",
    [
        "x" * 1_000_000 + "\\boxed{5}",
        "{" * 1_000_000,
        "\\boxed{" * 150_000,
        "1+" * 500_000,
        "\\frac{" * 200_000,
    ],
)
def test_megabyte_responses_return_quickly(response):
    start = time.monotonic()
    result = grade(response, "5", timeout_s=2.0)
    assert time.monotonic() - start < 2.5
    assert isinstance(result, Grade)


def test_prepare_decides_plain_numbers_without_sympy():
    options = GradeOptions()
    assert prepare("\\boxed{0.5}", "1/2", options) == Grade(1.0, Reason.CORRECT, "0.5")
    pending = prepare("\\boxed{\\sqrt{8}}", "2\\sqrt{2}", options)
    assert pending == PendingGrade(
        answer="\\sqrt{8}", response_tail="", gold="2\\sqrt{2}", has_box=True
    )


def test_grade_pickles():
    result = grade("\\boxed{4}", "4")
    assert pickle.loads(pickle.dumps(result)) == result
    assert result.reason == "correct" and result.is_correct


def test_invalid_options_raise_value_error():
    with pytest.raises(ValueError, match="format_reward"):
        grade("\\boxed{4}", "4", format_reward=float("nan"))
    with pytest.raises(ValueError, match="timeout_s"):
        grade("\\boxed{4}", "4", timeout_s=0)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    response=st.lists(
        st.sampled_from([*"\\{}()$^_0123456789xab=+-/.,%\x00 ", "\\boxed{", "\\frac", "\\sqrt"]),
        max_size=40,
    ).map("".join),
    gold=st.text(max_size=10),
)
def test_grade_never_raises(response, gold):
    result = grade(response, gold, timeout_s=2.0)
    assert isinstance(result, Grade)
    assert isinstance(result.reason, Reason)
    assert result.extracted is None or result.extracted in response
