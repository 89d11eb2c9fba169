"""Learning-rate schedule: linear warm-up, then constant, cosine or linear decay.

A small state object (its only state is the step counter) so that resume
restores the exact learning rate.
"""

from __future__ import annotations

import math

from pipeline.config import OptimConfig


def learning_rate_at(step: int, cfg: OptimConfig) -> float:
    """The learning rate of optimizer step ``step`` (0-based)."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.decay == "constant":
        return cfg.lr
    span = max(1, cfg.total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.lr * cfg.min_lr_ratio
    if cfg.decay == "cosine":
        return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return floor + (cfg.lr - floor) * (1.0 - progress)


class LearningRateSchedule:
    def __init__(self, cfg: OptimConfig) -> None:
        self.cfg = cfg
        self.step_count = 0

    def apply(self, optimizer) -> float:
        """Set the current rate on every parameter group; returns it."""
        rate = learning_rate_at(self.step_count, self.cfg)
        for group in optimizer.param_groups:
            group["lr"] = rate
        return rate

    def step(self) -> None:
        self.step_count += 1

    def state_dict(self) -> dict[str, int]:
        return {"step_count": self.step_count}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step_count = int(state["step_count"])
