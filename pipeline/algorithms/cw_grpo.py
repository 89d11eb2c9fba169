"""CW-GRPO: covariance-aware Gaussian-kernel advantage reweighting.

Paper: /work/shared/papers/cw-grpo-covariance-gaussian-reweighting.txt, "Taming
Extreme Tokens: Covariance-Aware GRPO with Gaussian-Kernel Advantage
Reweighting" (Wang, Liu, Zhou, Chen; arXiv:2605.11538), Sec. 2.3. The paper's
equations are unnumbered; in the order they appear in Sec. 2.3:

* (2.3-a) ``c_{i,t} = (log π_θ(o_{i,t}) − mean log π) · (Â_i − mean Â)``
* (2.3-b) ``w_{i,t} = exp(−c_{i,t}² / (2σ²))``, σ the std of ``{c_{i,t}}``
* (2.3-c) ``w̃_{i,t} = w_{i,t} · N / Σ_{j=1}^{G} Σ_{k=1}^{|o_j|} w_{j,k}``, ``N = Σ_j |o_j|``
* (2.3-d) ``ℓ̃_{i,t} = ratio_{i,t} · (w̃_{i,t} Â_i) − β KL_{i,t}``

``cw_grpo_token_weights`` (``TOKEN_WEIGHTS["cw_grpo"]``) returns ``w̃`` of
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
* 2.3-c is evaluated as ``N · softmax(−c²/(2σ²))`` in log space: identical
  whenever ``Σ w`` is representable, and finite when all ``w`` would underflow
  (c clustered far from 0 with a tiny spread).
"""

from __future__ import annotations

from typing import Literal

import torch

from pipeline.algorithms.registry import TOKEN_WEIGHTS
from pipeline.algorithms.segments import check_group_ids

__all__ = ["cw_grpo_token_weights"]

CovarianceScope = Literal["group", "batch"]


def _scope_sum(values: torch.Tensor, scope_ids: torch.Tensor, num_scopes: int) -> torch.Tensor:
    return values.new_zeros(num_scopes).index_add(0, scope_ids, values)


@TOKEN_WEIGHTS.register("cw_grpo")
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
    # Only the valid tokens are touched from here on: select first, then widen to float64.
    flat_valid = valid_mask.reshape(-1)  # (B·T,)
    valid_positions = flat_valid.nonzero().squeeze(1)  # (n,)
    valid_rows = torch.div(valid_positions, num_cols, rounding_mode="floor")  # (n,)
    logp_valid = logprobs.detach().reshape(-1)[valid_positions]  # (n,)
    if not bool(torch.isfinite(logp_valid).all()):
        raise ValueError("logprobs contain non-finite values on response tokens")
    if not bool(torch.isfinite(advantages.detach()[valid_mask.any(dim=1)]).all()):
        raise ValueError("advantages of responses with tokens contain non-finite values")

    with torch.no_grad():
        if scope == "group":
            row_scope = group_ids.long()
            num_scopes = num_groups
        else:
            row_scope = torch.zeros(num_rows, dtype=torch.int64, device=logprobs.device)
            num_scopes = 1 if num_rows else 0
        scope_ids = row_scope[valid_rows]  # (n,)
        # Statistics in float64: c is a product of two centred quantities and
        # its square enters an exponent.
        logp = logp_valid.to(torch.float64)  # (n,)
        adv = advantages.detach()[valid_rows].to(torch.float64)  # (n,)

        counts = _scope_sum(torch.ones_like(logp), scope_ids, num_scopes).clamp(min=1)  # (U,)
        mean_logp = _scope_sum(logp, scope_ids, num_scopes) / counts
        mean_adv = _scope_sum(adv, scope_ids, num_scopes) / counts
        cov = (logp - mean_logp[scope_ids]) * (adv - mean_adv[scope_ids])  # (n,) 2.3-a
        mean_cov = _scope_sum(cov, scope_ids, num_scopes) / counts
        centred = cov - mean_cov[scope_ids]
        sigma = (_scope_sum(centred * centred, scope_ids, num_scopes) / counts).sqrt()  # (U,)

        # 2.3-b in log space; σ = 0 → log w = 0 (weight 1) for the whole scope.
        sigma_sq = (sigma * sigma)[scope_ids]
        degenerate = sigma_sq == 0
        safe_sigma_sq = sigma_sq.clamp(min=torch.finfo(torch.float64).tiny)
        log_w = torch.where(degenerate, torch.zeros_like(cov), -(cov * cov) / (2.0 * safe_sigma_sq))
        # 2.3-c as n · softmax(log w) per scope.
        scope_max = log_w.new_full((num_scopes,), float("-inf")).scatter_reduce(
            0, scope_ids, log_w, reduce="amax", include_self=True
        )
        shifted = torch.exp(log_w - scope_max[scope_ids])
        normaliser = _scope_sum(shifted, scope_ids, num_scopes)
        weights_valid = shifted * counts[scope_ids] / normaliser[scope_ids]

        weights = torch.zeros(num_rows * num_cols, dtype=logprobs.dtype, device=logprobs.device)
        weights[valid_positions] = weights_valid.to(logprobs.dtype)
        weights = weights.view(num_rows, num_cols)

        present = _scope_sum(torch.ones_like(logp), scope_ids, num_scopes) > 0
        raw_w = torch.exp(log_w)
    empty = logp.new_zeros(())
    metrics: dict[str, float | torch.Tensor] = {
        "cw_grpo/cov_mean": cov.mean() if cov.numel() else empty,
        "cw_grpo/cov_abs_max": cov.abs().max() if cov.numel() else empty,
        "cw_grpo/sigma_mean": sigma[present].mean() if bool(present.any()) else empty,
        "cw_grpo/sigma_zero_fraction": (
            (sigma[present] == 0).to(torch.float64).mean() if bool(present.any()) else empty
        ),
        "cw_grpo/kernel_mean": raw_w.mean() if raw_w.numel() else empty,
        "cw_grpo/weight_min": weights_valid.min() if weights_valid.numel() else empty,
        "cw_grpo/weight_max": weights_valid.max() if weights_valid.numel() else empty,
    }
    return weights, metrics
