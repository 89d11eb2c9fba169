"""Campaign recipes: whole campaigns (bootstrap or HF policy → curate → estimator, when a variant
filters with DEPO → rl variants → evaluate and export each), with their resources, built from the
stage presets.

``cpu_campaign`` runs anywhere (``tiny=True`` in a few minutes, for CI); the H100 presets
start from a Hugging Face model folder, train on ``nodes`` 8-GPU trainer nodes with SGLang
servers on rollout nodes of the same job, and compare the staged pipeline
(``recipes.staged.staged_pipeline``), or the RL config given as ``rl=``, with a plain GRPO
baseline matched to it on everything but the method (``pipeline.config.plain_grpo``).
Curation, RL and evaluation generate with one budget of new tokens, the model's. The
trainer and the servers take the base model in different formats: a
``convert`` stage turns the folder into a winnow checkpoint once (logit gate on), the rl
stages train from that, and their servers load the folder itself (``rollout.model_path``). Every path between stages comes from ``output_dir``
(:func:`pipeline.launch.campaign.wire_campaign`).

Which prompts a variant trains on: DEPO's filter is the alternative to curation as a filter,
so a variant that filters with DEPO trains on the curation's sources as they are (the raw
stream), with the estimator trained on the curation; the ledger charges it the curation and
the estimator through that dependency (``pipeline.launch.ledger``). A variant without DEPO
trains on the curated prompts, except the CPU campaign's ``default``, which trains on the raw
stream and pays nothing before RL. An H100 baseline trains on its method's prompts.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Literal

from pipeline.config import (
    AlgorithmConfig,
    CheckpointConfig,
    ConvertConfig,
    DataConfig,
    DemoConfig,
    LoggingConfig,
    OptimConfig,
    ParallelConfig,
    Resources,
    RewardConfig,
    RLConfig,
    RolloutServers,
    TrainerConfig,
    plain_grpo,
)
from pipeline.launch.campaign import (
    ESTIMATOR_STAGE,
    CampaignPlan,
    Stage,
    reads_estimator,
    wire_campaign,
)
from pipeline.launch.demo import VARIANTS as DEMO_VARIANTS
from recipes.cpu import default_cpu, grpo_cpu, methods_cpu
from recipes.staged import staged_pipeline
from recipes.stages import (
    bootstrap_cpu,
    curate_cpu,
    curate_h100,
    estimator_cpu,
    estimator_h100,
    evaluate_cpu,
    evaluate_h100,
)

# ================================================================ CPU


def _tiny_rl(cfg: RLConfig) -> RLConfig:
    """A CPU preset shrunk to seconds per step: 4 prompts × 4 samples, 16 new tokens, small held-out set."""
    return dataclasses.replace(
        cfg, prompts_per_step=4, max_new_tokens=16, eval_set="arith?difficulty=3&size=40", eval_samples=1,
        reward=RewardConfig(num_workers=1), logging=dataclasses.replace(cfg.logging, progress=False, trackers=[]),
    )


# The CPU variants trained on the curation's sources as they are: the default (plain GRPO), which
# neither waits for nor pays for the curation, and the methods stack, whose DEPO filter replaces
# curation as a filter and whose estimator is trained on (and pays for) the curation.
UNCURATED_VARIANTS = ("default", "methods")


def cpu_campaign(*, output_dir: str | Path = "runs/campaigns/cpu", tiny: bool = False,
                 steps: int | None = None) -> CampaignPlan:
    """The CPU campaign: the demo's bootstrap policy and three RL variants with the same budget of steps.

    - ``default``: the default chosen by the default race (``default_cpu``: plain GRPO) on the
      uncurated stream, the curation's own sources;
    - ``grpo``: plain GRPO on the curated prompts (the campaign's layout before the race);
    - ``methods``: the staged pipeline (``methods_cpu``: DEPO + Ada-Seq-BALANCE + D³S + CW-GRPO,
      at Reinforce-Ada's n = 4) on the uncurated stream, its DEPO estimator trained on the curation.

    ``tiny``: every stage at toy size (a 40-step bootstrap cached under ``output_dir``,
    48 curated prompts, 2 RL steps per variant); the whole campaign takes minutes on 2 cores.
    """
    num_steps = steps if steps is not None else (2 if tiny else 100)
    group_size = 4 if tiny else 8
    variants = {"default": default_cpu(steps=num_steps, group_size=group_size),
                "grpo": grpo_cpu(steps=num_steps, group_size=group_size),
                "methods": methods_cpu(steps=num_steps)}
    if tiny:
        variants = {name: _tiny_rl(cfg) for name, cfg in variants.items()}
        bootstrap = bootstrap_cpu(tiny=True, cache_dir=str(Path(output_dir).absolute() / "cache" / "bootstrap"))
    else:
        bootstrap = bootstrap_cpu()
    curate = curate_cpu(tiny=tiny)
    plan = wire_campaign(
        name="cpu-tiny" if tiny else "cpu", output_dir=output_dir, bootstrap=bootstrap,
        curate=curate, estimator=estimator_cpu(tiny=tiny), rl_variants=variants,
        evaluate=evaluate_cpu(tiny=tiny),
    )
    for variant in UNCURATED_VARIANTS:
        plan = _train_uncurated(plan, variant=variant, sources=curate.sources, split=curate.split)
    return plan


def _train_uncurated(plan: CampaignPlan, *, variant: str, sources: list[str], split: str | None) -> CampaignPlan:
    """``rl-<variant>`` trains on ``sources`` as they are: no curated prompts, no curation statistics.

    It depends on the base policy and, when it filters with DEPO, on the estimator trained on the
    curation: the ledger charges it the curation and the estimator through that dependency, and
    nothing before RL otherwise.
    """
    name = f"rl-{variant}"
    stage = plan.stage(name)
    cfg = dataclasses.replace(stage.config, curation_dir=None,
                              data=dataclasses.replace(stage.config.data, train=list(sources), split=split))
    base = tuple(s.name for s in plan.stages if s.kind == "bootstrap")
    estimator = (ESTIMATOR_STAGE,) if reads_estimator(cfg) else ()
    rewired = dataclasses.replace(stage, config=cfg, depends_on=(*base, *estimator))
    return CampaignPlan(name=plan.name, output_dir=plan.output_dir,
                        stages=[rewired if s.name == name else s for s in plan.stages])


def demo_campaign(cfg: DemoConfig) -> CampaignPlan:
    """``winnow demo``'s plan: ``cpu_campaign`` with the demo's evaluation settings on every variant."""
    plan = cpu_campaign(output_dir=cfg.output_dir, tiny=cfg.tiny, steps=cfg.steps)
    overrides = []
    for variant in DEMO_VARIANTS:  # every variant the demo's tables report
        # Most GSM8K and MATH-500 problems do not fit the bootstrap policy's 128 positions: the demo
        # shows them counted as too long beside the arithmetic it can score, rather than refusing.
        overrides += [f"evaluate-{variant}.eval.benchmarks={json.dumps(cfg.benchmarks)}",
                      f"evaluate-{variant}.eval.max_skipped_fraction=1.0",
                      f"evaluate-{variant}.eval.limit={cfg.eval_limit}",
                      f"evaluate-{variant}.eval.num_samples={cfg.eval_samples}",
                      f"evaluate-{variant}.eval.ks={json.dumps(cfg.ks)}"]
    return plan.with_overrides(overrides)


# ================================================================ H100


def h100_rl(*, model_dir: str, tensor_parallel: int, max_new_tokens: int = 4096,
            micro_batch_tokens: int = 32768) -> RLConfig:
    """A plain GRPO config for a 1.5-8B policy: the shared settings the staged pipeline
    (``h100_staged_rl``) builds on, and the base the paper presets replace (``rl=`` argument).

    ``tensor_parallel``, ``max_new_tokens`` and ``micro_batch_tokens`` are what ``winnow plan``
    accepts for the model on 8×H100 (checked by ``tests/launch/test_plan.py``): bf16 weights with
    fp32 gradients and Adam state take 18 bytes per parameter, 137 GB for a 7.6B model, so 7-8B
    models need TP = 4; Qwen2.5-Math's 4,096 positions leave 3,072 new tokens after a prompt.
    Rollouts are corrected by token-level TIS (``algorithm.rollout_correction``).
    """
    return RLConfig(
        policy=model_dir, data=DataConfig(template="chat"), eval_set="math500", eval_samples=4,
        prompts_per_step=128, group_size=8, max_new_tokens=max_new_tokens, temperature=1.0, steps=500,
        optim=OptimConfig(lr=1e-6, total_steps=500, warmup_steps=10, weight_decay=0.01),
        parallel=ParallelConfig(tensor_parallel=tensor_parallel),
        # SGLang's bf16 kernels and the Megatron trainer disagree on log-probs token by token;
        # truncated importance sampling (C = 2) keeps the update on-policy for the trainer.
        algorithm=AlgorithmConfig(rollout_correction="tis"),
        trainer=TrainerConfig(precision="bf16", micro_batch_tokens=micro_batch_tokens),
        reward=RewardConfig(num_workers=32),
        checkpoint=CheckpointConfig(every_steps=20),
        logging=LoggingConfig(progress=False),
    )


def h100_staged_rl(*, model_dir: str, tensor_parallel: int, sample_selector: Literal["d3s_cross", "d3s_intra"],
                   max_new_tokens: int = 4096, micro_batch_tokens: int = 32768) -> RLConfig:
    """The H100 campaigns' ``default``: the staged pipeline (``recipes.staged.staged_pipeline``) on
    ``h100_rl``'s shared settings, with the pretrained MiniLM encoder (DEPO §3.1.1's BERT family).

    ``sample_selector``: D³S across groups for the math-aligned Qwen2.5-Math models, within each
    group for Llama-3.1-8B-Instruct (D³S Table 7: cross-group selection over-concentrates the
    update on an unaligned model's outliers; docs/reproducing.md, "The staged pipeline").
    """
    base = h100_rl(model_dir=model_dir, tensor_parallel=tensor_parallel, max_new_tokens=max_new_tokens,
                   micro_batch_tokens=micro_batch_tokens)
    return staged_pipeline(base, sample_selector=sample_selector, estimator_encoder="minilm")


def h100_campaign(*, name: str, model_dir: str, output_dir: str | Path, rl: RLConfig, nodes: int,
                  rollout: RolloutServers, time_limit: str = "04:00:00") -> CampaignPlan:
    """A campaign on 8×H100 nodes: ``rl`` against plain GRPO with the same layout and budgets.

    The baseline is ``rl`` with its method fields reset (``plain_grpo``): it keeps the shared
    settings, the rollout correction (TIS) and the group size included, so the two differ only
    in the method. Curation and evaluation generate ``rl.max_new_tokens``, the budget RL samples
    with, which leaves the prompt the rest of the model's context. The estimator is trained only
    when ``rl`` filters with DEPO (``wire_campaign``); then both variants train on the
    curation's sources as they are (DEPO replaces curation as a filter), and only ``rl-default``
    waits for, and is charged, the estimator and the curation it is trained on
    (``_train_uncurated``). Otherwise both train on the curated prompts.

    The rl jobs take ``nodes`` trainer nodes (8 ranks each) plus ``rollout.nodes`` nodes of
    SGLang servers; they get SIGUSR1 before their time limit, checkpoint and are requeued
    (up to 50 times: a 500-step run spans many 4-hour jobs). Curation and evaluation generate
    on the same kind of server nodes: one head node runs the stage (curation's question
    log-probs on its GPU) and the servers load the policy it scores; a requeued job resumes
    from the finished shards.
    """
    # Trainer and rollout nodes share the job's network: weights reach the servers by broadcast.
    sync = dataclasses.replace(rl.rollout, sync="distributed", server_tensor_parallel=rollout.tensor_parallel)
    chosen = dataclasses.replace(rl, policy=rl.policy or model_dir, rollout=sync)
    baseline = dataclasses.replace(chosen, algorithm=plain_grpo(chosen.algorithm))
    trainer = Resources(nodes=nodes, ranks_per_node=8, gpus_per_node=8, rollout=rollout, time_limit=time_limit,
                        requeues=50)
    one_gpu = Resources(gpus_per_node=1, time_limit=time_limit, requeues=3)
    on_servers = Resources(gpus_per_node=8, rollout=dataclasses.replace(rollout, model_path=chosen.policy),
                           time_limit=time_limit, requeues=3)
    curate = curate_h100(max_new_tokens=chosen.max_new_tokens)
    plan = wire_campaign(
        name=name, output_dir=output_dir, curate=curate,
        estimator=estimator_h100(), rl_variants={"default": chosen, "grpo": baseline},
        evaluate=evaluate_h100(max_new_tokens=chosen.max_new_tokens), export_dtype="bf16",
        resources={"curate": on_servers, "train-estimator": one_gpu, "rl-default": trainer, "rl-grpo": trainer,
                   "evaluate-default": on_servers, "evaluate-grpo": on_servers,
                   "export-default": Resources(time_limit="01:00:00"), "export-grpo": Resources(time_limit="01:00:00")},
    )
    if reads_estimator(chosen):
        for variant in ("default", "grpo"):
            plan = _train_uncurated(plan, variant=variant, sources=curate.sources, split=curate.split)
    return _train_from_converted_policy(plan, hf_dir=chosen.policy)


def _train_from_converted_policy(plan: CampaignPlan, *, hf_dir: str) -> CampaignPlan:
    """Add the ``convert`` stage (``hf_dir`` → ``<output_dir>/base``); rl stages train from its
    checkpoint. Every stage's SGLang servers start from ``hf_dir``; curation and evaluation have
    them load the policy they score."""
    converted = str(plan.output_dir / "base")
    stages = [Stage(name="convert", kind="convert", config=ConvertConfig(hf=hf_dir, out=converted),
                    resources=Resources(time_limit="02:00:00"))]
    for stage in plan.stages:
        if stage.resources.rollout is not None:
            stage = dataclasses.replace(stage, resources=dataclasses.replace(
                stage.resources, rollout=dataclasses.replace(stage.resources.rollout, model_path=hf_dir)))
        if stage.kind == "rl":
            stage = dataclasses.replace(stage, config=dataclasses.replace(stage.config, policy=converted),
                                        depends_on=("convert", *stage.depends_on))
        stages.append(stage)
    return CampaignPlan(name=plan.name, output_dir=plan.output_dir, stages=stages)


# The shipped H100 campaigns compare the staged pipeline (``h100_staged_rl``) with its matched GRPO;
# ``rl=`` replaces the staged pipeline, e.g. with a paper preset (``recipes.papers.build(name, policy=...)``).


def qwen25_math_7b(*, output_dir: str | Path, model_dir: str = "/models/Qwen2.5-Math-7B",
                   rl: RLConfig | None = None) -> CampaignPlan:
    """Qwen2.5-Math-7B: 2 trainer nodes at TP=4; 1 rollout node of 8 single-GPU SGLang servers (7B fits one H100)."""
    rl = rl or h100_staged_rl(model_dir=model_dir, tensor_parallel=4, sample_selector="d3s_cross",
                              max_new_tokens=3072, micro_batch_tokens=8192)
    return h100_campaign(name="qwen25-math-7b", model_dir=model_dir, output_dir=output_dir, rl=rl, nodes=2,
                         rollout=RolloutServers(nodes=1, servers_per_node=8, tensor_parallel=1))


def qwen25_math_1p5b(*, output_dir: str | Path, model_dir: str = "/models/Qwen2.5-Math-1.5B",
                     rl: RLConfig | None = None) -> CampaignPlan:
    """Qwen2.5-Math-1.5B: 1 trainer node at TP=2; 1 rollout node of 8 single-GPU servers."""
    rl = rl or h100_staged_rl(model_dir=model_dir, tensor_parallel=2, sample_selector="d3s_cross",
                              max_new_tokens=3072)
    return h100_campaign(name="qwen25-math-1.5b", model_dir=model_dir, output_dir=output_dir, rl=rl, nodes=1,
                         rollout=RolloutServers(nodes=1, servers_per_node=8, tensor_parallel=1))


def llama31_8b(*, output_dir: str | Path, model_dir: str = "/models/Llama-3.1-8B-Instruct",
               rl: RLConfig | None = None) -> CampaignPlan:
    """Llama-3.1-8B: 2 trainer nodes at TP=4; 2 rollout nodes of 4 two-GPU (TP=2) servers for its 128K-vocab KV cache."""
    rl = rl or h100_staged_rl(model_dir=model_dir, tensor_parallel=4, sample_selector="d3s_intra",
                              micro_batch_tokens=8192)
    return h100_campaign(name="llama31-8b", model_dir=model_dir, output_dir=output_dir, rl=rl, nodes=2,
                         rollout=RolloutServers(nodes=2, servers_per_node=4, tensor_parallel=2))


def cpu_tiny_campaign(*, output_dir: str | Path = "runs/campaigns/cpu-tiny") -> CampaignPlan:
    return cpu_campaign(output_dir=output_dir, tiny=True)


# `winnow launch campaign --recipe NAME`: every function takes output_dir (the H100 ones also model_dir).
CAMPAIGNS = {
    "cpu": cpu_campaign,
    "cpu-tiny": cpu_tiny_campaign,
    "qwen25-math-7b": qwen25_math_7b,
    "qwen25-math-1.5b": qwen25_math_1p5b,
    "llama31-8b": llama31_8b,
}
