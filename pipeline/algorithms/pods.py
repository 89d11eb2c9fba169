"""PODS: max-variance down-sampling of rollouts by reward.

PODS is Xu, Savani, Fang and Kolter (2025), "Not All Rollouts are Useful:
Down-Sampling Rollouts in LLM Reinforcement Learning" (arXiv:2504.13818). It is
implemented as described by the D³S paper ("Learning More with Less: A Dynamic
Dual-Level Down-Sampling Framework for Efficient Policy Optimization"), which
uses it as its baseline: Sec. 2.2 and
Sec. 3.1 ("maximizing Var(R)" over a subset, the optimum being the highest plus
the lowest values), Sec. 4.1 ("a down-sampling strategy via maximizing reward
variance") and App. D.2 (intra-group selection).

Per group, the ``N`` rollouts whose *rewards* have the largest variance are
kept (the same i-largest + (N − i)-smallest structure as D³S Eq. 6, so the
selector is ``d3s.max_variance_subset``), and the GRPO advantage (D³S Eq. 2,
``advantages.grpo_advantages``) is then recomputed *inside the subset*:
``A_i = (R_i − mean_Ŝ R) / (std_Ŝ R + eps)``.
This is the difference D³S Sec. 2.2 points out: PODS re-normalises, so the
subset's Var(A) is 1 again, whereas D³S keeps the full-group advantages.
"""

from __future__ import annotations

import torch

from pipeline.algorithms.advantages import grpo_advantages
from pipeline.algorithms.d3s import (
    check_num_keep,
    draw_tie_break_key,
    max_variance_subset,
    sample_selection_metrics,
)
from pipeline.algorithms.segments import check_group_ids, group_counts, group_std

__all__ = ["pods_select"]


def pods_select(
    *,
    advantages: torch.Tensor | None,
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    num_keep: int,
    generator: torch.Generator | None = None,
    num_groups: int | None = None,
    eps: float = 1e-6,
    random_ties: bool = False,
) -> tuple[tuple[torch.Tensor, torch.Tensor], dict[str, float | torch.Tensor]]:
    """PODS max-variance down-sampling with GRPO advantages re-normalised in the subset.

    Args:
        advantages: the full-group advantages; ignored (PODS recomputes them),
            only their dtype is used for the output when given.
        rewards: ``(S,)`` scalar reward per rollout.
        group_ids: int64 ``(S,)``; ragged groups allowed.
        num_keep: subset size N per group; smaller groups keep all members.
        generator: draws the order of equal rewards when ``random_ties`` is
            set; otherwise equal rewards are ordered by index, as in
            ``max_variance_subset``.
        eps: added to the subset std, as in GRPO.
        random_ties: see ``generator``.

    Returns:
        ``((keep_mask (S,) bool, advantages (S,)), metrics)``. Kept samples get
        the in-subset GRPO advantage of ``advantages.grpo_advantages``
        (population std, a constant subset or a subset of one gets exactly 0);
        dropped samples get 0.
    """
    num_keep = check_num_keep(num_keep)
    num_groups = check_group_ids(group_ids, num_groups)
    # Validates shapes and finiteness of the rewards, then selects.
    keep_mask = max_variance_subset(
        rewards,
        group_ids,
        num_keep=num_keep,
        num_groups=num_groups,
        tie_break_key=draw_tie_break_key(rewards, random_ties=random_ties, generator=generator),
    )

    out_dtype = advantages.dtype if advantages is not None else rewards.dtype
    kept_rewards = rewards.detach().to(torch.float64)[keep_mask]
    kept_ids = group_ids[keep_mask]
    kept_advantages, _ = grpo_advantages(
        rewards=kept_rewards, group_ids=kept_ids, eps=eps, num_groups=num_groups
    )
    new_advantages = torch.zeros(rewards.shape, dtype=torch.float64, device=rewards.device)
    new_advantages[keep_mask] = kept_advantages
    new_advantages = new_advantages.to(out_dtype)

    metrics = sample_selection_metrics(
        advantages=new_advantages,
        keep_mask=keep_mask,
        group_ids=group_ids,
        num_groups=num_groups,
        prefix="pods",
    )
    contributing = group_counts(kept_ids, num_groups) > 0  # (G,)
    reward_var = group_std(kept_rewards, kept_ids, num_groups) ** 2
    # Mean over groups of the in-subset (population) reward variance: what PODS maximises.
    metrics["pods/selected_reward_var"] = (
        reward_var[contributing].mean() if bool(contributing.any()) else kept_rewards.new_zeros(())
    )
    return (keep_mask, new_advantages), metrics
