"""CPU presets on the demo's bootstrap policy (difficulty-3 arithmetic, 0.8M parameters)."""

from __future__ import annotations

import dataclasses

from pipeline.config import AlgorithmConfig, D3SConfig, RLConfig


def grpo_cpu(*, steps: int = 100, group_size: int = 8) -> RLConfig:
    """Plain GRPO: the baseline every other preset is compared against."""
    cfg = RLConfig(steps=steps, group_size=group_size)
    cfg.optim.total_steps = steps
    return cfg


def d3s_cpu(*, steps: int = 100, group_size: int = 8) -> RLConfig:
    """D³S (cross-group samples + top-K tokens, dynamic schedule, Eq. 10 aggregation).

    Table 6's schedule scaled to the CPU group size: N_s from G/4 to G, K from 5% to 20%.
    """
    cfg = grpo_cpu(steps=steps, group_size=group_size)
    cfg.algorithm = dataclasses.replace(
        cfg.algorithm,
        sample_selector="d3s_cross",
        token_weights=["d3s_topk"],
        aggregation="d3s",
        d3s=D3SConfig(num_keep_init=max(2, group_size // 4), num_keep_final=group_size),
    )
    return cfg


def d3s_cw_cpu(*, steps: int = 100, group_size: int = 8) -> RLConfig:
    """D³S with CW-GRPO covariance weights on the kept tokens."""
    cfg = d3s_cpu(steps=steps, group_size=group_size)
    cfg.algorithm.token_weights = ["d3s_topk", "cw_grpo"]
    return cfg


def e3_temperature_cpu(*, steps: int = 100, group_size: int = 8) -> RLConfig:
    """GRPO with E3's entropy-targeting temperature (Eq. 4) and its annealing (Eq. 5)."""
    cfg = grpo_cpu(steps=steps, group_size=group_size)
    cfg.algorithm.temperature = "e3"
    return cfg


def default_cpu(*, steps: int = 100, group_size: int = 8) -> RLConfig:
    """The combined default: DEPO filter + Ada-Seq-BALANCE + D³S + CW-GRPO + E3 temperature.

    Ada-Seq draws rounds of 4 until a prompt has 2 correct and 2 incorrect answers (cap 4G),
    then balanced down-sampling keeps G per prompt; D³S then selects samples and tokens.
    """
    cfg = d3s_cw_cpu(steps=steps, group_size=group_size)
    cfg.algorithm.temperature = "e3"
    cfg.algorithm.prompt_filter = "depo"
    cfg.algorithm.sampling = "ada_seq"
    cfg.algorithm.advantage = "global_baseline"
    cfg.algorithm.ada_seq = dataclasses.replace(cfg.algorithm.ada_seq, max_samples=4 * group_size)
    return cfg


RECIPES = {
    "grpo_cpu": grpo_cpu,
    "d3s_cpu": d3s_cpu,
    "d3s_cw_cpu": d3s_cw_cpu,
    "e3_temperature_cpu": e3_temperature_cpu,
    "default_cpu": default_cpu,
}
