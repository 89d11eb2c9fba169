"""Reference-answer extraction for datasets that ship worked solutions.

These parse *reference* solutions written by dataset authors (MATH, Minerva, GSM8K);
grading model responses is ``pipeline.rewards``' job. Each parser returns ``None``
when the solution holds no answer, which the loaders record as the bad-row reason
``unparseable_answer``.
"""

from __future__ import annotations

from pipeline.rewards.extract import last_boxed as find_last_box

def last_boxed(text: str) -> str | None:
    """The stripped contents of the last ``\\boxed{...}``/``\\fbox{...}`` of a reference solution.

    The same scanner that grades model output (``pipeline.rewards.extract``), so a
    reference answer and a response are read by one rule. "Last" follows the MATH
    convention: when a solution boxes several values, the final box holds the answer.
    ``None`` when there is no box, or when the last box is unbalanced or empty: an
    earlier box is then not trusted to be the answer.
    """
    box = find_last_box(text)
    if box is None or box.content is None or not box.content.strip():
        return None
    return box.content.strip()


def gsm8k_final_answer(solution: str) -> str | None:
    """The GSM8K answer: the text after the last ``####``, thousands separators removed.

    ``"... #### 1,080"`` → ``"1080"``. ``None`` when there is no ``####`` or nothing after it.
    """
    if "####" not in solution:
        return None
    answer = solution.rsplit("####", 1)[1].strip().replace(",", "")
    return answer or None
