"""Train/rollout log-prob mismatch metrics and truncated importance-sampling weights.

The rollout engine samples from ``π_rollout`` (SGLang kernels, bf16, another
parallel layout); the trainer recomputes ``π_train`` of the same tokens with its own
kernels. Even with identical weights the two differ, which makes "on-policy" RL
silently off-policy. With ``Δ = log π_train − log π_rollout`` per token:

    mean |Δ|, max |Δ|                     how far apart the engines are
    std(exp Δ)                            spread of the per-token ratio π_train / π_rollout
    frac(|Δ| > threshold)                 share of tokens that disagree materially

Truncated importance sampling (TIS) corrects the policy gradient for the mismatch
by weighting each token with ``w = min(π_old / π_rollout, C)`` — Ionides (2008),
"Truncated Importance Sampling", J. Comput. Graph. Stat. 17(2), applied to LLM RL by
Yao, Liu et al. (2025), "Your Efficient RL Framework Secretly Brings You Off-Policy
RL Training" (fengyao.notion.site). ``π_old`` is
the trainer's recomputation for the rollout's weights (the denominator of the PPO
ratio), so ``w`` rescales the PPO objective token by token, with no gradient.

Both functions are pure: masked positions are ignored (their inputs may hold any
value, even ``±inf``/NaN), and a non-finite value at a masked-in position is a
``ValueError`` naming the tensor, because a −inf log-prob means a sampled token the
other side considers impossible — a bug to fix, not to average over.
"""

from __future__ import annotations

import torch

__all__ = ["logprob_mismatch", "tis_weights"]


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


def tis_weights(
    trainer_old_logprobs: torch.Tensor,
    engine_logprobs: torch.Tensor,
    *,
    mask: torch.Tensor,
    cap: float,
) -> tuple[torch.Tensor, dict[str, float | torch.Tensor]]:
    """Truncated IS weights ``min(exp(old − engine), cap)`` ``(…)``, 0 where masked out, no gradient.

    ``cap`` ≥ 1 (Yao et al. use 2). Metrics: ``mean_weight`` and ``frac_capped`` over the
    masked-in tokens (NaN when there are none), ``num_tokens``. The ratio is computed
    in at least float32 and returned in that dtype.
    """
    if not cap >= 1.0:
        raise ValueError(f"cap must be >= 1 (a cap below 1 down-weights on-policy tokens), got {cap}")
    delta, mask = _checked_delta(trainer_old_logprobs, engine_logprobs, mask, trainer_name="trainer_old_logprobs")
    ratio = delta.exp()
    weights = torch.where(mask, ratio.clamp(max=cap), torch.zeros((), dtype=ratio.dtype))
    num_tokens = int(mask.sum())
    if num_tokens == 0:
        nan = torch.tensor(float("nan"), dtype=torch.float64)
        metrics: dict[str, float | torch.Tensor] = {"mean_weight": nan, "frac_capped": nan.clone()}
    else:
        metrics = {
            "mean_weight": weights[mask].double().mean(),
            "frac_capped": (ratio[mask] > cap).double().mean(),
        }
    metrics["num_tokens"] = float(num_tokens)
    return weights, metrics
