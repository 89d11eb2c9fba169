"""Difficulty-curation rules: pure functions over prompt records and per-prompt ``(n, c)``.

Implements the training-set curation of Reinforce-Ada ("Reinforce-Ada: An Adaptive
Sampling Framework under Non-linear RL Objectives", §4.1 "Data Curation and Verifier"):
deduplicate prompts, exclude prompts whose reference fails verification, sample k = 16
responses from the base model and discard trivial prompts (average reward > 0.375) and
effectively impossible ones (0 correct); and its App. C.1: the "hard subset" (1–2 correct
of 16) and the four difficulty levels by base-model pass rate — extremely hard (0),
hard (0, 0.2], medium (0.2, 0.5], easy (0.5, 1].

Every rule returns ``(keep_mask, metrics)``: a ``(P,)`` bool mask over its own inputs and
``{"num_dropped": ...}``. Rules compose in one fixed order, ``RULE_ORDER``; each rule
sees only the prompts every earlier rule kept, so a dropped prompt carries exactly one
reason, the first rule that dropped it:

1. ``reference_fails``      ``reference_verifies``: ``\\boxed{gold}`` must grade correct against ``gold``
2. ``duplicate``            ``dedup``: a later prompt with an already-kept normalized problem text
3. ``too_long``             prompt + ``max_new_tokens`` exceed the model's context (the stage
                            decides it: it needs the tokenizer; recorded with ``apply_rule``)
4. ``trivial``              ``drop_trivial``: pass rate ``c / n > threshold``
5. ``impossible``           ``drop_impossible``: ``c == 0``
6. ``outside_hard_subset``  ``hard_subset``: ``c`` outside ``[min_correct, max_correct]``

Choices the paper leaves open:

* Order. The paper lists dedup before reference verification; we verify first, so when
  two copies of a problem differ in their reference answer and the first copy's does not
  verify, the second copy survives dedup instead of both being lost.
* "Fails verification" is decided by the same grader that scores RL responses: a response
  stating exactly the reference, ``\\boxed{gold}``, must grade ``correct``. So a prompt is
  kept only if some response can earn its reward. Empty references (``$$``), over-long ones
  (> ``max_answer_chars``) and ones no answer can be extracted from (``}{``) fail.
* Trivial is strict, ``c / n > threshold`` ("average reward > 0.375"): with k = 16 a prompt
  with 6 correct (0.375) is kept, one with 7 is dropped.
* The hard subset is in counts of correct samples out of ``n``, as the paper states it
  (1–2 of 16); with ``impossible``/``trivial`` active they take the prompts they cover first.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np

from pipeline.data import normalize_text
from pipeline.rewards import Grade, grade

__all__ = [
    "DIFFICULTY_BUCKETS",
    "DIFFICULTY_EDGES",
    "DUPLICATE",
    "IMPOSSIBLE",
    "KEPT",
    "OUTSIDE_HARD_SUBSET",
    "REFERENCE_FAILS",
    "RULE_ORDER",
    "TOO_LONG",
    "TRIVIAL",
    "GradeBatch",
    "apply_rule",
    "count_reasons",
    "dedup",
    "difficulty_bucket",
    "difficulty_names",
    "drop_impossible",
    "drop_trivial",
    "hard_subset",
    "new_drop_reasons",
    "reference_response",
    "reference_verifies",
    "screen_prompts",
    "select_by_pass_rate",
]

KEPT = ""  # the drop reason of a prompt no rule dropped
REFERENCE_FAILS = "reference_fails"
DUPLICATE = "duplicate"
TOO_LONG = "too_long"
TRIVIAL = "trivial"
IMPOSSIBLE = "impossible"
OUTSIDE_HARD_SUBSET = "outside_hard_subset"
RULE_ORDER: tuple[str, ...] = (REFERENCE_FAILS, DUPLICATE, TOO_LONG, TRIVIAL, IMPOSSIBLE, OUTSIDE_HARD_SUBSET)

# Reinforce-Ada App. C.1: extremely hard (p = 0), hard (0, 0.2], medium (0.2, 0.5], easy (0.5, 1].
DIFFICULTY_BUCKETS: tuple[str, ...] = ("extremely_hard", "hard", "medium", "easy")
DIFFICULTY_EDGES: tuple[float, ...] = (0.0, 0.2, 0.5)  # right-closed upper edges of the first three

GradeBatch = Callable[[list[tuple[str, str]]], list[Grade]]
Counts = np.ndarray | Sequence[int]  # (P,) integers


# ----------------------------------------------------------------------------- inputs


def _counts(num_samples: Counts, num_correct: Counts) -> tuple[np.ndarray, np.ndarray]:
    """Validated ``(n, c)`` as int64 arrays of one shape ``(P,)``."""
    n = np.asarray(num_samples)
    c = np.asarray(num_correct)
    if n.ndim != 1 or n.shape != c.shape:
        raise ValueError(f"num_samples {n.shape} and num_correct {c.shape} must be 1-D arrays of one shape")
    if n.size and not (np.issubdtype(n.dtype, np.integer) and np.issubdtype(c.dtype, np.integer)):
        raise ValueError(f"num_samples and num_correct must be integer arrays, got {n.dtype} and {c.dtype}")
    n, c = n.astype(np.int64), c.astype(np.int64)
    if np.any(n < 1):
        raise ValueError(f"every prompt needs at least one sample; got num_samples min {int(n.min())}")
    if np.any((c < 0) | (c > n)):
        raise ValueError("num_correct must lie in [0, num_samples] for every prompt")
    return n, c


def _dropped(keep_mask: np.ndarray) -> dict[str, float]:
    return {"num_dropped": int(keep_mask.size - np.count_nonzero(keep_mask))}


# ----------------------------------------------------------------------------- rules


def reference_response(answer: str) -> str:
    """The response that states exactly the reference answer."""
    return "\\boxed{" + answer + "}"


def _grade_in_process(items: list[tuple[str, str]]) -> list[Grade]:
    return [grade(response, gold) for response, gold in items]


def reference_verifies(
    answers: Sequence[str], *, grade_batch: GradeBatch | None = None
) -> tuple[np.ndarray, dict[str, float]]:
    """Keep prompts whose reference answer, boxed, grades ``correct`` against itself.

    ``grade_batch`` grades ``[(response, gold), ...]``; the default is in-process
    ``pipeline.rewards.grade`` (the stage passes ``GradingPool.grade_batch``, whose
    workers can be killed on a hostile reference). Metrics count the failing grade
    reasons as ``reason/<reason>`` (``invalid_gold``, ``parse_error``, ...).
    """
    items = [(reference_response(answer), answer) for answer in answers]
    grades = (grade_batch or _grade_in_process)(items)
    if len(grades) != len(items):
        raise ValueError(f"grade_batch returned {len(grades)} grades for {len(items)} items")
    keep_mask = np.array([g.is_correct for g in grades], dtype=bool)  # (P,)
    failures = Counter(str(g.reason) for g in grades if not g.is_correct)
    return keep_mask, {**_dropped(keep_mask), **{f"reason/{r}": n for r, n in sorted(failures.items())}}


def dedup(problems: Sequence[str]) -> tuple[np.ndarray, dict[str, float]]:
    """Keep the first prompt of each normalized problem text (``pipeline.data.normalize_text``:
    NFKC, case-folded, whitespace runs collapsed), as the data loaders do within one file."""
    keep_mask = np.zeros(len(problems), dtype=bool)  # (P,)
    if problems:
        keys = np.array([normalize_text(problem) for problem in problems], dtype=object)
        # return_index gives each key's first occurrence (numpy sorts stably for it).
        _, first_index = np.unique(keys, return_index=True)
        keep_mask[first_index] = True
    return keep_mask, _dropped(keep_mask)


def drop_trivial(num_samples: Counts, num_correct: Counts, *, threshold: float) -> tuple[np.ndarray, dict[str, float]]:
    """Keep prompts with pass rate ``c / n ≤ threshold`` (Reinforce-Ada: drop average reward > 0.375)."""
    if not (isinstance(threshold, (int, float)) and math.isfinite(threshold) and 0.0 <= threshold <= 1.0):
        raise ValueError(f"threshold must be a number in [0, 1], got {threshold!r}")
    n, c = _counts(num_samples, num_correct)
    keep_mask = c / n <= threshold  # (P,)
    return keep_mask, _dropped(keep_mask)


def drop_impossible(num_samples: Counts, num_correct: Counts) -> tuple[np.ndarray, dict[str, float]]:
    """Keep prompts with at least one correct sample."""
    _, c = _counts(num_samples, num_correct)
    keep_mask = c > 0  # (P,)
    return keep_mask, _dropped(keep_mask)


def hard_subset(
    num_samples: Counts, num_correct: Counts, *, min_correct: int, max_correct: int
) -> tuple[np.ndarray, dict[str, float]]:
    """Keep prompts with ``min_correct ≤ c ≤ max_correct`` (Reinforce-Ada App. C.1: 1–2 correct of 16)."""
    if not (0 <= min_correct <= max_correct):
        raise ValueError(f"hard subset needs 0 <= min_correct <= max_correct, got [{min_correct}, {max_correct}]")
    _, c = _counts(num_samples, num_correct)
    keep_mask = (c >= min_correct) & (c <= max_correct)  # (P,)
    return keep_mask, _dropped(keep_mask)


def difficulty_bucket(num_samples: Counts, num_correct: Counts) -> np.ndarray:
    """``(P,)`` int64 index into ``DIFFICULTY_BUCKETS`` of each prompt's pass rate ``c / n``."""
    n, c = _counts(num_samples, num_correct)
    # side="left" puts a rate equal to an edge in the bucket that edge closes: (0, 0.2], (0.2, 0.5].
    return np.searchsorted(np.array(DIFFICULTY_EDGES), c / n, side="left").astype(np.int64)


def difficulty_names(num_samples: Counts, num_correct: Counts) -> list[str]:
    return [DIFFICULTY_BUCKETS[i] for i in difficulty_bucket(num_samples, num_correct)]


# ----------------------------------------------------------------------------- composition


def new_drop_reasons(num_prompts: int) -> np.ndarray:
    """``(P,)`` object array of ``KEPT``: nothing dropped yet."""
    reasons = np.empty(num_prompts, dtype=object)
    reasons[:] = KEPT
    return reasons


def apply_rule(drop_reasons: np.ndarray, keep_mask: np.ndarray, *, rule: str) -> tuple[np.ndarray, dict[str, float]]:
    """Record ``rule`` as the reason of every still-kept prompt that ``keep_mask`` drops.

    ``keep_mask`` is ``(A,)`` over the still-kept prompts (``drop_reasons == KEPT``), in
    order: the output of a rule evaluated on exactly those prompts. Returns a new array.
    """
    if rule not in RULE_ORDER:
        raise ValueError(f"unknown rule {rule!r}; rules are {RULE_ORDER}")
    alive_index = np.flatnonzero(drop_reasons == KEPT)  # (A,)
    keep_mask = np.asarray(keep_mask, dtype=bool)
    if keep_mask.shape != alive_index.shape:
        raise ValueError(f"{rule}: keep_mask has shape {keep_mask.shape}, expected ({alive_index.size},) "
                         "(one entry per prompt still kept)")
    reasons = drop_reasons.copy()
    reasons[alive_index[~keep_mask]] = rule
    return reasons, _dropped(keep_mask)


def _alive(drop_reasons: np.ndarray) -> np.ndarray:
    return np.flatnonzero(drop_reasons == KEPT)


def screen_prompts(
    *,
    problems: Sequence[str],
    answers: Sequence[str],
    verify_reference: bool,
    deduplicate: bool,
    grade_batch: GradeBatch | None = None,
) -> tuple[np.ndarray, dict[str, float]]:
    """Rules 1–2, which need no generation: ``(drop_reasons (P,), metrics)``.

    Metrics: ``<rule>/num_dropped`` and ``reference_fails/reason/<reason>``.
    """
    if len(problems) != len(answers):
        raise ValueError(f"{len(problems)} problems but {len(answers)} answers")
    reasons = new_drop_reasons(len(problems))
    metrics: dict[str, float] = {}
    if verify_reference:
        keep_mask, rule_metrics = reference_verifies(answers, grade_batch=grade_batch)
        reasons, _ = apply_rule(reasons, keep_mask, rule=REFERENCE_FAILS)
        metrics.update({f"{REFERENCE_FAILS}/{k}": v for k, v in rule_metrics.items()})
    if deduplicate:
        keep_mask, rule_metrics = dedup([problems[i] for i in _alive(reasons)])
        reasons, _ = apply_rule(reasons, keep_mask, rule=DUPLICATE)
        metrics[f"{DUPLICATE}/num_dropped"] = rule_metrics["num_dropped"]
    return reasons, metrics


def select_by_pass_rate(
    drop_reasons: np.ndarray,
    *,
    num_samples: Counts,
    num_correct: Counts,
    trivial_threshold: float | None,
    drop_impossible_prompts: bool,
    hard_subset_range: tuple[int, int] | None,
) -> tuple[np.ndarray, dict[str, float]]:
    """Rules 4–6 on the still-kept prompts: ``(drop_reasons (P,), metrics)``.

    ``num_samples``/``num_correct`` are ``(P,)`` over all prompts; entries of prompts
    already dropped are ignored (they were never sampled). ``None`` disables a rule.
    """
    n_all, c_all = np.asarray(num_samples), np.asarray(num_correct)
    if n_all.shape != drop_reasons.shape or c_all.shape != drop_reasons.shape:
        raise ValueError(f"num_samples {n_all.shape} and num_correct {c_all.shape} must match "
                         f"drop_reasons {drop_reasons.shape}")
    steps: list[tuple[str, Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, dict[str, float]]]]] = []
    if trivial_threshold is not None:
        steps.append((TRIVIAL, lambda n, c: drop_trivial(n, c, threshold=trivial_threshold)))
    if drop_impossible_prompts:
        steps.append((IMPOSSIBLE, drop_impossible))
    if hard_subset_range is not None:
        low, high = hard_subset_range
        steps.append((OUTSIDE_HARD_SUBSET, lambda n, c: hard_subset(n, c, min_correct=low, max_correct=high)))
    _counts(n_all[_alive(drop_reasons)], c_all[_alive(drop_reasons)])  # every still-kept prompt was sampled
    reasons, metrics = drop_reasons, {}
    for rule, keep_fn in steps:
        alive = _alive(reasons)
        keep_mask, _ = keep_fn(n_all[alive], c_all[alive])
        reasons, rule_metrics = apply_rule(reasons, keep_mask, rule=rule)
        metrics[f"{rule}/num_dropped"] = rule_metrics["num_dropped"]
    return reasons, metrics


def count_reasons(drop_reasons: np.ndarray) -> dict[str, int]:
    """``{"total", <each rule in RULE_ORDER>, "kept"}``; the rules and ``kept`` sum to ``total``."""
    counts = Counter(drop_reasons.tolist())
    unknown = set(counts) - {KEPT, *RULE_ORDER}
    assert not unknown, f"unknown drop reasons {sorted(unknown)}"
    return {"total": int(drop_reasons.size), **{rule: counts.get(rule, 0) for rule in RULE_ORDER},
            "kept": counts.get(KEPT, 0)}
