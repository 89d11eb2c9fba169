"""Group-relative advantages: one scalar per sample from the rewards of its group.

Called through ``pipeline.rl.methods.ADVANTAGES`` with the contract
``fn(*, rewards, group_ids, **options) -> (advantages, metrics)``; ``rewards``,
``group_ids`` and the returned advantages are ``(S,)``. Groups are the responses
to one prompt; they may be ragged and non-contiguous (see ``segments``).

Shared behaviour, whatever the method:

* a group of one sample has advantage 0 (no baseline can be formed from it);
* a group whose rewards are all equal has advantage exactly 0 (decided by
  comparing the group's max and min, so rounding in the mean cannot leave a
  tiny residue that a std division would blow up);
* a non-finite reward raises ``ValueError`` naming its index — the reward
  function never raises (STYLE §9), so a NaN here is a pipeline bug;
* statistics are computed in float64 and the result is cast back to the
  reward dtype.
"""

from __future__ import annotations

import torch

from pipeline.algorithms import segments

Metrics = dict[str, float | torch.Tensor]

__all__ = ["dr_grpo_advantages", "global_baseline_advantages", "grpo_advantages", "rloo_advantages"]

GLOBAL_BASELINE_WEIGHTS = ("none", "inv_mean", "inv_sqrt_mean", "bernoulli_std")


def _check_rewards(rewards: torch.Tensor, group_ids: torch.Tensor, *, name: str = "rewards") -> None:
    if rewards.dim() != 1:
        raise ValueError(f"{name} must be 1-D (S,), got shape {tuple(rewards.shape)}")
    if group_ids.shape != rewards.shape:
        raise ValueError(
            f"group_ids shape {tuple(group_ids.shape)} does not match {name} shape {tuple(rewards.shape)}"
        )
    if not rewards.is_floating_point():
        raise ValueError(f"{name} must be a floating tensor, got {rewards.dtype}")
    bad = (~torch.isfinite(rewards)).nonzero().flatten()
    if bad.numel():
        index = int(bad[0])
        raise ValueError(
            f"{name}[{index}] = {float(rewards[index])} is not finite "
            f"({bad.numel()} non-finite value(s) in total, first at index {index})"
        )


def _degenerate_mask(
    rewards: torch.Tensor, group_ids: torch.Tensor, num_groups: int
) -> torch.Tensor:
    """``(S,)`` True where the sample's group has one member or constant rewards."""
    counts = segments.group_counts(group_ids, num_groups)
    spread = segments.group_max(rewards, group_ids, num_groups) - segments.group_min(
        rewards, group_ids, num_groups
    )
    degenerate = (counts < 2) | (spread == 0)
    return segments.broadcast(degenerate, group_ids)


def _summary(
    advantages: torch.Tensor, degenerate: torch.Tensor, group_ids: torch.Tensor, num_groups: int
) -> Metrics:
    if advantages.numel() == 0:
        return {"advantage_mean": 0.0, "advantage_std": 0.0, "advantage_abs_max": 0.0,
                "num_groups": 0.0, "zero_signal_group_fraction": 0.0}
    present = segments.group_counts(group_ids, num_groups) > 0
    degenerate_groups = segments.group_sum(degenerate.double(), group_ids, num_groups) > 0
    detached = advantages.detach()
    return {
        "advantage_mean": detached.mean(),
        "advantage_std": detached.std(unbiased=False),
        "advantage_abs_max": detached.abs().max(),
        "num_groups": float(present.sum()),
        # Groups whose samples carry no learning signal (one member or equal rewards).
        "zero_signal_group_fraction": degenerate_groups[present].double().mean(),
    }


def grpo_advantages(
    *,
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    eps: float = 1e-6,
    num_groups: int | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """GRPO advantage ``A_i = (r_i − mean_g r) / (std_g r + eps)``.

    DeepSeekMath (Shao et al., 2024) as written in Reinforce-Ada Eq. 2
    ("Reinforce-Ada: An Adaptive Sampling Framework under Non-linear RL
    Objectives") and D³S Eq. 2 ("Learning More with Less: A Dynamic Dual-Level
    Down-Sampling Framework for Efficient Policy Optimization"). Neither
    paper says which std; we use the population std (divide by n), so a group's
    advantages have population variance ``std²/(std+eps)² ≈ 1`` and, for binary rewards,
    ``std = sqrt(p(1−p))`` (Reinforce-Ada App. B, Remark 1). D³S Lemma 1 holds
    only for the sample (n−1) variance (see ``d3s.py``), which the sample selector
    does not depend on: both variances rank subsets of one size identically.
    """
    _check_rewards(rewards, group_ids)
    num_groups = segments.check_group_ids(group_ids, num_groups)
    values = rewards.double()
    mean = segments.group_mean(values, group_ids, num_groups)
    std = segments.group_std(values, group_ids, num_groups, unbiased=False)
    advantages = (values - segments.broadcast(mean, group_ids)) / (segments.broadcast(std, group_ids) + eps)
    degenerate = _degenerate_mask(values, group_ids, num_groups)
    advantages = torch.where(degenerate, torch.zeros_like(advantages), advantages)
    return advantages.to(rewards.dtype), _summary(advantages, degenerate, group_ids, num_groups)


def dr_grpo_advantages(
    *,
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    num_groups: int | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Dr.GRPO advantage ``A_i = r_i − mean_g r`` (Liu et al., 2025, "Understanding
    R1-Zero-Like Training"): GRPO without the std division, which biases updates
    toward groups with low reward spread (too easy or too hard prompts).
    """
    _check_rewards(rewards, group_ids)
    num_groups = segments.check_group_ids(group_ids, num_groups)
    values = rewards.double()
    mean = segments.group_mean(values, group_ids, num_groups)
    advantages = values - segments.broadcast(mean, group_ids)
    degenerate = _degenerate_mask(values, group_ids, num_groups)
    advantages = torch.where(degenerate, torch.zeros_like(advantages), advantages)
    return advantages.to(rewards.dtype), _summary(advantages, degenerate, group_ids, num_groups)


def rloo_advantages(
    *,
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    num_groups: int | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """REINFORCE leave-one-out (Kool et al., 2019; Ahmadian et al., 2024):
    ``A_i = r_i − (Σ_{j≠i} r_j) / (n − 1)``, an unbiased baseline because it
    excludes the sample's own reward. Equals ``n/(n−1) · (r_i − mean)``.
    """
    _check_rewards(rewards, group_ids)
    num_groups = segments.check_group_ids(group_ids, num_groups)
    values = rewards.double()
    sums = segments.broadcast(segments.group_sum(values, group_ids, num_groups), group_ids)
    counts = segments.broadcast(segments.group_counts(group_ids, num_groups), group_ids).double()
    advantages = values - (sums - values) / (counts - 1).clamp(min=1)
    degenerate = _degenerate_mask(values, group_ids, num_groups)
    advantages = torch.where(degenerate, torch.zeros_like(advantages), advantages)
    return advantages.to(rewards.dtype), _summary(advantages, degenerate, group_ids, num_groups)


def global_baseline_advantages(
    *,
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    pool_rewards: torch.Tensor | None = None,
    pool_group_ids: torch.Tensor | None = None,
    weight: str = "none",
    eps: float = 1e-6,
    num_groups: int | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Reinforce-Ada global-baseline advantage ``A_i = w(r̄_x) · (r_i − r̄_x)``.

    "Reinforce-Ada: An Adaptive Sampling Framework under Non-linear RL
    Objectives", Algorithm 2 lines 15-19 and §3.2 "Practical
    Implementation via Static Batches": the baseline ``r̄_x`` is the mean reward
    over the *whole pool* collected for prompt x (all ``N_x`` responses of the
    sequential sampling), computed before the pool is down-sampled to the
    update group. "Global" in the paper means all samples of one prompt, not
    all prompts of the batch.

    ``pool_rewards``/``pool_group_ids`` give that pool (same group id space);
    when omitted the baseline is the mean over ``rewards`` itself, and with
    ``weight="none"`` the result then equals ``dr_grpo``. The paper does *not*
    divide by a std in Algorithm 2; the explicit per-prompt weight is optional:

    ``"none"``           ``A = r − r̄`` — Algorithm 2 line 19 (the default).
    ``"inv_mean"``       ``A = (r − r̄) / (r̄ + eps)`` — the §3.2 final estimator,
                         which re-introduces the log-objective weight ``1/p̂``.
    ``"inv_sqrt_mean"``  ``A = (r − r̄) / sqrt(r̄ + eps)`` — Algorithm 1 lines
                         15-16 (Reinforce-Ada-Est hybrid, residual ``1/sqrt(p̂)``).
    ``"bernoulli_std"``  ``A = (r − r̄) / (sqrt(r̄(1 − r̄)) + eps)`` — App. B,
                         "Reinforce with baseline" step 2 (``r̄(1−r̄)`` is the
                         Bernoulli variance). The three weighted forms treat r̄
                         as a pass rate and require rewards in [0, 1].

    A sample whose pool has one member or constant rewards gets advantage 0.
    Metrics include ``pool_size_mean``.
    """
    if weight not in GLOBAL_BASELINE_WEIGHTS:
        raise ValueError(f"unknown global_baseline weight {weight!r}; choose one of {GLOBAL_BASELINE_WEIGHTS}")
    _check_rewards(rewards, group_ids)
    if (pool_rewards is None) != (pool_group_ids is None):
        raise ValueError("pool_rewards and pool_group_ids must be given together")
    if pool_rewards is None:
        pool_rewards, pool_group_ids = rewards, group_ids
    else:
        _check_rewards(pool_rewards, pool_group_ids, name="pool_rewards")
    if num_groups is None:
        num_groups = max(
            segments.check_group_ids(group_ids), segments.check_group_ids(pool_group_ids)
        )
    else:
        segments.check_group_ids(group_ids, num_groups)
        segments.check_group_ids(pool_group_ids, num_groups)

    pool_values = pool_rewards.double()
    pool_counts = segments.group_counts(pool_group_ids, num_groups)
    pool_mean = segments.group_mean(pool_values, pool_group_ids, num_groups)  # (G,)
    update_counts = segments.group_counts(group_ids, num_groups)
    orphan = (update_counts > 0) & (pool_counts == 0)
    if bool(orphan.any()):
        group = int(orphan.nonzero()[0])
        raise ValueError(f"group {group} has samples to update but no pool rewards to form its baseline")

    # The weights are functions of a pass rate; outside [0, 1] they are undefined.
    if weight != "none" and bool(((pool_values < 0) | (pool_values > 1)).any()):
        raise ValueError(f"weight={weight!r} treats the mean reward as a pass rate and needs rewards in [0, 1]")
    if weight == "none":
        scale = torch.ones_like(pool_mean)
    elif weight == "inv_mean":
        scale = 1.0 / (pool_mean + eps)
    elif weight == "inv_sqrt_mean":
        scale = 1.0 / (pool_mean + eps).sqrt()
    else:
        scale = 1.0 / ((pool_mean * (1 - pool_mean)).clamp(min=0).sqrt() + eps)

    values = rewards.double()
    advantages = segments.broadcast(scale, group_ids) * (values - segments.broadcast(pool_mean, group_ids))
    degenerate_groups = (pool_counts < 2) | (
        segments.group_max(pool_values, pool_group_ids, num_groups)
        == segments.group_min(pool_values, pool_group_ids, num_groups)
    )
    degenerate = segments.broadcast(degenerate_groups, group_ids)
    advantages = torch.where(degenerate, torch.zeros_like(advantages), advantages)
    metrics = _summary(advantages, degenerate, group_ids, num_groups)
    present = pool_counts > 0
    metrics["pool_size_mean"] = pool_counts[present].double().mean() if bool(present.any()) else 0.0
    metrics["baseline_mean"] = pool_mean[present].mean() if bool(present.any()) else 0.0
    return advantages.to(rewards.dtype), metrics
