"""Policy losses against float64 loops written from D³S Eqs. 1, 3 and 10 and Dr. GRPO's constant normaliser."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.algorithms import losses

AGGREGATIONS = losses.AGGREGATIONS
# Dr. GRPO's L_max: larger than the batches' padded width (6), as a generation limit is.
MAX_RESPONSE_LENGTH = 9

LOSS_FUNCTIONS = {"grpo": losses.grpo_loss, "gspo": losses.gspo_loss}


# ---------------------------------------------------------------- loop reference
def reference_loss(
    method: str,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    eps_low: float,
    eps_high: float,
    aggregation: str,
    token_mask: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    max_response_length: int | None = None,
) -> torch.Tensor:
    """One token at a time; differentiable through ``logprobs`` and ``entropy``."""
    num_rows, num_cols = logprobs.shape
    per_sequence = []
    token_terms = []
    for i in range(num_rows):
        response = [t for t in range(num_cols) if response_mask[i, t]]
        if not response:
            continue
        selected = [t for t in response if token_mask is None or token_mask[i, t]]
        if method == "gspo":
            # Eq. 3: s_i = (π_θ(y_i)/π_old(y_i))^{1/|y_i|}, token form sg[s_i]·π_θ(y_t)/sg[π_θ(y_t)].
            s_i = torch.exp(sum(logprobs[i, t] - old_logprobs[i, t] for t in response) / len(response))
        terms = []
        for t in selected:
            if method == "gspo":
                ratio = s_i.detach() * torch.exp(logprobs[i, t] - logprobs[i, t].detach())
            else:
                ratio = torch.exp(logprobs[i, t] - old_logprobs[i, t])  # Eq. 1: w_{i,t}
            a = advantages[i, t]
            term = -torch.minimum(ratio * a, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * a)
            if ref_logprobs is not None:
                delta = ref_logprobs[i, t] - logprobs[i, t]
                term = term + kl_coef * (torch.exp(delta) - delta - 1)
            if entropy is not None:
                term = term - entropy_coef * entropy[i, t]
            terms.append(term)
        token_terms.extend(terms)
        total = sum(terms, torch.zeros((), dtype=logprobs.dtype))
        if aggregation == "seq_mean_token_mean":
            per_sequence.append(total / len(response))  # 1/|y_i|
        elif aggregation == "d3s":
            per_sequence.append(total / len(selected) if selected else total)  # 1/|T_i|
    zero = torch.zeros((), dtype=logprobs.dtype)
    if aggregation == "token_mean":
        return sum(token_terms, zero) / max(len(token_terms), 1)
    if aggregation == "dr_grpo":
        # Σ over every response of its token sum / L_max, averaged over the G responses.
        num_sequences = sum(1 for i in range(num_rows) if response_mask[i].any())
        return sum(token_terms, zero) / (max(num_sequences, 1) * max_response_length)
    return sum(per_sequence, zero) / max(len(per_sequence), 1)


def _random_batch(seed: int, num_rows: int = 4, num_cols: int = 6, *, spread: float = 0.3):
    generator = torch.Generator().manual_seed(seed)
    old = -torch.rand(num_rows, num_cols, generator=generator, dtype=torch.float64) * 3
    logprobs = old + torch.randn(num_rows, num_cols, generator=generator, dtype=torch.float64) * spread
    advantages = torch.randn(num_rows, num_cols, generator=generator, dtype=torch.float64)
    response_mask = torch.rand(num_rows, num_cols, generator=generator) < 0.75
    response_mask[0, 0] = True
    response_mask[-1] = False  # one fully padded row
    token_mask = torch.rand(num_rows, num_cols, generator=generator) < 0.6
    ref = old + torch.randn(num_rows, num_cols, generator=generator, dtype=torch.float64) * 0.2
    entropy = torch.rand(num_rows, num_cols, generator=generator, dtype=torch.float64) * 2
    return logprobs, old, advantages, response_mask, token_mask, ref, entropy


# ---------------------------------------------------------------- loop vs vectorized
@pytest.mark.parametrize("method", ["grpo", "gspo"])
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("use_token_mask", [False, True])
@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**20))
def test_matches_loop_reference(method, aggregation, use_token_mask, seed):
    logprobs, old, advantages, response_mask, token_mask, ref, entropy = _random_batch(seed)
    # GSPO ratios are ~1 ± small; widen its clip range so both clipped and unclipped sequences occur.
    eps_low, eps_high = (0.2, 0.28) if method == "grpo" else (0.05, 0.08)
    token_mask = token_mask if use_token_mask else None
    kwargs = dict(eps_low=eps_low, eps_high=eps_high, aggregation=aggregation, token_mask=token_mask,
                  max_response_length=MAX_RESPONSE_LENGTH)

    lp_fast = logprobs.clone().requires_grad_()
    entropy_fast = entropy.clone().requires_grad_()
    loss, metrics = LOSS_FUNCTIONS[method](
        logprobs=lp_fast,
        old_logprobs=old,
        advantages=advantages,
        response_mask=response_mask,
        ref_logprobs=ref,
        kl_coef=0.05,
        entropy=entropy_fast,
        entropy_coef=0.01,
        **kwargs,
    )
    loss.backward()

    lp_ref = logprobs.clone().requires_grad_()
    entropy_ref = entropy.clone().requires_grad_()
    expected = reference_loss(
        method, lp_ref, old, advantages, response_mask,
        ref_logprobs=ref, kl_coef=0.05, entropy=entropy_ref, entropy_coef=0.01, **kwargs,
    )
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lp_fast.grad, lp_ref.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(entropy_fast.grad, entropy_ref.grad, rtol=1e-10, atol=1e-12)
    assert float(metrics["loss"]) == pytest.approx(expected.item())


# ---------------------------------------------------------------- hand-computed cases
def _hand_row():
    old = torch.full((1, 3), -1.0, dtype=torch.float64)
    ratios = torch.tensor([[1.5, 0.7, 1.0]], dtype=torch.float64)
    logprobs = (old + ratios.log()).requires_grad_()
    advantages = torch.tensor([[1.0, -1.0, 2.0]], dtype=torch.float64)
    return logprobs, old, advantages, torch.ones(1, 3, dtype=torch.bool)


def test_grpo_hand_computed():
    # ratio 1.5, A=+1: min(1.5, 1.28) = 1.28  (clipped high → no gradient)
    # ratio 0.7, A=-1: min(-0.7, -0.8) = -0.8  (clipped low → no gradient)
    # ratio 1.0, A=+2: 2.0                       (gradient -A·ratio/3 = -2/3)
    # token_mean loss = -(1.28 - 0.8 + 2.0)/3 = -0.826667
    logprobs, old, advantages, mask = _hand_row()
    loss, metrics = losses.grpo_loss(logprobs=logprobs, old_logprobs=old, advantages=advantages, response_mask=mask)
    assert loss.item() == pytest.approx(-2.48 / 3)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, 0.0, -2 / 3]], dtype=torch.float64))
    assert float(metrics["clip_fraction_low"]) == pytest.approx(1 / 3)
    assert float(metrics["clip_fraction_high"]) == pytest.approx(1 / 3)
    assert float(metrics["ratio_mean"]) == pytest.approx(3.2 / 3)
    assert float(metrics["ratio_max"]) == pytest.approx(1.5)
    # k3 of KL(π_old‖π_θ): mean over tokens of (ρ − 1 − log ρ)
    expected_kl = sum(r - 1 - math.log(r) for r in (1.5, 0.7, 1.0)) / 3
    assert float(metrics["approx_kl"]) == pytest.approx(expected_kl)


def test_gspo_hand_computed():
    # s = exp((log 1.5 + log 0.7 + 0)/3) = 1.05^(1/3) = 1.016396; clip range [1 - 3e-4, 1 + 4e-4].
    # A=+1: min(s, 1.0004) = 1.0004 (clipped); A=-1: min(-s, -1.0004) = -s (unclipped);
    # A=+2: 2·1.0004 (clipped). seq_mean_token_mean over one sequence of 3 tokens:
    # loss = -(1.0004 - s + 2.0008)/3; gradient only on token 2: -(s·A)/3 = s/3.
    logprobs, old, advantages, mask = _hand_row()
    loss, metrics = losses.gspo_loss(logprobs=logprobs, old_logprobs=old, advantages=advantages, response_mask=mask)
    s = 1.05 ** (1 / 3)
    assert loss.item() == pytest.approx(-(1.0004 - s + 2.0008) / 3)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, s / 3, 0.0]], dtype=torch.float64))
    assert float(metrics["ratio_max"]) == pytest.approx(s)
    assert float(metrics["clip_fraction_high"]) == pytest.approx(2 / 3)


def test_gspo_gradient_flows_per_token_with_sequence_weight():
    # Unclipped: ∂loss/∂logπ_{i,t} = -s_i · A_{i,t} / (|y_i| · |Ŝ|), distinct per token.
    logprobs, old, advantages, mask = _hand_row()
    loss, _ = losses.gspo_loss(
        logprobs=logprobs, old_logprobs=old, advantages=advantages, response_mask=mask, eps_low=0.5, eps_high=0.5
    )
    loss.backward()
    s = 1.05 ** (1 / 3)
    torch.testing.assert_close(logprobs.grad, -s * advantages / 3)


def test_kl_and_entropy_terms_hand_computed():
    # δ = log π_ref − log π_θ = log 2 on one token: k3 = e^δ − δ − 1 = 1 − log 2 = 0.306853.
    # Its gradient w.r.t. log π_θ is 1 − e^δ = −1. Entropy bonus subtracts λ·H.
    logprobs = torch.tensor([[-1.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.0 + math.log(2)]], dtype=torch.float64)
    entropy = torch.tensor([[0.5]], dtype=torch.float64, requires_grad=True)
    loss, metrics = losses.grpo_loss(
        logprobs=logprobs,
        old_logprobs=logprobs.detach(),
        advantages=torch.zeros(1, 1, dtype=torch.float64),
        response_mask=torch.ones(1, 1, dtype=torch.bool),
        ref_logprobs=ref,
        kl_coef=0.1,
        entropy=entropy,
        entropy_coef=0.01,
    )
    assert loss.item() == pytest.approx(0.1 * (1 - math.log(2)) - 0.01 * 0.5)
    assert float(metrics["kl_ref"]) == pytest.approx(1 - math.log(2))
    assert float(metrics["entropy"]) == pytest.approx(0.5)
    loss.backward()
    assert logprobs.grad.item() == pytest.approx(0.1 * (1 - 2))
    assert entropy.grad.item() == pytest.approx(-0.01)


# ---------------------------------------------------------------- aggregation semantics
def test_d3s_equals_seq_mean_token_mean_without_token_mask():
    logprobs, old, advantages, response_mask, *_ = _random_batch(3)
    common = dict(logprobs=logprobs, old_logprobs=old, advantages=advantages, response_mask=response_mask)
    d3s, _ = losses.grpo_loss(aggregation="d3s", **common)
    seq, _ = losses.grpo_loss(aggregation="seq_mean_token_mean", **common)
    torch.testing.assert_close(d3s, seq)


def test_d3s_normalizes_by_selected_tokens_and_counts_unselected_sequences():
    # Ratios all 1 (no clipping), so each token contributes -A.
    # Row 0: response 4 tokens, selected tokens 0,1 with A = 1, 3 → per-seq mean over |T_0| = 2 → -2.
    # Row 1: response 2 tokens, none selected → contributes 0 but is a member of Ŝ.
    # d3s = (-2 + 0)/2 = -1;  seq_mean_token_mean = (-(1+3)/4 + 0)/2 = -0.5;
    # token_mean over the 2 selected tokens = -2.
    logprobs = torch.zeros(2, 4, dtype=torch.float64)
    advantages = torch.tensor([[1.0, 3.0, 5.0, 7.0], [2.0, 2.0, 0.0, 0.0]], dtype=torch.float64)
    response_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    token_mask = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    common = dict(
        logprobs=logprobs, old_logprobs=logprobs, advantages=advantages,
        response_mask=response_mask, token_mask=token_mask,
    )
    assert losses.grpo_loss(aggregation="d3s", **common)[0].item() == pytest.approx(-1.0)
    assert losses.grpo_loss(aggregation="seq_mean_token_mean", **common)[0].item() == pytest.approx(-0.5)
    loss, metrics = losses.grpo_loss(aggregation="token_mean", **common)
    assert loss.item() == pytest.approx(-2.0)
    assert float(metrics["num_tokens"]) == 2.0 and float(metrics["num_sequences"]) == 2.0


def test_dr_grpo_hand_computed():
    # Ratios all 1 (no clipping), so each token contributes -A. Row 0: 4 tokens with A = 1;
    # row 1: 2 tokens with A = -1; L_max = 8, G = 2 responses.
    # dr_grpo = (-4 + 2) / (2 · 8) = -0.125, and every token's gradient is -A/16 whatever its
    # response's length. seq_mean_token_mean = (-4/4 + 2/2)/2 = 0; token_mean = -2/6.
    old = torch.zeros(2, 4, dtype=torch.float64)
    advantages = torch.tensor([[1.0, 1.0, 1.0, 1.0], [-1.0, -1.0, 0.0, 0.0]], dtype=torch.float64)
    response_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    logprobs = old.clone().requires_grad_()
    common = dict(old_logprobs=old, advantages=advantages, response_mask=response_mask, max_response_length=8)
    loss, _ = losses.grpo_loss(logprobs=logprobs, aggregation="dr_grpo", **common)
    assert loss.item() == -0.125
    loss.backward()
    assert logprobs.grad.tolist() == [[-1 / 16] * 4, [1 / 16, 1 / 16, 0.0, 0.0]]
    assert losses.grpo_loss(logprobs=old, aggregation="seq_mean_token_mean", **common)[0].item() == 0.0
    assert losses.grpo_loss(logprobs=old, aggregation="token_mean", **common)[0].item() == pytest.approx(-2 / 6)
    denominator = losses.loss_denominator(response_mask, aggregation="dr_grpo", max_response_length=8)
    assert denominator.dtype == torch.float64 and denominator.item() == 16.0


def test_dr_grpo_needs_a_valid_max_response_length():
    logprobs, old, advantages, response_mask, *_ = _random_batch(2)
    common = dict(logprobs=logprobs, old_logprobs=old, advantages=advantages, response_mask=response_mask,
                  aggregation="dr_grpo")
    with pytest.raises(ValueError, match="needs max_response_length"):
        losses.grpo_loss(**common)
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="integer ≥ 1"):
            losses.grpo_loss(max_response_length=bad, **common)
    longest = int(response_mask.sum(dim=1).max())
    with pytest.raises(ValueError, match="more than max_response_length"):
        losses.grpo_loss(max_response_length=longest - 1, **common)
    losses.grpo_loss(max_response_length=longest, **common)  # a response may use the whole budget
    # With the global normalizer given, L_max is already inside it.
    num_sequences = int(response_mask.any(dim=1).sum())  # the padded last row does not count
    loss, _ = losses.grpo_loss(normalizer=float(num_sequences * MAX_RESPONSE_LENGTH), **common)
    expected, _ = losses.grpo_loss(max_response_length=MAX_RESPONSE_LENGTH, **common)
    torch.testing.assert_close(loss, expected)
    # The other aggregations ignore it.
    plain, _ = losses.grpo_loss(**dict(common, aggregation="token_mean"))
    ignored, _ = losses.grpo_loss(max_response_length=1, **dict(common, aggregation="token_mean"))
    torch.testing.assert_close(plain, ignored)


@pytest.mark.parametrize("method", ["grpo", "gspo"])
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**20), cuts=st.lists(st.integers(1, 5), min_size=0, max_size=3, unique=True))
def test_micro_batches_sum_to_full_batch(method, aggregation, seed, cuts):
    # With the global normalizer, Σ micro-batch losses (and gradients) equal the full-batch ones:
    # what gradient accumulation and data parallel (sum of grads) rely on.
    logprobs, old, advantages, response_mask, token_mask, ref, entropy = _random_batch(seed, num_rows=6)
    options = dict(aggregation=aggregation, token_mask=token_mask, ref_logprobs=ref, kl_coef=0.1,
                   entropy=entropy, entropy_coef=0.01, eps_low=0.2, eps_high=0.28,
                   max_response_length=MAX_RESPONSE_LENGTH)
    loss_fn = LOSS_FUNCTIONS[method]

    full_lp = logprobs.clone().requires_grad_()
    full, _ = loss_fn(logprobs=full_lp, old_logprobs=old, advantages=advantages, response_mask=response_mask, **options)
    full.backward()

    bounds = [0, *sorted(cuts), 6]
    parts = [slice(a, b) for a, b in zip(bounds, bounds[1:])]
    normalizer = sum(
        losses.loss_denominator(response_mask[p], aggregation=aggregation, token_mask=token_mask[p],
                                max_response_length=MAX_RESPONSE_LENGTH)
        for p in parts
    )
    micro_lp = logprobs.clone().requires_grad_()
    total = torch.zeros((), dtype=torch.float64)
    for p in parts:
        part_options = dict(options, token_mask=token_mask[p], ref_logprobs=ref[p], entropy=entropy[p])
        micro, _ = loss_fn(
            logprobs=micro_lp[p], old_logprobs=old[p], advantages=advantages[p],
            response_mask=response_mask[p], normalizer=normalizer, **part_options,
        )
        micro.backward()
        total = total + micro.detach()
    torch.testing.assert_close(total, full.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(micro_lp.grad, full_lp.grad, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- masks, NaN, errors
@pytest.mark.parametrize("method", ["grpo", "gspo"])
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_nan_outside_mask_does_not_leak(method, aggregation):
    logprobs, old, advantages, response_mask, token_mask, ref, entropy = _random_batch(7)
    outside = ~response_mask

    def run(fill):
        lp = torch.where(outside, fill, logprobs).requires_grad_()
        ent = torch.where(outside, fill, entropy).requires_grad_()
        loss, metrics = LOSS_FUNCTIONS[method](
            logprobs=lp,
            old_logprobs=torch.where(outside, fill, old),
            advantages=torch.where(outside, fill, advantages),
            response_mask=response_mask,
            aggregation=aggregation,
            max_response_length=MAX_RESPONSE_LENGTH,
            ref_logprobs=torch.where(outside, fill, ref),
            kl_coef=0.1,
            entropy=ent,
            entropy_coef=0.01,
        )
        loss.backward()
        return loss, lp.grad, ent.grad, metrics

    nan_loss, nan_grad, nan_entropy_grad, metrics = run(torch.tensor(float("nan"), dtype=torch.float64))
    zero_loss, zero_grad, zero_entropy_grad, _ = run(torch.tensor(0.0, dtype=torch.float64))
    assert torch.isfinite(nan_loss)
    assert all(math.isfinite(float(v)) for v in metrics.values())
    torch.testing.assert_close(nan_loss, zero_loss)
    torch.testing.assert_close(nan_grad, zero_grad)
    torch.testing.assert_close(nan_entropy_grad, zero_entropy_grad)
    assert nan_grad[outside].abs().sum() == 0


@pytest.mark.parametrize("name", ["logprobs", "old_logprobs", "advantages", "ref_logprobs", "entropy"])
def test_non_finite_inside_mask_raises(name):
    logprobs, old, advantages, response_mask, _, ref, entropy = _random_batch(11)
    inputs = dict(logprobs=logprobs, old_logprobs=old, advantages=advantages, ref_logprobs=ref, entropy=entropy)
    inputs[name] = inputs[name].clone()
    inputs[name][0, 0] = float("-inf")
    with pytest.raises(ValueError, match=rf"{name}\[0, 0\]"):
        losses.grpo_loss(response_mask=response_mask, kl_coef=0.1, entropy_coef=0.01, **inputs)


@pytest.mark.parametrize("method", ["grpo", "gspo"])
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_fully_masked_batch_gives_zero_loss_and_gradient(method, aggregation):
    logprobs = torch.full((2, 3), float("nan"), dtype=torch.float64, requires_grad=True)
    loss, metrics = LOSS_FUNCTIONS[method](
        logprobs=logprobs,
        old_logprobs=torch.zeros(2, 3, dtype=torch.float64),
        advantages=torch.ones(2, 3, dtype=torch.float64),
        response_mask=torch.zeros(2, 3, dtype=torch.bool),
        aggregation=aggregation,
        max_response_length=MAX_RESPONSE_LENGTH,
    )
    assert loss.item() == 0.0
    loss.backward()
    assert logprobs.grad.abs().sum() == 0
    assert float(metrics["num_tokens"]) == 0.0 and float(metrics["clip_fraction"]) == 0.0


def test_extreme_ratio_stays_finite():
    # log-ratio 200 would overflow exp in float32; the clamp keeps the clipped surrogate finite.
    logprobs = torch.tensor([[0.0, 0.0]], requires_grad=True)
    old = torch.tensor([[-200.0, 200.0]])
    loss, _ = losses.grpo_loss(
        logprobs=logprobs, old_logprobs=old, advantages=torch.tensor([[1.0, -1.0]]),
        response_mask=torch.ones(1, 2, dtype=torch.bool),
    )
    assert torch.isfinite(loss)
    # A=+1, ratio huge → clipped at 1.28; A=-1, ratio tiny → clipped at 0.8: loss = -(1.28 - 0.8)/2
    assert loss.item() == pytest.approx(-0.24)


def test_argument_validation():
    logprobs, old, advantages, response_mask, *_ = _random_batch(1)
    common = dict(logprobs=logprobs, old_logprobs=old, advantages=advantages)
    with pytest.raises(ValueError, match="bool or integer"):
        losses.grpo_loss(response_mask=response_mask.double(), **common)
    with pytest.raises(ValueError, match="unknown aggregation"):
        losses.grpo_loss(response_mask=response_mask, aggregation="sum", **common)
    with pytest.raises(ValueError, match="ref_logprobs is missing"):
        losses.grpo_loss(response_mask=response_mask, kl_coef=0.1, **common)
    with pytest.raises(ValueError, match="entropy is missing"):
        losses.grpo_loss(response_mask=response_mask, entropy_coef=0.1, **common)
    with pytest.raises(ValueError, match="does not match"):
        losses.grpo_loss(response_mask=response_mask[:, :2], **common)
    with pytest.raises(ValueError, match="normalizer"):
        losses.grpo_loss(response_mask=response_mask, normalizer=-1.0, **common)
    with pytest.raises(ValueError, match="eps_low"):
        losses.grpo_loss(response_mask=response_mask, eps_low=1.5, **common)
    # integer 0/1 masks are accepted
    loss_int, _ = losses.grpo_loss(response_mask=response_mask.long(), **common)
    loss_bool, _ = losses.grpo_loss(response_mask=response_mask, **common)
    torch.testing.assert_close(loss_int, loss_bool)
