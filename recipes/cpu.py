"""CPU presets on the demo's bootstrap policy (difficulty-3 arithmetic, 0.8M parameters)."""

from __future__ import annotations

import dataclasses

from pipeline.config import D3SConfig, PodsConfig, RLConfig
from recipes.papers import with_ada_seq
from recipes.staged import staged_pipeline

# Adam's first updates are ~lr·sign(g) per weight, so on this 0.8M-parameter policy, with
# 16 × 8 samples of mostly zero-variance groups per step, the noise in the sign dominates
# at RLConfig's generic lr. Measured with GRPO, seed 0, held-out d3 pass@1 (400 × 8
# samples) from 0.286: lr 3e-4 → 0.090 after 150 steps, 1e-4 → 0.268 after 100,
# 5e-5 → 0.299 after 100, 3e-5 → 0.299 after 60 and 0.312 after 150, 1e-5 → 0.301 after 150.
CPU_LEARNING_RATE = 3e-5


def grpo_cpu(*, steps: int = 100, group_size: int = 8) -> RLConfig:
    """Plain GRPO: the baseline every other preset is compared against."""
    cfg = RLConfig(steps=steps, group_size=group_size)
    cfg.optim.lr = CPU_LEARNING_RATE
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


def grpo_n4_cpu(*, steps: int = 100, group_size: int = 4) -> RLConfig:
    """GRPO with G = 4: the update cost Ada-Seq-BALANCE claims to keep."""
    return grpo_cpu(steps=steps, group_size=group_size)


def grpo_n16_cpu(*, steps: int = 100, group_size: int = 16) -> RLConfig:
    """GRPO with G = 16: the accuracy Ada-Seq-BALANCE claims to reach."""
    return grpo_cpu(steps=steps, group_size=group_size)


def d3s_i_cpu(*, steps: int = 100, group_size: int = 8) -> RLConfig:
    """D³S-I: samples selected within each group (Eq. 6) instead of across groups."""
    cfg = d3s_cpu(steps=steps, group_size=group_size)
    cfg.algorithm.sample_selector = "d3s_intra"
    return cfg


def cw_grpo_cpu(*, steps: int = 100, group_size: int = 8) -> RLConfig:
    """CW-GRPO: covariance token weights on plain GRPO."""
    cfg = grpo_cpu(steps=steps, group_size=group_size)
    cfg.algorithm.token_weights = ["cw_grpo"]
    return cfg


def pods_cpu(*, steps: int = 100, group_size: int = 8) -> RLConfig:
    """PODS: max-variance down-sampling to N = G/2 of G samples, N held fixed."""
    cfg = grpo_cpu(steps=steps, group_size=group_size)
    cfg.algorithm.sample_selector = "pods"
    cfg.algorithm.pods = PodsConfig(num_keep=group_size // 2)
    return cfg


def dapo_cpu(*, steps: int = 100, group_size: int = 8) -> RLConfig:
    """DAPO dynamic sampling: top up the batch with prompts whose groups have reward variance."""
    cfg = grpo_cpu(steps=steps, group_size=group_size)
    cfg.algorithm.sampling = "dynamic"
    return cfg


def ada_seq_balance_cpu(*, steps: int = 100, group_size: int = 4) -> RLConfig:
    """Reinforce-Ada-Seq-BALANCE as the paper preset runs it (``recipes.papers.with_ada_seq``): rounds
    of 8 until 2 correct and 2 incorrect (cap 32), the pool-normalised advantage (r − p̂)/√(p̂(1 − p̂)),
    balanced down-sampling to n = 4: GRPO-n16-level signal at n = 4 update cost (Reinforce-Ada Table 2)."""
    cfg = grpo_cpu(steps=steps, group_size=group_size)
    cfg.algorithm = with_ada_seq(cfg.algorithm, exit_rule="balance", update_size=group_size)
    return cfg


def ada_seq_pos_cpu(*, steps: int = 100, group_size: int = 4) -> RLConfig:
    """Reinforce-Ada-Seq-POS as the paper preset runs it: exit once a prompt has 1 correct answer."""
    cfg = grpo_cpu(steps=steps, group_size=group_size)
    cfg.algorithm = with_ada_seq(cfg.algorithm, exit_rule="pos", update_size=group_size)
    return cfg


def ada_est_cpu(*, steps: int = 100, group_size: int = 8) -> RLConfig:
    """Reinforce-Ada-Est: budgets ∝ 1/√p̂ from EMA/Beta pass rates in [2, 16], 1/√p̂ advantage weight."""
    cfg = grpo_cpu(steps=steps, group_size=group_size)
    cfg.algorithm.budget = "ada_est"
    cfg.algorithm.ada_est = dataclasses.replace(cfg.algorithm.ada_est, min_budget=2, max_budget=2 * group_size)
    cfg.algorithm.advantage = "global_baseline"
    cfg.algorithm.baseline_weight = "inv_sqrt_mean"
    return cfg


def depo_cpu(*, steps: int = 100, group_size: int = 8) -> RLConfig:
    """DEPO: an online-trained estimator drops likely zero-variance prompts after 10 warm-up steps."""
    cfg = grpo_cpu(steps=steps, group_size=group_size)
    cfg.algorithm.prompt_filter = "depo"
    return cfg


def e3_cpu(*, steps: int = 100, group_size: int = 8) -> RLConfig:
    """E3: rank-based rollout budgets (G_min/G_max widening by 2 per pass to [4, 16]) and the
    entropy-targeting temperature with annealing (E3 TS+AN)."""
    cfg = e3_temperature_cpu(steps=steps, group_size=group_size)
    cfg.algorithm.budget = "e3"
    cfg.algorithm.e3_budget = dataclasses.replace(cfg.algorithm.e3_budget, min_limit=group_size // 2,
                                                  max_limit=2 * group_size)
    return cfg


def methods_cpu(*, steps: int = 100, group_size: int = 4) -> RLConfig:
    """The staged pipeline on the demo policy (``recipes.staged.staged_pipeline``, the H100 campaigns'
    default): DEPO filter on Ada-Seq's pool + Ada-Seq-BALANCE at n = ``group_size`` + D³S across
    groups + CW-GRPO, E3's temperature off; a fresh estimator is the tiny encoder.

    The campaign trains it on the raw stream with the estimator pre-trained on the curation
    (``recipes.campaigns.cpu_campaign``).
    """
    return staged_pipeline(grpo_cpu(steps=steps), sample_selector="d3s_cross", estimator_encoder="tiny",
                           update_size=group_size)


def grpo_async_cpu(*, steps: int = 100, group_size: int = 8) -> RLConfig:
    """GRPO one step off policy: step t+1's batch is generated (engine in a process of its own) while
    step t updates, corrected by token-level TIS (docs/rl.md, One-step-off-policy rollouts).

    On 2 cores it measured 1.07–1.30× the synchronous loop's step time at the same thread share
    (``tools.bench.staleness``): the overlap hides generation, but the engine's CPU comes out of
    the update. It pays where generation and update run on different devices.
    """
    cfg = grpo_cpu(steps=steps, group_size=group_size)
    # Rebuilt, not mutated: RLConfig resolves the correction (rollout_correction=tis) when it is built.
    return dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, max_staleness=1))


def default_cpu(*, steps: int = 100, group_size: int = 8) -> RLConfig:
    """The CPU campaign's default, chosen by measurement: plain GRPO, trained on the uncurated stream.

    In the default race (``tools.bench.default_race``; docs/benchmarks.md, "The default race")
    nothing beat it on total campaign tokens at its held-out accuracy: curating first cost a
    quarter of a run and ended lower, and the online-filtered stacks (DEPO, E3 or Ada-Est budgets,
    D³S, CW-GRPO) spent the same rollouts plus their estimator's reading; in the demo
    (docs/benchmarks.md, "The CPU campaign") neither alternative measured differed from it beyond
    noise on any held-out metric, at 2.3–4.0× its campaign tokens, while it pays nothing before RL.
    The campaign skips curation for this variant (``recipes.campaigns.cpu_campaign``); not in
    ``RECIPES``, where it would race as a second ``grpo_cpu``.
    """
    return grpo_cpu(steps=steps, group_size=group_size)


RECIPES = {
    "grpo_cpu": grpo_cpu,
    "grpo_async_cpu": grpo_async_cpu,
    "grpo_n4_cpu": grpo_n4_cpu,
    "grpo_n16_cpu": grpo_n16_cpu,
    "d3s_cpu": d3s_cpu,
    "d3s_i_cpu": d3s_i_cpu,
    "d3s_cw_cpu": d3s_cw_cpu,
    "cw_grpo_cpu": cw_grpo_cpu,
    "pods_cpu": pods_cpu,
    "dapo_cpu": dapo_cpu,
    "ada_seq_pos_cpu": ada_seq_pos_cpu,
    "ada_seq_balance_cpu": ada_seq_balance_cpu,
    "ada_est_cpu": ada_est_cpu,
    "depo_cpu": depo_cpu,
    "e3_temperature_cpu": e3_temperature_cpu,
    "e3_cpu": e3_cpu,
    "methods_cpu": methods_cpu,
}
