"""The papers' experimental setups as named RL presets.

Each recipe function reproduces one paper's setup (section and table cited in its
docstring) and derives its variants from that paper's baseline, changing only what the
paper changes. ``PAPER_PRESETS`` names every row of the papers' result and ablation
tables that winnow can express; ``docs/reproducing.md`` lists them with the hardware
and the results to expect.

Papers:

* D³S — "Learning More with Less: A Dynamic Dual-Level Down-Sampling Framework for Efficient
  Policy Optimization" (Tables 1–3, 5–7)
* Reinforce-Ada — "Reinforce-Ada: An Adaptive Sampling Framework under Non-linear RL
  Objectives" (§4.1, Tables 2–4)
* E3 — "Enhancing Efficiency and Exploration in Reinforcement Learning for LLMs" (§5.1–5.4,
  Tables 1–3)
* DEPO — "Difficulty-Estimated Policy Optimization" (§4.1, Tables 1–2)
* CW-GRPO — "Taming Extreme Tokens: Covariance-Aware GRPO with Gaussian-Kernel Advantage
  Reweighting" (§3.1, App. C Table 5)

What every preset leaves to the user:

* ``policy`` is None: set it to the Hugging Face folder of the paper's model
  (``policy=/models/Qwen2.5-Math-7B``); ``PaperModel.hf_id`` says which one. A None
  policy would fall back to the CPU demo's bootstrap model.
* ``data.train`` is MATH's train split (``math?split=train``), a source winnow ships;
  the papers' training sets (DeepScaleR, OpenR1-Math, DAPO-Math-17K, Open-RS) are
  files the user downloads and names in ``data.train``.
* ``rollout`` is the local engine; on a cluster ``rollout.engine=sglang``,
  ``rollout.servers=[...]`` and ``rollout.weights_dir`` point it at SGLang servers.
* Several updates per RL step (verl's PPO mini-batches) are not modelled: winnow makes
  one optimizer step per RL step, so ``prompts_per_step`` is the paper's rollout batch.

Write a preset as YAML for ``winnow rl --config``::

    python -m recipes d3s_qwen25_math_7b runs/papers/d3s.yaml
    python -m recipes --list
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pipeline import configlib
from pipeline.algorithms.d3s import D3S_VARIANTS
from pipeline.config import AlgorithmConfig, DataConfig, OptimConfig, RLConfig, TrainerConfig

# The D³S schedule of Table 6: N_s from 8 to 32 of G = 32 samples, K from 5% to 20% of tokens.
D3S_NUM_KEEP = (8, 32)
D3S_KEEP_RATIO = (0.05, 0.20)
# DAPO's clip-higher upper range (used by Reinforce-Ada, E3's and DEPO's DAPO baselines).
DAPO_EPS_HIGH = 0.28


@dataclass(frozen=True, slots=True)
class PaperModel:
    key: str  # the suffix of preset names
    hf_id: str  # the checkpoint the paper starts from; download it and pass its folder as `policy`
    # The smallest tensor-parallel size at which `winnow plan` fits the trainer on 8×H100 nodes
    # (bf16, no distributed optimizer or recompute: 18 bytes per parameter before activations).
    tensor_parallel: int = 1


QWEN25_MATH_7B = PaperModel("qwen25_math_7b", "Qwen/Qwen2.5-Math-7B", tensor_parallel=4)
QWEN25_MATH_1P5B = PaperModel("qwen25_math_1p5b", "Qwen/Qwen2.5-Math-1.5B")
LLAMA31_8B_INSTRUCT = PaperModel("llama31_8b_instruct", "meta-llama/Llama-3.1-8B-Instruct", tensor_parallel=4)
OPENMATH2_LLAMA31_8B = PaperModel("openmath2_llama31_8b", "nvidia/OpenMath2-Llama3.1-8B", tensor_parallel=4)
LLAMA32_3B_INSTRUCT = PaperModel("llama32_3b_instruct", "meta-llama/Llama-3.2-3B-Instruct", tensor_parallel=2)
QWEN3_4B_INSTRUCT = PaperModel("qwen3_4b_instruct", "Qwen/Qwen3-4B-Instruct-2507", tensor_parallel=2)
R1_DISTILL_QWEN_1P5B = PaperModel("r1_distill_qwen_1p5b", "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B")
R1_DISTILL_QWEN_7B = PaperModel("r1_distill_qwen_7b", "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", tensor_parallel=4)
QWEN25_1P5B_INSTRUCT = PaperModel("qwen25_1p5b_instruct", "Qwen/Qwen2.5-1.5B-Instruct")
QWEN25_7B_INSTRUCT = PaperModel("qwen25_7b_instruct", "Qwen/Qwen2.5-7B-Instruct", tensor_parallel=4)
QWEN25_MATH_7B_INSTRUCT = PaperModel("qwen25_math_7b_instruct", "Qwen/Qwen2.5-Math-7B-Instruct",
                                     tensor_parallel=4)


MODELS = {model.key: model for model in (
    QWEN25_MATH_7B, QWEN25_MATH_1P5B, LLAMA31_8B_INSTRUCT, OPENMATH2_LLAMA31_8B, LLAMA32_3B_INSTRUCT,
    QWEN3_4B_INSTRUCT, R1_DISTILL_QWEN_1P5B, R1_DISTILL_QWEN_7B, QWEN25_1P5B_INSTRUCT, QWEN25_7B_INSTRUCT,
    QWEN25_MATH_7B_INSTRUCT,
)}


def check_backbone(backbone: str, known: dict[str, object], *, paper: str) -> None:
    """Fail early, naming the choices, when a paper's recipe is asked for a model the paper does not use."""
    if backbone not in known:
        raise ValueError(f"backbone: {paper} uses {sorted(known)}, not {backbone!r}")


def hf_policy_run(
    *, policy: str | None, lr: float, steps: int, prompts_per_step: int, group_size: int, max_new_tokens: int,
    temperature: float, top_p: float, warmup_steps: int = 0,
) -> RLConfig:
    """What every paper preset shares: a Hugging Face policy trained in bf16 on math prompts.

    Not from a paper: bf16 weights with fp32 master copies (every paper trains in bf16 with
    verl or TRL), the tokenizer's chat template (base models without one fall back to the
    plain boxed-answer instruction), MATH's train split as a shipped stand-in for the
    papers' training files, and MATH-500 as the held-out set scored at start and end.
    """
    return RLConfig(
        policy=policy,
        data=DataConfig(train=["math?split=train"], template="chat"),
        eval_set="math500",
        prompts_per_step=prompts_per_step,
        group_size=group_size,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        steps=steps,
        optim=OptimConfig(lr=lr, total_steps=steps, warmup_steps=warmup_steps),
        trainer=TrainerConfig(precision="bf16"),
    )


def with_dapo(cfg: RLConfig) -> RLConfig:
    """DAPO as the papers run it as a baseline: dynamic sampling plus clip-higher (ε_high = 0.28).

    DAPO's token-level loss is winnow's ``token_mean`` (already the baselines' aggregation
    where they use DAPO); its overlong reward shaping has no winnow counterpart.
    """
    cfg.algorithm = dataclasses.replace(cfg.algorithm, sampling="dynamic", eps_high=DAPO_EPS_HIGH)
    return cfg


# ------------------------------------------------------------------------------------ D³S


@dataclass(frozen=True, slots=True)
class D3SBackbone:
    """One row of D³S Table 5 ("Generation configuration ... according to their official release")."""

    model: PaperModel
    temperature: float
    top_p: float
    lr: float
    epochs: int


D3S_BACKBONES = {
    backbone.model.key: backbone
    for backbone in (
        D3SBackbone(model=QWEN25_MATH_7B, temperature=1.0, top_p=0.9, lr=5e-7, epochs=1),
        D3SBackbone(model=QWEN25_MATH_1P5B, temperature=1.0, top_p=0.9, lr=5e-7, epochs=1),
        D3SBackbone(model=LLAMA31_8B_INSTRUCT, temperature=0.6, top_p=0.9, lr=1e-8, epochs=2),
        D3SBackbone(model=OPENMATH2_LLAMA31_8B, temperature=0.7, top_p=0.95, lr=2e-7, epochs=2),
    )
}
# D³S §4.1 trains on DeepScaleR (AIME 1984–2023, AMC before 2023, Omni-MATH, STILL): 40,315 problems.
DEEPSCALER_NUM_PROBLEMS = 40_315
# Not stated in D³S: 64 prompts × G = 32 samples is 2,048 rollouts per step.
D3S_PROMPTS_PER_STEP = 64


def d3s_baseline(*, backbone: str, loss: str = "grpo", policy: str | None = None) -> RLConfig:
    """D³S Table 1's GRPO (or GSPO, ``loss="gspo"``) rows: the baseline every D³S variant builds on.

    From the paper: G = 32 and ε = 0.2 (Table 6; no clip-higher, so ``eps_high`` = 0.2, for
    GSPO as for GRPO since Table 6 gives one ε); temperature, top-p, learning rate and
    epochs per backbone (Table 5); the GRPO/GSPO objectives average tokens within a response
    and responses within the group (Eq. 1 and 3: ``seq_mean_token_mean``).

    Not stated, chosen here: 64 prompts per step; steps = epochs × ⌈40,315 / 64⌉ over
    DeepScaleR (630 per epoch); 3,072 new tokens (Qwen2.5-Math has a 4,096-token context);
    constant learning rate without warm-up; β = 0 (Eq. 1 has a KL term but no β is given;
    ``algorithm.kl_coef`` adds one with a frozen reference copy). GSPO's own paper clips its
    sequence ratio at 3e-4/4e-4; override ``algorithm.eps_low``/``eps_high`` for that.
    """
    check_backbone(backbone, D3S_BACKBONES, paper="D³S")
    row = D3S_BACKBONES[backbone]
    steps = row.epochs * math.ceil(DEEPSCALER_NUM_PROBLEMS / D3S_PROMPTS_PER_STEP)
    cfg = hf_policy_run(policy=policy, lr=row.lr, steps=steps, prompts_per_step=D3S_PROMPTS_PER_STEP,
                        group_size=32, max_new_tokens=3072, temperature=row.temperature, top_p=row.top_p)
    cfg.algorithm = dataclasses.replace(cfg.algorithm, loss=loss, eps_low=0.2, eps_high=0.2,
                                        aggregation="seq_mean_token_mean")
    return cfg


def d3s_down_sampling(
    *, backbone: str, variant: str = "d3s", loss: str = "grpo", num_keep: tuple[int, int] = D3S_NUM_KEEP,
    keep_ratio: tuple[float, float] = D3S_KEEP_RATIO, policy: str | None = None,
) -> RLConfig:
    """D³S and its ablation variants on top of ``d3s_baseline``.

    ``variant`` is a key of ``pipeline.algorithms.d3s.D3S_VARIANTS`` (§4.1, App. D.1):
    ``d1s`` (Eq. 6 per group), ``d1s_c`` (Eq. 7 across groups), ``d2s`` (Eq. 7 + Eq. 8
    top-K tokens), ``d3s`` (plus the Eq. 9 linear schedule), ``d3s_i`` (D³S with Eq. 6
    instead of Eq. 7). Table 6: N_s 8 → 32, K 5% → 20%; Table 3 varies ``num_keep`` and
    ``keep_ratio``. Variants without the schedule hold (N_init, K_init) for the whole run.
    The loss is Eq. 10's ``1/|Ŝ| Σ 1/|𝒯|`` (``aggregation="d3s"``).

    Changes from the baseline: ``algorithm.sample_selector``, ``algorithm.token_weights``
    (D²S, D³S, D³S-I), ``algorithm.aggregation`` and ``algorithm.d3s.*``.
    """
    shape = D3S_VARIANTS[variant]
    cfg = d3s_baseline(backbone=backbone, loss=loss, policy=policy)
    cfg.algorithm = dataclasses.replace(
        cfg.algorithm,
        sample_selector=shape.sample_selector,
        token_weights=[shape.token_weighting] if shape.token_weighting else [],
        aggregation="d3s",
        d3s=dataclasses.replace(cfg.algorithm.d3s, num_keep_init=num_keep[0], num_keep_final=num_keep[1],
                                keep_ratio_init=keep_ratio[0], keep_ratio_final=keep_ratio[1],
                                dynamic=shape.dynamic_schedule),
    )
    return cfg


def d3s_pods(*, backbone: str, loss: str = "grpo", policy: str | None = None) -> RLConfig:
    """D³S Table 1's "+PODS" rows: max-reward-variance down-sampling per group (App. D.2).

    D³S does not state PODS's subset size; we keep 8 of the 32 samples, D³S's N_init, so
    PODS and D³S start from the same number of samples per prompt, held fixed for the run
    (``algorithm.pods.num_keep``, whose default is that size).
    Changes from the baseline: ``algorithm.sample_selector``.
    """
    cfg = d3s_baseline(backbone=backbone, loss=loss, policy=policy)
    cfg.algorithm = dataclasses.replace(
        cfg.algorithm, sample_selector="pods", pods=dataclasses.replace(cfg.algorithm.pods, num_keep=D3S_NUM_KEEP[0]),
    )
    return cfg


# --------------------------------------------------------------------------- Reinforce-Ada


ADA_MODELS = {model.key: model for model in (QWEN25_MATH_1P5B, QWEN25_MATH_7B, LLAMA32_3B_INSTRUCT,
                                               QWEN3_4B_INSTRUCT)}


def ada_baseline(*, backbone: str, group_size: int = 4, policy: str | None = None) -> RLConfig:
    """Reinforce-Ada §4.1 "RL Training Details" and Table 2's GRPO-n{4,8,16} rows.

    From the paper: 512 prompts per step, AdamW at a fixed 1e-6 with a 10-step warm-up,
    entropy bonus 1e-4, no KL, clip-higher [0.2, 0.28], 600 steps, temperature 1.0, update
    group n = 4 (GRPO baselines also at 8 and 16).

    From the authors' released script (github.com/WeiXiongUST/Reinforce-Ada,
    scripts/run_reinforce_ada.sh), where the paper is silent: 2,048 new tokens (the paper's
    4,096 is its evaluation limit), top-p 1.0, ``token-mean`` loss aggregation (winnow's
    ``token_mean``). That script runs 4 PPO mini-batches of 128 prompts per step; winnow
    makes one update on all 512.
    """
    check_backbone(backbone, ADA_MODELS, paper="Reinforce-Ada")
    cfg = hf_policy_run(policy=policy, lr=1e-6, steps=600, prompts_per_step=512, group_size=group_size,
                        max_new_tokens=2048, temperature=1.0, top_p=1.0, warmup_steps=10)
    cfg.algorithm = dataclasses.replace(cfg.algorithm, eps_low=0.2, eps_high=0.28, entropy_coef=1e-4,
                                        aggregation="token_mean")
    return cfg


def ada_dapo(*, backbone: str, policy: str | None = None) -> RLConfig:
    """Reinforce-Ada Table 2's DAPO row: GRPO-n4 plus dynamic sampling (§3.3).

    Changes from ``ada_baseline``: ``algorithm.sampling`` (clip-higher is already the
    baseline's).
    """
    return with_dapo(ada_baseline(backbone=backbone, policy=policy))


# Reinforce-Ada's update group (§4.1: "we standardize the update group size ... to n = 4").
ADA_SEQ_UPDATE_SIZE = 4


def with_ada_seq(algorithm: AlgorithmConfig, *, exit_rule: Literal["pos", "balance"],
                 update_size: int) -> AlgorithmConfig:
    """``algorithm`` sampling with Reinforce-Ada-Seq (Algorithm 2) as the authors run it, for an update group of n.

    From the paper: N_max = 32 samples per prompt at n = 4 (§4.1), down-sampled to n for the
    update, with the baseline over the whole pool (Algorithm 2 lines 17–19). From the authors'
    released code (verl/trainer/config/ppo_trainer.yaml, ray_trainer.py and
    scripts/run_reinforce_ada.sh of github.com/WeiXiongUST/Reinforce-Ada), at n = 4: rounds of
    8 samples (round_repeat 8, max_rounds 4: N_max = 32); POS exits at 1 correct sample,
    BALANCE at n/2 = 2 correct and 2 incorrect; the advantage is GRPO's with the pool's mean
    and std (``global_stat_est=True``), ``(r − p̂)/√(p̂(1 − p̂))`` for binary rewards
    (``baseline_weight="bernoulli_std"``; §3.2's 1/p̂ weight is ``"inv_mean"``, Algorithm 2
    line 19's unweighted r − p̂ is ``"none"``). For another n the counts keep their proportion
    to n (rounds of 2n, N_max = 8n, BALANCE at n/2 of each; §3.2's own example, N_max = 128
    and K = 8 at n = 16, keeps the last two). Sets ``sampling``, ``advantage``,
    ``baseline_weight`` and ``ada_seq.*``; the caller's ``group_size`` must be ``update_size``.
    """
    if update_size < 2:
        raise ValueError(f"update_size: Reinforce-Ada-Seq down-samples to n ≥ 2 (one of each outcome), "
                         f"got {update_size}")
    k_pos, k_neg = (1, 0) if exit_rule == "pos" else (update_size // 2, update_size // 2)
    return dataclasses.replace(
        algorithm, sampling="ada_seq", advantage="global_baseline", baseline_weight="bernoulli_std",
        ada_seq=dataclasses.replace(algorithm.ada_seq, exit_rule=exit_rule, k_pos=k_pos, k_neg=k_neg,
                                    round_size=2 * update_size, max_samples=8 * update_size),
    )


def ada_seq(*, backbone: str, exit_rule: Literal["pos", "balance"] = "balance", policy: str | None = None) -> RLConfig:
    """Reinforce-Ada-Seq (Algorithm 2) with the POS or BALANCE exit rule, n = 4 (§4.1), as
    ``with_ada_seq`` describes: rounds of 8 up to 32 samples, POS at 1 correct, BALANCE at 2 and
    2, the pool-normalised advantage of the authors' code.

    Changes from ``ada_baseline``: ``algorithm.sampling``, ``algorithm.advantage``,
    ``algorithm.baseline_weight`` and ``algorithm.ada_seq.*``.
    """
    cfg = ada_baseline(backbone=backbone, group_size=ADA_SEQ_UPDATE_SIZE, policy=policy)
    cfg.algorithm = with_ada_seq(cfg.algorithm, exit_rule=exit_rule, update_size=cfg.group_size)
    return cfg


def ada_est(*, backbone: str, policy: str | None = None) -> RLConfig:
    """Reinforce-Ada-Est (Algorithm 1) with Ada-EMA pass rates: N_x ∝ 1/√(p̂_x + ε).

    From the paper: the budget averages 8 samples per prompt (§4.1, "hyper-parameter 8",
    so ``group_size`` = 8, the batch total), the update uses every sample, and the hybrid
    strategy leaves the other 1/√p̂ in the advantage, A = (r − r̄_x)/√(r̄_x + ε)
    (§3.1, Algorithm 1 lines 14–16: ``baseline_weight="inv_sqrt_mean"``).
    Not stated, kept at winnow's defaults: N ∈ [2, 32] (32 = Ada-Seq's N_max), λ = 0.9 and
    a Beta(1, 1) prior. Changes from ``ada_baseline``: ``group_size``, ``algorithm.budget``,
    ``algorithm.advantage`` and ``algorithm.baseline_weight``.
    """
    cfg = ada_baseline(backbone=backbone, group_size=8, policy=policy)
    cfg.algorithm = dataclasses.replace(cfg.algorithm, budget="ada_est", advantage="global_baseline",
                                        baseline_weight="inv_sqrt_mean")
    return cfg


def ada_seq_balance_d3s_cw(*, backbone: str = QWEN25_MATH_7B.key, policy: str | None = None) -> RLConfig:
    """Ada-Seq-BALANCE + D³S + CW-GRPO on Reinforce-Ada's setup: no paper runs this combination.

    Reinforce-Ada's setup (``ada_seq``, n = 4) with D³S cross-group samples and top-K tokens
    on the down-sampled groups and CW-GRPO weights on the kept tokens. D³S's Table 6
    schedule is scaled to n = 4 as the CPU preset does: N_s from max(2, n/4) = 2 to n,
    K from 5% to 20%. Changes from ``ada_seq``: ``algorithm.sample_selector``,
    ``algorithm.token_weights``, ``algorithm.aggregation`` and ``algorithm.d3s.*``.
    """
    cfg = ada_seq(backbone=backbone, exit_rule="balance", policy=policy)
    cfg.algorithm = dataclasses.replace(
        cfg.algorithm, sample_selector="d3s_cross", token_weights=["d3s_topk", "cw_grpo"], aggregation="d3s",
        d3s=dataclasses.replace(cfg.algorithm.d3s, num_keep_init=max(2, cfg.group_size // 4),
                                num_keep_final=cfg.group_size),
    )
    return cfg


# ------------------------------------------------------------------------------------- E3


E3_LEARNING_RATES = {R1_DISTILL_QWEN_1P5B.key: 5e-6, R1_DISTILL_QWEN_7B.key: 2e-6}  # §5.1


def e3_baseline(*, backbone: str, policy: str | None = None) -> RLConfig:
    """E3 §5.1 "Training Details" and Table 1's GRPO row.

    From the paper: 64 prompts × G = 8, temperature 1, 6k-token responses (6,144), 3 epochs
    over the 10k set = 480 steps, one update per sampling, learning rate 5e-6 (1.5B) or
    2e-6 (7B). Not stated, chosen here: top-p 1.0, ε = 0.2 on both sides (plain GRPO), no
    KL, ``token_mean`` aggregation (verl's default; the code is adapted from verl), constant
    learning rate.
    """
    check_backbone(backbone, E3_LEARNING_RATES, paper="E3")
    cfg = hf_policy_run(policy=policy, lr=E3_LEARNING_RATES[backbone], steps=480, prompts_per_step=64,
                        group_size=8, max_new_tokens=6144, temperature=1.0, top_p=1.0)
    cfg.algorithm = dataclasses.replace(cfg.algorithm, eps_low=0.2, eps_high=0.2, aggregation="token_mean")
    return cfg


def e3_entropy_regularized(*, backbone: str, policy: str | None = None) -> RLConfig:
    """E3 Table 2's GRPO+ER row: the entropy bonus λ = 1e-4 (§5.3, Eq. 3).

    Changes from ``e3_baseline``: ``algorithm.entropy_coef``.
    """
    cfg = e3_baseline(backbone=backbone, policy=policy)
    cfg.algorithm.entropy_coef = 1e-4
    return cfg


def e3_method(*, backbone: str, dynamic_budget: bool, temperature: bool, anneal: bool,
              policy: str | None = None) -> RLConfig:
    """E3's components on ``e3_baseline``: DR (Algorithm 1), TS (Eq. 4), AN (Eq. 5).

    DR (§4.1, §5.2 "Implementation Details"): budgets from difficulty ranks, G_min/G_max
    start at G = 8 and move by 2 after each epoch, so the third epoch allocates within
    [4, 12]; the limits (4, 16) = (G/2, 2G) never bind in 3 epochs. TS: τ adapts so the
    entropy stays at the first batch's level, starting from τ = 1 within winnow's default
    clamp [0.1, 2.0] (the paper gives none). AN: the target entropy anneals by cosine from
    step ⌊0.6·t_max⌋ to η = 0.9 of the initial level. Table 1's "Ours" is DR+TS+AN,
    Table 2 has TS and TS+AN, Table 3's "w/o DS" is TS+AN.

    Changes from the baseline: ``algorithm.budget`` (DR), ``algorithm.temperature`` and
    ``algorithm.e3.*`` (TS, AN).
    """
    if anneal and not temperature:
        raise ValueError("anneal: the annealing (Eq. 5) moves the temperature scheduler's target; "
                         "it needs temperature=True")
    cfg = e3_baseline(backbone=backbone, policy=policy)
    algorithm = cfg.algorithm
    if dynamic_budget:
        algorithm.budget = "e3"
        algorithm.e3_budget = dataclasses.replace(algorithm.e3_budget, min_limit=4, max_limit=16, widen_step=2)
    if temperature:
        algorithm.temperature = "e3"
        algorithm.e3 = dataclasses.replace(algorithm.e3, anneal_start_fraction=0.6 if anneal else None, eta=0.9)
    return cfg


def e3_dapo(*, backbone: str, policy: str | None = None) -> RLConfig:
    """E3 Table 1's DAPO row: GRPO with DAPO's dynamic sampling and clip-higher (§5.2 "Baselines").

    Changes from ``e3_baseline``: ``algorithm.sampling`` and ``algorithm.eps_high``.
    """
    return with_dapo(e3_baseline(backbone=backbone, policy=policy))


# ----------------------------------------------------------------------------------- DEPO


DEPO_MODELS = {model.key: model for model in (QWEN25_1P5B_INSTRUCT, QWEN25_7B_INSTRUCT)}


def depo_baseline(*, backbone: str, policy: str | None = None) -> RLConfig:
    """DEPO §4.1 "Training & Evaluation Details" and Table 1's GRPO row.

    From the paper: 1,000 steps, 128 prompts per step, learning rate 1e-6, 8 rollouts per
    prompt. Not stated, chosen here: temperature 1.0 and top-p 1.0 in training (the paper's
    T = 1, top-p 0.95 are for evaluation), 4,096 new tokens, ε = 0.2 on both sides (plain
    GRPO), no KL, ``token_mean`` aggregation (verl's default).
    """
    check_backbone(backbone, DEPO_MODELS, paper="DEPO")
    cfg = hf_policy_run(policy=policy, lr=1e-6, steps=1000, prompts_per_step=128, group_size=8,
                        max_new_tokens=4096, temperature=1.0, top_p=1.0)
    cfg.algorithm = dataclasses.replace(cfg.algorithm, eps_low=0.2, eps_high=0.2, aggregation="token_mean")
    return cfg


def depo_dapo_baseline(*, backbone: str, policy: str | None = None) -> RLConfig:
    """DEPO Table 1's DAPO row (Table 2 times its rollouts at ~2× GRPO's).

    Changes from ``depo_baseline``: ``algorithm.sampling`` and ``algorithm.eps_high``.
    """
    return with_dapo(depo_baseline(backbone=backbone, policy=policy))


def depo(*, backbone: str, w_rank: float = 3.0, w_distill: float = 0.5, clip_higher: bool = False,
         policy: str | None = None) -> RLConfig:
    """DEPO (§3): the online difficulty estimator drops likely zero-variance prompts before rollout.

    From the paper: the estimator trains alone for the first 100 steps (§3.2, §4.1), then
    filters; w_distill = 0.5, w_rank = 3 (§4.1); a pre-trained BERT-family encoder (§3.1.1:
    winnow's ``minilm``). Table 1's ablations: "– ranking loss" (``w_rank=0``), "– distill
    loss" (``w_distill=0``), "+ DAPO w/o Dynamic Sampling" (``clip_higher=True``).
    Not stated, kept at winnow's defaults: the drop threshold P(all G rewards equal) > 0.9,
    2 candidates per kept prompt (the paper's filter ratio settles near 50%, Fig. 6), the
    estimator's AdamW at 1e-4 and margin 0.1.

    Changes from ``depo_baseline``: ``algorithm.prompt_filter``, ``algorithm.depo.*`` and,
    with ``clip_higher``, ``algorithm.eps_high``.
    """
    cfg = depo_baseline(backbone=backbone, policy=policy)
    cfg.algorithm = dataclasses.replace(
        cfg.algorithm, prompt_filter="depo",
        depo=dataclasses.replace(cfg.algorithm.depo, encoder="minilm", warmup_steps=100, w_rank=w_rank,
                                 w_distill=w_distill),
    )
    if clip_higher:
        cfg.algorithm.eps_high = DAPO_EPS_HIGH
    return cfg


# -------------------------------------------------------------------------------- CW-GRPO


CW_MODELS = {model.key: model for model in (R1_DISTILL_QWEN_1P5B, QWEN25_MATH_7B_INSTRUCT)}


def cw_baseline(*, backbone: str, policy: str | None = None) -> RLConfig:
    """CW-GRPO §3.1 and App. C Table 5, GRPO row of Table 2.

    From the paper: learning rate 1e-6 with 10% warm-up (10 of 100 steps), 100 steps,
    12 generations per prompt, temperature 0.7, the GRPO objective
    of §2.3 (``seq_mean_token_mean``). Table 5's batch of 12 with 4 accumulation steps is
    TRL's count of completions per device: 12 × 4 × 4 GPUs / 12 generations = 16 prompts
    per step. Not stated, chosen here: top-p 1.0, ε = 0.2 on both sides, no KL. The paper's
    <think>/<answer> system prompt and format reward have no winnow counterpart (the chat
    template asks for a boxed answer). Changed from the paper: its 4,096-token completions
    become 3,072 on Qwen2.5-Math-7B-Instruct, whose context is 4,096 positions (prompt
    included); R1-Distill-Qwen-1.5B keeps 4,096.
    """
    check_backbone(backbone, CW_MODELS, paper="CW-GRPO")
    cfg = hf_policy_run(policy=policy, lr=1e-6, steps=100, prompts_per_step=16, group_size=12,
                        max_new_tokens=3072 if backbone == QWEN25_MATH_7B_INSTRUCT.key else 4096, temperature=0.7, top_p=1.0, warmup_steps=10)
    cfg.algorithm = dataclasses.replace(cfg.algorithm, eps_low=0.2, eps_high=0.2, aggregation="seq_mean_token_mean")
    return cfg


def cw_grpo(*, backbone: str, policy: str | None = None) -> RLConfig:
    """CW-GRPO (§2.3): Gaussian-kernel weights on the token covariance, normalized per group.

    Hyper-parameter free; the covariance means and the weight normalizer run over one
    prompt's G responses (``cw_grpo_scope="group"``). Changes from ``cw_baseline``:
    ``algorithm.token_weights``.
    """
    cfg = cw_baseline(backbone=backbone, policy=policy)
    cfg.algorithm.token_weights = ["cw_grpo"]
    return cfg


# ------------------------------------------------------------------------------ registry


@dataclass(frozen=True, slots=True)
class PaperPreset:
    """A named paper setup: a recipe, its arguments, and where its numbers come from."""

    name: str
    source: str
    recipe: Callable[..., RLConfig]
    options: dict[str, object] = field(default_factory=dict)

    @property
    def model(self) -> PaperModel:
        """The checkpoint to download and pass as ``policy``."""
        return MODELS[str(self.options["backbone"])]

    def __call__(self, *, policy: str | None = None) -> RLConfig:
        cfg = self.recipe(policy=policy, **self.options)
        cfg.parallel = dataclasses.replace(cfg.parallel, tensor_parallel=self.model.tensor_parallel)
        # Each preset writes to its own run directory, so a sweep over presets never resumes
        # one run from another's checkpoints.
        cfg.logging.output_dir = f"runs/papers/{self.name}"
        cfg.checkpoint.directory = f"runs/papers/{self.name}/checkpoints"
        configlib.validate(cfg)  # the recipes mutate sections after construction
        return cfg


PAPER_PRESETS: dict[str, PaperPreset] = {}


def _add(name: str, source: str, recipe: Callable[..., RLConfig], **options: object) -> None:
    assert name not in PAPER_PRESETS, f"preset {name} is defined twice"
    PAPER_PRESETS[name] = PaperPreset(name=name, source=source, recipe=recipe, options=options)


def _percent(ratio: float) -> str:
    return f"{round(ratio * 100)}"


def _register_presets() -> None:
    """Every table row the recipes can express, named ``<method>_<model>``."""
    # D³S: Table 1 (three backbones × GRPO/GSPO × ±PODS/D³S), Table 2 (ablations on Qwen2.5-Math-7B),
    # Table 7 (ablations on the two Llama backbones, with D³S-I), Table 3 (the N/K schedule grid).
    for key, losses in ((QWEN25_MATH_7B.key, ("grpo", "gspo")), (QWEN25_MATH_1P5B.key, ("grpo", "gspo")),
                        (LLAMA31_8B_INSTRUCT.key, ("grpo",))):
        for loss in losses:
            prefix = "" if loss == "grpo" else f"{loss}_"
            _add(f"{loss}_n32_{key}", f"D³S Table 1, {loss.upper()}", d3s_baseline, backbone=key, loss=loss)
            _add(f"{prefix}pods_{key}", f"D³S Table 1, {loss.upper()}+PODS", d3s_pods, backbone=key, loss=loss)
            _add(f"{prefix}d3s_{key}", f"D³S Table 1, {loss.upper()}+D³S", d3s_down_sampling, backbone=key,
                 loss=loss)
    _add(f"grpo_n32_{OPENMATH2_LLAMA31_8B.key}", "D³S Table 7, GRPO", d3s_baseline, backbone=OPENMATH2_LLAMA31_8B.key)
    _add(f"d3s_{OPENMATH2_LLAMA31_8B.key}", "D³S Table 7, D³S", d3s_down_sampling, backbone=OPENMATH2_LLAMA31_8B.key)
    for key, table in ((QWEN25_MATH_7B.key, "Table 2"), (LLAMA31_8B_INSTRUCT.key, "Table 7"),
                       (OPENMATH2_LLAMA31_8B.key, "Table 7")):
        for variant, label in (("d1s", "D¹S"), ("d1s_c", "D¹S-C"), ("d2s", "D²S")):
            _add(f"{variant}_{key}", f"D³S {table}, {label}", d3s_down_sampling, backbone=key, variant=variant)
        if table == "Table 7":
            _add(f"d3s_i_{key}", "D³S Table 7, D³S-I", d3s_down_sampling, backbone=key, variant="d3s_i")
    table3_rows = [((8, 16), D3S_KEEP_RATIO), ((16, 32), D3S_KEEP_RATIO)] + [
        (D3S_NUM_KEEP, keep_ratio)
        for keep_ratio in ((0.05, 0.30), (0.05, 0.40), (0.05, 0.50), (0.10, 0.20), (0.10, 0.30), (0.10, 0.40),
                           (0.10, 0.50))
    ]
    for num_keep, keep_ratio in table3_rows:
        _add(f"d3s_n{num_keep[0]}to{num_keep[1]}_k{_percent(keep_ratio[0])}to{_percent(keep_ratio[1])}"
             f"_{QWEN25_MATH_7B.key}",
             f"D³S Table 3, N = {num_keep[0]} → {num_keep[1]}, K = {_percent(keep_ratio[0])}% → "
             f"{_percent(keep_ratio[1])}%",
             d3s_down_sampling, backbone=QWEN25_MATH_7B.key, num_keep=num_keep, keep_ratio=keep_ratio)

    # Reinforce-Ada: Table 2 (Qwen2.5-Math-1.5B has the full set of baselines), Tables 3–4.
    for key in ADA_MODELS:
        _add(f"grpo_n4_{key}", "Reinforce-Ada Table 2, GRPO(-n4)", ada_baseline, backbone=key)
        _add(f"ada_seq_pos_{key}", "Reinforce-Ada Table 2, Reinforce-Ada-Seq-POS", ada_seq, backbone=key,
             exit_rule="pos")
        _add(f"ada_seq_balance_{key}", "Reinforce-Ada Table 2, Reinforce-Ada-Seq-BALANCE", ada_seq, backbone=key,
             exit_rule="balance")
        _add(f"ada_est_{key}", "Reinforce-Ada Table 2, Reinforce-Ada-Est", ada_est, backbone=key)
    for group_size in (8, 16):
        _add(f"grpo_n{group_size}_{QWEN25_MATH_1P5B.key}", f"Reinforce-Ada Table 2, GRPO-n{group_size}",
             ada_baseline, backbone=QWEN25_MATH_1P5B.key, group_size=group_size)
    _add(f"dapo_n4_{QWEN25_MATH_1P5B.key}", "Reinforce-Ada Table 2, DAPO", ada_dapo, backbone=QWEN25_MATH_1P5B.key)
    _add(f"ada_seq_balance_d3s_cw_{QWEN25_MATH_7B.key}", "not a paper row: Ada-Seq-BALANCE + D³S + CW-GRPO on Reinforce-Ada's setup",
         ada_seq_balance_d3s_cw, backbone=QWEN25_MATH_7B.key)

    # E3: Table 1 (GRPO, DAPO, Ours on both sizes), Table 2 (ER, TS, TS+AN), Table 3 (w/o DS).
    for key in E3_LEARNING_RATES:
        _add(f"grpo_n8_{key}", "E3 Table 1, GRPO", e3_baseline, backbone=key)
        _add(f"dapo_n8_{key}", "E3 Table 1, DAPO", e3_dapo, backbone=key)
        _add(f"e3_er_{key}", "E3 Table 2, GRPO+ER", e3_entropy_regularized, backbone=key)
        _add(f"e3_dr_{key}", "E3 §4.1, DR alone (a component, not a table row)", e3_method, backbone=key,
             dynamic_budget=True, temperature=False, anneal=False)
        _add(f"e3_ts_{key}", "E3 Table 2, GRPO+TS", e3_method, backbone=key, dynamic_budget=False,
             temperature=True, anneal=False)
        _add(f"e3_ts_an_{key}", "E3 Table 2, GRPO+TS+AN; Table 3, w/o DS", e3_method, backbone=key,
             dynamic_budget=False, temperature=True, anneal=True)
        _add(f"e3_{key}", "E3 Table 1, Ours (DR+TS+AN)", e3_method, backbone=key, dynamic_budget=True,
             temperature=True, anneal=True)

    # DEPO: Table 1 (DAPO-Math-17K rows; the OR1/NT rows differ only in data.train).
    for key in DEPO_MODELS:
        _add(f"grpo_n8_{key}", "DEPO Table 1, GRPO", depo_baseline, backbone=key)
        _add(f"depo_{key}", "DEPO Table 1, DEPO", depo, backbone=key)
    _add(f"dapo_n8_{QWEN25_1P5B_INSTRUCT.key}", "DEPO Table 1, DAPO", depo_dapo_baseline,
         backbone=QWEN25_1P5B_INSTRUCT.key)
    _add(f"depo_no_rank_{QWEN25_1P5B_INSTRUCT.key}", "DEPO Table 1, – ranking loss", depo,
         backbone=QWEN25_1P5B_INSTRUCT.key, w_rank=0.0)
    _add(f"depo_no_distill_{QWEN25_1P5B_INSTRUCT.key}", "DEPO Table 1, – distill loss", depo,
         backbone=QWEN25_1P5B_INSTRUCT.key, w_distill=0.0)
    _add(f"depo_clip_higher_{QWEN25_1P5B_INSTRUCT.key}", "DEPO Table 1, + DAPO w/o Dynamic Sampling", depo,
         backbone=QWEN25_1P5B_INSTRUCT.key, clip_higher=True)

    # CW-GRPO: Table 2 (GRPO and "GRPO + Gaussian Reweight" on both models).
    for key in CW_MODELS:
        _add(f"grpo_n12_{key}", "CW-GRPO Table 2, GRPO", cw_baseline, backbone=key)
        _add(f"cw_grpo_{key}", "CW-GRPO Table 2, GRPO + Gaussian Reweight", cw_grpo, backbone=key)


_register_presets()


def build(name: str, *, policy: str | None = None) -> RLConfig:
    """The preset ``name`` as a validated config; unknown names list the known ones."""
    try:
        preset = PAPER_PRESETS[name]
    except KeyError:
        raise configlib.ConfigError(f"unknown paper preset {name!r}; known presets: {', '.join(sorted(PAPER_PRESETS))}"
                                    ) from None
    return preset(policy=policy)


def write_yaml(name: str, path: str | Path, *, policy: str | None = None) -> Path:
    """Write preset ``name`` as a YAML file that ``winnow rl --config`` loads (atomically)."""
    path = Path(path)
    return configlib.save_resolved(build(name, policy=policy), path.parent, path.name)
