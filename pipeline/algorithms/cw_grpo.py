"""CW-GRPO: covariance-aware Gaussian-kernel advantage reweighting.

Paper: "Taming Extreme Tokens: Covariance-Aware GRPO with Gaussian-Kernel
Advantage Reweighting" (Wang, Liu, Zhou, Chen; arXiv:2605.11538), Sec. 2.3. The paper's
equations are unnumbered; in the order they appear in Sec. 2.3:

* (2.3-a) ``c_{i,t} = (log π_θ(o_{i,t}) − mean log π) · (Â_i − mean Â)``
* (2.3-b) ``w_{i,t} = exp(−c_{i,t}² / (2σ²))``, σ the std of ``{c_{i,t}}``
* (2.3-c) ``w̃_{i,t} = w_{i,t} · N / Σ_{j=1}^{G} Σ_{k=1}^{|o_j|} w_{j,k}``, ``N = Σ_j |o_j|``
* (2.3-d) ``ℓ̃_{i,t} = ratio_{i,t} · (w̃_{i,t} Â_i) − β KL_{i,t}``

``cw_grpo_token_weights`` (the ``cw_grpo`` entry of ``pipeline.rl.methods.TOKEN_WEIGHTS``) returns ``w̃`` of
2.3-a..c; the policy loss applies 2.3-d by multiplying the per-token advantage
by it.

Choices where the paper is ambiguous:

* Scope of the statistics. The paper says the means are "computed over
  responses", and 2.3-c normalises over the G responses of one prompt
  (``Σ_{j=1}^{G}``, ``N = Σ_j |o_j|``). ``scope="group"`` (default) therefore
  computes the means, σ and the normalisation per prompt group;
  ``scope="batch"`` pools every valid token of the batch, like the batch
  covariance of Clip-Cov (Cui et al. 2025) that motivates the method.
* Means and σ are taken over the valid (response) tokens, with ``Â_i``
  broadcast to each token of response i, so long responses weigh more, as in
  the token-level sums of 2.3-c. σ is the population std (divide by n).
* σ = 0 (every ``c`` equal, e.g. a group of one or a zero-advantage group)
  gives weight 1 to every valid token instead of 0/0.
* Zero is decided with a tolerance, because float arithmetic rarely produces
  it. When every response of a scope has the same advantage, ``Â_i − mean Â``
  comes out as ±1e-17 instead of 0 whenever the token-weighted mean rounds
  (three responses of 7 tokens, Â = 0.1 + 0.2); with Â = (+1, −1) and one
  token each, the two ``c`` are equal in exact arithmetic but
  ``log π − mean log π`` rounds differently for the two tokens. Either way σ
  is rounding noise, and the kernel ``exp(−c²/2σ²)`` turns it into arbitrary
  weights: (0, 2) for log π = (−0.1, −0.2) where the exact answer is (1, 1).
  So a centred advantage with ``|Â_i − mean Â| ≤ rtol · max|Â|`` is set to
  exactly 0, and ``σ ≤ rtol · max|log π| · max|Â|`` counts as σ = 0, maxima
  over the scope's valid tokens, ``rtol = ZERO_RELATIVE_TOLERANCE = 1e-9``.
  The scales: the rounding error of a mean is proportional to the magnitude
  of its terms, not to the (possibly tiny) centred values, and
  ``max|log π| · max|Â|`` bounds ``|c|``. The value: a float64 sum of n terms
  rounds by at most ~n · 1.1e-16 of its scale, so 1e-9 holds the noise of
  scopes of up to ~9·10⁶ tokens even in the worst case (typically ~√n · 1e-16);
  and it is 60× below float32's resolution 2⁻²⁴ ≈ 6e-8, the precision the
  log-probs come in, so it does not touch spreads the inputs can express. The
  exception is a spread made by one float32 step in a few tokens of a scope of
  ≳ 3,600 tokens (σ ≈ step/√n): there the exact kernel would hand all the
  weight to one token because of that step, and weight 1 is the better answer.
  Zeroing a centred advantage moves ``c`` by at most 2 · rtol times the scale,
  so it changes weights only in scopes whose σ is itself near the threshold.
* 2.3-c is evaluated as ``N · softmax(−c²/(2σ²))`` in log space: identical
  whenever ``Σ w`` is representable, and finite when all ``w`` would underflow
  (c clustered far from 0 with a tiny spread).
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from pipeline.algorithms.segments import (
    all_finite,
    check_group_ids,
    count_true,
    group_min,
    group_sum,
    run_min,
    run_sum,
)

__all__ = ["ZERO_RELATIVE_TOLERANCE", "cw_grpo_token_weights"]

CovarianceScope = Literal["group", "batch"]

# Centred advantages and σ at most this fraction of their scale are exactly 0 (module docstring).
ZERO_RELATIVE_TOLERANCE = 1e-9


def cw_grpo_token_weights(
    *,
    advantages: torch.Tensor,
    entropy: torch.Tensor | None,
    logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor,
    scope: CovarianceScope = "group",
) -> tuple[torch.Tensor, dict[str, float | torch.Tensor]]:
    """Normalised Gaussian-kernel token weights ``w̃`` of CW-GRPO (Sec. 2.3, 2.3-a..c).

    Args:
        advantages: ``(B,)`` per-response advantage Â_i.
        entropy: unused; part of the ``TOKEN_WEIGHTS`` contract.
        logprobs: ``(B, T)`` log π_θ of the sampled tokens (current policy);
            any gradient is cut, the weights are constants of the loss.
        response_mask: ``(B, T)`` bool, True on response tokens.
        group_ids: int64 ``(B,)`` prompt group of each row.
        scope: ``"group"`` (default) or ``"batch"``: where means, σ and the
            normalisation to mean weight 1 are taken (see the module docstring).

    Returns:
        ``(weights (B, T), metrics)``: in every scope with n valid tokens the
        weights of the valid tokens sum to n (mean 1); masked tokens get 0.
        Raises ``ValueError`` if a valid token has a non-finite log-prob or a
        response with valid tokens has a non-finite advantage; masked
        positions may hold anything (padding is often −inf or nan).
    """
    del entropy
    if scope not in ("group", "batch"):
        raise ValueError(f"scope must be 'group' or 'batch', got {scope!r}")
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be (B, T), got shape {tuple(logprobs.shape)}")
    num_rows, num_cols = logprobs.shape
    if response_mask.shape != logprobs.shape:
        raise ValueError(
            f"response_mask {tuple(response_mask.shape)} must match "
            f"logprobs {tuple(logprobs.shape)}"
        )
    if advantages.shape != (num_rows,):
        raise ValueError(f"advantages must be (B,) = ({num_rows},), got {tuple(advantages.shape)}")
    if group_ids.shape != (num_rows,):
        raise ValueError(f"group_ids must be (B,) = ({num_rows},), got {tuple(group_ids.shape)}")
    num_groups = check_group_ids(group_ids)

    valid_mask = response_mask.bool()  # (B, T)
    # Only the valid tokens are touched: rows with tokens first (a cheap count), then the
    # positions inside them; every statistic below is a run over a row or a sum over rows.
    row_counts = count_true(valid_mask, dim=1)  # (B,)
    rows = (row_counts > 0).nonzero().squeeze(1)  # (R,)
    num_token_rows = rows.numel()
    lengths = row_counts.index_select(0, rows)  # (R,) valid tokens per row
    token_rows = torch.repeat_interleave(torch.arange(num_token_rows, device=rows.device), lengths)  # (n,)
    if num_token_rows == num_rows:
        positions = valid_mask.reshape(-1).nonzero().squeeze(1)  # (n,) row-major in (B, T)
    else:
        positions = valid_mask.index_select(0, rows).reshape(-1).nonzero().squeeze(1)  # (n,) in (R, T)
        row_shift = (rows - torch.arange(num_token_rows, device=rows.device)) * num_cols  # (R,)
        positions += row_shift.index_select(0, token_rows)  # → (B, T)
    logp_valid = logprobs.detach().reshape(-1).index_select(0, positions)  # (n,)
    row_advantages = advantages.detach().index_select(0, rows)  # (R,)
    if not all_finite(logp_valid):
        raise ValueError("logprobs contain non-finite values on response tokens")
    if not all_finite(row_advantages):
        raise ValueError("advantages of responses with tokens contain non-finite values")

    with torch.no_grad():
        if scope == "group":
            row_scope = group_ids.long().index_select(0, rows)  # (R,)
            num_scopes = num_groups
        else:
            row_scope = torch.zeros(num_token_rows, dtype=torch.int64, device=logprobs.device)
            num_scopes = 1 if num_rows else 0
        lengths_f = lengths.to(torch.float64)
        counts = group_sum(lengths_f, row_scope, num_scopes)  # (U,) valid tokens per scope
        safe_counts = counts.clamp(min=1)
        # Per-token arithmetic runs in place on two float64 buffers: fresh memory, not the
        # arithmetic, is what costs on CPU. Statistics are float64 because c is a product
        # of two centred quantities and its square enters an exponent.
        token_values = logp_valid.to(torch.float64)  # (n,) log π
        broadcast = torch.empty_like(token_values)  # (n,) a per-scope or per-row value per token

        def per_token(per_row: torch.Tensor) -> torch.Tensor:  # (R,) → (n,), into `broadcast`
            return torch.index_select(per_row, 0, token_rows, out=broadcast)

        def scope_sum(values: torch.Tensor) -> torch.Tensor:  # (n,) → (U,)
            return group_sum(run_sum(values, lengths), row_scope, num_scopes)

        # max|log π| per scope, negated so that run_min/group_min can take it (no run_max).
        neg_abs_logp = torch.abs(token_values, out=broadcast).neg_()  # (n,)
        logp_scale = -group_min(run_min(neg_abs_logp, lengths), row_scope, num_scopes)  # (U,)
        mean_logp = scope_sum(token_values) / safe_counts
        adv = row_advantages.to(torch.float64)
        adv_scale = -group_min(-adv.abs(), row_scope, num_scopes)  # (U,) max|Â|
        mean_adv = group_sum(adv * lengths_f, row_scope, num_scopes) / safe_counts
        centred_adv = adv - mean_adv.index_select(0, row_scope)  # (R,)
        # A shared advantage leaves ±1e-17 here, not 0 (module docstring).
        adv_noise = ZERO_RELATIVE_TOLERANCE * adv_scale.index_select(0, row_scope)  # (R,)
        centred_adv = torch.where(centred_adv.abs() <= adv_noise, 0.0, centred_adv)
        cov = token_values.sub_(per_token(mean_logp.index_select(0, row_scope)))
        cov.mul_(per_token(centred_adv))  # (n,) c of 2.3-a
        cov_sum = scope_sum(cov)  # (U,)
        centred = torch.sub(cov, per_token((cov_sum / safe_counts).index_select(0, row_scope)), out=broadcast)
        sigma = (scope_sum(centred.mul_(centred)) / safe_counts).sqrt()  # (U,)
        # σ of equal c is rounding noise proportional to max|log π|·max|Â|, which bounds |c|.
        sigma = torch.where(sigma <= ZERO_RELATIVE_TOLERANCE * logp_scale * adv_scale, 0.0, sigma)
        empty = cov.new_zeros(())
        cov_low, cov_high = torch.aminmax(cov) if cov.numel() else (empty, empty)

        # 2.3-b as w = exp(−q), q = (c / (√2 σ))²; σ = 0 → q = 0 (weight 1) for the whole
        # scope. Scaling c before squaring keeps an overflowing c² from meeting a zero scale.
        smallest_sigma = torch.finfo(torch.float64).tiny ** 0.5
        inverse_width = torch.where(
            sigma > 0, 1.0 / (math.sqrt(2.0) * sigma.clamp(min=smallest_sigma)), 0.0
        )  # (U,)
        q = cov.mul_(per_token(inverse_width.index_select(0, row_scope)))
        q.mul_(q)  # (n,) −log w
        # 2.3-c as n · softmax(−q) per scope, shifted by the scope's smallest q.
        q_min = group_min(run_min(q, lengths), row_scope, num_scopes)  # (U,)
        shifted = torch.sub(per_token(q_min.index_select(0, row_scope)), q, out=q).exp_()  # (n,) w / max w
        normaliser = scope_sum(shifted)  # (U,) ≥ 1 where the scope has tokens
        weights_valid = shifted.mul_(per_token((counts / normaliser.clamp(min=1)).index_select(0, row_scope)))

        weights = torch.zeros(num_rows * num_cols, dtype=logprobs.dtype, device=logprobs.device)
        weights.scatter_(0, positions, weights_valid.to(logprobs.dtype))
        weights = weights.view(num_rows, num_cols)

        present = counts > 0
        num_tokens = max(positions.numel(), 1)
        weight_min, weight_max = torch.aminmax(weights_valid) if positions.numel() else (empty, empty)
        # Σ exp(−q) per scope is exp(−q_min) · normaliser: no second exp over the tokens.
        kernel_sum = torch.where(present, torch.exp(-q_min) * normaliser, 0.0).sum()
    metrics: dict[str, float | torch.Tensor] = {
        "cw_grpo/cov_mean": cov_sum.sum() / num_tokens,
        "cw_grpo/cov_abs_max": torch.maximum(cov_low.abs(), cov_high.abs()),
        "cw_grpo/sigma_mean": sigma[present].mean() if bool(present.any()) else empty,
        "cw_grpo/sigma_zero_fraction": (
            (sigma[present] == 0).to(torch.float64).mean() if bool(present.any()) else empty
        ),
        "cw_grpo/kernel_mean": kernel_sum / num_tokens,
        "cw_grpo/weight_min": weight_min,
        "cw_grpo/weight_max": weight_max,
    }
    return weights, metrics
