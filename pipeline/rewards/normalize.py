"""The fast path: decide most gradings with string normalization and exact rationals.

RL answers are mostly integers and short fractions; parsing them with sympy costs ~8 ms
each, comparing normalized strings costs microseconds. ``fast_compare`` returns

* ``True``  for a true equality: both answers normalize to the same string, or both
  are numbers with equal values (``numbers_agree``: exact for integers and fractions,
  the tolerance rule below when either is written as a decimal);
* ``False`` when both answers are numbers that do not agree and neither carries a
  percent sign or degrees the other lacks (``10\\%`` may equal ``0.1``), and when one
  answer is a list (``1, 234``) and the other a number (``1,234``);
* ``None``  otherwise: the caller must ask math-verify.

Numbers are read once, here, for the fast path and for the answer rules alike
(``normalize_answer``'s ``value`` and ``form``): integers (``2070``, ``2,070``,
``14{,}916``), decimals (``.75``), fractions (``7/2``, ``\\frac{1}{2}``, the MATH
shorthand ``\\frac32``/``\\frac9{19}``, ``\\frac{3}{-4}``) and repeating decimals (``1.\\overline{3}`` = 4/3), with optional
sign, ``$``, ``%``, degrees, ``x =`` and unit words (``18 miles``, ``12\\text{ cm}``).
An answer written as several boxes (``\\boxed{1} \\text{ and } \\boxed{2}``) is the list of
their contents (``1, 2``), never the number their digits would spell.

Tolerance: a decimal agrees with the gold ``g`` when ``|a - g| <= min(1e-6, 1e-4 |g|)``.
From 0.01 up that is math-verify's own rule (it rounds to 6 decimal places); below
0.01 it is relative, so ``.0000673`` is not ``.0000672`` and ``0.0000014`` not
``0.000001``, which 6-place rounding would accept.

Every step is meaning-preserving LaTeX cleanup except the "lossy" ones (percent,
degrees, a leading ``x =``, currency), which are recorded in ``marks``. Unit words
carry no value and are dropped. When a step reads something math-verify cannot
(unit words it does not know, repeating decimals, ``°``, brace-less ``\\frac``/``\\sqrt``
arguments such as ``\\frac\\pi2``), ``for_math_verify`` holds the answer rewritten in plain
LaTeX, so the slow path sees the same number.
All work is linear in the (bounded) answer length; numbers with more than
``MAX_NUMBER_CHARS`` characters are not converted, so no huge integers are built.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from fractions import Fraction

from pipeline.rewards.extract import box_list, find_closing_brace

__all__ = [
    "MAX_NUMBER_CHARS",
    "NormalizedAnswer",
    "brace_shorthand_arguments",
    "fast_compare",
    "latex_cleanup",
    "normalize_answer",
    "numbers_agree",
]

MAX_NUMBER_CHARS = 40
# The tolerance rule of the module docstring: min(absolute, relative * |gold|).
_ABSOLUTE_TOLERANCE = Fraction(1, 10**6)
_RELATIVE_TOLERANCE = Fraction(1, 10**4)

# Macros whose argument is kept verbatim: formatting, not mathematics.
_UNWRAP = re.compile(r"\\(?:text|textbf|textit|textrm|textnormal|mathrm|mathbf|mbox|boxed|fbox)\s*\{")
# Sizing/style macros and spacing commands are dropped and \dfrac/\tfrac/\cfrac become
# \frac. A "\\\\" line break is matched as one token first so that "\\\\," is not
# misread as a thin space.
_CLEANUP = re.compile(
    r"(?P<linebreak>\\\\)"
    r"|(?P<frac>\\[dtc]frac(?![A-Za-z]))"
    r"|\\(?:left|right|displaystyle|[bB]igg?[lr]?)(?![A-Za-z])"
    r"|\\[,;:! ]\s*|~"
)
_DOLLAR = re.compile(r"\\\$|\$")
_LATEX_COMMA = re.compile(r"\{\s*,\s*\}")  # 14{,}916
_MACRO = re.compile(r"\\[A-Za-z]+")
# A comma followed by a space separates list items: "32, 349" is not 32,349.
_LIST_COMMA = re.compile(r"\d,\s+\d")
# Whitespace is dropped except between two letters ("\pi r" is not "\pir") or two
# digits ("2 3" is not obviously "23").
_SPACE = re.compile(r"\s+")
_DEGREE_SUFFIX = re.compile(r"(?:\^\{\\circ\}|\^\\circ|°|\\degree)$")
_PERCENT_SUFFIX = re.compile(r"\\?%$")
_ASSIGNMENT = re.compile(r"^([A-Za-z](?:_\{?\w+\}?)?)=(?=[^=<>,;]+$)")
_PAREN_SINGLE_TOKEN = re.compile(r"^\(([A-Za-z]|[+-]?\d+(?:\.\d+)?)\)$")

# 2070, 2,070 or 2 070: separators only between groups of three.
_DIGITS = r"(?:\d{1,3}(?:,\d{3})+|\d{1,3}(?: \d{3})+|\d+)"
_INTEGER = re.compile(rf"[+-]?{_DIGITS}")
_DECIMAL = re.compile(rf"[+-]?(?:{_DIGITS}\.\d*|\.\d+)")
_SLASH_FRACTION = re.compile(r"([+-]?\d+)/([+-]?\d+)")
# \frac{a}{b}, and the shorthand \frac32 / \frac9{19} / \frac{9}2 (one digit, no braces).
# A space may separate two one-digit arguments ("\frac 3 4" is "\frac3 4" once cleaned up).
_LATEX_FRACTION = re.compile(r"([+-]?)\\frac(?:\{([+-]?\d+)\}|(\d))(?:\{([+-]?\d+)\}| ?(\d))")
_REPEATING = re.compile(r"([+-]?)(\d*)\.(\d*)\\(?:overline|bar)(?:\{(\d+)\}|(\d))")
# Words after a number: "18miles", "12cm^2", "5miles per hour" (spaces are gone between a
# digit and a letter, kept between two letters). The first word has two letters or more,
# so "2x" stays a product. Possessive quantifiers and one separator between words keep
# each attempt linear; only short answers are tried (a number and a few words).
_UNIT_WORDS = re.compile(
    r"(?<=[\d}.])(?P<words>[A-Za-z]{2,}+(?:\^\{?[23]\}?)?(?:[ /][A-Za-z]++(?:\^\{?[23]\}?)?)*+)$"
)
_MAX_UNIT_ANSWER_CHARS = 80
_WORD = re.compile(r"[A-Za-z]+")
# Words that change a number's value or join it to more mathematics: "3 hundred",
# "2 thirds", "5 squared", "3 and 4", "2 pi" are not the number followed by a unit.
_VALUE_WORDS = frozenset(
    "and or to not than more less plus minus times over divided by squared cubed factorial choose mod "
    "hundred hundreds thousand thousands million millions billion billions trillion trillions dozen dozens "
    "half halves third thirds quarter quarters fourth fourths fifth fifths sixth sixths seventh sevenths "
    "eighth eighths ninth ninths tenth tenths hundredth hundredths thousandth thousandths "
    "pi sqrt sin cos tan cot sec csc log ln exp infinity inf infty".split()
)
# One LaTeX token: a control word ("\frac", "\pi"), a control symbol ("\{", "\\"), a run of
# whitespace, or one other character. Possessive, so one linear scan.
_LATEX_TOKEN = re.compile(r"\\(?:[A-Za-z]++|.)|\s++|.", re.DOTALL)
# Macros whose arguments may be written without braces, with how many they take.
_SHORTHAND_MACROS = {"\\frac": 2, "\\dfrac": 2, "\\tfrac": 2, "\\cfrac": 2, "\\sqrt": 1}
# Where there may be something to brace: a \frac or \sqrt not followed by braced arguments
# ("\frac{1}{2}", the common case, is not), or one that is a script's argument.
_SHORTHAND_CANDIDATE = re.compile(
    r"\\(?:[dtc]?frac|sqrt)(?![A-Za-z])(?!\{[^{}]*+\}\{)|[\^_]\s*+\\(?:[dtc]?frac|sqrt)(?![A-Za-z])"
)
# Macros that take arguments of their own, so never stand as one brace-less argument:
# "\frac\sqrt23" is not a fraction of two one-token arguments (TeX rejects it too).
_ARGUMENT_MACROS = frozenset(
    "frac dfrac tfrac cfrac sqrt text textbf textit textrm textnormal mathrm mathbf mathit mathbb mathcal "
    "operatorname mbox boxed fbox overline underline bar hat vec tilde widehat widetilde dot ddot "
    "binom dbinom tbinom left right begin end".split()
)
_MARK_WORDS = {"percent": "percent", "percentage": "percent", "degree": "degrees", "degrees": "degrees"}
# Marks that change which values are equal (10% may be 0.1, 30 degrees may be pi/6):
# numbers where only one side has one are left to math-verify's conventions.
_VALUE_MARKS = frozenset({"percent", "degrees"})


@dataclass(frozen=True, slots=True)
class NormalizedAnswer:
    """An answer after fast-path normalization.

    ``value`` is the exact rational when ``text`` is a number; ``form`` says how it was
    written (``integer``, ``decimal``, ``fraction`` in lowest terms, ``quotient`` for one
    still to be divided out such as ``100/2``, ``repeating``; ``None`` for anything else);
    ``marks`` names the lossy normalizations applied;
    ``for_math_verify`` is the answer rewritten for math-verify when it holds something
    math-verify reads differently (unit words, a repeating decimal, ``°``, several boxes,
    brace-less ``\\frac``/``\\sqrt`` arguments),
    else ``None``; ``is_list`` says the answer is a list of two or more items by its
    writing (several boxes, or ``32, 349``), so never one number.
    """

    text: str
    value: Fraction | None
    form: str | None
    marks: frozenset[str]
    for_math_verify: str | None = None
    is_list: bool = False

    @property
    def is_decimal(self) -> bool:
        return self.form == "decimal"


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


def _brace_less_argument(token: str) -> bool:
    """Whether ``token`` can be a whole argument written without braces: one digit or
    letter (``\\frac12``, ``\\frac1x``) or a macro that takes none (``\\frac\\pi2``)."""
    if len(token) == 1:
        return token.isascii() and token.isalnum()
    return token[0] == "\\" and token[1:].isalpha() and token[1:] not in _ARGUMENT_MACROS


def brace_shorthand_arguments(text: str) -> str:
    """``text`` with the brace-less arguments of ``\\frac`` (``\\dfrac``, ``\\tfrac``,
    ``\\cfrac``) and ``\\sqrt`` braced, as TeX reads them: one token each, so ``\\frac3{3}``,
    ``\\frac{3}3``, ``\\frac 3 4``, ``\\frac\\pi2``, ``\\frac{1}x``, ``\\frac12x``, ``\\sqrt\\pi``
    become ``\\frac{3}{3}``, ..., ``\\frac{1}{2}x``, ``\\sqrt{\\pi}``. A fraction that is a
    script's argument is braced whole (``2^\\frac12`` is ``2^{\\frac{1}{2}}``).

    math-verify reads some of these shapes (``\\frac12``, ``\\frac1x``) but misreads others:
    ``\\frac\\pi2`` and ``\\frac{1}x`` do not parse and ``2^\\frac{1}{2}`` parses as 1/2.
    Text with nothing to brace is returned as is. Linear in ``len(text)``: one tokenizing
    pass, one pass to pair the braces and one to rewrite.
    """
    if _SHORTHAND_CANDIDATE.search(text) is None:
        return text
    tokens = _LATEX_TOKEN.findall(text)
    closing: dict[int, int] = {}  # the token index of each "{" -> that of its "}"
    open_braces: list[int] = []
    next_bracket = [len(tokens)] * (len(tokens) + 1)  # the index of the first "]" at or after each token
    for index, token in enumerate(tokens):
        if token == "{":
            open_braces.append(index)
        elif token == "}" and open_braces:
            closing[open_braces.pop()] = index
    for index in range(len(tokens) - 1, -1, -1):
        next_bracket[index] = index if tokens[index] == "]" else next_bracket[index + 1]

    def skip_spaces(index: int, step: int = 1) -> int:
        while 0 <= index < len(tokens) and tokens[index].isspace():
            index += step
        return index

    before: dict[int, str] = {}  # text inserted before / after a token
    after: dict[int, str] = {}
    dropped: set[int] = set()
    for index, token in enumerate(tokens):
        count = _SHORTHAND_MACROS.get(token)
        if count is None:
            continue
        position = index + 1
        if token == "\\sqrt":
            bracket = skip_spaces(position)
            if bracket < len(tokens) and tokens[bracket] == "[":  # \sqrt[3]8: the root's degree is no argument
                position = next_bracket[bracket] + 1
        arguments: list[tuple[int, int, bool]] = []  # first token, last token, written in braces
        spaces: list[int] = []
        for _ in range(count):
            start = position
            position = skip_spaces(position)
            spaces.extend(range(start, min(position, len(tokens))))
            if position >= len(tokens):
                break
            if tokens[position] == "{" and position in closing:
                arguments.append((position, closing[position], True))
                position = closing[position] + 1
            elif _brace_less_argument(tokens[position]):
                arguments.append((position, position, False))
                position += 1
            else:
                break
        if len(arguments) < count:
            continue
        dropped.update(spaces)  # they only separated the arguments: "\frac 3 4" is "\frac{3}{4}"
        for first, last, braced in arguments:
            if not braced:
                before[first] = before.get(first, "") + "{"
                after[last] = after.get(last, "") + "}"
        previous = skip_spaces(index - 1, step=-1)
        if previous >= 0 and tokens[previous] in ("^", "_"):
            before[index] = "{" + before.get(index, "")
            after[arguments[-1][1]] = after.get(arguments[-1][1], "") + "}"
    if not before and not dropped:
        return text
    return "".join(
        "" if index in dropped else before.get(index, "") + token + after.get(index, "")
        for index, token in enumerate(tokens)
    )


def _strip_outer_braces(text: str) -> str:
    while text.startswith("{") and find_closing_brace(text, 0) == len(text) - 1:
        text = text[1:-1]
    return text


def latex_cleanup(text: str) -> str:
    """The meaning-preserving part of normalization: math delimiters, sizing and spacing
    macros and formatting wrappers (``\\text{}``, ``\\textbf{}``, ``\\mathrm{}``, ``\\boxed{}``)
    removed, ``\\dfrac`` → ``\\frac``, whitespace dropped where it separates nothing."""
    text = _LATEX_COMMA.sub(",", text.replace("\u2212", "-"))
    text = _DOLLAR.sub("", text)
    text = _CLEANUP.sub(_cleanup_token, text)
    text = _unwrap_macros(text)
    return _drop_spaces(text.strip())


def _exact_value(text: str) -> tuple[Fraction | None, str | None]:
    if len(text) > MAX_NUMBER_CHARS:
        return None, None
    if _INTEGER.fullmatch(text):
        return Fraction(int(text.replace(",", "").replace(" ", ""))), "integer"
    if _DECIMAL.fullmatch(text):
        return Fraction(text.replace(",", "").replace(" ", "")), "decimal"
    if match := _REPEATING.fullmatch(text):
        sign, whole, fixed, repeating = match[1], match[2], match[3], match[4] or match[5]
        value = int(whole or "0") + (
            int(fixed or "0") + Fraction(int(repeating), 10 ** len(repeating) - 1)
        ) / 10 ** len(fixed)
        return (-value if sign == "-" else value), "repeating"
    if match := _SLASH_FRACTION.fullmatch(text):
        numerator, denominator = int(match[1]), int(match[2])
    elif match := _LATEX_FRACTION.fullmatch(text):
        numerator = int(match[2] if match[2] is not None else match[3])
        denominator = int(match[4] if match[4] is not None else match[5])
        if match[1] == "-":
            numerator = -numerator
    else:
        return None, None
    if denominator == 0:
        return None, None
    # 100/2 or \frac{6}{4} still has to be divided out: a quotient, not a fraction literal.
    reduced = abs(denominator) > 1 and math.gcd(numerator, denominator) == 1
    return Fraction(numerator, denominator), "fraction" if reduced else "quotient"


def _last_of_equality_chain(text: str) -> str:
    """``x=5+5+1=11`` → ``11``: like math-verify, a chain of two or more equalities answers
    with its last part; words between the signs (``p=-1 and p=2``) make it no chain."""
    parts = text.split("=")
    if len(parts) < 3 or "," in text or ";" in text or not all(parts[1:]):
        return text
    if any(character.isalpha() for part in parts[1:] for character in _MACRO.sub("", part)):
        return text
    return parts[-1]


def _strip_decorations(text: str, marks: set[str]) -> str:
    """Degrees, percent, ``x =`` and redundant braces/parentheses around one token."""
    text = _strip_outer_braces(text)
    text = _last_of_equality_chain(text)
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
    elif text.startswith("(") and text.endswith(")") and _exact_value(text[1:-1])[0] is not None:
        text = text[1:-1]  # (\frac{1}{3})
    return text


def _unit_phrase_marks(words: str) -> set[str] | None:
    """The marks a trailing phrase stands for (``percent``, ``degrees``, or none for a
    unit), or ``None`` when it is not a unit phrase."""
    names = [word.lower() for word in _WORD.findall(words)]
    if any(name in _VALUE_WORDS for name in names):
        return None
    if len(names) == 1 and names[0] in _MARK_WORDS:
        return {_MARK_WORDS[names[0]]}
    return set()


def _as_latex(value: Fraction, form: str, text: str, marks: frozenset[str]) -> str:
    """A number with its marks in LaTeX math-verify reads (the inverse of the lossy steps)."""
    if form == "repeating":
        sign = "-" if value < 0 else ""
        text = f"{sign}\\frac{{{abs(value.numerator)}}}{{{value.denominator}}}"
    for mark in sorted(marks):
        if mark == "percent":
            text += "\\%"
        elif mark == "degrees":
            text += "^\\circ"
        elif mark == "currency":
            text = "\\$" + text
        elif mark.startswith("assign:"):
            text = mark.removeprefix("assign:") + "=" + text
    return text


def normalize_answer(answer: str) -> NormalizedAnswer:
    """Normalize one extracted answer (or gold answer) for ``fast_compare``."""
    boxes = box_list(answer)
    listed_boxes = None if boxes is None else ", ".join(content.strip() for content in boxes)
    if listed_boxes is not None:
        answer = listed_boxes
    marks: set[str] = set()
    if "\\$" in answer:
        marks.add("currency")
    cleaned = latex_cleanup(answer)
    if cleaned.endswith(".") and not cleaned.endswith(".."):
        cleaned = cleaned[:-1]
    found_marks = set(marks)
    text = _strip_decorations(cleaned, found_marks)
    value, form = _exact_value(text)
    is_list = listed_boxes is not None or _LIST_COMMA.search(answer) is not None
    if "," in text and is_list:
        value, form = None, None
    dropped_units = False
    units = (_UNIT_WORDS.search(cleaned) if value is None and not is_list and len(cleaned) <= _MAX_UNIT_ANSWER_CHARS
             else None)
    if units is not None:
        unit_marks = _unit_phrase_marks(units["words"])
        if unit_marks is not None:
            unit_marks |= marks
            number = _strip_decorations(cleaned[: units.start()], unit_marks)
            number_value, number_form = _exact_value(number)
            if number_value is not None:
                text, value, form, found_marks, dropped_units = number, number_value, number_form, unit_marks, True
    final_marks = frozenset(found_marks)
    for_math_verify = listed_boxes
    if value is not None and (dropped_units or form == "repeating"):
        for_math_verify = _as_latex(value, form, text, final_marks)
    elif "°" in answer:
        for_math_verify = answer.replace("°", "^\\circ")
    braced = brace_shorthand_arguments(for_math_verify or answer)
    if braced != (for_math_verify or answer):
        for_math_verify = braced
    return NormalizedAnswer(
        text=text, value=value, form=form, marks=final_marks, for_math_verify=for_math_verify, is_list=is_list
    )


def numbers_agree(answer: Fraction, gold: Fraction, *, decimal: bool) -> bool:
    """Equal values; when either side was written as a decimal, equal within the
    tolerance ``min(1e-6, 1e-4 |gold|)`` (module docstring)."""
    if not decimal:
        return answer == gold
    return abs(answer - gold) <= min(_ABSOLUTE_TOLERANCE, _RELATIVE_TOLERANCE * abs(gold))


def fast_compare(pred: NormalizedAnswer, gold: NormalizedAnswer) -> bool | None:
    """``True``/``False`` when the fast path is certain, ``None`` to defer to math-verify."""
    if pred.marks and gold.marks and pred.marks != gold.marks:
        return None
    if pred.is_list != gold.is_list and (pred.value is not None or gold.value is not None):
        return False  # two or more items are never one number: "1, 234" is not 1,234, though both read "1,234"
    if pred.text == gold.text:
        return True
    if pred.value is None or gold.value is None:
        return None
    if pred.value == gold.value:
        return True
    if (pred.marks ^ gold.marks) & _VALUE_MARKS:
        return None
    return numbers_agree(pred.value, gold.value, decimal=pred.is_decimal or gold.is_decimal)
