"""`winnow plan`: will this RL job fit, how long will it take, and what will it cost?

Inputs: a model (``config.json``, Hugging Face folder or winnow checkpoint), the RL config
(a campaign recipe's rl stages, a paper preset, or ``--config`` YAML with overrides) and a
cluster (a SLURM profile's GPUs per node, the GPU kind, trainer and rollout nodes). Prints
the per-GPU memory table of every pipeline stage, the SGLang KV cache against a step's
sequences, the requests the rollout client keeps in flight, the context check, the pipeline bubble, the
response lengths the step is timed with (the rl config's ``curation_dir`` when it holds a finished
curation, else the planner's stated shape; ``--response-fraction`` moves that shape's mean) and the
generation time beside its mean-length and all-max bounds, with DEPO the difficulty estimator's
share of the step on rank 0's GPU (and its state in rank 0's memory), step time and GPU-hours at the
printed assumptions, and the verdict with the smallest TP×PP layout that fits; with ``--recipe``, also
the context check of the campaign's curate and evaluate stages on the same model. Exit status
1 when the job does not fit. The planner itself is ``pipeline.launch.plan``.

``winnow launch`` runs ``check_campaign_plan`` before it submits anything: the context of every
stage that generates, each on the model it will run (``planner.stage_contexts``), and the whole
plan of every GPU rl stage. A refusal stops the launch unless ``--force``; a stage whose model
config cannot be read on the launching machine stops it unless ``--skip-plan-check``.

Activation recompute and the distributed optimizer are the config's ``trainer.recompute`` and
``trainer.distributed_optimizer`` (on by default whenever DP > 1); ``--recompute`` and
``--distributed-optimizer on|off`` override them as what-ifs. ``_trainer_options`` is the one
place that reads them.
"""

from __future__ import annotations

import argparse
from typing import Any

from pipeline import configlib
from pipeline.errors import UserError
from pipeline.launch import plan as planner

GIB = planner.GIB



def _sync_assumption(sync: str, assumptions) -> str:
    """How the plan times the weight push: the transport and the bandwidths it assumes."""
    return {
        "distributed": f"distributed: broadcast at {assumptions.sync_broadcast_gbps:g} GB/s",
        "disk": f"disk: written at {assumptions.checkpoint_write_gbps:g} GB/s, each server reads at "
                f"{assumptions.server_load_gbps:g} GB/s",
    }[sync]

def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="the policy: a config.json, a Hugging Face folder or a winnow checkpoint directory")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--recipe", default=None, help="a campaign recipe (recipes/campaigns.py); plans its rl stages")
    source.add_argument("--preset", default=None, help="a paper preset (recipes/papers.py)")
    parser.add_argument("--config", metavar="YAML", default=None, help="an rl config YAML (with neither of the above)")
    add_cluster_arguments(parser)
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides of the rl config")


def add_cluster_arguments(parser: argparse.ArgumentParser, *, with_nodes: bool = True) -> None:
    """The planner's cluster and what-if flags (also on `winnow launch`)."""
    group = parser.add_argument_group("plan")
    group.add_argument("--gpu", choices=sorted(planner.GPUS), default="h100", help="GPU kind of the cluster's nodes")
    if with_nodes:
        group.add_argument("--profile", default="h100-example",
                           help="cluster profile (a name in slurm/profiles/ or a path) whose gpus_per_node the plan uses")
        group.add_argument("--nodes", type=int, default=None,
                           help="trainer nodes (default: the recipe's, else 1)")
        group.add_argument("--rollout-nodes", type=int, default=None,
                           help="SGLang nodes (default: the recipe's, else 0)")
        group.add_argument("--servers-per-node", type=int, default=None, help="SGLang servers per rollout node")
        group.add_argument("--server-tp", type=int, default=None, help="SGLang --tp-size of each server")
    group.add_argument("--distributed-optimizer", choices=["on", "off"], default=None,
                       help="what-if: shard the optimizer state over data parallel (default: the config's "
                            "trainer.distributed_optimizer, on when DP > 1)")
    group.add_argument("--recompute", choices=["none", "selective", "full"], default=None,
                       help="what-if: activation recompute (default: the config's trainer.recompute)")
    group.add_argument("--prompt-tokens", type=int, default=None,
                       help="the longest templated prompt, in tokens, that every generating stage leaves room for "
                            f"(context and memory use it; default: {planner.DEFAULT_PROMPT_TOKENS}, or a quarter "
                            "of a shorter model's positions)")
    group.add_argument("--mfu", type=float, default=planner.Assumptions().mfu, help="assumed trainer MFU")
    group.add_argument("--rollout-mfu", type=float, default=planner.Assumptions().rollout_mfu,
                       help="assumed SGLang generation MFU")
    group.add_argument("--response-fraction", type=float, default=planner.Assumptions().response_fraction,
                       help="what-if: mean response length / max_new_tokens, the stated long-tail shape moved to "
                            "this mean (1.0: every response at the cap; time and GPU-hours only). Default: the "
                            "lengths the rl config's curation_dir measured, else the stated shape (median "
                            f"{planner.Assumptions().response_median * 100:.0f}%%, p90 "
                            f"{planner.Assumptions().response_p90 * 100:.0f}%% of max_new_tokens)")
    if not with_nodes:
        # The launch form (the stages' resources give the nodes): it submits, so it has a check to skip.
        group.add_argument("--skip-plan-check", action="store_true",
                           help="launch even when a stage's model config cannot be read on this machine (that "
                                "stage goes unchecked; the others are still checked, and --force overrides a "
                                "refusal)")


def _trainer_options(args: argparse.Namespace, cfg: Any) -> dict[str, Any]:
    # null in the config means "on when DP > 1"; sharding over DP = 1 divides by one, so on is exact.
    configured = cfg.trainer.distributed_optimizer is not False
    return {"distributed_optimizer": configured if args.distributed_optimizer is None else args.distributed_optimizer == "on",
            "recompute": args.recompute if args.recompute is not None else cfg.trainer.recompute}


def _gpus_per_node(args: argparse.Namespace) -> int:
    from pipeline.launch.slurm_profiles import load_profile

    gpus = load_profile(args.profile).gpus_per_node
    if gpus < 1:
        raise UserError(f"--profile: {args.profile} has no GPUs to plan for")
    return gpus


def _response_lengths(cfg: Any, args: argparse.Namespace) -> planner.ResponseLengths | None:
    """The measured response lengths of the rl config's ``curation_dir`` when it holds a finished curation
    and ``--response-fraction`` does not override them; None: the planner's stated shape."""
    fraction = args.response_fraction
    if fraction is not None and not 0 < fraction <= 1:
        raise UserError(f"--response-fraction: {fraction} is not a share of max_new_tokens in (0, 1]")
    if fraction is not None or cfg.curation_dir is None:
        return None
    from pipeline.stats.curation import CurationError

    try:
        return planner.curation_lengths(cfg.curation_dir, max_new_tokens=cfg.max_new_tokens)
    except CurationError:  # not curated yet (a campaign planned before it runs): the stated shape
        return None


def stage_inputs(cfg: Any, dims: planner.ModelDims, *, resources: Any, args: argparse.Namespace, num_runs: int,
                 gpus_per_node: int, campaign: Any | None = None) -> planner.PlanInputs:
    """``PlanInputs`` for one rl config on a stage's resources (``resources``: a campaign ``Resources`` or None);
    ``campaign``, the ``CampaignPlan`` the stage belongs to, finds the stage that trains its DEPO estimator."""
    rollout = getattr(resources, "rollout", None) if resources is not None else None
    cluster = planner.Cluster(
        gpu=planner.GPUS[args.gpu],
        trainer_nodes=(getattr(args, "nodes", None) or (resources.nodes if resources is not None else 1)),
        gpus_per_node=gpus_per_node,
        rollout_nodes=(getattr(args, "rollout_nodes", None) if getattr(args, "rollout_nodes", None) is not None
                       else (rollout.nodes if rollout is not None else 0)),
        servers_per_node=getattr(args, "servers_per_node", None) or (rollout.servers_per_node if rollout else 1),
        server_tensor_parallel=getattr(args, "server_tp", None) or (rollout.tensor_parallel if rollout else 1),
    )
    return planner.PlanInputs(
        dims=dims, layout=planner.layout_from_rl(cfg, trainer_gpus=cluster.trainer_gpus),
        in_flight=planner.in_flight_from_rl(cfg, cluster), response_lengths=_response_lengths(cfg, args),
        estimator=planner.estimator_from_rl(cfg, campaign=campaign),
        trainer=planner.trainer_settings_from_rl(cfg, **_trainer_options(args, cfg)),
        workload=planner.workload_from_rl(cfg, prompt_tokens=planner.prompt_allowance(dims, args.prompt_tokens),
                                          num_runs=num_runs),
        cluster=cluster,
        assumptions=planner.Assumptions(mfu=args.mfu, rollout_mfu=args.rollout_mfu,
                                        response_fraction=args.response_fraction),
    )


def format_plan(result: planner.Plan, *, title: str) -> str:
    """The per-GPU table, KV cache, context, time and the verdict."""
    inputs = result.inputs
    dims, trainer, workload, cluster = inputs.dims, inputs.trainer, inputs.workload, inputs.cluster
    lines = [
        f"plan: {title}",
        f"model {dims.name}: {dims.num_parameters() / 1e9:.2f}B parameters, {dims.num_layers} layers, h={dims.hidden_size},"
        f" {dims.num_attention_heads} heads / {dims.num_kv_heads} KV heads × {dims.head_dim}, vocab {dims.vocab_size},"
        f" {dims.max_position_embeddings} positions",
        f"cluster: {cluster.trainer_nodes} trainer node(s) + {cluster.rollout_nodes} rollout node(s) × "
        f"{cluster.gpus_per_node} {cluster.gpu.name}; usable per GPU {cluster.usable_bytes / GIB:.1f} GiB "
        f"(reserve {cluster.reserve_gib} GiB, {cluster.fragmentation:.0%} fragmentation)",
        f"layout: {inputs.layout}; {trainer.precision}, distributed optimizer {'on' if trainer.distributed_optimizer else 'off'}, "
        f"recompute {trainer.recompute}, backend {trainer.backend} (fused attention: no s² scores), "
        f"sequence parallel {'on' if trainer.sequence_parallel else 'off'}",
        f"step: {workload.prompts_per_step} prompts × {workload.trained_per_prompt} trained "
        f"({workload.sampled_per_prompt} sampled) × ≤{inputs.seq_length} tokens; micro-batch "
        f"{planner.micro_batch_tokens(inputs)} tokens, {planner.num_micro_batches(inputs)} micro-batches per DP rank",
        "",
        f"{'per GPU, GiB':16s}" + "".join(f"{'stage ' + str(stage.stage):>10s}" for stage in result.stages),
    ]
    rows = [("weights", "weights"), ("gradients", "gradients"), ("optimizer", "optimizer"),
            ("activations", "activations"), ("  no recompute", "activations_no_recompute"),
            ("  full recompute", "activations_full_recompute"), ("log-prob head", "head_buffer"),
            ("reference", "reference_weights"), ("generator (fp32)", "generator_weights")]
    if inputs.estimator is not None:
        rows.append(("estimator (fp32)", "estimator_state"))
    for label, key in rows:
        lines.append(f"{label:16s}" + "".join(f"{getattr(stage, key) / GIB:10.2f}" for stage in result.stages))
    lines.append(f"{'total':16s}" + "".join(f"{stage.total / GIB:10.2f}" for stage in result.stages))
    lines.append(f"{'in-flight micro':16s}" + "".join(f"{stage.in_flight_micro_batches:10d}"
                                                      for stage in result.stages))
    lines.append(f"pipeline bubble (1F1B): {result.time.bubble:.1%}")
    if result.kv is not None:
        kv = result.kv
        lines.append(f"SGLang: {kv.num_servers} server(s), TP {cluster.server_tensor_parallel}; per GPU weights "
                     f"{kv.server_weights / GIB:.1f} GiB, KV {kv.bytes_per_token / 1024:.0f} KiB/token → capacity "
                     f"{kv.capacity_tokens:,} tokens vs {kv.in_flight_tokens:,} in flight per server "
                     f"({'fits at once' if kv.waves == 1 else f'{kv.waves} waves'}; --mem-fraction-static "
                     f"{inputs.assumptions.mem_fraction_static})")
    if inputs.in_flight is not None:
        lines.append(f"requests in flight: {inputs.in_flight.describe()}")
    context = "fits" if inputs.seq_length <= dims.max_position_embeddings else "DOES NOT FIT"
    lines.append(f"context: {workload.prompt_tokens} prompt + {workload.max_new_tokens} new = {inputs.seq_length} "
                 f"of {dims.max_position_embeddings} positions: {context}")
    assumptions = inputs.assumptions
    time = result.time
    lines += format_generation(time)
    if inputs.estimator is not None:
        lines.append(format_estimator(inputs.estimator, time, cluster=cluster, assumptions=assumptions))
    recompute = f", {trainer.recompute} recompute {time.recompute_s:.0f} s of it" if time.recompute_s else ""
    estimator = f", DEPO estimator {_brief_seconds(time.estimator_s)} s" if inputs.estimator is not None else ""
    lines.append(f"time (assumed: MFU {assumptions.mfu:.0%} trainer, {assumptions.rollout_mfu:.0%} rollout, "
                 f"{cluster.gpu.peak_tflops:.0f} TFLOPS bf16 peak): step {time.step_s:.0f} s (rollout "
                 f"{time.rollout_s:.0f} s, train {time.train_s:.0f} s{recompute}"
                 f"{', overlapped (rollout.max_staleness=1): the longer' if time.overlapped else ''}{estimator}"
                 f", weight sync {time.sync_s:.1f} s ({_sync_assumption(workload.sync, assumptions) if cluster.rollout_nodes else 'in process'}); "
                 f"{time.rollout_flops:.2e} + {time.train_flops:.2e} FLOPs)")
    lines.append(f"run: {workload.steps} steps × {workload.num_runs} run(s) = {result.gpu_hours:,.0f} GPU-hours "
                 f"({result.gpu_hours / (cluster.trainer_gpus + cluster.rollout_gpus):,.1f} h wall)")
    smallest = str(result.smallest_layout) if result.smallest_layout else "none on this cluster"
    if result.fits:
        lines.append(f"verdict: FITS, {result.margin_bytes / GIB:.1f} GiB spare on the fullest GPU; "
                     f"smallest fitting layout: {smallest}")
    else:
        lines.append("verdict: DOES NOT FIT")
        lines += [f"  - {problem}" for problem in result.problems]
        lines.append(f"  smallest fitting layout: {smallest}")
    return "\n".join(lines)


def _seconds(value: float) -> str:
    return f"{value:.0f}" if value >= 10 else f"{value:.1f}"


def _brief_seconds(value: float) -> str:
    """Hundredths under a second (the estimator's time), else as ``_seconds``."""
    return f"{value:.2f}" if value < 1 else _seconds(value)


def format_estimator(estimator: planner.EstimatorWorkload, time: planner.TimePlan, *, cluster: planner.Cluster,
                     assumptions: planner.Assumptions) -> str:
    """DEPO's estimator: its FLOPs by their formula, its time and share of the step, and where in the step it runs."""
    encoder = estimator.encoder
    if time.overlapped:
        where = (f"the other ranks wait for rank 0's scoring ({_brief_seconds(time.estimator_score_s)} s) before the "
                 f"batch is launched; its training ({_brief_seconds(time.estimator_train_s)} s) is on the update's "
                 "side, beside the next batch's generation")
    else:
        where = ("all on the step's critical path: the other ranks wait for rank 0's scoring before generation and "
                 "for its training after the update")
    return (f"DEPO estimator ({encoder.name}, {estimator.source}; fp32 on rank 0's GPU): "
            f"{time.estimator_flops:.2e} FLOPs a step = 2·N·T̄·(3·{estimator.minibatches}·{estimator.minibatch_size} "
            f"trained + {estimator.candidates} scored) with N = {encoder.forward_cost().matmul_parameters:,} matmul "
            f"weights, T̄ = {estimator.question_tokens} tokens ({estimator.question_tokens_source}); "
            f"{_brief_seconds(time.estimator_s)} s at {assumptions.estimator_mfu:.0%} of "
            f"{cluster.gpu.peak_fp32_tflops:.0f} TFLOPS fp32 peak (assumed), adding "
            f"{_brief_seconds(time.estimator_added_s)} s, {time.estimator_added_s / time.step_s:.2%} of the step; "
            f"{where}")


def format_generation(time: planner.TimePlan) -> list[str]:
    """The response lengths the step is timed with, and the generation time they give beside its bounds."""
    lengths, batches = time.lengths, time.batches
    where = (f"each of {batches.generators} server(s) (TP {batches.gpus_per_generator})" if batches.on_servers
             else "rank 0's in-process engine (1 GPU)")
    return [
        f"responses ({lengths.source}): median {lengths.quantile(0.5):,.0f}, p90 {lengths.quantile(0.9):,.0f}, "
        f"mean {lengths.mean:,.0f}, max {lengths.values[-1]:,.0f} of {lengths.max_new_tokens:,} tokens",
        f"generation: {_seconds(time.generation_s)} s at the expected longest response of each batch (mean-length "
        f"{_seconds(time.generation_mean_s)} s, all-max bound {_seconds(time.generation_max_s)} s); "
        f"{batches.rounds} round(s) × {batches.waves} wave(s) of {batches.batch:,} sequences on {where}; "
        f"prefill {time.prefill_s:.1f} s",
    ]


def _unreadable(context: planner.StageContext) -> str:
    """What could not be read for a stage, and why (the reason names the path when it can)."""
    why = str(context.unreadable)
    return why if context.source in why else f"{context.source}: {why}"


def format_context(context: planner.StageContext, *, prompt_tokens: int | None) -> str:
    """One generating stage's context check: the prompt allowance plus its max_new_tokens against its model."""
    if context.dims is None:
        return f"context: {context.option}: not checked, cannot be read here: {_unreadable(context)}"
    dims = context.dims
    allowance = planner.prompt_allowance(dims, prompt_tokens)
    verdict = "fits" if context.problem(prompt_tokens) is None else "DOES NOT FIT"
    return (f"context: {context.option}: ~{allowance} prompt + {context.max_new_tokens} new = "
            f"{allowance + context.max_new_tokens} of {dims.max_position_embeddings} positions ({dims.name}, "
            f"from {context.source}): {verdict}")


def _recipe_campaign(args: argparse.Namespace) -> Any:
    from recipes.campaigns import CAMPAIGNS

    if args.recipe not in CAMPAIGNS:
        raise UserError(f"--recipe: unknown campaign {args.recipe!r}; known: {', '.join(sorted(CAMPAIGNS))}")
    return CAMPAIGNS[args.recipe](output_dir="runs/plan")


def rl_jobs(args: argparse.Namespace) -> list[tuple[str, Any, Any]]:
    """(name, RLConfig, Resources or None) of every rl job the arguments name."""
    from pipeline.config import RLConfig

    if args.recipe:
        campaign = _recipe_campaign(args)
        rl_stages = [stage.name for stage in campaign.stages if stage.kind == "rl"]
        # Every rl stage plans under the same overrides, whatever variants the campaign has.
        campaign = campaign.with_overrides([f"{name}.{override}" for name in rl_stages for override in args.overrides])
        return [(stage.name, stage.config, stage.resources) for stage in campaign.stages if stage.kind == "rl"]
    if args.preset:
        from recipes import papers

        cfg = configlib.load(RLConfig, base=papers.build(args.preset), overrides=args.overrides)
        return [(args.preset, cfg, None)]
    return [("rl", configlib.load(RLConfig, yaml_path=args.config, overrides=args.overrides), None)]


def plan_jobs(jobs: list[tuple[str, Any, Any]], dims: planner.ModelDims, args: argparse.Namespace,
              gpus_per_node: int, campaign: Any | None = None) -> list[tuple[str, planner.Plan]]:
    return [(name, planner.plan(stage_inputs(cfg, dims, resources=resources, args=args, num_runs=1,
                                             gpus_per_node=gpus_per_node, campaign=campaign)))
            for name, cfg, resources in jobs]


def recipe_contexts(args: argparse.Namespace, dims: planner.ModelDims) -> list[planner.StageContext]:
    """The curate and evaluate stages of ``--recipe`` on the planned model (its rl stages are planned whole)."""
    if not args.recipe:
        return []
    contexts = []
    for stage in _recipe_campaign(args).stages:
        if stage.stage_kind.generation_length_option is not None and stage.kind != "rl":
            field_name, max_new_tokens = planner.stage_generation(stage)
            contexts.append(planner.StageContext(stage=stage.name, kind=stage.kind, field=field_name,
                                                 max_new_tokens=max_new_tokens, source=args.model, dims=dims))
    return contexts


def run_plan_command(args: argparse.Namespace) -> int:
    try:
        dims = planner.load_model_dims(args.model)
    except (ValueError, OSError) as error:
        raise UserError(f"--model: {error}") from None
    jobs = rl_jobs(args)
    # A recipe's rl stages read the estimator its train-estimator stage writes (overrides reach rl stages only).
    campaign = _recipe_campaign(args) if args.recipe else None
    results = plan_jobs(jobs, dims, args, _gpus_per_node(args), campaign=campaign)
    for name, result in results:
        print(format_plan(result, title=name))
        print()
    contexts = recipe_contexts(args, dims)
    for context in contexts:
        print(format_context(context, prompt_tokens=args.prompt_tokens))
    total = sum(result.gpu_hours for _, result in results)
    print(f"rl stages: {len(results)}, {total:,.0f} GPU-hours in all (curate, evaluate and export not counted)")
    refused = [problem for problem in (context.problem(args.prompt_tokens) for context in contexts) if problem]
    for problem in refused:
        print(f"refused: {problem}")
    return 0 if all(result.fits for _, result in results) and not refused else 1


def check_campaign_plan(plan: Any, args: argparse.Namespace, *, out=print) -> None:
    """`winnow launch`'s pre-flight, before anything is submitted.

    Every stage that generates (rl, curate, evaluate, on CPU or GPU) has its ``max_new_tokens``
    checked against its model's positions with the prompt allowance (``--prompt-tokens``), on the
    model ``planner.stage_contexts`` finds for it across the campaign; a GPU rl stage is planned
    whole (memory, KV cache, context). A refused stage stops the launch unless ``--force``. A stage
    whose model config cannot be read here (a path only the cluster sees) stops it unless
    ``--skip-plan-check``; a bootstrap policy that does not exist yet is no such stage, its
    ``model`` section gives the dimensions.
    """
    failures: list[str] = []
    unchecked: dict[str, list[str]] = {}  # what could not be read, and why → the stages it leaves unchecked
    for context in planner.stage_contexts(plan):
        stage = plan.stage(context.stage)
        if context.dims is None:
            out(f"plan: {stage.name} not checked: {_unreadable(context)}")
            unchecked.setdefault(_unreadable(context), []).append(stage.name)
            continue
        if stage.kind == "rl" and stage.resources.gpus_per_node > 0:
            result = planner.plan(stage_inputs(stage.config, context.dims, resources=stage.resources, args=args,
                                               num_runs=1, gpus_per_node=stage.resources.gpus_per_node,
                                               campaign=plan))
            out(format_plan(result, title=stage.name))
            if not result.fits:
                failures.append(f"{stage.name}: " + "; ".join(result.problems))
            continue
        out(f"plan: {stage.name}: " + format_context(context, prompt_tokens=args.prompt_tokens))
        problem = context.problem(args.prompt_tokens)
        if problem is not None:
            failures.append(problem)
    if failures and not args.force:
        raise UserError("the plan refuses: " + " | ".join(failures) + " (winnow plan shows why; --force launches anyway)")
    if unchecked and not args.skip_plan_check:
        unread = " | ".join(f"{', '.join(stages)}: {why}" for why, stages in unchecked.items())
        raise UserError(f"the plan cannot check these stages, their model config cannot be read on this machine: "
                        f"{unread}; give a folder holding the model's config.json (--model-dir for a campaign "
                        f"recipe), or --skip-plan-check to launch them unchecked")
    if unchecked:
        out(f"plan: launching {sum(len(stages) for stages in unchecked.values())} stage(s) unchecked "
            "(--skip-plan-check)")
