"""Stateful reference implementations of two per-prompt estimators, for tests only.

Production keeps these counters in one place, ``pipeline.stats.store.PromptStatsStore``
(Ada-EMA/Beta of Reinforce-Ada-Est §3.1; E3 §4.1 cumulative rewards and ranks); these
small objects, built only on the pure functions of ``pipeline.algorithms``, are the
oracles the store and the budgets are checked against.
"""

from __future__ import annotations

import torch

from pipeline.algorithms.e3 import accumulate_prompt_rewards, difficulty_ranks
from pipeline.algorithms.reinforce_ada import ema_beta_estimate, ema_beta_update


class RankTracker:
    """Per-prompt cumulative reward/count and the difficulty ranks k_i of §4.1.

    ``update`` after every rollout batch; ``end_pass`` at the end of each pass
    over the dataset, which recomputes k and advances the pass counter that
    ``e3_budget_bounds`` widens G_min/G_max with. Until the first ``end_pass``
    every prompt has the neutral k = 1/2 (and G_min = G_max = G anyway).
    Prompt ids are indices in ``[0, num_prompts)``.
    """

    def __init__(self, *, num_prompts: int) -> None:
        if num_prompts < 0:
            raise ValueError(f"num_prompts must be ≥ 0, got {num_prompts}")
        self.reward_sum = torch.zeros(num_prompts, dtype=torch.float64)
        self.num_rollouts = torch.zeros(num_prompts, dtype=torch.int64)
        self.difficulty = torch.full((num_prompts,), 0.5, dtype=torch.float64)
        self.num_completed_passes = 0

    def update(self, *, prompt_ids: torch.Tensor, rewards: torch.Tensor) -> None:
        self.reward_sum, self.num_rollouts = accumulate_prompt_rewards(
            reward_sum=self.reward_sum,
            num_rollouts=self.num_rollouts,
            prompt_ids=prompt_ids.cpu(),
            rewards=rewards.detach().cpu(),
        )

    def end_pass(self) -> dict[str, float | torch.Tensor]:
        self.difficulty, metrics = difficulty_ranks(
            reward_sum=self.reward_sum, num_rollouts=self.num_rollouts
        )
        self.num_completed_passes += 1
        return metrics

    def difficulty_of(self, prompt_ids: torch.Tensor) -> torch.Tensor:
        """k for ``prompt_ids`` ``(B,)`` → ``(B,)`` float64, ready for ``e3_rollout_budgets``."""
        return self.difficulty[prompt_ids.long().cpu()]

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {
            "reward_sum": self.reward_sum.clone(),
            "num_rollouts": self.num_rollouts.clone(),
            "difficulty": self.difficulty.clone(),
            "num_completed_passes": torch.tensor(self.num_completed_passes, dtype=torch.int64),
        }

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for key in ("reward_sum", "num_rollouts", "difficulty"):
            if key not in state:
                raise ValueError(f"RankTracker state is missing {key!r}")
            if tuple(state[key].shape) != tuple(self.reward_sum.shape):
                raise ValueError(
                    f"RankTracker state {key!r} has shape {tuple(state[key].shape)}, "
                    f"expected {tuple(self.reward_sum.shape)}"
                )
        if "num_completed_passes" not in state:
            raise ValueError("RankTracker state is missing 'num_completed_passes'")
        self.reward_sum = state["reward_sum"].to(torch.float64).clone()
        self.num_rollouts = state["num_rollouts"].to(torch.int64).clone()
        self.difficulty = state["difficulty"].to(torch.float64).clone()
        self.num_completed_passes = int(state["num_completed_passes"])


class PassRateEstimator:
    """Ada-EMA pass-rate estimator of Reinforce-Ada-Est (§3.1, Algorithm 1 line 19).

    Holds two float64 counters per prompt id in ``[0, num_prompts)``. The paper
    gives no values for λ, α, β; the defaults here (λ = 0.9, a uniform
    Beta(1, 1) prior) are ours. With α > 0 an unsolved prompt keeps p̂ > 0, so
    the 1/√p̂ allocation never discards it (the point of §3.1).
    """

    def __init__(
        self,
        *,
        num_prompts: int,
        decay: float = 0.9,
        prior_alpha: float = 1.0,
        prior_beta: float = 1.0,
    ) -> None:
        if num_prompts < 0:
            raise ValueError(f"num_prompts must be ≥ 0, got {num_prompts}")
        if not (0.0 < decay <= 1.0):
            raise ValueError(f"decay λ must lie in (0, 1], got {decay}")
        if prior_alpha < 0 or prior_beta < 0 or prior_alpha + prior_beta <= 0:
            raise ValueError(f"need α, β ≥ 0 with α + β > 0, got α={prior_alpha}, β={prior_beta}")
        self.decay = decay
        self.prior_alpha = prior_alpha
        self.prior_beta = prior_beta
        self.num_total = torch.zeros(num_prompts, dtype=torch.float64)
        self.num_positive = torch.zeros(num_prompts, dtype=torch.float64)

    def estimate(self, prompt_ids: torch.Tensor) -> torch.Tensor:
        """p̂ for ``prompt_ids`` ``(B,)`` → ``(B,)`` float64."""
        ids = prompt_ids.long()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_total.numel()):
            raise ValueError(f"prompt ids must lie in [0, {self.num_total.numel()})")
        return ema_beta_estimate(
            num_total=self.num_total[ids],
            num_positive=self.num_positive[ids],
            prior_alpha=self.prior_alpha,
            prior_beta=self.prior_beta,
        )

    def update(
        self, *, prompt_ids: torch.Tensor, num_samples: torch.Tensor, num_correct: torch.Tensor
    ) -> dict[str, float | torch.Tensor]:
        self.num_total, self.num_positive = ema_beta_update(
            num_total=self.num_total,
            num_positive=self.num_positive,
            prompt_ids=prompt_ids.cpu(),
            num_samples=num_samples.cpu(),
            num_correct=num_correct.cpu(),
            decay=self.decay,
        )
        seen = self.num_total > 0
        return {"ada_est/num_prompts_seen": float(seen.sum())}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"num_total": self.num_total.clone(), "num_positive": self.num_positive.clone()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for key in ("num_total", "num_positive"):
            if key not in state:
                raise ValueError(f"PassRateEstimator state is missing {key!r}")
            if tuple(state[key].shape) != tuple(self.num_total.shape):
                raise ValueError(
                    f"PassRateEstimator state {key!r} has shape {tuple(state[key].shape)}, "
                    f"expected {tuple(self.num_total.shape)}"
                )
        self.num_total = state["num_total"].to(torch.float64).clone()
        self.num_positive = state["num_positive"].to(torch.float64).clone()
