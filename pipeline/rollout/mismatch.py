"""Train/rollout log-prob mismatch metrics (the correction itself: ``pipeline.algorithms.rollout_correction``).

The rollout engine samples from ``π_rollout`` (SGLang kernels, bf16, another
parallel layout); the trainer recomputes ``π_train`` of the same tokens with its own
kernels. Even with identical weights the two differ, which makes "on-policy" RL
silently off-policy. With ``Δ = log π_train − log π_rollout`` per token:

    mean |Δ|, max |Δ|                     how far apart the engines are
    std(exp Δ)                            spread of the per-token ratio π_train / π_rollout
    frac(|Δ| > threshold)                 share of tokens that disagree materially

The loop corrects for the gap with importance ratios π_old/π_rollout, truncated (TIS) or
masked (MIS), per token or per sample (``algorithm.rollout_correction``; the pure function is
``pipeline.algorithms.rollout_correction.rollout_correction``).

``logprob_mismatch`` is pure: masked positions are ignored (their inputs may hold any
value, even ``±inf``/NaN), and a non-finite value at a masked-in position is a
``ValueError`` naming the tensor, because a −inf log-prob means a sampled token the
other side considers impossible — a bug to fix, not to average over.
"""

from __future__ import annotations

import torch

__all__ = ["logprob_mismatch"]


def _checked_delta(
    trainer_logprobs: torch.Tensor,
    engine_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    trainer_name: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Δ (…), bool mask (…))``: ``Δ = trainer − engine`` in at least float32, 0 where masked out."""
    if trainer_logprobs.shape != engine_logprobs.shape or mask.shape != engine_logprobs.shape:
        raise ValueError(
            f"shape mismatch: {trainer_name} {tuple(trainer_logprobs.shape)}, engine_logprobs "
            f"{tuple(engine_logprobs.shape)}, mask {tuple(mask.shape)}"
        )
    mask = mask.bool()
    dtype = torch.promote_types(torch.promote_types(trainer_logprobs.dtype, engine_logprobs.dtype), torch.float32)
    trainer_logprobs, engine_logprobs = trainer_logprobs.detach().to(dtype), engine_logprobs.detach().to(dtype)
    for name, values in ((trainer_name, trainer_logprobs), ("engine_logprobs", engine_logprobs)):
        if not bool(torch.isfinite(values).logical_or(~mask).all()):
            raise ValueError(f"{name} has a non-finite value at a position inside the mask")
    delta = torch.where(mask, trainer_logprobs - engine_logprobs, torch.zeros((), dtype=dtype))
    return delta, mask


def logprob_mismatch(
    engine_logprobs: torch.Tensor,
    trainer_logprobs: torch.Tensor,
    *,
    mask: torch.Tensor,
    threshold: float = 0.1,
) -> tuple[torch.Tensor, dict[str, float | torch.Tensor]]:
    """Per-token ``Δ = trainer − engine`` ``(…)`` (0 where masked out) and summary metrics.

    Inputs share one shape, e.g. ``(B, T)``; ``mask`` is bool or 0/1. ``threshold`` is in
    nats (0.1 ≈ a 10% probability ratio). Metrics (0-d tensors, float64):
    ``mean_abs_diff``, ``max_abs_diff``, ``ratio_std`` (population std of ``exp Δ``),
    ``frac_above_threshold``, and ``num_tokens``. With no token in the mask every
    statistic is NaN (undefined, and loud in a metrics check) and ``num_tokens`` is 0.
    """
    if not threshold >= 0:
        raise ValueError(f"threshold must be >= 0, got {threshold}")
    delta, mask = _checked_delta(trainer_logprobs, engine_logprobs, mask, trainer_name="trainer_logprobs")
    values = delta[mask].double()  # (N,)
    num_tokens = values.numel()
    if num_tokens == 0:
        nan = torch.tensor(float("nan"), dtype=torch.float64)
        metrics: dict[str, float | torch.Tensor] = {
            "mean_abs_diff": nan,
            "max_abs_diff": nan.clone(),
            "ratio_std": nan.clone(),
            "frac_above_threshold": nan.clone(),
        }
    else:
        abs_delta = values.abs()
        metrics = {
            "mean_abs_diff": abs_delta.mean(),
            "max_abs_diff": abs_delta.max(),
            "ratio_std": values.exp().std(correction=0),
            "frac_above_threshold": (abs_delta > threshold).double().mean(),
        }
    metrics["num_tokens"] = float(num_tokens)
    return delta, metrics

