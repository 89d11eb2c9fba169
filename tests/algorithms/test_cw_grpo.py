"""CW-GRPO ("Taming Extreme Tokens: Covariance-Aware GRPO with Gaussian-Kernel Advantage Reweighting", Sec. 2.3)."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.algorithms.cw_grpo import cw_grpo_token_weights


def reference_weights(advantages, logprobs, mask, group_ids, scope):
    """Sec. 2.3 equations as loops over tokens, float64, per scope."""
    num_rows, num_cols = len(logprobs), len(logprobs[0])
    scopes = group_ids if scope == "group" else [0] * num_rows
    weights = [[0.0] * num_cols for _ in range(num_rows)]
    for unit in set(scopes):
        tokens = [
            (i, t)
            for i in range(num_rows)
            if scopes[i] == unit
            for t in range(num_cols)
            if mask[i][t]
        ]
        if not tokens:
            continue
        n = len(tokens)
        mean_logp = sum(logprobs[i][t] for i, t in tokens) / n
        mean_adv = sum(advantages[i] for i, t in tokens) / n
        c = {(i, t): (logprobs[i][t] - mean_logp) * (advantages[i] - mean_adv) for i, t in tokens}
        mean_c = sum(c.values()) / n
        sigma = math.sqrt(sum((v - mean_c) ** 2 for v in c.values()) / n)
        w = {k: 1.0 if sigma == 0 else math.exp(-(v**2) / (2 * sigma**2)) for k, v in c.items()}
        total = sum(w.values())
        for (i, t), value in w.items():
            weights[i][t] = value * n / total
    return weights


def call(advantages, logprobs, mask, group_ids, scope="group"):
    return cw_grpo_token_weights(
        advantages=advantages, entropy=None, logprobs=logprobs, response_mask=mask,
        group_ids=group_ids, scope=scope,
    )


def test_hand_computed():
    # One group: A = [1, -1]; log π row0 = [-1, -3], row1 = [-2, -2].
    # mean log π = -2, mean Â over the 4 tokens = 0 →
    # c = [(1)(1), (-1)(1), (0)(-1), (0)(-1)] = [1, -1, 0, 0]; mean c = 0, σ² = 2/4 = 0.5.
    # w = exp(-c²/(2·0.5)) = [e⁻¹, e⁻¹, 1, 1];
    # w̃ = 4w/Σw = [2/(e+1), 2/(e+1), 2e/(e+1), 2e/(e+1)]
    #   = [0.5379, 0.5379, 1.4621, 1.4621].
    weights, metrics = call(
        torch.tensor([1.0, -1.0]),
        torch.tensor([[-1.0, -3.0], [-2.0, -2.0]]),
        torch.ones(2, 2, dtype=torch.bool),
        torch.tensor([0, 0]),
    )
    e = math.e
    low, high = 2 / (e + 1), 2 * e / (e + 1)
    assert weights.flatten().tolist() == pytest.approx([low, low, high, high])
    assert float(metrics["cw_grpo/sigma_mean"]) == pytest.approx(math.sqrt(0.5))
    assert float(metrics["cw_grpo/cov_mean"]) == pytest.approx(0.0)


@pytest.mark.parametrize("scope", ["group", "batch"])
@pytest.mark.parametrize("seed", range(4))
def test_matches_loop_reference(scope, seed):
    gen = torch.Generator().manual_seed(seed)
    num_rows, num_cols = 8, 6
    advantages = torch.randn(num_rows, generator=gen, dtype=torch.float64)
    logprobs = -torch.rand(num_rows, num_cols, generator=gen, dtype=torch.float64) * 3
    lengths = torch.randint(0, num_cols + 1, (num_rows,), generator=gen)
    mask = torch.arange(num_cols)[None, :] < lengths[:, None]
    logprobs = torch.where(mask, logprobs, torch.tensor(float("-inf"), dtype=torch.float64))
    group_ids = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])
    logprobs_before = logprobs.clone()
    weights, _ = call(advantages, logprobs, mask, group_ids, scope)
    assert torch.equal(logprobs, logprobs_before)
    expected = reference_weights(
        advantages.tolist(), logprobs.tolist(), mask.tolist(), group_ids.tolist(), scope
    )
    assert weights.tolist() == [pytest.approx(row, abs=1e-12) for row in expected]


def test_group_and_batch_scopes_differ_and_agree_on_one_group():
    gen = torch.Generator().manual_seed(3)
    advantages = torch.randn(4, generator=gen)
    logprobs = -torch.rand(4, 5, generator=gen)
    mask = torch.ones(4, 5, dtype=torch.bool)
    one_group = torch.zeros(4, dtype=torch.int64)
    assert torch.allclose(call(advantages, logprobs, mask, one_group, "group")[0],
                          call(advantages, logprobs, mask, one_group, "batch")[0])
    two_groups = torch.tensor([0, 0, 1, 1])
    assert not torch.allclose(call(advantages, logprobs, mask, two_groups, "group")[0],
                              call(advantages, logprobs, mask, two_groups, "batch")[0])


def test_sigma_zero_gives_unit_weights():
    mask = torch.tensor([[True, True, False], [True, False, False]])
    # Zero-advantage group: c ≡ 0.
    w, metrics = call(torch.zeros(2), torch.randn(2, 3), mask, torch.tensor([0, 0]))
    assert torch.equal(w, mask.float())
    assert float(metrics["cw_grpo/sigma_zero_fraction"]) == 1.0
    # Group of one: Â − mean Â = 0.
    w, _ = call(
        torch.tensor([2.5]), torch.tensor([[-0.1, -4.0, -2.0]]),
        torch.ones(1, 3, dtype=torch.bool), torch.tensor([0]),
    )
    assert torch.equal(w, torch.ones(1, 3))
    # Equal log-probs everywhere: log π − mean = 0.
    w, _ = call(torch.tensor([1.0, -1.0]), torch.full((2, 3), -0.7), mask, torch.tensor([0, 0]))
    assert torch.equal(w, mask.float())


def exact_sigma_is_zero(advantages, logprobs):
    """σ of 2.3-b in exact rational arithmetic, one group, every token valid."""
    tokens = [(Fraction(a), Fraction(lp)) for a, row in zip(advantages, logprobs) for lp in row]
    n = len(tokens)
    mean_adv = sum(a for a, _ in tokens) / n
    mean_logp = sum(lp for _, lp in tokens) / n
    c = [(lp - mean_logp) * (a - mean_adv) for a, lp in tokens]
    return len(set(c)) == 1


@pytest.mark.parametrize("logprobs", [(-0.1, -0.2), (-0.1, -0.3), (-1.9009878704674152, -1.1203638022999252)])
def test_opposite_advantages_one_token_each_give_unit_weights(logprobs):
    # A = (+1, −1), one token each: c_1 = (a − m)·1 and c_2 = (b − m)·(−1) with m = (a + b)/2
    # are equal, so σ = 0 and 2.3-b gives weight 1 to both. In float64, a − m and m − b
    # round differently, σ ≈ 1e-17, and the kernel used to return (0, 2) or (2, 0).
    advantages = [1.0, -1.0]
    rows = [[logprobs[0]], [logprobs[1]]]
    assert exact_sigma_is_zero(advantages, rows)
    weights, metrics = call(torch.tensor(advantages, dtype=torch.float64), torch.tensor(rows, dtype=torch.float64),
                            torch.ones(2, 1, dtype=torch.bool), torch.tensor([0, 0]))
    assert weights.flatten().tolist() == [1.0, 1.0]
    assert float(metrics["cw_grpo/sigma_zero_fraction"]) == 1.0


def test_shared_advantage_whose_mean_rounds_gives_unit_weights():
    # Three responses of 7 tokens sharing Â = 0.1 + 0.2 (as after a D³S subset): the
    # token-weighted mean Σ Â·7 / 21 rounds to Â + 5.6e-17, so Â − mean Â is noise, σ is
    # noise, and the kernel used to weight tokens by their standardised log-prob.
    shared = 0.1 + 0.2
    assert (shared * 7 * 3) / 21 != shared  # the premise: the float mean is off
    logprobs = -torch.rand(3, 7, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 3
    for advantages in ([shared] * 3, [shared, 0.3, shared]):  # 0.3 differs from 0.1 + 0.2 by 5.6e-17
        weights, metrics = call(torch.tensor(advantages, dtype=torch.float64), logprobs,
                                torch.ones(3, 7, dtype=torch.bool), torch.tensor([0, 0, 0]))
        assert torch.equal(weights, torch.ones(3, 7, dtype=torch.float64))
        assert float(metrics["cw_grpo/cov_abs_max"]) == 0.0


@pytest.mark.parametrize("relative_spread", [1e-6, 6e-8])
def test_spreads_the_inputs_can_express_are_not_zeroed(relative_spread):
    # The tolerance (1e-9 of the scale) sits below float32's resolution: a spread of
    # one float32 step (6e-8) in the advantages still reweights, as the reference does.
    advantages = torch.tensor([1.0, 1.0 + relative_spread, 1.0], dtype=torch.float64)
    logprobs = -torch.rand(3, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 3
    mask = torch.ones(3, 4, dtype=torch.bool)
    weights, metrics = call(advantages, logprobs, mask, torch.tensor([0, 0, 0]))
    expected = reference_weights(advantages.tolist(), logprobs.tolist(), mask.tolist(), [0, 0, 0], "group")
    assert weights.tolist() == [pytest.approx(row, rel=1e-6) for row in expected]
    assert float(metrics["cw_grpo/sigma_zero_fraction"]) == 0.0
    assert float(weights.max() - weights.min()) > 0.1


@settings(max_examples=100, deadline=None)
@given(
    shared=st.lists(
        st.one_of(st.floats(-8, 8, allow_subnormal=False), st.sampled_from([0.1 + 0.2, 1 / 3, 0.7, -0.1])),
        min_size=1, max_size=4,
    ),
    seed=st.integers(0, 10_000),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    scope=st.sampled_from(["group", "batch"]),
)
def test_equal_advantages_in_a_scope_give_unit_weights(shared, seed, dtype, scope):
    """σ = 0 whenever every response of a scope has one advantage: every weight is 1."""
    gen = torch.Generator().manual_seed(seed)
    group_ids = torch.randint(0, len(shared), (7,), generator=gen)
    # In the batch scope the whole batch is the unit that must share one advantage.
    advantages = torch.tensor([shared[int(g) if scope == "group" else 0] for g in group_ids], dtype=dtype)
    logprobs = (-torch.rand(7, 9, generator=gen, dtype=torch.float64) * 6).to(dtype)
    lengths = torch.randint(0, 10, (7,), generator=gen)
    mask = torch.arange(9)[None, :] < lengths[:, None]
    weights, _ = call(advantages, logprobs, mask, group_ids, scope)
    assert torch.equal(weights, mask.to(dtype))


def test_fully_masked_response_gets_zero_and_changes_nothing_else():
    gen = torch.Generator().manual_seed(5)
    advantages = torch.randn(3, generator=gen)
    logprobs = -torch.rand(3, 4, generator=gen)
    mask = torch.ones(3, 4, dtype=torch.bool)
    mask[1] = False
    logprobs[1] = float("nan")  # padding garbage must be ignored
    ids = torch.zeros(3, dtype=torch.int64)
    weights, _ = call(advantages, logprobs, mask, ids)
    assert torch.equal(weights[1], torch.zeros(4))
    keep = torch.tensor([0, 2])
    without, _ = call(advantages[keep], logprobs[keep], mask[keep], ids[keep])
    assert torch.allclose(weights[keep], without)
    all_masked, _ = call(advantages, logprobs, torch.zeros(3, 4, dtype=torch.bool), ids)
    assert torch.equal(all_masked, torch.zeros(3, 4))


def test_non_finite_inputs_raise():
    mask = torch.tensor([[True, True]])
    with pytest.raises(ValueError, match="logprobs"):
        call(torch.ones(1), torch.tensor([[-1.0, float("-inf")]]), mask, torch.tensor([0]))
    with pytest.raises(ValueError, match="advantages"):
        call(torch.tensor([float("nan")]), torch.zeros(1, 2), mask, torch.tensor([0]))
    with pytest.raises(ValueError, match="scope"):
        call(torch.ones(1), torch.zeros(1, 2), mask, torch.tensor([0]), scope="token")
    with pytest.raises(ValueError, match="shape|must be"):
        call(torch.ones(2), torch.zeros(1, 2), mask, torch.tensor([0]))


def test_weights_carry_no_gradient():
    logprobs = (-torch.rand(2, 3)).requires_grad_()
    advantages = torch.tensor([1.0, -1.0], requires_grad=True)
    mask = torch.ones(2, 3, dtype=torch.bool)
    weights, _ = call(advantages, logprobs, mask, torch.tensor([0, 0]))
    assert not weights.requires_grad
    loss = (weights * logprobs * advantages[:, None]).sum()
    loss.backward()
    # The gradient is exactly w̃·Â: nothing flows through the weights.
    assert torch.allclose(logprobs.grad, weights * advantages.detach()[:, None])


def test_underflowing_kernel_stays_finite():
    # c ≈ 1 for every token with a spread of ~1e-4 (far above the zero tolerance):
    # exp(-c²/2σ²) underflows to 0 for all tokens, and the literal Σw normalisation
    # would be 0/0. The log-space normalisation puts the mass on the token with the
    # smallest |c|.
    delta = 1e-4
    logprobs = torch.tensor([[0.0, 0.0], [-2.0, -2.0 + delta]], dtype=torch.float64)
    weights, _ = call(torch.tensor([1.0, -1.0], dtype=torch.float64), logprobs,
                      torch.ones(2, 2, dtype=torch.bool), torch.tensor([0, 0]))
    assert torch.isfinite(weights).all()
    assert float(weights.sum()) == pytest.approx(4.0)
    assert weights.argmax().item() == 3  # c = 1 − 3δ/4, the smallest


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 10_000), scope=st.sampled_from(["group", "batch"]))
def test_mean_weight_is_one_per_scope(seed, scope):
    """Sec. 2.3: w̃ is normalised to keep the expected loss — mean 1 over the N valid tokens."""
    gen = torch.Generator().manual_seed(seed)
    advantages = torch.randn(6, generator=gen)
    logprobs = -torch.rand(6, 7, generator=gen) * 5
    mask = torch.rand(6, 7, generator=gen) < 0.7
    group_ids = torch.tensor([0, 1, 0, 1, 2, 2])
    weights, _ = call(advantages, logprobs, mask, group_ids, scope)
    assert bool((weights >= 0).all()) and bool((weights[~mask] == 0).all())
    units = group_ids if scope == "group" else torch.zeros(6, dtype=torch.int64)
    for unit in units.unique():
        in_scope = mask & (units == unit)[:, None]
        n = int(in_scope.sum())
        if n == 0:
            continue
        assert float(weights[in_scope].sum()) == pytest.approx(n, rel=1e-5, abs=1e-6)
        # w ≤ 1 before normalisation, so no weight exceeds N / Σw ≤ N.
        assert float(weights[in_scope].max()) <= n + 1e-5
