"""Rules a *correct* answer must also pass: it has to be an answer, not the question again.

math-verify decides mathematical equality, so ``30 * 69`` "equals" the gold ``2070``. A
policy under RL finds that quickly: in our own CPU run, GRPO at lr 2e-4 learned within
~90 steps to answer "What is 30 * 69?" with ``30 * 69 =`` and no box, and held-out
"pass@1" went from 0.42 to 0.999 while the model computed nothing. Two rules close it,
applied after grading to every answer graded correct (wrong answers stay wrong),
whether the answer was boxed or math-verify found it in unboxed text:

``restates_problem`` (always, when the problem text is known)
    The answer occurs in the problem while the gold answer does not, and the answer is
    not a bare number (an integer or decimal). Both are compared after the same cleanup
    (``restatement_key``): math delimiters, spacing, ``\\left``/``\\right``,
    ``\\dfrac``, and the wrappers ``\\text{}``, ``\\textbf{}``, ``\\mathrm{}`` removed,
    shorthand arguments braced (``\\frac32`` → ``\\frac{3}{2}``, ``\\frac\\pi2`` →
    ``\\frac{\\pi}{2}``, ``\\log_264`` → ``\\log_{2}64``), case folded. An occurrence
    counts only as a whole token: the gold ``6`` does not occur in ``\\log_264``.
    Copying an expression or a fraction from the question never counts; a legitimate
    answer that occurs in the problem (a choice among options, ``\\boxed{B}`` for the
    gold ``\\text{(B)}``) still counts, because then the gold occurs there too; so does a
    bare number the question happens to mention ("What is 2070 - 0?").
``numeric_answers="literal"`` (the default)
    When the gold is a number literal, the answer must be one too. Both are read by
    ``normalize.normalize_answer`` (the fast path's own reading): integers, decimals,
    fractions in lowest terms and repeating decimals, with sign, thousands separators, ``$``, ``%``,
    degrees, ``x =`` and unit words. ``2070``, ``2,070``, ``\\frac{1}{2}``, ``18 miles``
    pass; ``69 * 30``, ``2^{11} + 22``, ``100/2`` do not. Non-numeric golds (``\\frac{\\pi}{3}``,
    ``x^2 + 1``) keep math-verify's symbolic equality. ``"symbolic"`` turns this off
    (paper-faithful evaluation: their numbers used plain math-verify), at the price of
    rewarding unevaluated arithmetic.

A rejected answer scores as a wrong one (0 plus the same format term) and carries its own
reason, so the grading metrics show how often the policy tries it.
"""

from __future__ import annotations

import functools
import re
from typing import Literal

from pipeline.rewards.extract import box_list
from pipeline.rewards.normalize import brace_shorthand_arguments, latex_cleanup, normalize_answer

NumericAnswers = Literal["literal", "symbolic"]

# A one-character script written without braces: "^2", "_2" (those of "\frac32" and "\sqrt2"
# are braced by normalize.brace_shorthand_arguments).
_SHORTHAND_SCRIPT = re.compile(r"([_^])([A-Za-z0-9])")


def number_literal(text: str) -> bool:
    """Whether ``text`` is one number written out: no operators, powers or functions, and
    no fraction left to divide out (``100/2``, ``\\frac{6}{4}``)."""
    return normalize_answer(text).form not in (None, "quotient")


def bare_number(text: str) -> bool:
    """Whether ``text`` is an integer or decimal literal (not a fraction, not a repeating decimal)."""
    return normalize_answer(text).form in ("integer", "decimal")


@functools.lru_cache(maxsize=4096)
def restatement_key(text: str) -> str:
    """``text`` as the restatement test compares it (see the module docstring)."""
    boxes = box_list(text)
    key = brace_shorthand_arguments(latex_cleanup(text if boxes is None else ", ".join(boxes)))
    key = _SHORTHAND_SCRIPT.sub(r"\1{\2}", key)
    return key.lower().rstrip(".")


def _continues(a: str, b: str) -> bool:
    """Whether characters ``a`` then ``b`` belong to one token (one number or one word)."""
    return (a.isdigit() and b.isdigit()) or (a.isalpha() and b.isalpha()) or (a == "\\" and b.isalpha())


def occurs_as_token(needle: str, haystack: str) -> bool:
    """``needle`` occurs in ``haystack`` and is not part of a longer number or word there."""
    if not needle:
        return False
    start = haystack.find(needle)
    while start != -1:
        end = start + len(needle)
        before_ok = start == 0 or not _continues(haystack[start - 1], needle[0])
        decimal_before = start >= 2 and haystack[start - 1] == "." and haystack[start - 2].isdigit()
        after_ok = end == len(haystack) or not _continues(needle[-1], haystack[end])
        decimal_after = end + 1 < len(haystack) and haystack[end] == "." and haystack[end + 1].isdigit()
        if before_ok and after_ok and not (needle[0].isdigit() and decimal_before) and not (
            needle[-1].isdigit() and decimal_after
        ):
            return True
        start = haystack.find(needle, start + 1)
    return False


def restates_problem(extracted: str, *, problem: str, gold: str) -> bool:
    """The answer is copied from the problem, which does not contain the gold."""
    answer = restatement_key(extracted)
    if not answer or bare_number(extracted):
        return False
    question = restatement_key(problem)
    return occurs_as_token(answer, question) and not occurs_as_token(restatement_key(gold), question)


def rejection(extracted: str | None, *, gold: str, problem: str | None,
              numeric_answers: NumericAnswers) -> str | None:
    """Why an answer graded correct does not count (``"restates_problem"``, ``"not_a_number"``), or None."""
    if extracted is None:
        return None
    if problem is not None and restates_problem(extracted, problem=problem, gold=gold):
        return "restates_problem"
    if numeric_answers == "literal" and number_literal(gold) and not number_literal(extracted):
        return "not_a_number"
    return None
