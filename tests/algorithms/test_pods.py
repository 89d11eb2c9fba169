"""PODS (Xu et al. 2025, as described in the D³S paper, "Learning More with Less: A Dynamic Dual-Level
Down-Sampling Framework for Efficient Policy Optimization")."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.algorithms import d3s, pods
from pipeline.algorithms.pods import pods_select


def population_var(values: list[float]) -> float:
    mean = sum(values) / len(values)
    return sum((v - mean) ** 2 for v in values) / len(values)


def reference_pods(rewards: list[float], group_ids: list[int], num_keep: int, eps: float):
    """Max Var(R) subset by brute force, then GRPO (D³S Eq. 2) inside the subset."""
    best_var = {}
    expected_adv = {}
    for g in sorted(set(group_ids)):
        members = [j for j, gid in enumerate(group_ids) if gid == g]
        size = min(num_keep, len(members))
        best = max(
            itertools.combinations(members, size),
            key=lambda c: population_var([rewards[j] for j in c]),
        )
        best_var[g] = population_var([rewards[j] for j in best])
        kept = [rewards[j] for j in best]
        mean = sum(kept) / len(kept)
        std = population_var(kept) ** 0.5
        for j in best:
            expected_adv[j] = 0.0 if max(kept) == min(kept) else (rewards[j] - mean) / (std + eps)
    return best_var, expected_adv


def test_hand_computed():
    # Group 0 rewards [1, 0, 0, 0, 1], N = 2: the max-variance pair is one 1 and one
    # 0; with (value, index) ordering that is index 1 (smallest 0) and index 4
    # (largest 1). In the subset mean = 0.5, std = 0.5 → A = ±0.5 / (0.5 + 1e-6).
    # Group 1 rewards [5, 5, 5]: constant subset → A = 0 exactly.
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 5.0, 5.0, 5.0])
    group_ids = torch.tensor([0, 0, 0, 0, 0, 1, 1, 1])
    (keep, adv), metrics = pods_select(
        advantages=None, rewards=rewards, group_ids=group_ids, num_keep=2
    )
    assert keep.tolist() == [False, True, False, False, True, True, True, False]
    a = 0.5 / (0.5 + 1e-6)
    assert adv.tolist() == pytest.approx([0, -a, 0, 0, a, 0, 0, 0])
    assert float(metrics["pods/selected_reward_var"]) == pytest.approx((0.25 + 0.0) / 2)
    assert float(metrics["pods/sample_usefulness_rate"]) == 0.5


@pytest.mark.parametrize("seed", range(5))
def test_matches_reference_on_ragged_groups(seed):
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, 8, (4,), generator=gen).tolist()
    group_ids = torch.cat([torch.full((n,), g) for g, n in enumerate(sizes)])
    group_ids = group_ids[torch.randperm(len(group_ids), generator=gen)]
    rewards = torch.randint(0, 3, (len(group_ids),), generator=gen).to(torch.float64) / 2
    (keep, adv), _ = pods_select(
        advantages=None, rewards=rewards, group_ids=group_ids, num_keep=3
    )
    best_var, expected_adv = reference_pods(rewards.tolist(), group_ids.tolist(), 3, 1e-6)
    for g in best_var:
        kept = rewards[(group_ids == g) & keep].tolist()
        assert population_var(kept) == pytest.approx(best_var[g], abs=1e-12)
    # Tie-breaking may pick a different but equally good subset than the reference
    # ``max``; the advantage of a kept sample depends only on the subset's reward
    # multiset, which has the same variance, so compare via the subset itself.
    for j in range(len(rewards)):
        if not keep[j]:
            assert adv[j] == 0
            continue
        members = rewards[(group_ids == group_ids[j]) & keep].tolist()
        mean = sum(members) / len(members)
        std = population_var(members) ** 0.5
        want = 0.0 if max(members) == min(members) else (rewards[j].item() - mean) / (std + 1e-6)
        assert adv[j].item() == pytest.approx(want, abs=1e-12)


def test_renormalised_subset_has_unit_variance_unlike_d3s():
    # D³S Sec. 2.2: PODS re-normalises, so Var(A') of the subset is back to ~1,
    # while D³S keeps full-group advantages and gets Var(A') ≥ 1 (Lemma 1).
    rewards = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.3])
    group_ids = torch.zeros(8, dtype=torch.int64)
    (keep, adv), _ = pods_select(advantages=None, rewards=rewards, group_ids=group_ids, num_keep=4)
    kept = adv[keep].to(torch.float64)
    assert float(kept.mean()) == pytest.approx(0.0, abs=1e-9)
    assert float(kept.var(unbiased=False)) == pytest.approx(1.0, rel=1e-5)


def test_selection_ignores_advantages_and_reuses_d3s_selector():
    assert pods.max_variance_subset is d3s.max_variance_subset
    rewards = torch.tensor([0.0, 1.0, 0.0, 1.0])
    group_ids = torch.zeros(4, dtype=torch.int64)
    (keep_a, adv_a), _ = pods_select(
        advantages=torch.tensor([9.0, -9.0, 3.0, 0.0]), rewards=rewards, group_ids=group_ids,
        num_keep=2,
    )
    (keep_b, adv_b), _ = pods_select(
        advantages=None, rewards=rewards, group_ids=group_ids, num_keep=2
    )
    assert torch.equal(keep_a, keep_b) and torch.equal(adv_a, adv_b)


def test_small_groups_and_group_of_one():
    rewards = torch.tensor([2.0, 0.0, 1.0, 7.0])
    group_ids = torch.tensor([0, 0, 0, 1])
    (keep, adv), _ = pods_select(advantages=None, rewards=rewards, group_ids=group_ids, num_keep=4)
    assert keep.all()  # both groups are smaller than N
    std = math.sqrt(2 / 3)  # population std of [2, 0, 1]
    assert adv.tolist() == pytest.approx([1 / (std + 1e-6), -1 / (std + 1e-6), 0.0, 0.0])


def test_output_dtype_follows_advantages():
    rewards = torch.tensor([0.0, 1.0, 1.0], dtype=torch.float64)
    (_, adv), _ = pods_select(
        advantages=torch.zeros(3, dtype=torch.bfloat16), rewards=rewards,
        group_ids=torch.zeros(3, dtype=torch.int64), num_keep=2,
    )
    assert adv.dtype == torch.bfloat16


def test_errors():
    ids = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="non-finite"):
        pods_select(
            advantages=None, rewards=torch.tensor([1.0, float("inf")]), group_ids=ids, num_keep=2
        )
    with pytest.raises(ValueError, match="at least 1"):
        pods_select(advantages=None, rewards=torch.zeros(2), group_ids=ids, num_keep=0)


@settings(max_examples=100, deadline=None)
@given(raw=st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=1, max_size=8), data=st.data())
def test_selected_reward_variance_is_maximal(raw, data):
    rewards = torch.tensor(raw, dtype=torch.float64)
    size = data.draw(st.integers(min_value=1, max_value=len(raw)))
    (keep, _), _ = pods_select(
        advantages=None, rewards=rewards, group_ids=torch.zeros(len(raw), dtype=torch.int64),
        num_keep=size,
    )
    best = max(population_var(list(c)) for c in itertools.combinations(raw, size))
    assert population_var(rewards[keep].tolist()) == pytest.approx(best, abs=1e-12)
