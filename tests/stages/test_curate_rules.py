"""Curation rules (Reinforce-Ada §4.1 and App. C.1): exact counts, first-reason attribution, composition."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.rewards import Grade, Reason
from pipeline.stages import curate_rules as rules
from pipeline.stages.curate_rules import (
    DIFFICULTY_BUCKETS,
    DUPLICATE,
    IMPOSSIBLE,
    KEPT,
    OUTSIDE_HARD_SUBSET,
    REFERENCE_FAILS,
    RULE_ORDER,
    TOO_LONG,
    TRIVIAL,
)


def _correct_if(flags):
    """A grade_batch that marks item i correct iff flags[i]; checks it is asked the self-check."""

    def grade_batch(items):
        assert all(response == "\\boxed{" + gold + "}" for response, gold in items)
        assert len(items) == len(flags)
        return [Grade(1.0, Reason.CORRECT, gold) if ok else Grade(0.0, Reason.INVALID_GOLD, None)
                for (_, gold), ok in zip(items, flags)]

    return grade_batch


# ----------------------------------------------------------------------------- single rules


def test_drop_trivial_is_strict_at_the_threshold():
    # k = 16, threshold 0.375 = 6/16: 6 correct is kept, 7 (0.4375) is dropped.
    n = np.full(6, 16)
    c = np.array([0, 1, 6, 7, 15, 16])
    keep, metrics = rules.drop_trivial(n, c, threshold=0.375)
    assert keep.tolist() == [True, True, True, False, False, False]
    assert metrics == {"num_dropped": 3}
    # 3/10 is the double nearest 0.3, as is the literal: equal, so kept; 4/10 is not.
    keep, _ = rules.drop_trivial(np.array([10, 10]), np.array([3, 4]), threshold=0.3)
    assert keep.tolist() == [True, False]
    # Mixed n: the rate, not the count, decides (3/8 = 0.375 kept, 3/4 dropped).
    keep, _ = rules.drop_trivial(np.array([8, 4]), np.array([3, 3]), threshold=0.375)
    assert keep.tolist() == [True, False]


def test_drop_impossible_and_hard_subset():
    n = np.full(6, 16)
    c = np.array([0, 1, 2, 3, 0, 16])
    keep, metrics = rules.drop_impossible(n, c)
    assert keep.tolist() == [False, True, True, True, False, True] and metrics == {"num_dropped": 2}
    keep, metrics = rules.hard_subset(n, c, min_correct=1, max_correct=2)  # Reinforce-Ada App. C.1
    assert keep.tolist() == [False, True, True, False, False, False] and metrics == {"num_dropped": 4}
    keep, _ = rules.hard_subset(n, c, min_correct=0, max_correct=0)
    assert keep.tolist() == [True, False, False, False, True, False]


def test_difficulty_buckets_follow_the_paper_edges():
    # p = 0 | (0, 0.2] | (0.2, 0.5] | (0.5, 1]; edges belong to the bucket they close.
    n = np.array([10, 10, 10, 10, 10, 10, 10, 15, 16])
    c = np.array([0, 1, 2, 3, 5, 6, 10, 3, 1])  # p = 0, .1, .2, .3, .5, .6, 1, 3/15 = .2, 1/16
    assert rules.difficulty_bucket(n, c).tolist() == [0, 1, 1, 2, 2, 3, 3, 1, 1]
    assert rules.difficulty_names(n[:2], c[:2]) == ["extremely_hard", "hard"]
    assert DIFFICULTY_BUCKETS == ("extremely_hard", "hard", "medium", "easy")


def test_dedup_keeps_the_first_normalized_copy():
    problems = ["What is 1+1?", "what  is 1+1?", "What is 2+2?", " WHAT IS 1+1?\n", "What is １+1?", "What is 3+3?"]
    keep, metrics = rules.dedup(problems)
    # NFKC folds the full-width "１" to "1"; case and whitespace runs are ignored.
    assert keep.tolist() == [True, False, True, False, False, True]
    assert metrics == {"num_dropped": 3}
    keep, metrics = rules.dedup(["b", "a", "b", "a"])
    assert keep.tolist() == [True, True, False, False] and metrics == {"num_dropped": 2}


def test_reference_verifies_with_the_real_grader():
    answers = ["4", "\\frac{1}{2}", "$$", "x" * 2000, "}{", "1,2"]
    keep, metrics = rules.reference_verifies(answers)
    # "$$" is empty once its delimiters go, 2000 chars exceed max_answer_chars, "}{" holds no answer.
    assert keep.tolist() == [True, True, False, False, False, True]
    assert metrics == {"num_dropped": 3, "reason/invalid_gold": 2, "reason/no_answer": 1}
    keep, metrics = rules.reference_verifies(["7", "8"], grade_batch=_correct_if([False, True]))
    assert keep.tolist() == [False, True] and metrics == {"num_dropped": 1, "reason/invalid_gold": 1}
    with pytest.raises(ValueError, match="returned 1 grades for 2 items"):
        rules.reference_verifies(["7", "8"], grade_batch=lambda items: _correct_if([True])(items[:1]))


@pytest.mark.parametrize(
    ("n", "c", "message"),
    [
        ([4, 4], [1, 5], r"num_correct must lie in \[0, num_samples\]"),
        ([4, 4], [-1, 0], r"num_correct must lie"),
        ([4, 0], [1, 0], "at least one sample"),
        ([4.0], [1.0], "integer arrays"),
        ([4, 4], [1], "one shape"),
    ],
)
def test_bad_counts_raise(n, c, message):
    with pytest.raises(ValueError, match=message):
        rules.drop_impossible(np.array(n), np.array(c))


def test_bad_parameters_raise():
    n, c = np.array([4]), np.array([1])
    for threshold in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="threshold"):
            rules.drop_trivial(n, c, threshold=threshold)
    with pytest.raises(ValueError, match="min_correct <= max_correct"):
        rules.hard_subset(n, c, min_correct=3, max_correct=2)


def test_empty_inputs():
    empty = np.zeros(0, dtype=np.int64)
    for keep, metrics in (rules.drop_trivial(empty, empty, threshold=0.5), rules.drop_impossible(empty, empty),
                          rules.hard_subset(empty, empty, min_correct=1, max_correct=2), rules.dedup([]),
                          rules.reference_verifies([])):
        assert keep.shape == (0,) and metrics["num_dropped"] == 0
    reasons, _ = rules.screen_prompts(problems=[], answers=[], verify_reference=True, deduplicate=True)
    reasons, _ = rules.select_by_pass_rate(reasons, num_samples=empty, num_correct=empty, trivial_threshold=0.375,
                                           drop_impossible_prompts=True, hard_subset_range=(1, 2))
    assert rules.count_reasons(reasons) == {"total": 0, **dict.fromkeys(RULE_ORDER, 0), "kept": 0}


# ----------------------------------------------------------------------------- composition


def test_apply_rule_marks_only_still_kept_prompts():
    reasons = rules.new_drop_reasons(5)
    reasons, metrics = rules.apply_rule(reasons, np.array([True, False, True, False, True]), rule=REFERENCE_FAILS)
    assert reasons.tolist() == [KEPT, REFERENCE_FAILS, KEPT, REFERENCE_FAILS, KEPT] and metrics == {"num_dropped": 2}
    # The next mask covers the three prompts still kept, in order.
    reasons, _ = rules.apply_rule(reasons, np.array([False, True, True]), rule=DUPLICATE)
    assert reasons.tolist() == [DUPLICATE, REFERENCE_FAILS, KEPT, REFERENCE_FAILS, KEPT]
    with pytest.raises(ValueError, match=r"expected \(2,\)"):
        rules.apply_rule(reasons, np.ones(5, dtype=bool), rule=TOO_LONG)
    with pytest.raises(ValueError, match="unknown rule"):
        rules.apply_rule(reasons, np.ones(2, dtype=bool), rule="too_easy")


def test_first_reason_attribution_by_hand():
    # 0: reference fails and duplicates 1 → reference_fails; 1 survives dedup because its
    #    first copy is already gone (reference first, then dedup), and is kept (c = 2);
    # 2: duplicate of 1 → duplicate; 3: too long; 4: 7/16 → trivial (also outside [1, 2]);
    # 5: 0/16 → impossible (also outside [1, 2]); 6: 4/16 → outside_hard_subset; 7: 1/16 → kept.
    problems = ["What is 9*9?", "what is 9*9?", "What is  9*9? ", "p3", "p4", "p5", "p6", "p7"]
    answers = ["$$", "81", "81", "1", "1", "1", "1", "1"]
    reasons, metrics = rules.screen_prompts(problems=problems, answers=answers, verify_reference=True,
                                            deduplicate=True)
    assert metrics == {"reference_fails/num_dropped": 1, "reference_fails/reason/invalid_gold": 1,
                       "duplicate/num_dropped": 1}
    reasons, _ = rules.apply_rule(reasons, np.array([True, False, True, True, True, True]), rule=TOO_LONG)
    n = np.array([0, 16, 0, 0, 16, 16, 16, 16])  # never-sampled prompts carry n = 0: ignored
    c = np.array([0, 2, 0, 0, 7, 0, 4, 1])
    reasons, metrics = rules.select_by_pass_rate(reasons, num_samples=n, num_correct=c, trivial_threshold=0.375,
                                                 drop_impossible_prompts=True, hard_subset_range=(1, 2))
    assert reasons.tolist() == [REFERENCE_FAILS, KEPT, DUPLICATE, TOO_LONG, TRIVIAL, IMPOSSIBLE,
                                OUTSIDE_HARD_SUBSET, KEPT]
    assert metrics == {"trivial/num_dropped": 1, "impossible/num_dropped": 1, "outside_hard_subset/num_dropped": 1}
    assert rules.count_reasons(reasons) == {"total": 8, "reference_fails": 1, "duplicate": 1, "too_long": 1,
                                            "trivial": 1, "impossible": 1, "outside_hard_subset": 1, "kept": 2}


def test_disabled_rules_drop_nothing():
    problems, answers = ["a", "a", "b"], ["$$", "1", "2"]
    reasons, metrics = rules.screen_prompts(problems=problems, answers=answers, verify_reference=False,
                                            deduplicate=False)
    assert reasons.tolist() == [KEPT] * 3 and metrics == {}
    reasons, metrics = rules.select_by_pass_rate(reasons, num_samples=np.full(3, 4), num_correct=np.array([0, 4, 2]),
                                                 trivial_threshold=None, drop_impossible_prompts=False,
                                                 hard_subset_range=None)
    assert reasons.tolist() == [KEPT] * 3 and metrics == {}


def test_select_rejects_unsampled_survivors():
    reasons = rules.new_drop_reasons(2)
    with pytest.raises(ValueError, match="at least one sample"):
        rules.select_by_pass_rate(reasons, num_samples=np.array([4, 0]), num_correct=np.array([1, 0]),
                                  trivial_threshold=0.375, drop_impossible_prompts=True, hard_subset_range=None)
    with pytest.raises(ValueError, match="must match drop_reasons"):
        rules.select_by_pass_rate(reasons, num_samples=np.array([4]), num_correct=np.array([1]),
                                  trivial_threshold=0.375, drop_impossible_prompts=True, hard_subset_range=None)


def _reference_reasons(*, problems, reference_ok, too_long, n, c, verify, deduplicate, threshold, impossible, hard):
    """Loop reference: walk the prompts in order, give each the first rule in RULE_ORDER that drops it."""
    from pipeline.data import normalize_text

    seen: set[str] = set()
    reasons = []
    for i, problem in enumerate(problems):
        key = normalize_text(problem)
        if verify and not reference_ok[i]:
            reasons.append(REFERENCE_FAILS)
            continue
        if deduplicate:
            if key in seen:
                reasons.append(DUPLICATE)
                continue
            seen.add(key)
        if too_long[i]:
            reasons.append(TOO_LONG)
        elif threshold is not None and c[i] / n[i] > threshold:
            reasons.append(TRIVIAL)
        elif impossible and c[i] == 0:
            reasons.append(IMPOSSIBLE)
        elif hard is not None and not hard[0] <= c[i] <= hard[1]:
            reasons.append(OUTSIDE_HARD_SUBSET)
        else:
            reasons.append(KEPT)
    return reasons


@st.composite
def _cases(draw):
    size = draw(st.integers(0, 40))
    problems = draw(st.lists(st.sampled_from(["a", "A ", "b", "c", " c", "d", "e"]), min_size=size, max_size=size))
    reference_ok = draw(st.lists(st.booleans(), min_size=size, max_size=size))
    too_long = draw(st.lists(st.booleans(), min_size=size, max_size=size))
    n = draw(st.lists(st.integers(1, 16), min_size=size, max_size=size))
    c = [draw(st.integers(0, ni)) for ni in n]
    hard = draw(st.none() | st.tuples(st.integers(0, 4), st.integers(0, 4)).map(sorted).map(tuple))
    return {
        "problems": problems, "reference_ok": reference_ok, "too_long": too_long, "n": n, "c": c,
        "verify": draw(st.booleans()), "deduplicate": draw(st.booleans()),
        "threshold": draw(st.none() | st.sampled_from([0.0, 0.25, 0.375, 0.5, 1.0])),
        "impossible": draw(st.booleans()), "hard": hard,
    }


@settings(max_examples=150, deadline=None)
@given(_cases())
def test_every_dropped_prompt_has_exactly_its_first_reason(case):
    size = len(case["problems"])
    reasons, _ = rules.screen_prompts(problems=case["problems"], answers=["1"] * size, verify_reference=case["verify"],
                                      deduplicate=case["deduplicate"], grade_batch=_correct_if(case["reference_ok"]))
    alive = reasons == KEPT
    reasons, _ = rules.apply_rule(reasons, ~np.array(case["too_long"], dtype=bool)[alive], rule=TOO_LONG)
    # Prompts dropped before sampling have no samples, as in the stage.
    sampled = reasons == KEPT
    n = np.where(sampled, case["n"], 0).astype(np.int64)
    c = np.where(sampled, case["c"], 0).astype(np.int64)
    reasons, _ = rules.select_by_pass_rate(reasons, num_samples=n, num_correct=c, trivial_threshold=case["threshold"],
                                           drop_impossible_prompts=case["impossible"], hard_subset_range=case["hard"])

    assert reasons.tolist() == _reference_reasons(**case)
    assert all(reason in (KEPT, *RULE_ORDER) for reason in reasons)  # one reason each, or kept
    counts = rules.count_reasons(reasons)
    assert counts["kept"] + sum(counts[rule] for rule in RULE_ORDER) == counts["total"] == size
    kept = reasons == KEPT
    if case["deduplicate"]:
        from pipeline.data import normalize_text

        kept_keys = [normalize_text(p) for p, k in zip(case["problems"], kept) if k]
        assert len(kept_keys) == len(set(kept_keys))
    if case["threshold"] is not None:
        assert np.all(c[kept] <= case["threshold"] * n[kept])
