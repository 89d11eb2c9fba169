"""Answer extraction from untrusted model output: the last ``\\boxed{...}``, or the
boxes it closes a list with (``$\\boxed{1}$ and $\\boxed{2}$``).

Everything here is linear-time string scanning with no recursion, so it is safe to
run in the trainer process on arbitrary text (1 MB strings, NUL bytes, ten thousand
unbalanced braces). Callers bound the input length first (``grader.prepare``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["BoxedAnswer", "box_list", "enclosing_expression", "final_boxed", "find_closing_brace", "last_boxed"]

# "\boxed" or "\fbox" not followed by a letter ("\boxedfoo" is another macro).
_BOX_COMMAND = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
# One lexical unit for brace matching: an escaped character ("\{", "\}", "\\") or a brace.
_BRACE_TOKEN = re.compile(r"\\.|[{}]", re.DOTALL)
# "\boxed 12" (no braces): the argument runs to the next whitespace or "$".
_BARE_ARGUMENT = re.compile(r"[ \t]*([^\s${}\\][^\s$]*)")
# What may stand between the boxes of one answer written as several ("$\boxed{1}$ and
# $\boxed{2}$", "\boxed{1}, \boxed{2}"): spacing, math delimiters, commas, semicolons and
# the word "and" (also in \text{}). Any other word ends the list: "\boxed{3} for part (a)
# and \boxed{1}", "y_1 = \boxed{..}", and "or", which also joins two forms of one answer
# (MATH's "$\boxed{15\frac{39}{40}},$ or $\boxed{\frac{639}{40}}$"). Possessive, so linear.
_LIST_SEPARATOR = re.compile(
    r"(?:\s++|[$,;]|\\[()\[\]]|\\q?quad(?![A-Za-z])|\\[,;:! ]|(?<![A-Za-z\\])and(?![A-Za-z])"
    r"|\\(?:text|textrm|mbox|mathrm)\s*+\{\s*+(?:,|and)?\s*+\})*+"
)
# A list needs one of these between two boxes: "\boxed{2}\quad\boxed{3}" is not a list.
_LIST_MARK = re.compile(r"[,;]|(?<![A-Za-z\\])and(?![A-Za-z])")
# Around a whole answer written as boxes: spacing, math delimiters and a final period.
_ANSWER_EDGE = re.compile(r"(?:\s++|\$|\\[()\[\]])*+\.?(?:\s++|\$|\\[()\[\]])*+")
# An expression written in plain text ("2x+1", "3x^2 - 2x + 1", "2\sqrt{3}", "2(x+1)"):
# terms written without spaces (numbers, one-letter variables, LaTeX commands, brackets,
# powers, subscripts) joined by operators. A letter next to another letter is a word
# ("is", "cm"), never a variable, so prose and unit words end the expression. LaTeX
# commands are never prose, so spaces may stand before one ("2 \pi", "10 \sqrt{2}") and
# between one and its argument ("\sqrt 5"). Operator, spacing and relation commands are
# not terms: "2\times 10^5" is one expression, not "2\times"; "y \le 1", like "y = 1", two.
_NOT_A_TERM_COMMAND = (
    r"(?:cdot|times|div|pm|mp|quad|qquad|le|leq|ge|geq|lt|gt|ne|neq|approx|equiv|sim|simeq|cong|in|notin"
    r"|to|implies|iff|Rightarrow|rightarrow|Leftrightarrow|mid)(?![A-Za-z])"
)
_COMMAND = rf"\\(?!{_NOT_A_TERM_COMMAND})[A-Za-z]++(?:[ \t]++(?=[\d{{]))?+"
_TERM_PIECE = rf"(?:\d++(?:\.\d++)?+|(?<![A-Za-z])[A-Za-z](?![A-Za-z])|{_COMMAND}|[(){{}}\[\]^_!])"
_TERM = rf"{_TERM_PIECE}(?:{_TERM_PIECE}|[ \t]++{_COMMAND})*+"
_OPERATOR = r"(?:[ \t]*+(?:[+\-*/\u00d7\u00f7\u00b7]|\\(?:cdot|times|div|pm|mp)(?![A-Za-z]))[ \t]*+)"
_PLAIN_EXPRESSION = re.compile(rf"-?{_TERM}(?:{_OPERATOR}{_TERM})*+")
# More than a number: a variable, a command, a power or a subscript.
_BEYOND_A_NUMBER = re.compile(r"[A-Za-z^_]")
# Written in LaTeX (a command, a power, a subscript), which prose never is: "2 + \sqrt{3} and
# so on" ends with an expression, "5 - a classic result" with words.
_LATEX_SYNTAX = re.compile(r"\\[A-Za-z]|[\^_]")
# A number written against a variable or a bracket: "2x", "2(".
_COEFFICIENT = re.compile(r"\d[A-Za-z(]")
# What may follow a complete expression: the end of the text, a line or a sentence.
_EXPRESSION_END = re.compile(r"[ \t]*+(?:[.,;:!?$)\]\n]|\Z)")
_BRACKET_PAIRS = {")": "(", "]": "[", "}": "{"}
# Longer plain-text "expressions" are prose that happens to hold operators.
MAX_PLAIN_EXPRESSION_CHARS = 200


@dataclass(frozen=True, slots=True)
class BoxedAnswer:
    """The last box of a response.

    ``content`` is the raw substring inside the braces (``None`` when the last box never
    closes, e.g. a response truncated at the generation limit); from ``final_boxed``, the
    raw text of the boxes of a list, from the first box command to the last closing brace.
    """

    content: str | None


def find_closing_brace(text: str, open_index: int) -> int | None:
    """Index of the ``}`` that closes the ``{`` at ``open_index``; ``None`` if it never closes.

    ``\\{`` and ``\\}`` are literal braces in LaTeX and do not change the depth.
    """
    assert text[open_index] == "{", "open_index must point at '{'"
    depth = 0
    for token in _BRACE_TOKEN.finditer(text, open_index):
        if token.group() == "{":
            depth += 1
        elif token.group() == "}":
            depth -= 1
            if depth == 0:
                return token.start()
    return None


def _box_at(text: str, command: re.Match[str]) -> tuple[str | None, int]:
    """The raw content of the box whose command is ``command`` (``None``: it never closes)
    and the index just past the box."""
    index = command.end()
    while index < len(text) and text[index] in " \t\n":
        index += 1
    if index < len(text) and text[index] == "{":
        close = find_closing_brace(text, index)
        return (None, len(text)) if close is None else (text[index + 1 : close], close + 1)
    bare = _BARE_ARGUMENT.match(text, command.end())
    return (bare.group(1), bare.end()) if bare else (None, command.end())


def _lists(separator: str) -> bool:
    """Whether ``separator`` (the text between two boxes) joins them into one list."""
    return _LIST_SEPARATOR.fullmatch(separator) is not None and _LIST_MARK.search(separator) is not None


def last_boxed(text: str) -> BoxedAnswer | None:
    """The last ``\\boxed{...}``/``\\fbox{...}`` (also ``\\boxed 12``) of ``text``, or ``None``.

    Only the last box counts, even when an earlier one is complete: a final answer cut
    off mid-box is not silently replaced by an intermediate result.
    """
    last = None
    for last in _BOX_COMMAND.finditer(text):
        pass
    if last is None:
        return None
    return BoxedAnswer(_box_at(text, last)[0])


def final_boxed(text: str) -> BoxedAnswer | None:
    """The answer a response ends with: its last box (as ``last_boxed``), or, when the
    boxes before it are joined to it by list separators only (``$\\boxed{1}$ and
    $\\boxed{2}$``, ``\\boxed{1}, \\boxed{2}``), the verbatim text from the first of those
    boxes to the end of the last, which ``box_list`` reads as the list of their contents.

    Boxes separated by anything else stay intermediate results: only the last one
    counts. Linear in ``len(text)``: the boxes of a list do not overlap, and the walk
    back stops at the first box that does not join.
    """
    commands = list(_BOX_COMMAND.finditer(text))
    if not commands:
        return None
    content, end = _box_at(text, commands[-1])
    if content is None or not content.strip():
        return BoxedAnswer(content)
    start = commands[-1].start()
    for command in reversed(commands[:-1]):
        earlier, earlier_end = _box_at(text, command)
        if earlier is None or not earlier.strip() or earlier_end > start or not _lists(text[earlier_end:start]):
            break
        start = command.start()
    return BoxedAnswer(text[start:end] if start < commands[-1].start() else content)


def box_list(text: str) -> list[str] | None:
    """The contents of the boxes when ``text`` is two or more non-empty boxes joined by
    list separators and nothing else (``\\boxed{1} \\text{ and } \\boxed{2}``,
    ``$\\boxed{1}$, $\\boxed{2}$.``, ``\\boxed{1}\\boxed{2}``), else ``None``. Linear in ``len(text)``.

    Unlike ``final_boxed``, no comma, semicolon or "and" is needed between two boxes: a
    text that is nothing but boxes has no intermediate results among them, so a gold
    written ``\\boxed{1}\\boxed{2}`` is the list ``1, 2``, never the number 12. (A response's
    answer reaches here only through ``final_boxed``, which already asked for the marks.)
    """
    if "box" not in text:
        return None
    contents: list[str] = []
    position = _ANSWER_EDGE.match(text).end()
    while True:
        command = _BOX_COMMAND.match(text, position)
        if command is None:
            return None
        content, end = _box_at(text, command)
        if content is None or not content.strip():
            return None
        contents.append(content)
        if _ANSWER_EDGE.match(text, end).end() == len(text):
            return contents if len(contents) > 1 else None
        position = _LIST_SEPARATOR.match(text, end).end()


def _balanced_prefix_end(text: str, start: int, end: int) -> int | None:
    """The end of the longest prefix of ``text[start:end]`` whose brackets all close,
    cut at the first unmatched closing bracket ("x + 1)" → "x + 1"); ``None`` when a
    bracket opened there is still open at the cut."""
    stack: list[str] = []
    for index in range(start, end):
        character = text[index]
        if character in "([{":
            stack.append(character)
        elif character in _BRACKET_PAIRS:
            if not stack or stack[-1] != _BRACKET_PAIRS[character]:
                end = index
                break
            stack.pop()
    return None if stack else end


def enclosing_expression(text: str, start: int, end: int) -> tuple[int, int] | None:
    """The plain-text expression that the number (or bare ``\\frac{..}{..}``) at
    ``text[start:end]`` is one term of, as ``(start, end)``, or ``None`` when it stands
    alone (or the expression is not a complete one).

    math-verify's plain-text extraction reads numbers only, so "the answer is 2x+1"
    yields ``2`` and "we get 2x + 1" yields ``1``; its LaTeX extraction reads a bare
    ``\\frac`` only, so "the answer is 12\\frac{1}{2}" yields ``\\frac{1}{2}``. The expression
    counts when it holds more than numbers (a variable, a LaTeX command, a power or a
    subscript) and either is written in LaTeX ("2 \\pi", "5 - \\sqrt{2}", "2^{10}"), starts
    with a coefficient written against a variable or bracket ("2x", "2(x+1)") or ends
    where a sentence or line does ("x + 1."); this keeps "5 - a classic result" the
    number 5. Linear in the length of the line.
    """
    line_start = max(text.rfind("\n", 0, start) + 1, start - MAX_PLAIN_EXPRESSION_CHARS)
    for run in _PLAIN_EXPRESSION.finditer(text, line_start):
        if run.start() > start:
            return None
        if run.end() < end:
            continue
        run_end = _balanced_prefix_end(text, run.start(), run.end())
        if run_end is None or run_end < end or run_end - run.start() > MAX_PLAIN_EXPRESSION_CHARS:
            return None
        expression = text[run.start() : run_end]
        if (run.start(), run_end) == (start, end) or not _BEYOND_A_NUMBER.search(expression):
            return None
        if (
            _LATEX_SYNTAX.search(expression)
            or _COEFFICIENT.search(expression)
            or _EXPRESSION_END.match(text, run_end)
        ):
            return run.start(), run_end
        return None
    return None
