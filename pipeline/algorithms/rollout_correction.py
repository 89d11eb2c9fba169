"""Rollout correction: importance weights for the gap between the rollout engine and the trainer.

The engine samples from ``π_rollout`` (SGLang kernels, bf16/FP8, another parallel layout);
the trainer's ``π_old`` of the same tokens differs even with identical weights, so the
"on-policy" gradient is silently off-policy. Per response token ``t`` of sample ``i`` let

    ρ_{i,t} = π_old(y_t | ·) / π_rollout(y_t | ·) = exp(log π_old − log π_rollout)

and the sequence ratio be the geometric mean over the sample's response tokens ``y_i``,

    ρ_i = exp( 1/|y_i| Σ_t (log π_old − log π_rollout) )

(the length-normalised sequence ratio of GSPO's Eq. 3 as D³S writes it, so a long response
is not truncated for being long). Four corrections, ``(mode, level)``:

``truncate, token``     w_{i,t} = min(ρ_{i,t}, C)        — truncated IS (TIS): Ionides (2008),
                        "Truncated Importance Sampling", J. Comput. Graph. Stat. 17(2);
                        applied to LLM RL by Yao, Liu et al. (2025), "Your Efficient RL
                        Framework Secretly Brings You Off-Policy RL Training".
``truncate, sequence``  w_{i,t} = min(ρ_i, C) for every token of sample i.
``mask, token``         keep token t iff C_low ≤ ρ_{i,t} ≤ C (masked IS, MIS): a token the
                        two engines disagree on that much is dropped rather than re-weighted.
``mask, sequence``      keep sample i iff C_low ≤ ρ_i ≤ C.

Truncation returns weights (multiplied into the advantage: for ``w ≥ 0`` the clipped
surrogate ``min(ρA, clip(ρ)A)`` scaled by ``w`` equals the surrogate with ``wA``), and a
keep mask of all response tokens; masking returns weights 1 and the keep mask. Neither
carries gradient. Inputs are ``(B, T)``; positions outside ``response_mask`` may hold
anything (NaN, ±inf) and never reach the arithmetic; a non-finite log-prob inside the mask
raises ``ValueError`` (a token one side calls impossible is a bug, not noise). A sample with
no response token has ρ_i = 1. Float noise where the math says 0 (identical log-probs up to
1e-17) gives ρ = exp(1e-17) = 1 exactly in float64 and never crosses a threshold ≥ 1.
"""

from __future__ import annotations

from typing import Literal

import torch

__all__ = ["CorrectionLevel", "CorrectionMode", "rollout_correction"]

CorrectionMode = Literal["truncate", "mask"]
CorrectionLevel = Literal["token", "sequence"]

# exp() of a log-ratio beyond this overflows float32; such a ratio is past any threshold anyway.
_MAX_LOG_RATIO = 20.0


def rollout_correction(
    *,
    old_logprobs: torch.Tensor,
    engine_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    mode: CorrectionMode,
    level: CorrectionLevel,
    upper: float,
    lower: float = 0.0,
) -> tuple[tuple[torch.Tensor, torch.Tensor], dict[str, float]]:
    """``((weights (B, T), keep (B, T) bool), metrics)`` for the correction ``(mode, level)``.

    ``upper`` is C (≥ 1: a cap below 1 down-weights on-policy tokens); ``lower`` is C_low of
    masking (``0 ≤ lower ≤ 1``; truncation ignores it). ``weights`` is 0 outside ``keep``.
    Metrics over response tokens (NaN when there are none): ``ratio_mean``, ``ratio_max``,
    ``ratio_min`` of the level's ratio, and ``corrected_fraction`` — the share of response
    tokens truncated (ratio > C) or masked out.
    """
    if old_logprobs.shape != engine_logprobs.shape or response_mask.shape != old_logprobs.shape:
        raise ValueError(f"shape mismatch: old_logprobs {tuple(old_logprobs.shape)}, engine_logprobs "
                         f"{tuple(engine_logprobs.shape)}, response_mask {tuple(response_mask.shape)}")
    if old_logprobs.dim() != 2:
        raise ValueError(f"expected (B, T) tensors, got shape {tuple(old_logprobs.shape)}")
    if mode not in ("truncate", "mask"):
        raise ValueError(f"mode must be 'truncate' or 'mask', got {mode!r}")
    if level not in ("token", "sequence"):
        raise ValueError(f"level must be 'token' or 'sequence', got {level!r}")
    if not upper >= 1.0:
        raise ValueError(f"upper must be >= 1 (below 1 it corrects on-policy tokens), got {upper}")
    if not 0.0 <= lower <= 1.0:
        raise ValueError(f"lower must lie in [0, 1], got {lower}")
    mask = response_mask.bool()
    dtype = torch.promote_types(torch.promote_types(old_logprobs.dtype, engine_logprobs.dtype), torch.float32)
    zero = torch.zeros((), dtype=dtype)
    old, engine = old_logprobs.detach().to(dtype), engine_logprobs.detach().to(dtype)
    for name, values in (("old_logprobs", old), ("engine_logprobs", engine)):
        if not bool(torch.isfinite(values).logical_or(~mask).all()):
            raise ValueError(f"{name} has a non-finite value at a response position")
    log_ratio = torch.where(mask, old - engine, zero).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)  # (B, T)
    if level == "token":
        ratio = log_ratio.exp()  # (B, T)
    else:
        lengths = mask.sum(dim=1, keepdim=True)  # (B, 1)
        mean_log = log_ratio.sum(dim=1, keepdim=True) / lengths.clamp(min=1).to(dtype)  # (B, 1)
        ratio = mean_log.exp().expand_as(log_ratio)  # (B, T): the sample's ratio on each of its tokens
    if mode == "truncate":
        keep = mask
        weights = torch.where(mask, ratio.clamp(max=upper), zero)
        corrected = mask & (ratio > upper)
    else:
        keep = mask & (ratio <= upper) & (ratio >= lower)
        weights = keep.to(dtype)
        corrected = mask & ~keep
    values = ratio[mask].double()  # (N,)
    num_tokens = values.numel()
    nan = float("nan")
    metrics = {
        "ratio_mean": float(values.mean()) if num_tokens else nan,
        "ratio_max": float(values.max()) if num_tokens else nan,
        "ratio_min": float(values.min()) if num_tokens else nan,
        "corrected_fraction": float(corrected.sum()) / num_tokens if num_tokens else nan,
    }
    return (weights, keep), metrics
