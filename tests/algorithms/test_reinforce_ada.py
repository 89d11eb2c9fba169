"""Reinforce-Ada ("Reinforce-Ada: An Adaptive Sampling Framework under Non-linear RL Objectives"):
Algorithms 1–2, §3.2, Appendices B, C.2 and D."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.algorithms.advantages import global_baseline_advantages
from pipeline.algorithms.reinforce_ada import (
    ada_est_budgets,
    allocate_proportional_budgets,
    balanced_downsample,
    exit_condition,
    expected_samples,
    pool_statistics,
    pool_zero_variance_probability,
)
from tests.oracles.estimators import PassRateEstimator

# ---------------------------------------------------------------------------
# float64 loop references, written from the paper's text
# ---------------------------------------------------------------------------


def ref_pool_means(rewards: list[float], groups: list[int], num_groups: int) -> tuple[list[float], list[float]]:
    means, rates = [], []
    for g in range(num_groups):
        members = [r for r, gid in zip(rewards, groups) if gid == g]
        means.append(sum(members) / len(members) if members else 0.0)
        rates.append(sum(1.0 for r in members if r > 0) / len(members) if members else 0.0)
    return means, rates


def ref_ada_seq(rewards, groups, num_groups, weight):
    """Algorithm 2 line 19 (A = r − r̄), × 1/p̂ of §3.2 when ``weight``."""
    means, rates = ref_pool_means(rewards, groups, num_groups)
    out = []
    for r, g in zip(rewards, groups):
        a = r - means[g]
        if weight:
            a = a / rates[g] if rates[g] > 0 else 0.0
        out.append(a)
    return out


def ref_ada_est(rewards, groups, num_groups, eps):
    """Algorithm 1 lines 14–16: A = (r − r̄)·1/√(r̄ + ε)."""
    means, _ = ref_pool_means(rewards, groups, num_groups)
    return [(r - means[g]) / math.sqrt(means[g] + eps) for r, g in zip(rewards, groups)]


def ref_allocation(weights: list[float], total: int, lo: int, hi: int) -> list[int]:
    """Bisection for c with Σ clip(c·w, lo, hi) = total, then largest remainder."""

    def f(c):
        return sum(min(max(c * w, lo), hi) for w in weights)

    left, right = 0.0, 1.0
    while f(right) < total:
        right *= 2.0
    for _ in range(300):
        mid = 0.5 * (left + right)
        if f(mid) < total:
            left = mid
        else:
            right = mid
    real = [min(max(right * w, lo), hi) for w in weights]
    base = [min(max(math.floor(x), lo), hi) for x in real]
    remainder = total - sum(base)
    candidates = sorted(
        (i for i in range(len(weights)) if base[i] < hi),
        key=lambda i: (-(real[i] - base[i]), -weights[i], i),
    )
    for i in candidates[:remainder]:
        base[i] += 1
    return base


def ref_expected_samples(p: float, rule: str, k_pos: int, k_neg: int, batch: int, cap: int) -> float:
    """Round-by-round dynamic programme over the number of correct responses so far."""
    active = {0: 1.0}  # correct count → probability of still being active with it
    drawn_so_far = 0
    expected = 0.0
    while drawn_so_far < cap and active:
        size = min(batch, cap - drawn_so_far)
        expected += size * sum(active.values())
        drawn_so_far += size
        nxt: dict[int, float] = {}
        for c, mass in active.items():
            for j in range(size + 1):
                prob = math.comb(size, j) * p**j * (1 - p) ** (size - j)
                nxt[c + j] = nxt.get(c + j, 0.0) + mass * prob
        active = {}
        for c, mass in nxt.items():
            done = c >= k_pos and (rule == "pos" or drawn_so_far - c >= k_neg)
            if not done:
                active[c] = mass
    return expected


# ---------------------------------------------------------------------------
# Exit conditions (Algorithm 2 lines 8–9)
# ---------------------------------------------------------------------------


def test_exit_condition_hand_case():
    num_correct = torch.tensor([0, 3, 8, 8, 20])
    num_incorrect = torch.tensor([16, 13, 0, 8, 4])
    pos, _ = exit_condition(num_correct=num_correct, num_incorrect=num_incorrect, rule="pos", k_pos=8)
    assert pos.tolist() == [False, False, True, True, True]
    bal, metrics = exit_condition(
        num_correct=num_correct, num_incorrect=num_incorrect, rule="balance", k_pos=8, k_neg=8
    )
    assert bal.tolist() == [False, False, False, True, False]
    assert metrics["ada/exit_fraction"] == pytest.approx(0.2)


def test_exit_condition_matches_loop_reference():
    gen = torch.Generator().manual_seed(3)
    num_correct = torch.randint(0, 12, (200,), generator=gen)
    num_incorrect = torch.randint(0, 12, (200,), generator=gen)
    got, _ = exit_condition(num_correct=num_correct, num_incorrect=num_incorrect, rule="balance", k_pos=4, k_neg=6)
    expected = [c >= 4 and i >= 6 for c, i in zip(num_correct.tolist(), num_incorrect.tolist())]
    assert got.tolist() == expected


def test_exit_condition_rejects_bad_input():
    counts = torch.tensor([1, 2])
    with pytest.raises(ValueError, match="unknown exit rule"):
        exit_condition(num_correct=counts, num_incorrect=counts, rule="both", k_pos=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="same shape"):
        exit_condition(num_correct=counts, num_incorrect=counts[:1], rule="pos", k_pos=1)


# ---------------------------------------------------------------------------
# Pool statistics and the Ada-Seq advantage (Algorithm 2 lines 16–19, §3.2)
# ---------------------------------------------------------------------------


def _ragged_pool(seed: int, num_groups: int = 7):
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, 30, (num_groups,), generator=gen)
    group_ids = torch.repeat_interleave(torch.arange(num_groups), sizes)
    group_ids = group_ids[torch.randperm(group_ids.numel(), generator=gen)]  # non-contiguous members
    pass_rates = torch.rand(num_groups, generator=gen, dtype=torch.float64)
    rewards = (torch.rand(group_ids.numel(), generator=gen, dtype=torch.float64) < pass_rates[group_ids]).double()
    return rewards, group_ids


def test_pool_statistics_match_loop_reference():
    rewards, group_ids = _ragged_pool(0)
    stats, _ = pool_statistics(rewards=rewards, group_ids=group_ids)
    means, rates = ref_pool_means(rewards.tolist(), group_ids.tolist(), 7)
    torch.testing.assert_close(stats.mean_reward, torch.tensor(means, dtype=torch.float64))
    torch.testing.assert_close(stats.pass_rate, torch.tensor(rates, dtype=torch.float64))
    assert (stats.num_correct + stats.num_incorrect).tolist() == torch.bincount(group_ids).tolist()


def test_pool_statistics_empty_trailing_group_and_non_finite():
    stats, _ = pool_statistics(rewards=torch.tensor([1.0, 0.0]), group_ids=torch.tensor([0, 0]), num_groups=2)
    assert stats.num_samples.tolist() == [2, 0]
    assert stats.mean_reward.tolist() == [0.5, 0.0]
    with pytest.raises(ValueError, match="non-finite"):
        pool_statistics(rewards=torch.tensor([1.0, float("nan")]), group_ids=torch.tensor([0, 0]))


def test_pool_statistics_count_outcomes_by_threshold():
    # {−1, +1} rewards with the default threshold 0: two correct, one incorrect.
    stats, _ = pool_statistics(rewards=torch.tensor([1.0, -1.0, 1.0]), group_ids=torch.tensor([0, 0, 0]))
    assert stats.num_correct.tolist() == [2] and stats.num_incorrect.tolist() == [1]
    assert stats.mean_reward.tolist() == pytest.approx([1 / 3]) and stats.pass_rate.tolist() == pytest.approx([2 / 3])
    # A stricter threshold turns partial credit into failures.
    stats, _ = pool_statistics(rewards=torch.tensor([0.5, 1.0]), group_ids=torch.tensor([0, 0]), success_threshold=0.75)
    assert stats.num_correct.tolist() == [1]


# The advantages of both Reinforce-Ada variants are ``global_baseline`` (advantages.py) fed with
# the whole pool; these integration tests check it against the paper-derived references above,
# including after balanced down-sampling.


def test_global_baseline_hand_case_for_ada():
    # Group 0: pool {1, 0, 0, 0} → r̄ = p̂ = 1/4. Algorithm 2: A = r − 1/4 = [0.75, −0.25, −0.25, −0.25];
    #   §3.2 weight 1/p̂ = 4 → [3, −1, −1, −1];
    #   Algorithm 1 weight 1/√(1/4) = 2 → [1.5, −0.5, −0.5, −0.5].
    # Group 1: {1, 1} zero variance → 0.   Group 2: a group of one → 0.
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0], dtype=torch.float64)
    group_ids = torch.tensor([0, 0, 0, 0, 1, 1, 2])
    cases = {
        "none": [0.75, -0.25, -0.25, -0.25, 0.0, 0.0, 0.0],
        "inv_mean": [3.0, -1.0, -1.0, -1.0, 0.0, 0.0, 0.0],
        "inv_sqrt_mean": [1.5, -0.5, -0.5, -0.5, 0.0, 0.0, 0.0],
    }
    for weight, expected in cases.items():
        got, _ = global_baseline_advantages(rewards=rewards, group_ids=group_ids, weight=weight, eps=1e-12)
        torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), atol=1e-9, rtol=0)


@pytest.mark.parametrize("weight", ["none", "inv_mean", "inv_sqrt_mean"])
def test_ada_pipeline_pool_then_balanced_subset(weight):
    """Pool → advantages over the pool → balanced subset equals the paper's per-sample formula."""
    rewards, group_ids = _ragged_pool(2)
    full, _ = global_baseline_advantages(rewards=rewards, group_ids=group_ids, weight=weight, eps=1e-12)
    (keep, passed), _ = balanced_downsample(
        advantages=full, rewards=rewards, group_ids=group_ids, num_keep=4, generator=torch.Generator().manual_seed(0)
    )
    assert passed is full
    if weight == "inv_sqrt_mean":
        expected = ref_ada_est(rewards.tolist(), group_ids.tolist(), 7, 1e-12)
    else:
        expected = ref_ada_seq(rewards.tolist(), group_ids.tolist(), 7, weight == "inv_mean")
    expected_t = torch.tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(full, expected_t, atol=1e-9, rtol=1e-9)
    # Computing on the kept subset, given the pool, gives the same numbers.
    subset, _ = global_baseline_advantages(
        rewards=rewards[keep],
        group_ids=group_ids[keep],
        pool_rewards=rewards,
        pool_group_ids=group_ids,
        weight=weight,
        eps=1e-12,
    )
    torch.testing.assert_close(subset, expected_t[keep], atol=1e-9, rtol=1e-9)


# ---------------------------------------------------------------------------
# Balanced down-sampling (Algorithm 2 line 18)
# ---------------------------------------------------------------------------


def _expected_quota(num_pos: int, num_neg: int, n: int) -> tuple[int, int]:
    """Written from the rule: ⌊n/2⌋ incorrect and the rest correct, short side filled by the other."""
    if num_pos + num_neg <= n:
        return num_pos, num_neg
    keep_neg = min(num_neg, n // 2)
    keep_pos = min(num_pos, n - keep_neg)
    keep_neg = min(num_neg, n - keep_pos)
    return keep_pos, keep_neg


def test_balanced_downsample_hand_case():
    # Group 0: 1 correct + 5 incorrect, n = 4 → the only correct one + 3 incorrect.
    # Group 1: 5 correct + 1 incorrect → 3 correct + the only incorrect one.
    # Group 2: 3 correct + 3 incorrect → 2 + 2.   Group 3: 3 samples ≤ n → all kept.
    rewards = torch.tensor([1.0, 0, 0, 0, 0, 0] + [1.0, 1, 1, 1, 1, 0] + [1.0, 1, 1, 0, 0, 0] + [0.0, 1, 0])
    group_ids = torch.tensor([0] * 6 + [1] * 6 + [2] * 6 + [3] * 3)
    advantages = torch.arange(21, dtype=torch.float32)
    (keep, adv), metrics = balanced_downsample(
        advantages=advantages,
        rewards=rewards,
        group_ids=group_ids,
        num_keep=4,
        generator=torch.Generator().manual_seed(1),
    )
    assert adv is advantages  # passed through: pool-level advantages are kept as they are
    for g, (pos, neg) in enumerate([(1, 3), (3, 1), (2, 2), (1, 2)]):
        in_group = keep & (group_ids == g)
        assert int((in_group & (rewards > 0)).sum()) == pos
        assert int((in_group & (rewards <= 0)).sum()) == neg
    assert bool(keep[0]) and bool(keep[11])  # the lone correct / incorrect responses
    assert metrics["balanced/mixed_group_fraction"] == 1.0
    assert metrics["balanced/short_group_fraction"] == pytest.approx(0.25)


@settings(max_examples=150, deadline=None)
@given(
    compositions=st.lists(st.tuples(st.integers(0, 20), st.integers(0, 20)), min_size=1, max_size=8),
    num_keep=st.integers(1, 12),
    seed=st.integers(0, 2**31 - 1),
)
def test_balanced_downsample_quota_property(compositions, num_keep, seed):
    """Per group: kept = min(n, pool), ≥ min(side, ⌊n/2⌋) of each outcome, exact split from the rule."""
    rewards_list, groups_list = [], []
    for g, (num_pos, num_neg) in enumerate(compositions):
        rewards_list += [1.0] * num_pos + [0.0] * num_neg
        groups_list += [g] * (num_pos + num_neg)
    rewards = torch.tensor(rewards_list, dtype=torch.float32)
    group_ids = torch.tensor(groups_list, dtype=torch.int64)
    perm = torch.randperm(rewards.numel(), generator=torch.Generator().manual_seed(seed))
    rewards, group_ids = rewards[perm], group_ids[perm]
    (keep, _), _ = balanced_downsample(
        advantages=torch.zeros_like(rewards),
        rewards=rewards,
        group_ids=group_ids,
        num_keep=num_keep,
        generator=torch.Generator().manual_seed(seed),
        num_groups=len(compositions),
    )
    for g, (num_pos, num_neg) in enumerate(compositions):
        in_group = keep & (group_ids == g)
        kept_pos = int((in_group & (rewards > 0)).sum())
        kept_neg = int((in_group & (rewards <= 0)).sum())
        assert (kept_pos, kept_neg) == _expected_quota(num_pos, num_neg, num_keep)
        assert kept_pos + kept_neg == min(num_keep, num_pos + num_neg)
        assert kept_pos >= min(num_pos, num_keep // 2) and kept_neg >= min(num_neg, num_keep // 2)


def test_balanced_downsample_is_seeded_and_uniform():
    rewards = torch.tensor([1.0] * 6 + [0.0] * 10)
    group_ids = torch.zeros(16, dtype=torch.int64)
    advantages = torch.zeros(16)

    def draw(seed):
        (keep, _), _ = balanced_downsample(
            advantages=advantages,
            rewards=rewards,
            group_ids=group_ids,
            num_keep=4,
            generator=torch.Generator().manual_seed(seed),
        )
        return keep

    assert torch.equal(draw(7), draw(7))
    counts = torch.stack([draw(seed) for seed in range(2000)]).double().sum(0)
    # Each correct response is kept with probability 2/6, each incorrect one with 2/10.
    # Binomial(2000, q) standard deviations are ≈ 21 and ≈ 18; allow 4σ.
    assert (counts[:6] - 2000 * 2 / 6).abs().max() < 4 * math.sqrt(2000 * (1 / 3) * (2 / 3))
    assert (counts[6:] - 2000 * 2 / 10).abs().max() < 4 * math.sqrt(2000 * 0.2 * 0.8)


def test_balanced_downsample_edge_cases():
    gen = torch.Generator().manual_seed(0)
    (keep, _), metrics = balanced_downsample(
        advantages=torch.zeros(0),
        rewards=torch.zeros(0),
        group_ids=torch.zeros(0, dtype=torch.int64),
        num_keep=4,
        generator=gen,
    )
    assert keep.numel() == 0 and metrics == {}
    with pytest.raises(ValueError, match="num_keep"):
        balanced_downsample(
            advantages=torch.zeros(2),
            rewards=torch.zeros(2),
            group_ids=torch.zeros(2, dtype=torch.int64),
            num_keep=0,
            generator=gen,
        )
    with pytest.raises(ValueError, match="Generator"):
        balanced_downsample(
            advantages=torch.zeros(2),
            rewards=torch.zeros(2),
            group_ids=torch.zeros(2, dtype=torch.int64),
            num_keep=1,
            generator=None,  # type: ignore[arg-type]
        )
    with pytest.raises(ValueError, match="non-finite"):
        balanced_downsample(
            advantages=torch.zeros(2),
            rewards=torch.tensor([0.0, float("inf")]),
            group_ids=torch.zeros(2, dtype=torch.int64),
            num_keep=1,
            generator=gen,
        )


# ---------------------------------------------------------------------------
# Ada-EMA estimator (§3.1)
# ---------------------------------------------------------------------------


def test_pass_rate_estimator_hand_case():
    # λ = 0.5, Beta(1, 1). Step 1, prompt 0: n = 4, k = 1 → N_tot = 4, N_pos = 1 → p̂ = 2/6.
    # Step 2, prompt 0: n = 4, k = 3 → N_tot = 0.5·4 + 4 = 6, N_pos = 0.5·1 + 3 = 3.5 → p̂ = 4.5/8.
    # Prompt 1 is never seen → prior mean 1/2; prompt 2 seen only in step 1 keeps its counts.
    est = PassRateEstimator(num_prompts=3, decay=0.5, prior_alpha=1.0, prior_beta=1.0)
    est.update(prompt_ids=torch.tensor([0, 2]), num_samples=torch.tensor([4, 8]), num_correct=torch.tensor([1, 0]))
    expected = torch.tensor([2 / 6, 0.5, 1 / 10], dtype=torch.float64)
    torch.testing.assert_close(est.estimate(torch.tensor([0, 1, 2])), expected)
    est.update(prompt_ids=torch.tensor([0]), num_samples=torch.tensor([4]), num_correct=torch.tensor([3]))
    torch.testing.assert_close(est.estimate(torch.tensor([0, 2])), torch.tensor([4.5 / 8, 1 / 10], dtype=torch.float64))
    assert float(est.estimate(torch.tensor([2]))) > 0  # never solved, still not discarded


def test_pass_rate_estimator_matches_loop_reference_with_duplicates():
    gen = torch.Generator().manual_seed(5)
    decay, alpha, beta = 0.8, 0.5, 2.0
    est = PassRateEstimator(num_prompts=10, decay=decay, prior_alpha=alpha, prior_beta=beta)
    tot = [0.0] * 10
    pos = [0.0] * 10
    for _ in range(6):
        ids = torch.randint(0, 10, (7,), generator=gen)  # duplicates likely
        n = torch.randint(1, 9, (7,), generator=gen)
        k = torch.minimum(torch.randint(0, 9, (7,), generator=gen), n)
        est.update(prompt_ids=ids, num_samples=n, num_correct=k)
        batch_n: dict[int, int] = {}
        batch_k: dict[int, int] = {}
        for i, ni, ki in zip(ids.tolist(), n.tolist(), k.tolist()):
            batch_n[i] = batch_n.get(i, 0) + ni
            batch_k[i] = batch_k.get(i, 0) + ki
        for i in batch_n:
            tot[i] = decay * tot[i] + batch_n[i]
            pos[i] = decay * pos[i] + batch_k[i]
    expected = [(pos[i] + alpha) / (tot[i] + alpha + beta) for i in range(10)]
    torch.testing.assert_close(est.estimate(torch.arange(10)), torch.tensor(expected, dtype=torch.float64))


def test_pass_rate_estimator_state_round_trip_and_validation():
    est = PassRateEstimator(num_prompts=4, decay=0.9)
    est.update(prompt_ids=torch.tensor([1, 3]), num_samples=torch.tensor([8, 8]), num_correct=torch.tensor([2, 8]))
    state = est.state_dict()
    json.dumps({k: v.tolist() for k, v in state.items()})  # plain tensors only
    fresh = PassRateEstimator(num_prompts=4, decay=0.9)
    fresh.load_state_dict(state)
    torch.testing.assert_close(fresh.estimate(torch.arange(4)), est.estimate(torch.arange(4)))
    with pytest.raises(ValueError, match="shape"):
        PassRateEstimator(num_prompts=5).load_state_dict(state)
    with pytest.raises(ValueError, match="prompt ids"):
        est.update(prompt_ids=torch.tensor([4]), num_samples=torch.tensor([1]), num_correct=torch.tensor([0]))
    with pytest.raises(ValueError, match="num_correct"):
        est.update(prompt_ids=torch.tensor([0]), num_samples=torch.tensor([1]), num_correct=torch.tensor([2]))
    with pytest.raises(ValueError, match="decay"):
        PassRateEstimator(num_prompts=1, decay=0.0)


# ---------------------------------------------------------------------------
# Budget allocation (Algorithm 1 line 5, Appendix B.1)
# ---------------------------------------------------------------------------


def test_allocation_hand_case():
    # w = [1, 2, 3, 0.5], total 20, bounds [2, 8]. c = 10/3: c·w = [3.33, 6.67, 10 → 8, 1.67 → 2],
    # sum = 20. Floors [3, 6, 8, 2] = 19; the one leftover goes to the largest fraction (6.67).
    weights = torch.tensor([1.0, 2.0, 3.0, 0.5])
    budgets, _ = allocate_proportional_budgets(weights=weights, total=20, min_budget=2, max_budget=8)
    assert budgets.tolist() == [3, 7, 8, 2]


def test_allocation_matches_loop_reference():
    gen = torch.Generator().manual_seed(11)
    for trial in range(20):
        num = int(torch.randint(1, 40, (1,), generator=gen))
        weights = torch.rand(num, generator=gen, dtype=torch.float64) * 5 + 0.01
        lo = int(torch.randint(0, 4, (1,), generator=gen))
        hi = lo + int(torch.randint(1, 30, (1,), generator=gen))
        total = int(torch.randint(num * lo, num * hi + 1, (1,), generator=gen))
        got, _ = allocate_proportional_budgets(weights=weights, total=total, min_budget=lo, max_budget=hi)
        assert got.tolist() == ref_allocation(weights.tolist(), total, lo, hi), trial


@settings(max_examples=200, deadline=None)
@given(
    weights=st.lists(st.floats(0.0, 100.0, allow_nan=False, allow_infinity=False), min_size=1, max_size=30),
    lo=st.integers(0, 6),
    span=st.integers(0, 40),
    fraction=st.floats(0.0, 1.0),
)
def test_allocation_properties(weights, lo, span, fraction):
    w = torch.tensor(weights, dtype=torch.float64)
    hi = lo + span
    num_positive = int((w > 0).sum())
    lowest, highest = len(weights) * lo, (len(weights) - num_positive) * lo + num_positive * hi
    total = lowest + int(round(fraction * (highest - lowest)))
    budgets, metrics = allocate_proportional_budgets(weights=w, total=total, min_budget=lo, max_budget=hi)
    assert int(budgets.sum()) == total
    assert bool((budgets >= lo).all()) and bool((budgets <= hi).all())
    heavier = w[:, None] > w[None, :]  # (B, B)
    assert not bool((heavier & (budgets[:, None] < budgets[None, :])).any()), "w_i > w_j ⇒ N_i ≥ N_j"
    # Relative weights below 1e-200 are floored there (documented), so compare in relative units.
    max_weight = float(w.max()) if num_positive else 1.0
    relative = torch.where(w > 0, (w / max_weight).clamp(min=1e-200), w)
    real = (metrics["budget/scale"] * relative).clamp(lo, hi)
    assert bool(((budgets.double() - real).abs() < 1.0 + 1e-9).all())


def test_allocation_infeasible_targets_raise():
    w = torch.tensor([1.0, 2.0, 0.0])
    with pytest.raises(ValueError, match="infeasible"):
        allocate_proportional_budgets(weights=w, total=5, min_budget=2, max_budget=8)  # < 3·2
    with pytest.raises(ValueError, match="infeasible"):
        allocate_proportional_budgets(weights=w, total=19, min_budget=2, max_budget=8)  # > 8 + 8 + 2
    budgets, _ = allocate_proportional_budgets(weights=w, total=18, min_budget=2, max_budget=8)
    assert budgets.tolist() == [8, 8, 2]
    with pytest.raises(ValueError, match="non-finite"):
        allocate_proportional_budgets(weights=torch.tensor([float("nan")]), total=1, min_budget=0, max_budget=2)


def test_ada_est_budgets_rules():
    pass_rate = torch.tensor([0.04, 0.25, 1.0])
    # log rule, ε → 0: weights 1/√p = [5, 2, 1]; total 16 in [1, 10]: c = 2 → [10, 4, 2].
    budgets, _ = ada_est_budgets(pass_rate=pass_rate, total=16, min_budget=1, max_budget=10, eps=1e-12)
    assert budgets.tolist() == [10, 4, 2]
    # Appendix B rule: √((1−p)/p) = [√24, √3, 0]: the solved prompt gets N_min, the hard one the most.
    budgets, _ = ada_est_budgets(pass_rate=pass_rate, total=12, min_budget=1, max_budget=10, rule="reinforce_baseline")
    assert budgets[2] == 1 and budgets[0] > budgets[1] > 1 and int(budgets.sum()) == 12
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        ada_est_budgets(pass_rate=torch.tensor([1.5]), total=1, min_budget=1, max_budget=2)


def test_implicit_rule_hand_case():
    # Appendix C.2 implicit weighting, ε → 0: weights 1/p = [25, 4, 1]; total 30 in [1, 20].
    # c·(25, 4, 1) with the first clipped at 20: 20 + 5c = 30 → c = 2 → [20, 8, 2], all integers.
    pass_rate = torch.tensor([0.04, 0.25, 1.0], dtype=torch.float64)
    budgets, metrics = ada_est_budgets(pass_rate=pass_rate, total=30, min_budget=1, max_budget=20, rule="implicit",
                                       eps=1e-12)
    assert budgets.tolist() == [20, 8, 2]
    assert metrics["budget/scale"] == pytest.approx(2 * 25)  # c in units of the largest weight
    # The hybrid log rule spreads the same budget less steeply: 1/√p = [5, 2, 1].
    log_budgets, _ = ada_est_budgets(pass_rate=pass_rate, total=30, min_budget=1, max_budget=20, eps=1e-12)
    assert log_budgets[0] < budgets[0] and log_budgets[2] > budgets[2]


def test_implicit_rule_matches_loop_reference():
    gen = torch.Generator().manual_seed(5)
    for trial in range(20):
        num = int(torch.randint(1, 40, (1,), generator=gen))
        pass_rate = torch.rand(num, generator=gen, dtype=torch.float64)
        pass_rate[0] = 0.0  # a never-solved prompt: weight 1/ε
        lo = int(torch.randint(0, 4, (1,), generator=gen))
        hi = lo + int(torch.randint(1, 30, (1,), generator=gen))
        total = int(torch.randint(num * lo, num * hi + 1, (1,), generator=gen))
        got, _ = ada_est_budgets(pass_rate=pass_rate, total=total, min_budget=lo, max_budget=hi, rule="implicit")
        weights = [1.0 / (p + 1e-6) for p in pass_rate.tolist()]
        assert got.tolist() == ref_allocation(weights, total, lo, hi), trial


@settings(max_examples=150, deadline=None)
@given(
    pass_rate=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=30),
    lo=st.integers(0, 6),
    span=st.integers(0, 40),
    fraction=st.floats(0.0, 1.0),
)
def test_implicit_rule_properties(pass_rate, lo, span, fraction):
    """Σ N_x = N_total exactly, N_x ∈ [N_min, N_max], and a harder prompt never gets fewer samples."""
    p = torch.tensor(pass_rate, dtype=torch.float64)
    hi = lo + span
    total = len(pass_rate) * lo + int(round(fraction * len(pass_rate) * span))
    budgets, _ = ada_est_budgets(pass_rate=p, total=total, min_budget=lo, max_budget=hi, rule="implicit")
    assert int(budgets.sum()) == total
    assert bool((budgets >= lo).all()) and bool((budgets <= hi).all())
    # "Harder" as the rule sees it: pass rates closer than ε's resolution (p = 0 vs 1e-309) weigh the same,
    # and equal weights may be split either way by the integer rounding.
    weights = 1.0 / (p + 1e-6)
    harder = weights[:, None] > weights[None, :]
    assert not bool((harder & (budgets[:, None] < budgets[None, :])).any())


def test_implicit_rule_edge_cases():
    # One prompt takes the whole total; equal pass rates share it evenly.
    budgets, _ = ada_est_budgets(pass_rate=torch.tensor([0.3]), total=7, min_budget=1, max_budget=8, rule="implicit")
    assert budgets.tolist() == [7]
    budgets, _ = ada_est_budgets(pass_rate=torch.full((4,), 0.5), total=12, min_budget=1, max_budget=8,
                                 rule="implicit")
    assert budgets.tolist() == [3, 3, 3, 3]
    budgets, _ = ada_est_budgets(pass_rate=torch.zeros(0), total=0, min_budget=1, max_budget=8, rule="implicit")
    assert budgets.numel() == 0
    with pytest.raises(ValueError, match="non-finite"):
        ada_est_budgets(pass_rate=torch.tensor([float("nan")]), total=1, min_budget=1, max_budget=2, rule="implicit")
    with pytest.raises(ValueError, match="unknown allocation rule"):
        ada_est_budgets(pass_rate=torch.tensor([0.5]), total=1, min_budget=1, max_budget=2, rule="inverse")


# ---------------------------------------------------------------------------
# Appendix D: expected sampling cost
# ---------------------------------------------------------------------------


def test_expected_samples_hand_case():
    # POS, K = 1, rounds of 2, cap 4, p = 1/2: round 1 always (2 samples); round 2 only if
    # both were wrong (prob 1/4): E = 2 + 2·1/4 = 2.5. p = 0 never exits: 4. p = 1: 2.
    got, metrics = expected_samples(torch.tensor([0.5, 0.0, 1.0]), rule="pos", k_pos=1, batch_size=2, max_samples=4)
    torch.testing.assert_close(got, torch.tensor([2.5, 4.0, 2.0], dtype=torch.float64))
    torch.testing.assert_close(metrics["unresolved_prob"], torch.tensor([1 / 16, 1.0, 0.0], dtype=torch.float64))


def test_expected_samples_closed_forms():
    # K = 1, one sample per round, cap N: E[min(Geometric(p), N)] = Σ_{n<N} (1−p)^n.
    p = torch.tensor([0.1, 0.3, 0.9], dtype=torch.float64)
    got, _ = expected_samples(p, rule="pos", k_pos=1, batch_size=1, max_samples=25)
    expected = torch.stack([((1 - q) ** torch.arange(25, dtype=torch.float64)).sum() for q in p])
    torch.testing.assert_close(got, expected)
    # Negative binomial mean K/p of §3.2 once the cap is far away.
    got, _ = expected_samples(torch.tensor(0.5), rule="pos", k_pos=3, batch_size=1, max_samples=400)
    assert float(got) == pytest.approx(6.0, abs=1e-9)
    # A vacuous rule still draws the first round.
    got, _ = expected_samples(torch.tensor(0.3), rule="balance", k_pos=0, k_neg=0, batch_size=8, max_samples=64)
    assert float(got) == 8.0


@pytest.mark.parametrize("rule", ["pos", "balance"])
def test_expected_samples_match_round_dp(rule):
    ps = [0.0, 0.05, 0.3, 0.5, 0.8, 1.0]
    p = torch.tensor(ps, dtype=torch.float64)
    # Rounds of 4 up to 30: the last round draws only 2.
    got, _ = expected_samples(p, rule=rule, k_pos=3, k_neg=2, batch_size=4, max_samples=30)
    expected = [ref_expected_samples(p, rule, 3, 2, 4, 30) for p in ps]
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("rule", ["pos", "balance"])
def test_expected_samples_agree_with_monte_carlo(rule):
    """A seeded simulation of Algorithm 2's rounds agrees with the exact value within 3 standard errors."""
    k_pos, k_neg, batch, cap, trials = 4, 4, 4, 32, 20000
    gen = torch.Generator().manual_seed(1234)
    for p in (0.05, 0.3, 0.7, 0.95):
        draws = (torch.rand(trials, cap, generator=gen, dtype=torch.float64) < p).long()
        correct_after = draws.cumsum(1)[:, batch - 1 :: batch]  # (trials, rounds)
        drawn_after = torch.arange(1, cap // batch + 1) * batch
        met = correct_after >= k_pos
        if rule == "balance":
            met &= (drawn_after - correct_after) >= k_neg
        met[:, -1] = True  # the cap ends sampling
        first_exit = met.long().argmax(1)  # index of the first round after which sampling stops
        samples = (first_exit + 1).double() * batch
        exact, _ = expected_samples(
            torch.tensor(p), rule=rule, k_pos=k_pos, k_neg=k_neg, batch_size=batch, max_samples=cap
        )
        std_error = float(samples.std()) / math.sqrt(trials)
        mean = float(samples.mean())
        assert abs(mean - float(exact)) <= 3 * std_error + 1e-12, (p, mean, float(exact))


def test_expected_samples_rejects_bad_input():
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        expected_samples(torch.tensor([1.2]), k_pos=1, batch_size=1, max_samples=2)
    with pytest.raises(ValueError, match="non-finite"):
        expected_samples(torch.tensor([float("nan")]), k_pos=1, batch_size=1, max_samples=2)
    with pytest.raises(ValueError, match="unknown exit rule"):
        expected_samples(0.5, rule="neg", k_pos=1, batch_size=1, max_samples=2)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------
# The pool no number of rounds rescues
# ---------------------------------------------------------------------------


def ref_pool_zero_variance(p: float, rule: str, k_pos: int, k_neg: int, batch: int, cap: int) -> float:
    """Every outcome sequence of ``cap`` draws, each cut where Algorithm 2's rounds stop (lines 4–12)."""
    total = 0.0
    for bits in range(2**cap):
        outcomes = [(bits >> i) & 1 for i in range(cap)]
        drawn = 0
        while True:
            drawn = min(drawn + batch, cap)
            correct = sum(outcomes[:drawn])
            met = correct >= k_pos if rule == "pos" else correct >= k_pos and drawn - correct >= k_neg
            if met or drawn == cap:
                break
        correct = sum(outcomes)
        weight = p**correct * (1 - p) ** (cap - correct)  # the undrawn tail marginalises out
        if len(set(outcomes[:drawn])) == 1:
            total += weight
    return total


@pytest.mark.parametrize(("rule", "k_pos", "k_neg", "batch", "cap"), [
    ("balance", 2, 2, 3, 8), ("balance", 1, 1, 2, 9), ("balance", 3, 0, 2, 8), ("balance", 0, 2, 4, 10),
    ("balance", 0, 0, 3, 7), ("pos", 1, 5, 3, 8), ("pos", 4, 0, 3, 10), ("pos", 0, 0, 2, 6), ("pos", 9, 0, 4, 8),
])
def test_pool_zero_variance_matches_every_outcome_sequence(rule, k_pos, k_neg, batch, cap):
    ps = [0.0, 0.02, 0.3, 0.5, 0.85, 1.0]
    got = pool_zero_variance_probability(torch.tensor(ps, dtype=torch.float64), rule=rule, k_pos=k_pos, k_neg=k_neg, batch_size=batch,
                                         max_samples=cap)
    expected = torch.tensor([ref_pool_zero_variance(p, rule, k_pos, k_neg, batch, cap) for p in ps],
                            dtype=torch.float64)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-15)


def test_pool_zero_variance_at_the_authors_settings():
    # BALANCE at n = 4 (2 correct and 2 incorrect, rounds of 8, N_max = 32) never exits on a
    # one-outcome pool: p^32 + (1 − p)^32, symmetric, 0.9 near p = 0.0033. POS (1 correct) exits
    # after the first round of 8 on an all-correct pool.
    p = torch.tensor([0.0033, 0.5, 0.9967, 0.9], dtype=torch.float64)
    balance = pool_zero_variance_probability(p, rule="balance", k_pos=2, k_neg=2, batch_size=8, max_samples=32)
    torch.testing.assert_close(balance, p**32 + (1 - p) ** 32)
    assert float(balance[0]) == pytest.approx(0.8996, abs=1e-4) and float(balance[0]) == float(balance[2])
    pos = pool_zero_variance_probability(0.9, rule="pos", k_pos=1, batch_size=8, max_samples=32)
    assert float(pos) == pytest.approx(0.9**8 + 0.1**32)


def test_pool_zero_variance_rejects_bad_input():
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        pool_zero_variance_probability(torch.tensor([-0.1]), k_pos=1, batch_size=1, max_samples=2)
    with pytest.raises(ValueError, match="≥ 1"):
        pool_zero_variance_probability(0.5, k_pos=1, batch_size=0, max_samples=2)
    with pytest.raises(ValueError, match="unknown exit rule"):
        pool_zero_variance_probability(0.5, rule="neg", k_pos=1, batch_size=1, max_samples=2)  # type: ignore[arg-type]
