"""Reference-answer extraction for datasets that ship worked solutions.

These parse *reference* solutions written by dataset authors (MATH, Minerva, GSM8K);
grading model responses is ``pipeline.rewards``' job. Each parser returns ``None``
when the solution holds no answer, which the loaders record as the bad-row reason
``unparseable_answer``.
"""

from __future__ import annotations

import re

_BOXED_COMMANDS = ("\\boxed", "\\fbox")


def _read_braced(text: str, open_index: int) -> str | None:
    """The contents of the ``{...}`` group opening at ``open_index``; ``None`` if unbalanced.

    ``\\{`` and ``\\}`` are escaped literal braces in LaTeX and do not change the depth.
    """
    assert text[open_index] == "{"
    depth = 0
    index = open_index
    while index < len(text):
        char = text[index]
        if char == "\\":
            index += 2
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[open_index + 1 : index]
        index += 1
    return None


def _boxed_argument(text: str, start: int, command: str) -> tuple[bool, str | None]:
    """``(is_box, argument)`` for ``command`` at ``start``.

    Accepts ``\\boxed{...}``, ``\\boxed {...}`` and ``\\boxed 5``; ``is_box`` is False
    for a longer command name (``\\boxedsomething``) or ``\\boxed5``, which are not boxes.
    """
    index = start + len(command)
    if index < len(text) and text[index].isalnum():
        return False, None
    while index < len(text) and text[index] == " ":
        index += 1
    if index >= len(text):
        return True, None
    if text[index] == "{":
        return True, _read_braced(text, index)
    # "\boxed 2$." (three MATH train rows): the argument runs to the next "$" or space.
    match = re.match(r"[^\s$]+", text[index:])
    return True, match.group(0) if match else None


def last_boxed(text: str) -> str | None:
    """The contents of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces balanced.

    Nested braces are kept (``\\boxed{\\frac{1}{2}}`` → ``\\frac{1}{2}``) and the result
    is stripped. "Last" follows the MATH convention: when a solution boxes several
    values, the final box holds the answer. ``None`` when there is no box, or when the
    last box is unbalanced or empty: an earlier box is then not trusted to be the answer.
    """
    positions = sorted(
        (match.start(), command)
        for command in _BOXED_COMMANDS
        for match in re.finditer(re.escape(command), text)
    )
    for start, command in reversed(positions):
        is_box, argument = _boxed_argument(text, start, command)
        if not is_box:
            continue
        if argument is None or not argument.strip():
            return None
        return argument.strip()
    return None


def gsm8k_final_answer(solution: str) -> str | None:
    """The GSM8K answer: the text after the last ``####``, thousands separators removed.

    ``"... #### 1,080"`` → ``"1080"``. ``None`` when there is no ``####`` or nothing after it.
    """
    if "####" not in solution:
        return None
    answer = solution.rsplit("####", 1)[1].strip().replace(",", "")
    return answer or None
