"""Group advantages against float64 loops written from the papers' equations."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.algorithms import advantages as adv

EPS = 1e-6

ADVANTAGE_FUNCTIONS = {"grpo": adv.grpo_advantages, "dr_grpo": adv.dr_grpo_advantages, "rloo": adv.rloo_advantages,
                       "global_baseline": adv.global_baseline_advantages}


# ---------------------------------------------------------------- loop references
def _groups(rewards: list[float], ids: list[int]) -> dict[int, list[int]]:
    members: dict[int, list[int]] = {}
    for index, gid in enumerate(ids):
        members.setdefault(gid, []).append(index)
    return members


def _reference(method: str, rewards: list[float], ids: list[int]) -> list[float]:
    """Reinforce-Ada Eq. 2 (grpo), Dr.GRPO, RLOO and Algorithm 2 line 19, one sample at a time."""
    out = [0.0] * len(rewards)
    for members in _groups(rewards, ids).values():
        group = [rewards[i] for i in members]
        n = len(group)
        if n < 2 or max(group) == min(group):
            continue
        mean = sum(group) / n
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / n)
        for i in members:
            r = rewards[i]
            if method == "grpo":
                out[i] = (r - mean) / (std + EPS)
            elif method in ("dr_grpo", "global_baseline"):
                out[i] = r - mean
            elif method == "rloo":
                out[i] = r - (sum(group) - r) / (n - 1)
    return out


batches = st.integers(1, 5).flatmap(
    lambda num_groups: st.lists(st.integers(0, num_groups - 1), min_size=1, max_size=20)
).flatmap(
    lambda ids: st.tuples(
        st.just(ids),
        st.lists(
            st.one_of(st.sampled_from([0.0, 1.0]), st.floats(-5, 5, allow_nan=False)),
            min_size=len(ids),
            max_size=len(ids),
        ),
    )
)


@pytest.mark.parametrize("method", ["grpo", "dr_grpo", "rloo", "global_baseline"])
@settings(max_examples=40, deadline=None)
@given(batch=batches)
def test_matches_loop_reference(method, batch):
    ids, rewards = batch
    result, metrics = ADVANTAGE_FUNCTIONS[method](
        rewards=torch.tensor(rewards, dtype=torch.float64), group_ids=torch.tensor(ids)
    )
    assert result.dtype == torch.float64
    torch.testing.assert_close(result, torch.tensor(_reference(method, rewards, ids), dtype=torch.float64))
    assert 0.0 <= float(metrics["zero_signal_group_fraction"]) <= 1.0


def test_hand_computed_group():
    # Group 0 = samples 0,1,3,4 with rewards (1, 0, 1, 1): mean 0.75,
    # deviations (0.25, -0.75, 0.25, 0.25), population var 0.75/4 = 0.1875, std 0.4330127.
    # Group 1 = sample 2 alone → 0. Group 2 = samples 5, 6 with equal rewards → 0.
    rewards = torch.tensor([1.0, 0.0, 0.3, 1.0, 1.0, 0.5, 0.5])
    ids = torch.tensor([0, 0, 1, 0, 0, 2, 2])
    grpo, metrics = adv.grpo_advantages(rewards=rewards, group_ids=ids)
    std = math.sqrt(0.1875)
    expected = [0.25 / std, -0.75 / std, 0.0, 0.25 / std, 0.25 / std, 0.0, 0.0]  # 0.57735, -1.73205
    torch.testing.assert_close(grpo, torch.tensor(expected), rtol=1e-5, atol=1e-5)
    assert grpo.dtype == torch.float32
    assert float(metrics["zero_signal_group_fraction"]) == pytest.approx(2 / 3)
    assert metrics["num_groups"] == 3.0

    dr, _ = adv.dr_grpo_advantages(rewards=rewards, group_ids=ids)
    torch.testing.assert_close(dr, torch.tensor([0.25, -0.75, 0.0, 0.25, 0.25, 0.0, 0.0]))
    # RLOO: r=1 → others (0, 1, 1) mean 2/3 → 1/3; r=0 → others mean 1 → -1.
    rloo, _ = adv.rloo_advantages(rewards=rewards, group_ids=ids)
    torch.testing.assert_close(rloo, torch.tensor([1 / 3, -1.0, 0.0, 1 / 3, 1 / 3, 0.0, 0.0]))


@pytest.mark.parametrize("method", ["grpo", "dr_grpo", "rloo", "global_baseline"])
def test_zero_variance_group_is_exactly_zero(method):
    # 0.1 * 3 / 3 != 0.1 in floating point: the mean alone would leave a residue
    # that the std division would amplify to O(1).
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.7], dtype=torch.float64)
    result, _ = ADVANTAGE_FUNCTIONS[method](rewards=rewards, group_ids=torch.tensor([0, 0, 0, 1]))
    assert result.tolist() == [0.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("method", ["grpo", "dr_grpo", "rloo", "global_baseline"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_reward_names_its_index(method, bad):
    rewards = torch.tensor([1.0, 0.0, bad, 1.0])
    with pytest.raises(ValueError, match=r"rewards\[2\]"):
        ADVANTAGE_FUNCTIONS[method](rewards=rewards, group_ids=torch.tensor([0, 0, 1, 1]))


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.sampled_from([0.0, 1.0]), min_size=2, max_size=16).filter(lambda r: 0 < sum(r) < len(r))
)
def test_grpo_group_is_standardized(rewards):
    # D³S §2.2 / Lemma 1 take group advantages with E[A] = 0, Var(A) = 1.
    result, _ = adv.grpo_advantages(
        rewards=torch.tensor(rewards, dtype=torch.float64), group_ids=torch.zeros(len(rewards), dtype=torch.int64)
    )
    assert float(result.mean()) == pytest.approx(0.0, abs=1e-9)
    assert float(result.var(unbiased=False)) == pytest.approx(1.0, abs=1e-4)


@settings(max_examples=40, deadline=None)
@given(batch=batches, seed=st.integers(0, 2**16))
def test_permutation_equivariance(batch, seed):
    ids, rewards = batch
    permutation = torch.randperm(len(ids), generator=torch.Generator().manual_seed(seed))
    rewards_t = torch.tensor(rewards, dtype=torch.float64)
    ids_t = torch.tensor(ids)
    for method in ("grpo", "dr_grpo", "rloo"):
        fn = ADVANTAGE_FUNCTIONS[method]
        base, _ = fn(rewards=rewards_t, group_ids=ids_t)
        permuted, _ = fn(rewards=rewards_t[permutation], group_ids=ids_t[permutation])
        torch.testing.assert_close(permuted, base[permutation])


def test_rloo_is_rescaled_dr_grpo():
    rewards = torch.tensor([0.2, 0.9, 0.4, 1.0, 0.0], dtype=torch.float64)
    ids = torch.tensor([0, 0, 0, 1, 1])
    rloo, _ = adv.rloo_advantages(rewards=rewards, group_ids=ids)
    dr, _ = adv.dr_grpo_advantages(rewards=rewards, group_ids=ids)
    scale = torch.tensor([3 / 2, 3 / 2, 3 / 2, 2.0, 2.0], dtype=torch.float64)  # n/(n-1)
    torch.testing.assert_close(rloo, dr * scale)


# ---------------------------------------------------------------- Reinforce-Ada global baseline
def test_global_baseline_uses_the_whole_pool():
    # Prompt 0 collected 8 responses (3 correct) but updates on the balanced pair (1, 0):
    # Algorithm 2 line 17-19: r̄ = 3/8 from the pool, A = r − 3/8, not r − 1/2.
    pool = torch.tensor([1.0, 0, 0, 1, 0, 0, 1, 0])
    update = torch.tensor([1.0, 0.0, 1.0, 1.0])
    ids = torch.tensor([0, 0, 1, 1])
    pool_ids = torch.tensor([0] * 8 + [1] * 3)
    pool_all = torch.cat([pool, torch.tensor([1.0, 1.0, 0.0])])  # prompt 1: r̄ = 2/3
    result, metrics = adv.global_baseline_advantages(
        rewards=update, group_ids=ids, pool_rewards=pool_all, pool_group_ids=pool_ids
    )
    torch.testing.assert_close(result, torch.tensor([5 / 8, -3 / 8, 1 / 3, 1 / 3]))
    assert float(metrics["pool_size_mean"]) == pytest.approx(5.5)

    # §3.2 final estimator: explicit weight 1/p̂; Algorithm 1: 1/sqrt(p̂ + eps); App. B: 1/sqrt(p̂(1−p̂)).
    kwargs = dict(rewards=update, group_ids=ids, pool_rewards=pool_all, pool_group_ids=pool_ids, eps=0.0)
    inv_mean, _ = adv.global_baseline_advantages(weight="inv_mean", **kwargs)
    torch.testing.assert_close(inv_mean, torch.tensor([(5 / 8) / (3 / 8), -1.0, (1 / 3) / (2 / 3), 0.5]))
    inv_sqrt, _ = adv.global_baseline_advantages(weight="inv_sqrt_mean", **kwargs)
    s0, s1 = math.sqrt(3 / 8), math.sqrt(2 / 3)
    torch.testing.assert_close(inv_sqrt, torch.tensor([(5 / 8) / s0, (-3 / 8) / s0, (1 / 3) / s1, (1 / 3) / s1]))
    bern, _ = adv.global_baseline_advantages(weight="bernoulli_std", **kwargs)
    b0, b1 = math.sqrt(3 / 8 * 5 / 8), math.sqrt(2 / 3 * 1 / 3)
    torch.testing.assert_close(bern, torch.tensor([(5 / 8) / b0, (-3 / 8) / b0, (1 / 3) / b1, (1 / 3) / b1]))


@settings(max_examples=40, deadline=None)
@given(batch=batches)
def test_bernoulli_std_weight_recovers_grpo_for_binary_rewards(batch):
    # Reinforce-Ada App. B, Remark 1: (r − p)/sqrt(p(1−p)) is GRPO's std normalization
    # because Std[r] = sqrt(p(1−p)) for binary rewards.
    ids, rewards = batch
    binary = torch.tensor([1.0 if r > 0.5 else 0.0 for r in rewards], dtype=torch.float64)
    ids_t = torch.tensor(ids)
    bern, _ = adv.global_baseline_advantages(rewards=binary, group_ids=ids_t, weight="bernoulli_std")
    grpo, _ = adv.grpo_advantages(rewards=binary, group_ids=ids_t)
    torch.testing.assert_close(bern, grpo)


def test_global_baseline_without_pool_is_dr_grpo():
    rewards = torch.tensor([0.3, 0.8, 0.1, 0.6, 0.6])
    ids = torch.tensor([1, 0, 1, 0, 2])
    torch.testing.assert_close(
        adv.global_baseline_advantages(rewards=rewards, group_ids=ids)[0],
        adv.dr_grpo_advantages(rewards=rewards, group_ids=ids)[0],
    )


def test_global_baseline_degenerate_pool_and_errors():
    # A pool of identical rewards carries no signal even if the update subset is mixed-looking.
    result, _ = adv.global_baseline_advantages(
        rewards=torch.tensor([1.0, 1.0]),
        group_ids=torch.tensor([0, 0]),
        pool_rewards=torch.tensor([1.0, 1.0, 1.0]),
        pool_group_ids=torch.tensor([0, 0, 0]),
        weight="inv_mean",
    )
    assert result.tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="no pool rewards"):
        adv.global_baseline_advantages(
            rewards=torch.tensor([1.0, 0.0]),
            group_ids=torch.tensor([0, 1]),
            pool_rewards=torch.tensor([1.0, 0.0]),
            pool_group_ids=torch.tensor([0, 0]),
        )
    with pytest.raises(ValueError, match="together"):
        adv.global_baseline_advantages(
            rewards=torch.tensor([1.0]), group_ids=torch.tensor([0]), pool_rewards=torch.tensor([1.0])
        )
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        adv.global_baseline_advantages(
            rewards=torch.tensor([2.0, 0.0]), group_ids=torch.tensor([0, 0]), weight="inv_sqrt_mean"
        )
    with pytest.raises(ValueError, match="unknown global_baseline weight"):
        adv.global_baseline_advantages(rewards=torch.tensor([1.0]), group_ids=torch.tensor([0]), weight="std")
    with pytest.raises(ValueError, match=r"pool_rewards\[1\]"):
        adv.global_baseline_advantages(
            rewards=torch.tensor([1.0, 0.0]),
            group_ids=torch.tensor([0, 0]),
            pool_rewards=torch.tensor([1.0, float("nan")]),
            pool_group_ids=torch.tensor([0, 0]),
        )


def test_input_validation():
    with pytest.raises(ValueError, match="does not match"):
        adv.grpo_advantages(rewards=torch.tensor([1.0, 0.0]), group_ids=torch.tensor([0]))
    with pytest.raises(ValueError, match="floating"):
        adv.grpo_advantages(rewards=torch.tensor([1, 0]), group_ids=torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="out of range"):
        adv.grpo_advantages(rewards=torch.tensor([1.0, 0.0]), group_ids=torch.tensor([0, 2]), num_groups=2)


def test_empty_batch():
    result, metrics = adv.grpo_advantages(
        rewards=torch.zeros(0), group_ids=torch.zeros(0, dtype=torch.int64)
    )
    assert result.shape == (0,)
    assert metrics["num_groups"] == 0.0
