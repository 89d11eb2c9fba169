"""Answer extraction from untrusted model output: the last ``\\boxed{...}``.

Everything here is linear-time string scanning with no recursion, so it is safe to
run in the trainer process on arbitrary text (1 MB strings, NUL bytes, ten thousand
unbalanced braces). Callers bound the input length first (``grader.prepare``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["BoxedAnswer", "find_closing_brace", "last_boxed"]

# "\boxed" or "\fbox" not followed by a letter ("\boxedfoo" is another macro).
_BOX_COMMAND = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
# One lexical unit for brace matching: an escaped character ("\{", "\}", "\\") or a brace.
_BRACE_TOKEN = re.compile(r"\\.|[{}]", re.DOTALL)
# "\boxed 12" (no braces): the argument runs to the next whitespace or "$".
_BARE_ARGUMENT = re.compile(r"[ \t]*([^\s${}\\][^\s$]*)")


@dataclass(frozen=True, slots=True)
class BoxedAnswer:
    """The last box of a response.

    ``content`` is the raw substring inside the braces (``None`` when the last box never
    closes, e.g. a response truncated at the generation limit).
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
    index = last.end()
    while index < len(text) and text[index] in " \t\n":
        index += 1
    if index < len(text) and text[index] == "{":
        close = find_closing_brace(text, index)
        return BoxedAnswer(None if close is None else text[index + 1 : close])
    bare = _BARE_ARGUMENT.match(text, last.end())
    return BoxedAnswer(bare.group(1) if bare else None)
