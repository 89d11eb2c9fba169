"""``grade(response, gold) -> Grade``: a verifiable reward that never raises.

Model output is untrusted text. Nothing here evaluates it as code, and parsed sympy
objects are never converted to strings, printed or logged (``str()`` of some parsed
results does not return: https://github.com/huggingface/Math-Verify/issues/65).
``Grade.extracted`` is always a raw substring of the response.

Grading runs in three steps:

1. ``prepare`` (cheap, bounded, safe in the trainer process): keep the last
   ``max_response_chars`` of the response; take the last ``\\boxed{...}``/``\\fbox{...}``
   as the answer, with the boxes it closes a list with (``$\\boxed{1}$ and $\\boxed{2}$``
   is the answer ``1, 2``: ``extract.final_boxed``); reject answers and gold longer than
   ``max_answer_chars``; normalize both and compare (``normalize.fast_compare``). Most RL answers end here.
2. ``grade_with_math_verify`` (sympy; may be slow or stuck): parse the boxed answer,
   or, when there is no complete box, let math-verify extract one from the response
   tail (``extract_from_text``, which keeps the answer it found verbatim, so the
   answer rules see it), and verify it against the gold, which is parsed once per
   worker (LRU cache). Answers math-verify would misread (unit words, repeating
   decimals, ``°``) reach it rewritten by ``normalize``.
3. A deadline: ``grade()`` arms ``ITIMER_REAL`` around step 2 when called from the main
   thread. That stops Python-level sympy loops (``9^{9^{9^9}}``) but not a single
   long C call; ``pool.GradingPool`` runs step 2 in processes it can SIGKILL and is
   the way to grade untrusted output in training.

Score: ``1.0`` for ``correct`` and ``0.0`` otherwise, plus the format term
``+format_reward`` when the response has a complete, non-empty box and
``-format_reward`` when it has none. The format term applies to the outcomes the
response decides (``correct``, ``wrong``, ``no_answer``, ``parse_error``); grader
failures (``timeout``, ``memory``, ``worker_error``) and ``invalid_gold`` score
exactly ``0.0``.
"""

from __future__ import annotations

import enum
import functools
import itertools
import math
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from pipeline.rewards import answer_rules
from pipeline.rewards.answer_rules import NumericAnswers
from pipeline.rewards.extract import enclosing_expression, final_boxed
from pipeline.rewards.normalize import NormalizedAnswer, fast_compare, normalize_answer

__all__ = [
    "Grade",
    "GradeOptions",
    "PendingGrade",
    "Reason",
    "grade",
    "grade_with_math_verify",
    "prepare",
]


class Reason(enum.StrEnum):
    """Why a response got its score. A ``str``, so ``grade.reason == "correct"`` works."""

    CORRECT = "correct"  # the answer equals the gold answer
    WRONG = "wrong"  # an answer was parsed and it differs from the gold answer
    NO_ANSWER = "no_answer"  # no box and math-verify found nothing, or an empty box
    PARSE_ERROR = "parse_error"  # answer longer than max_answer_chars, or unparseable
    INVALID_GOLD = "invalid_gold"  # the gold answer is empty, too long or unparseable
    TIMEOUT = "timeout"  # grading passed its deadline (the pool killed the worker)
    MEMORY = "memory"  # grading hit the worker memory cap (see pool.GradingPool)
    WORKER_ERROR = "worker_error"  # unexpected exception in the grader or worker death
    RESTATES_PROBLEM = "restates_problem"  # copied from the question: boxed, whatever its value; unboxed, when equal to the gold
    NOT_A_NUMBER = "not_a_number"  # the gold is a number, the answer an unevaluated expression (answer_rules)


@dataclass(frozen=True, slots=True)
class Grade:
    """``score`` is the reward; ``extracted`` the raw answer substring (``None`` if none)."""

    score: float
    reason: Reason
    extracted: str | None

    @property
    def is_correct(self) -> bool:
        return self.reason is Reason.CORRECT


@dataclass(frozen=True, kw_only=True, slots=True)
class GradeOptions:
    """Grading knobs shared by ``grade`` and ``GradingPool``.

    ``format_reward`` is added when the response has a complete ``\\boxed{}`` and
    subtracted when it has none. Responses longer than ``max_response_chars`` are
    searched in their tail only; answers (extracted or gold) longer than
    ``max_answer_chars`` are not parsed.
    """

    format_reward: float = 0.0
    max_response_chars: int = 8192
    max_answer_chars: int = 1024
    numeric_answers: NumericAnswers = "literal"

    def __post_init__(self) -> None:
        if self.numeric_answers not in ("literal", "symbolic"):
            raise ValueError(f"numeric_answers must be 'literal' or 'symbolic', got {self.numeric_answers!r}")
        if not math.isfinite(self.format_reward):
            raise ValueError(f"format_reward must be finite, got {self.format_reward!r}")
        if self.max_response_chars < 1:
            raise ValueError(f"max_response_chars must be >= 1, got {self.max_response_chars}")
        if self.max_answer_chars < 1:
            raise ValueError(f"max_answer_chars must be >= 1, got {self.max_answer_chars}")


@dataclass(frozen=True, slots=True)
class PendingGrade:
    """A grading the fast path could not decide; plain strings only, so cheap to pickle.

    ``answer`` is the boxed answer, or ``None`` when math-verify must extract one from
    ``response_tail`` (then ``has_box`` is False).
    """

    answer: str | None
    response_tail: str
    gold: str
    has_box: bool


def _format_term(has_box: bool, options: GradeOptions) -> float:
    return options.format_reward if has_box else -options.format_reward


def _decided(
    reason: Reason, *, has_box: bool, extracted: str | None, options: GradeOptions
) -> Grade:
    """A grade for an outcome the response decided; the format term applies."""
    correctness = 1.0 if reason is Reason.CORRECT else 0.0
    return Grade(correctness + _format_term(has_box, options), reason, extracted)


def apply_answer_rules(grade: Grade, *, gold: str, problem: str | None, options: GradeOptions) -> Grade:
    """A correct grade that ``answer_rules`` rejects becomes wrong-scored with the rule as its reason."""
    if grade.reason is not Reason.CORRECT:
        return grade
    rule = answer_rules.rejection(grade.extracted, gold=gold, problem=problem, numeric_answers=options.numeric_answers)
    if rule is None:
        return grade
    return Grade(grade.score - 1.0, Reason(rule), grade.extracted)  # the wrong score: 0 + the same format term


def failure(reason: Reason, extracted: str | None = None) -> Grade:
    """A grade for a grader-side failure (timeout, memory, worker_error, invalid_gold)."""
    return Grade(0.0, reason, extracted)


@functools.lru_cache(maxsize=16384)
def _normalized_gold(gold: str) -> NormalizedAnswer:
    return normalize_answer(gold)


def _strip_math_delimiters(text: str) -> str:
    text = text.strip()
    if len(text) >= 2 and text[0] == "$" and text[-1] == "$":
        return text.strip("$").strip()
    return text


def prepare(response: Any, gold: Any, options: GradeOptions, problem: str | None = None) -> Grade | PendingGrade:
    """The cheap half of ``grade``: a final ``Grade``, or the work left for math-verify.

    A boxed answer copied from ``problem`` (``answer_rules.restates_problem``) is decided
    here: it could not count whatever its value, so no sympy time is spent on it.
    Linear in ``options.max_response_chars`` and safe on any input; never raises.
    """
    if not isinstance(gold, str):
        return failure(Reason.INVALID_GOLD)
    gold = _strip_math_delimiters(gold)
    if not gold or len(gold) > options.max_answer_chars:
        return failure(Reason.INVALID_GOLD)
    if not isinstance(response, str) or not response:
        return _decided(Reason.NO_ANSWER, has_box=False, extracted=None, options=options)
    tail = response[-options.max_response_chars :]
    boxed = final_boxed(tail)
    if boxed is None or boxed.content is None:
        # No complete box: math-verify's own extraction decides (in a worker).
        return PendingGrade(answer=None, response_tail=tail, gold=gold, has_box=False)
    answer = boxed.content
    if len(answer) > options.max_answer_chars:
        return _decided(Reason.PARSE_ERROR, has_box=True, extracted=None, options=options)
    normalized_gold = _normalized_gold(gold)
    if not normalized_gold.text:
        return failure(Reason.INVALID_GOLD)
    normalized = normalize_answer(answer)
    if not normalized.text:
        # "\boxed{}" holds no answer, so it earns no format bonus either.
        return _decided(Reason.NO_ANSWER, has_box=False, extracted=answer, options=options)
    if isinstance(problem, str) and answer_rules.restates_problem(answer, problem=problem, gold=gold):
        return _decided(Reason.RESTATES_PROBLEM, has_box=True, extracted=answer, options=options)
    verdict = fast_compare(normalized, normalized_gold)
    if verdict is None:
        return PendingGrade(answer=answer, response_tail="", gold=gold, has_box=True)
    reason = Reason.CORRECT if verdict else Reason.WRONG
    return _decided(reason, has_box=True, extracted=answer, options=options)


# ---------------------------------------------------------------------------------------
# math-verify (sympy) path


@functools.cache
def _math_verify() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """Import math-verify on first use: the fast path and the pool parent never need it."""
    import math_verify.grader
    import math_verify.parser
    from math_verify import parse, verify

    # Its "timeout is disabled" warning is for callers that own no deadline; we do
    # (the itimer in grade(), or the pool's SIGKILL).
    math_verify.grader.TIMEOUT_WARNING_SHOWN = True
    math_verify.parser.TIMEOUT_WARNING_SHOWN = True
    return parse, verify


def _parse(text: str) -> list[Any]:
    parse, _ = _math_verify()
    # parsing_timeout=None: its signal.alarm timeout raises ValueError off the main
    # thread and would fight with our own deadline.
    return parse(text, parsing_timeout=None)


@functools.lru_cache(maxsize=4096)
def _parsed_gold(gold: str) -> tuple[Any, ...]:
    return tuple(_parse("\\boxed{" + gold + "}"))


def _has_expression(parsed: list[Any]) -> bool:
    return any(not isinstance(item, str) for item in parsed)


@functools.cache
def _extraction_priorities() -> list[list[tuple[Any, Any]]]:
    """math-verify's answer-finding regexes for ``parse``'s default targets (LaTeX, then
    plain expressions), grouped by priority, most specific first."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig
    from math_verify.parser import get_extraction_regexes

    targets = get_extraction_regexes([LatexExtractionConfig(), ExprExtractionConfig()])
    patterns = sorted(
        ((pattern, target, priority) for regexes, target in targets for pattern, priority in regexes),
        key=lambda entry: entry[2],
    )
    return [
        [(pattern, target) for pattern, target, _ in group]
        for _, group in itertools.groupby(patterns, key=lambda entry: entry[2])
    ]


def _answer_span(match: re.Match[str]) -> tuple[int, int]:
    """Where the answer itself is in a match of math-verify's regexes (without the
    "final answer is" anchor or the ``$`` delimiters around it)."""
    spans = [
        match.span(name)
        for name, value in match.groupdict().items()
        if value is not None and _ANSWER_GROUP.match(name)
    ]
    if not spans:
        return match.span()
    return min(start for start, _ in spans), max(end for _, end in spans)


def _bare_fraction(match: re.Match[str]) -> bool:
    """Whether math-verify's match is a ``\\frac`` written outside math delimiters (its
    LaTeX regexes find those without the terms around them: "12\\frac{1}{2}", "1 + \\frac{1}{2}")."""
    return any(value is not None and name.endswith("_latexFraction") for name, value in match.groupdict().items())


# Named groups of math-verify's regexes that hold the answer: LaTeX environments
# ("first_latexInlineDollar", "next2_latexBoxed"), their percent signs, and the parts
# of a plain number or expression.
_ANSWER_GROUP = re.compile(r"(?:first|next\d)_(?:latex|percent)|integer|decimal|expr$|percent$")


# Operators plain text may use, in the LaTeX math-verify parses.
_PLAIN_OPERATORS = str.maketrans({"\u00d7": "\\times ", "\u00f7": "\\div ", "\u00b7": "\\cdot "})


def extract_from_text(text: str) -> tuple[list[Any], str | None]:
    """math-verify's extraction from unboxed text (``parse`` with its defaults), and
    the answer it graded as a verbatim substring of ``text`` (``None``: nothing found).

    ``parse`` reports the matched text after its LaTeX normalization (``\\left``
    dropped, ``\\dfrac`` → ``\\frac``, ``\\log_264`` → ``\\log_{2}{64}``), which is
    often not in the response; the answer rules must see what the response says, so
    this walks the same regexes in the same order and keeps the match's position.

    One correction: math-verify's plain-text regexes read numbers only, and its LaTeX
    regexes a bare ``\\frac`` only, so a number or bare fraction that is one term of an
    expression written in plain text ("the answer is 2x+1", "2 \\pi", "12\\frac{1}{2}")
    stands for the whole expression (``extract.enclosing_expression``), parsed as LaTeX.
    """
    from math_verify import ExprExtractionConfig
    from math_verify.parser import extract_match

    first_fallback: tuple[str, str] | None = None
    for group in _extraction_priorities():
        matches = sorted(
            ((match, target) for pattern, target in group for match in pattern.finditer(text)),
            key=lambda entry: (entry[0].end(), -entry[0].start()),
            reverse=True,
        )
        for match, target in matches:
            parsed, normalized = extract_match(match, target)
            start, end = _answer_span(match)
            if parsed is not None and (isinstance(target, ExprExtractionConfig) or _bare_fraction(match)):
                expression = enclosing_expression(text, start, end)
                if expression is not None:
                    written = text[expression[0] : expression[1]]
                    return _parse("\\boxed{" + written.translate(_PLAIN_OPERATORS) + "}"), written
            if first_fallback is None and normalized:
                first_fallback = (normalized, text[start:end])
            if parsed is not None:
                return [parsed, normalized] if normalized else [parsed], text[start:end]
    if first_fallback is None:
        return [], None
    return [first_fallback[0]], first_fallback[1]


def _math_verify_text(answer: str) -> str:
    """What math-verify parses for an answer: winnow's rewrite where math-verify would
    misread it (``normalize.NormalizedAnswer.for_math_verify``), else the answer."""
    return normalize_answer(answer).for_math_verify or answer


def grade_with_math_verify(pending: PendingGrade, options: GradeOptions) -> Grade:
    """The slow half of ``grade``. May take unbounded time or memory on hostile input:
    call it under a deadline. Exceptions propagate (callers map them to reasons)."""
    _, verify = _math_verify()
    gold = _parsed_gold(_normalized_gold(pending.gold).for_math_verify or pending.gold)
    if not gold:
        return failure(Reason.INVALID_GOLD, pending.answer)
    if pending.answer is not None:
        extracted = pending.answer
        prediction = _parse("\\boxed{" + _strip_math_delimiters(_math_verify_text(extracted)) + "}")
    else:
        prediction, extracted = extract_from_text(pending.response_tail)
        if extracted is None:
            return _decided(Reason.NO_ANSWER, has_box=False, extracted=None, options=options)
        if len(extracted) > options.max_answer_chars:
            return _decided(Reason.PARSE_ERROR, has_box=False, extracted=None, options=options)
        rewritten = normalize_answer(extracted).for_math_verify
        if rewritten is not None:
            prediction = _parse("\\boxed{" + rewritten + "}")
    has_box = pending.has_box
    if not prediction:
        return _decided(Reason.PARSE_ERROR, has_box=has_box, extracted=extracted, options=options)
    if verify(list(gold), prediction, timeout_seconds=None):
        return _decided(Reason.CORRECT, has_box=has_box, extracted=extracted, options=options)
    reason = Reason.WRONG if _has_expression(prediction) else Reason.PARSE_ERROR
    return _decided(reason, has_box=has_box, extracted=extracted, options=options)


# ---------------------------------------------------------------------------------------
# In-process deadline


class _DeadlineExceeded(BaseException):
    """Raised by our SIGALRM handler; a BaseException so library ``except Exception``
    blocks (math-verify has many) do not swallow it."""


@contextmanager
def _alarm(timeout_s: float | None) -> Iterator[None]:
    """Raise ``_DeadlineExceeded`` in the main thread after ``timeout_s`` seconds.

    A no-op off the main thread (signals are delivered to it only), when no Python
    handler can be restored afterwards, or when an outer ``ITIMER_REAL`` (for example
    pytest-timeout) fires first. An outer timer that fires later is re-armed with its
    remaining time on exit.
    """
    if timeout_s is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous_handler = signal.getsignal(signal.SIGALRM)
    outer_delay, outer_interval = signal.getitimer(signal.ITIMER_REAL)
    if previous_handler is None or (outer_delay > 0 and outer_delay <= timeout_s):
        yield
        return
    armed = [True]

    def on_alarm(signum: int, frame: Any) -> None:
        if armed[0]:
            raise _DeadlineExceeded

    start = time.monotonic()
    signal.signal(signal.SIGALRM, on_alarm)
    try:
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            armed[0] = False
    finally:
        signal.signal(signal.SIGALRM, previous_handler)
        if outer_delay > 0:
            remaining = max(outer_delay - (time.monotonic() - start), 1e-3)
            signal.setitimer(signal.ITIMER_REAL, remaining, outer_interval)


def grade(
    response: str,
    gold: str,
    *,
    problem: str | None = None,
    format_reward: float = 0.0,
    timeout_s: float | None = 5.0,
    max_response_chars: int = 8192,
    max_answer_chars: int = 1024,
    numeric_answers: NumericAnswers = "literal",
) -> Grade:
    """Grade one response against its gold answer, in this process.

    Never raises for any ``response``/``gold`` content (``KeyboardInterrupt`` and
    ``SystemExit`` still propagate); invalid options raise ``ValueError``.
    ``timeout_s`` bounds the math-verify step only when called from the main thread
    (see the module docstring); for training use ``GradingPool.grade_batch``.
    """
    options = GradeOptions(
        format_reward=format_reward,
        max_response_chars=max_response_chars,
        max_answer_chars=max_answer_chars,
        numeric_answers=numeric_answers,
    )
    if timeout_s is not None and not timeout_s > 0:
        raise ValueError(f"timeout_s must be positive or None, got {timeout_s!r}")
    try:
        prepared = prepare(response, gold, options, problem)
    except MemoryError:
        return failure(Reason.MEMORY)
    except Exception:  # noqa: BLE001 - the contract is "never raises"
        return failure(Reason.WORKER_ERROR)
    graded = prepared if isinstance(prepared, Grade) else grade_pending_guarded(prepared, options, timeout_s=timeout_s)
    return apply_answer_rules(graded, gold=gold, problem=problem, options=options)


def grade_pending_guarded(
    pending: PendingGrade, options: GradeOptions, *, timeout_s: float | None
) -> Grade:
    """``grade_with_math_verify`` with every failure mapped to a ``Reason``."""
    try:
        with _alarm(timeout_s):
            return grade_with_math_verify(pending, options)
    except _DeadlineExceeded:
        return failure(Reason.TIMEOUT, pending.answer)
    except MemoryError:
        return failure(Reason.MEMORY, pending.answer)
    except RecursionError:
        return _decided(
            Reason.PARSE_ERROR, has_box=pending.has_box, extracted=pending.answer, options=options
        )
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException:  # noqa: BLE001 - includes math-verify's TimeoutException
        return failure(Reason.WORKER_ERROR, pending.answer)
