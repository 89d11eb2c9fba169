"""The fast path: decide most gradings with string normalization and exact rationals.

RL answers are mostly integers and short fractions; parsing them with sympy costs ~8 ms
each, comparing normalized strings costs microseconds. ``fast_compare`` returns

* ``True``  only for a true equality: both answers normalize to the same string, or
  both are plain numbers with the same exact rational value;
* ``False`` only when both answers are plain numbers written without units, percent,
  degrees or ``x =`` (so no convention could make them equal) and they differ by more
  than math-verify's float tolerance (it rounds decimals to 6 places, so
  ``0.333333`` equals ``1/3`` there; such close calls are left to it);
* ``None``  otherwise: the caller must ask math-verify.

Every step is meaning-preserving LaTeX cleanup except the "lossy" ones (percent,
degrees, a leading ``x =``, currency), which are recorded in ``marks``: two answers
with different non-empty marks (``10\\%`` vs ``10^\\circ``) are never declared equal
here, and marked numbers are never declared unequal here (``10\\%`` may equal ``0.1``).
All work is linear in the (bounded) answer length; numbers with more than
``MAX_NUMBER_CHARS`` characters are not converted, so no huge integers are built.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

from pipeline.rewards.extract import find_closing_brace

__all__ = ["MAX_NUMBER_CHARS", "NormalizedAnswer", "fast_compare", "normalize_answer"]

MAX_NUMBER_CHARS = 40
# math-verify compares decimals after rounding to 6 places; numbers closer than this
# (relative, with a floor of 1) are left to it so the fast path never contradicts it.
_CLOSE_CALL_TOLERANCE = Fraction(1, 10**5)

# Macros whose argument is kept verbatim: formatting, not mathematics.
_UNWRAP = re.compile(r"\\(?:text|textbf|textrm|textnormal|mathrm|mbox|boxed|fbox)\s*\{")
# Sizing/style macros and spacing commands are dropped and \dfrac/\tfrac/\cfrac become
# \frac. A "\\\\" line break is matched as one token first so that "\\\\," is not
# misread as a thin space.
_CLEANUP = re.compile(
    r"(?P<linebreak>\\\\)"
    r"|(?P<frac>\\[dtc]frac(?![A-Za-z]))"
    r"|\\(?:left|right|displaystyle|[bB]igg?[lr]?)(?![A-Za-z])"
    r"|\\[,;:! ]|~"
)
_DOLLAR = re.compile(r"\\\$|\$")
# Whitespace is dropped except between two letters ("\pi r" is not "\pir") or two
# digits ("2 3" is not obviously "23").
_SPACE = re.compile(r"\s+")
_DEGREE_SUFFIX = re.compile(r"(?:\^\{\\circ\}|\^\\circ|°|\\degree)$")
_PERCENT_SUFFIX = re.compile(r"\\?%$")
_ASSIGNMENT = re.compile(r"^([A-Za-z])=(?=[^=<>,;]+$)")
_PAREN_SINGLE_TOKEN = re.compile(r"^\(([A-Za-z]|[+-]?\d+(?:\.\d+)?)\)$")

_INTEGER = re.compile(r"[+-]?\d+")
_DECIMAL = re.compile(r"[+-]?(?:\d+\.\d*|\.\d+)")
_SLASH_FRACTION = re.compile(r"([+-]?\d+)/([+-]?\d+)")
_LATEX_FRACTION = re.compile(r"([+-]?)\\frac(?:\{([+-]?\d+)\}\{([+-]?\d+)\}|(\d)(\d))")


@dataclass(frozen=True, slots=True)
class NormalizedAnswer:
    """An answer after fast-path normalization.

    ``value`` is the exact rational when ``text`` is a plain integer, decimal, ``a/b`` or
    ``\\frac{a}{b}``; ``is_decimal`` records a decimal point (math-verify then compares
    with float rounding); ``marks`` names the lossy normalizations applied.
    """

    text: str
    value: Fraction | None
    is_decimal: bool
    marks: frozenset[str]


def _cleanup_token(match: re.Match[str]) -> str:
    if match["linebreak"]:
        return match["linebreak"]
    return "\\frac" if match["frac"] else ""


def _unwrap_macros(text: str) -> str:
    # Each pass removes one macro, so the loop runs at most len(text) / 6 times.
    while (match := _UNWRAP.search(text)) is not None:
        close = find_closing_brace(text, match.end() - 1)
        if close is None:
            return text
        text = text[: match.start()] + text[match.end() : close] + text[close + 1 :]
    return text


def _drop_spaces(text: str) -> str:
    def keep_if_separating(match: re.Match[str]) -> str:
        before = text[match.start() - 1] if match.start() > 0 else ""
        after = text[match.end()] if match.end() < len(text) else ""
        if (before.isalpha() and after.isalpha()) or (before.isdigit() and after.isdigit()):
            return " "
        return ""

    return _SPACE.sub(keep_if_separating, text)


def _strip_outer_braces(text: str) -> str:
    while text.startswith("{") and find_closing_brace(text, 0) == len(text) - 1:
        text = text[1:-1]
    return text


def _exact_value(text: str) -> tuple[Fraction | None, bool]:
    if len(text) > MAX_NUMBER_CHARS:
        return None, False
    if _INTEGER.fullmatch(text):
        return Fraction(int(text)), False
    if _DECIMAL.fullmatch(text):
        return Fraction(text), True
    if match := _SLASH_FRACTION.fullmatch(text):
        numerator, denominator = int(match[1]), int(match[2])
    elif match := _LATEX_FRACTION.fullmatch(text):
        numerator = int(match[2] if match[2] is not None else match[4])
        denominator = int(match[3] if match[3] is not None else match[5])
        if match[1] == "-":
            numerator = -numerator
    else:
        return None, False
    if denominator == 0:
        return None, False
    return Fraction(numerator, denominator), False


def normalize_answer(answer: str) -> NormalizedAnswer:
    """Normalize one extracted answer (or gold answer) for ``fast_compare``."""
    marks = set()
    text = answer.replace("\u2212", "-").replace("{,}", ",")
    if _DOLLAR.search(text):
        if "\\$" in text:
            marks.add("currency")
        text = _DOLLAR.sub("", text)
    text = _CLEANUP.sub(_cleanup_token, text)
    text = _unwrap_macros(text)
    text = _drop_spaces(text.strip())
    if text.endswith(".") and not text.endswith(".."):
        text = text[:-1]
    text = _strip_outer_braces(text)
    if _DEGREE_SUFFIX.search(text):
        marks.add("degrees")
        text = _DEGREE_SUFFIX.sub("", text)
    if _PERCENT_SUFFIX.search(text):
        marks.add("percent")
        text = _PERCENT_SUFFIX.sub("", text)
    if match := _ASSIGNMENT.match(text):
        marks.add(f"assign:{match[1]}")
        text = text[match.end() :]
    text = _strip_outer_braces(text)
    if match := _PAREN_SINGLE_TOKEN.match(text):
        text = match[1]
    value, is_decimal = _exact_value(text)
    return NormalizedAnswer(text=text, value=value, is_decimal=is_decimal, marks=frozenset(marks))


def _is_close_call(a: Fraction, b: Fraction) -> bool:
    scale = max(Fraction(1), abs(a), abs(b))
    return abs(a - b) <= _CLOSE_CALL_TOLERANCE * scale


def fast_compare(pred: NormalizedAnswer, gold: NormalizedAnswer) -> bool | None:
    """``True``/``False`` when the fast path is certain, ``None`` to defer to math-verify."""
    if pred.marks and gold.marks and pred.marks != gold.marks:
        return None
    if pred.text == gold.text:
        return True
    if pred.value is None or gold.value is None:
        return None
    if pred.value == gold.value:
        return True
    if pred.marks or gold.marks:
        return None
    if (pred.is_decimal or gold.is_decimal) and _is_close_call(pred.value, gold.value):
        return None
    return False
