"""Rules a *correct* answer must also pass: it has to be an answer, not the question again.

math-verify decides mathematical equality, so ``30 * 69`` "equals" the gold ``2070``. A
policy under RL finds that quickly: in our own CPU run, GRPO at lr 2e-4 learned within
~90 steps to answer "What is 30 * 69?" with ``30 * 69 =`` and no box, and held-out
"pass@1" went from 0.42 to 0.999 while the model computed nothing. Two rules close it,
applied after grading to answers graded correct (wrong answers stay wrong):

``restates_problem`` (always, when the problem text is known)
    The extracted answer, whitespace removed, is a substring of the problem while the gold
    answer is not, and it is not a bare number. Copying an expression from the question
    never counts — whichever way the question is phrased — while a legitimate answer that
    happens to occur in the problem (a choice among options) still counts, because then
    the gold occurs there too.
``numeric_answers="literal"`` (the default)
    When the gold is a number literal (an integer, decimal, or fraction, with optional sign,
    thousands separators, ``$`` or ``%``), the answer must be one too: ``2070``, ``2,070``,
    ``\\frac{1}{2}`` pass; ``69 * 30``, ``2^{11} + 22`` do not. Non-numeric golds
    (``\\frac{\\pi}{3}``, ``x^2 + 1``) keep math-verify's symbolic equality.
    ``"symbolic"`` turns this off (paper-faithful evaluation: their numbers used plain
    math-verify), at the price of rewarding unevaluated arithmetic.

A rejected answer scores as a wrong one (0 plus the same format term) and carries its own
reason, so the grading metrics show how often the policy tries it.
"""

from __future__ import annotations

import re
from typing import Literal

NumericAnswers = Literal["literal", "symbolic"]

_NUMBER = re.compile(
    r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"  # 2070, 2,070, -3.5
    r"|[-+]?\\[dt]?frac\{[-+]?\d+\}\{\d+\}"  # \frac{1}{2}, \dfrac{-3}{4}
    r"|[-+]?\d+/\d+"  # 1/2
)
# "x = 2" answers with a number: a single variable (optionally subscripted) on the left.
_VARIABLE_IS = re.compile(r"[a-zA-Z](?:_\{?\w+\}?)?=")
# Spacing commands, dollar and percent signs, degrees, unit text and a trailing period carry no value.
_DECORATION = re.compile(r"\\[,;:! ]|\\\$|\$|\\%|%|\^\{?\\circ\}?|\\degree|\\(?:text|mathrm)\{[^{}]*\}|\s")


def _squash(text: str) -> str:
    return "".join(text.split()).lower()


def number_literal(text: str) -> bool:
    """Whether ``text`` is one number written out (no operators, powers or functions)."""
    stripped = _DECORATION.sub("", text).rstrip(".")
    if stripped.startswith("\\boxed{") and stripped.endswith("}"):
        stripped = stripped[len("\\boxed{"):-1]
    variable = _VARIABLE_IS.match(stripped)
    if variable is not None:
        stripped = stripped[variable.end():]
    return bool(stripped) and _NUMBER.fullmatch(stripped) is not None


def restates_problem(extracted: str, *, problem: str, gold: str) -> bool:
    """The answer is an expression copied from the problem, which does not contain the gold."""
    answer = _squash(extracted).strip("$")
    if not answer or number_literal(answer):
        return False
    question = _squash(problem)
    return answer in question and _squash(gold) not in question


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
