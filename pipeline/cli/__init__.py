"""The `winnow` command: stages, data tools and config tools.

Each subcommand is a small function that loads its typed config (YAML file plus
dotted ``key=value`` overrides) and calls into the library; heavy imports happen
inside the handlers so that ``winnow --help`` stays fast. User errors (bad
config, bad data, a missing file) print one ``error:`` line and exit 2; anything
else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pipeline import configlib
from pipeline.cli.common import run_handler
from pipeline.config import (
    STAGE_KINDS,
    BootstrapConfig,
    DataInspectConfig,
    DemoConfig,
    RLConfig,
)
from pipeline.errors import EXIT_USER_ERROR, UserError  # noqa: F401 (EXIT_USER_ERROR: the status callers check)

# Every command whose options are a config dataclass (`winnow config show|docs`): the stage kinds
# that are commands of their own, and the commands that are no stage.
COMMAND_CONFIGS: dict[str, type] = dict(sorted({
    **{kind.name: kind.config for kind in STAGE_KINDS.values() if kind.command},
    "data-inspect": DataInspectConfig, "demo": DemoConfig,
}.items()))
# The stage kinds that may run on several ranks, as the launch flags' help names them.
MULTI_RANK_KIND_NAMES = ", ".join(kind.name for kind in STAGE_KINDS.values() if kind.multi_rank)

# megatron-core warns at import that it falls back from Apex/Transformer Engine to torch
# kernels (on CPU that is the expected configuration), and its checkpoint code calls torch
# APIs that torch marks deprecated: nothing a user can act on.
BENIGN_WARNINGS = (
    r"Transformer Engine and Apex are not installed",
    r"Apex is not installed",
    r"full scope is deprecated",
    r"`load_state_dict` is deprecated",
    r"Please use DTensor instead",
)


@dataclass(frozen=True, slots=True)
class Command:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    # What `pipeline.stages.preflight` checks before `run` starts (a stage config, or the
    # inputs named by flags); None: nothing to check beyond what the parser does.
    inputs: Callable[[argparse.Namespace], object] | None = None


def _config_inputs(config_type: type) -> Callable[[argparse.Namespace], object]:
    """The command's stage config, loaded from ``--config`` and the overrides as its handler loads it."""
    return lambda args: configlib.load(config_type, yaml_path=args.config, overrides=args.overrides)


def _add_config_arguments(parser: argparse.ArgumentParser, *, example: str = "data.on_bad_row=skip") -> None:
    """``--config`` and the overrides; ``example``: an override the command's config accepts."""
    parser.add_argument("--config", metavar="YAML", help="a YAML file of options to load first")
    parser.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE",
        help=f"dotted overrides applied last, e.g. {example}",
    )


def _add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    _add_config_arguments(parser, example="steps=60")


def _add_bootstrap_arguments(parser: argparse.ArgumentParser) -> None:
    _add_config_arguments(parser, example="seed=1")


# ---------------------------------------------------------------- data inspect
def _data_inspect_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", help="benchmark name (math500, gsm8k, math, minerva), synthetic spec, or a .jsonl/.parquet path")
    parser.add_argument("--split", default=None, help="split to read (default: the data config's split, else test for benchmarks)")
    _add_config_arguments(parser)


def _data_inspect_inputs(args: argparse.Namespace) -> object:
    from pipeline.stages.preflight import DataInspectInputs

    cfg = configlib.load(DataInspectConfig, yaml_path=args.config, overrides=args.overrides)
    return DataInspectInputs(source=args.source, split=args.split or cfg.data.split, on_bad_row=cfg.data.on_bad_row,
                             max_field_chars=cfg.data.max_field_chars)


def _data_inspect(args: argparse.Namespace) -> int:
    from pipeline.data.inspect import format_inspection, inspect_dataset

    cfg = configlib.load(DataInspectConfig, yaml_path=args.config, overrides=args.overrides)
    report = inspect_dataset(
        args.source, split=args.split or cfg.data.split, num_examples=cfg.num_examples,
        on_bad_row=cfg.data.on_bad_row, max_field_chars=cfg.data.max_field_chars,
    )
    print(format_inspection(report))
    return 0


# ---------------------------------------------------------------- bootstrap
def _bootstrap(args: argparse.Namespace) -> int:
    from pipeline.stages.bootstrap import run_bootstrap

    cfg = configlib.load(BootstrapConfig, yaml_path=args.config, overrides=args.overrides)
    result = run_bootstrap(cfg)
    state = "reused cached" if result.cached else "trained"
    summary = result.summary
    print(f"{state} base policy: {summary['num_parameters']:,} parameters, vocab {summary['vocab_size']}, "
          f"final loss {summary['final_loss']:.3f}")
    print(f"  tokenizer:   {result.tokenizer_dir}")
    print(f"  checkpoints: {result.checkpoint_dir}")
    return 0


def _rl(args: argparse.Namespace) -> int:
    from pipeline.stages.rl import run_rl

    cfg = configlib.load(RLConfig, yaml_path=args.config, overrides=args.overrides)
    last = run_rl(cfg)
    shown = ("reward_mean", "eval/pass@1", "ledger/tokens_generated", "ledger/tokens_with_gradient")
    print("  ".join(f"{key}={last[key]:.4g}" for key in shown if key in last))
    print(f"outputs: {cfg.logging.output_dir} (metrics.jsonl, plots/, stats.parquet); "
          f"checkpoints: {cfg.checkpoint.directory}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from pipeline.launch.demo import run_demo
    from recipes.campaigns import demo_campaign

    cfg = configlib.load(DemoConfig, yaml_path=args.config, overrides=args.overrides)
    run_demo(cfg, plan=demo_campaign(cfg))
    return 0


# ---------------------------------------------------------------- config tools
def _config_show_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("stage", choices=sorted(COMMAND_CONFIGS), help="the command whose config to print")
    _add_config_arguments(parser)


def _config_show(args: argparse.Namespace) -> int:
    cfg = configlib.load(COMMAND_CONFIGS[args.stage], yaml_path=args.config, overrides=args.overrides)
    print(configlib.dump_yaml(cfg), end="")
    return 0


def _config_docs_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=None, help="write to this file instead of standard output")


def _config_docs(args: argparse.Namespace) -> int:
    from pipeline.configdocs import render_configuration_markdown

    text = render_configuration_markdown(COMMAND_CONFIGS)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(text)
    else:
        print(text, end="")
    return 0


STAGES: list[Command] = [
    Command("rl", "the RL loop: generate, grade, select, update, sync, checkpoint",
            _add_config_arguments, _rl, _config_inputs(RLConfig)),
    Command("demo", "the CPU campaign in one process: base policy, curation, estimator, three RL variants "
            "(default, grpo, methods), pass@k and token cost of each, a results table",
            _add_demo_arguments, _demo, _config_inputs(DemoConfig)),
    Command("bootstrap", "train the tokenizer and supervised base policy of the CPU demo (cached)",
            _add_bootstrap_arguments, _bootstrap, _config_inputs(BootstrapConfig)),
]


def _convert_commands() -> list[Command]:
    from pipeline.cli import convert

    return [
        Command("hf-to-megatron", "Hugging Face folder → winnow checkpoint (weights), verified by logits",
                convert.add_hf_to_megatron_arguments, convert.run_hf_to_megatron, convert.hf_to_megatron_inputs),
        Command("megatron-to-hf", "winnow checkpoint → Hugging Face folder, verified by logits",
                convert.add_megatron_to_hf_arguments, convert.run_megatron_to_hf, convert.megatron_to_hf_inputs),
    ]


def _stage_commands_with_own_arguments() -> list[Command]:
    from pipeline.cli import curate, evaluate, plan
    from pipeline.cli import estimator as train_estimator
    from pipeline.config import CurateConfig, TrainEstimatorConfig

    return [
        Command("plan", "per-GPU memory, KV cache, context, step time and GPU-hours of an rl job; the verdict",
                plan.add_plan_arguments, plan.run_plan_command),
        Command("train-estimator", "train the DEPO difficulty estimator on curation outputs; report calibration",
                train_estimator.add_train_estimator_arguments, train_estimator.run_train_estimator_command,
                _config_inputs(TrainEstimatorConfig)),
        Command("curate", "sample k answers per prompt, grade them, keep prompts of useful difficulty",
                curate.add_curate_arguments, curate.run_curate_command, _config_inputs(CurateConfig)),
        Command("evaluate", "sampled pass@1…pass@32 of a policy on benchmarks, sharded and resumable",
                evaluate.add_evaluate_arguments, evaluate.run_evaluate_command, _evaluate_inputs),
        Command("evaluate-compare", "two evaluation runs side by side: B − A with bootstrap intervals",
                evaluate.add_compare_arguments, evaluate.run_compare_command),
    ]


def _evaluate_inputs(args: argparse.Namespace) -> object:
    """The config `winnow evaluate` runs: the policy named as POLICY or policy=DIR, set after loading."""
    import dataclasses

    from pipeline.cli.evaluate import policy_and_overrides
    from pipeline.config import EvaluateConfig

    policy, overrides = policy_and_overrides(args.policy, args.overrides)
    cfg = configlib.load(EvaluateConfig, yaml_path=args.config, overrides=overrides)
    return dataclasses.replace(cfg, policy=policy if policy is not None else cfg.policy,
                               tokenizer=args.tokenizer or cfg.tokenizer)


def _stats_commands() -> list[Command]:
    from pipeline.cli import stats as stats_cli

    return [Command("show", "per-prompt statistics of a run: top prompts by a column, and a summary",
                    stats_cli.add_stats_show_arguments, stats_cli.run_stats_show, stats_cli.stats_show_inputs)]


# ---------------------------------------------------------------- launch
def _add_executor_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--executor", choices=["local", "slurm"], default="local",
                        help="local: this machine, one stage at a time; slurm: one job per stage on a cluster profile")
    parser.add_argument("--profile", default="dev", help="SLURM cluster profile: a name in slurm/profiles/ or a path")
    parser.add_argument("--output-dir", default=None, help="the campaign's output root (default: the recipe's)")
    parser.add_argument("--dryrun", action="store_true",
                        help="write the task scripts (and sbatch scripts) without running anything")
    parser.add_argument("--detach", action="store_true", help="slurm: submit and return without following the jobs")
    parser.add_argument("--rehearse", action="store_true",
                        help="run this exact plan here first: a scaled-down model of the same family, gloo ranks "
                             "for GPUs, CPU stand-ins for SGLang, fewer prompts and steps; SIGUSR1 and a killed "
                             "server are played during the rl stages; prints a PASS/FAIL row per stage "
                             "(docs/launching.md#rehearsal)")
    parser.add_argument("--rehearsal-dir", default=None,
                        help="--rehearse: where the rehearsal runs, started afresh (default runs/rehearsals/<name>); "
                             "--output-dir stays the cluster's root the plan is built for")
    parser.add_argument("--rehearse-events", choices=["on", "off"], default="on",
                        help="--rehearse: play the SIGUSR1 stop and the server kill during the rl stages")
    parser.add_argument("--executor.nodes", dest="executor_nodes", type=int, default=None, metavar="N",
                        help=f"trainer nodes of the multi-rank stages ({MULTI_RANK_KIND_NAMES})")
    parser.add_argument("--executor.ranks-per-node", dest="executor_ranks_per_node", type=int, default=None,
                        metavar="N", help="ranks per trainer node of the multi-rank stages")
    parser.add_argument("--executor.time", dest="executor_time", default=None, metavar="TIME",
                        help="SLURM time limit of every job, e.g. 04:00:00")
    parser.add_argument("--executor.partition", dest="executor_partition", default=None, help="SLURM partition")
    parser.add_argument("--executor.account", dest="executor_account", default=None, help="SLURM account")
    parser.add_argument("--executor.container-image", dest="executor_container_image", default=None,
                        help="pyxis container image")
    from pipeline.cli.plan import add_cluster_arguments

    parser.add_argument("--force", action="store_true",
                        help="launch even when the plan refuses a stage (context of a generating stage, memory of a "
                             "GPU rl stage)")
    add_cluster_arguments(parser, with_nodes=False)


def _launch_campaign_arguments(parser: argparse.ArgumentParser) -> None:
    from recipes.campaigns import CAMPAIGNS

    parser.add_argument("--recipe", choices=sorted(CAMPAIGNS), default="cpu", help="the campaign recipe")
    parser.add_argument("--model-dir", default=None, help="H100 recipes: the Hugging Face model folder to start from")
    _add_executor_arguments(parser)
    parser.add_argument("overrides", nargs="*", metavar="STAGE.KEY=VALUE",
                        help="stage config overrides, e.g. rl-grpo.steps=5 curate.num_samples=4")


def _launch_stage_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("kind", choices=STAGE_KINDS.names(), help="the stage to launch")
    parser.add_argument("--config", metavar="YAML", help="a YAML file of the stage's options to load first")
    parser.add_argument("--ranks-per-node", type=int, default=None,
                        help=f"processes per node ({MULTI_RANK_KIND_NAMES}; default: one per GPU of --gpus-per-node, "
                             "else 1)")
    parser.add_argument("--gpus-per-node", type=int, default=0, help="GPUs per node the job requests")
    _add_executor_arguments(parser)
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides of the stage's config")


def _launch_options(args: argparse.Namespace):
    from pipeline.launch.nemo import ExecutorOverrides, LaunchOptions, apply_profile_overrides
    from pipeline.launch.slurm_profiles import load_profile

    overrides = ExecutorOverrides(
        nodes=args.executor_nodes, ranks_per_node=args.executor_ranks_per_node, time=args.executor_time,
        partition=args.executor_partition, account=args.executor_account,
        container_image=args.executor_container_image,
    )
    profile = apply_profile_overrides(load_profile(args.profile), overrides) if args.executor == "slurm" else None
    return overrides, LaunchOptions(executor=args.executor, profile=profile, dryrun=args.dryrun,
                                    wait=not args.detach)


def _launch(plan, args: argparse.Namespace) -> int:
    from pathlib import Path

    from pipeline.cli.plan import check_campaign_plan
    from pipeline.launch.campaign import CampaignStatus
    from pipeline.launch.nemo import apply_executor_overrides, launch_campaign

    overrides, options = _launch_options(args)
    plan = apply_executor_overrides(plan, overrides)
    if args.rehearse:
        return _rehearse(plan, args, profile=options.profile)
    check_campaign_plan(plan, args)
    if options.executor == "local" and not options.dryrun:
        _preflight_campaign(plan)
    result = launch_campaign(plan, options=options)
    if isinstance(result, Path):
        print(f"dry run: task scripts under {result}")
        for script in sorted(result.rglob("*.sh")):
            print(f"  {script}")
        return 0
    print(CampaignStatus(plan.output_dir).format(plan))
    if not options.wait:
        return 0
    if not result.ok:
        failed = [name for name, state in result.states.items() if state == "failed"]
        print(f"campaign {plan.name} did not finish: failed {', '.join(failed) or 'none'}; "
              f"not run {', '.join(result.blocked) or 'none'}", file=sys.stderr)
        return 1
    return 0


def _rehearse(plan, args: argparse.Namespace, *, profile) -> int:
    from pipeline.cli.plan import check_campaign_plan
    from pipeline.launch.rehearse import RehearsalScale, run_rehearsal

    output_dir = args.rehearsal_dir
    events = args.rehearse_events == "on"
    # Without the events one rl step shows what the checks need (a stream, a gradient) and one grading
    # worker keeps up; with them, the stop lands mid-run and the resumed steps are compared with an
    # uninterrupted run.
    scale = RehearsalScale() if events else RehearsalScale(rl_steps=1, grading_workers=1)
    report = run_rehearsal(plan, output_dir=output_dir, executor=args.executor, profile=profile, events=events,
                           scale=scale, check_plan=lambda full_size: check_campaign_plan(
                               full_size, args, out=lambda line: print(f"  {line}")))
    print(report.format())
    Path(output_dir, "report.txt").write_text(report.format() + "\n")
    return 0 if report.ok else 1


def _preflight_campaign(plan) -> None:
    """Check every stage's inputs before the first one runs.

    Inputs under the campaign's output folder or a bootstrap cache of the plan are what
    earlier stages will write; the campaign runner checks those when the stage's turn comes
    (``pipeline.stages.preflight.preflight`` before each stage).
    """
    from pathlib import Path

    from pipeline.config import BootstrapConfig
    from pipeline.io import resolve_cache_dir
    from pipeline.stages.preflight import PreflightError, preflight

    roots = [Path(plan.output_dir).absolute()] + [resolve_cache_dir(stage.config.cache_dir) for stage in plan.stages
                                                   if isinstance(stage.config, BootstrapConfig)]

    def produced(path: Path) -> bool:
        return any(path.absolute().is_relative_to(root) for root in roots)

    problems = []
    done = _done_stages(plan)
    for stage in plan.stages:
        if stage.name in done:
            continue
        try:
            for note in preflight(stage.config, produced=produced):
                print(f"{stage.name}: {note}")
        except PreflightError as error:
            problems += [f"stages.{stage.name}.config.{problem}" for problem in error.problems]
    if problems:
        raise PreflightError(problems)


def _done_stages(plan) -> set[str]:
    from pipeline.launch.campaign import CampaignStatus

    states = CampaignStatus(plan.output_dir).read()
    return {name for name, entry in states.items() if entry.get("state") == "done"}


def _launch_campaign(args: argparse.Namespace) -> int:
    from recipes.campaigns import CAMPAIGNS

    kwargs = {}
    if args.output_dir:
        kwargs["output_dir"] = args.output_dir
    if args.model_dir:
        if args.recipe.startswith("cpu"):
            raise UserError(f"--model-dir: the {args.recipe} recipe bootstraps its own policy")
        kwargs["model_dir"] = args.model_dir
    args.rehearsal_dir = args.rehearsal_dir or f"runs/rehearsals/{args.recipe}"
    if args.rehearse:
        # The plan is built where the cluster would write it, then moved under the rehearsal's folder.
        kwargs.setdefault("output_dir", f"{args.rehearsal_dir}/campaign")
    if "output_dir" not in kwargs and not args.recipe.startswith("cpu"):
        raise UserError(f"--output-dir: required for the {args.recipe} recipe (a directory every node shares)")
    plan = CAMPAIGNS[args.recipe](**kwargs).with_overrides(args.overrides)
    return _launch(plan, args)


def _launch_stage(args: argparse.Namespace) -> int:
    from pipeline.config import Resources
    from pipeline.launch.campaign import CampaignPlan, Stage

    config = configlib.load(STAGE_KINDS.get(args.kind).config, yaml_path=args.config, overrides=args.overrides)
    ranks = args.ranks_per_node if args.ranks_per_node is not None else max(1, args.gpus_per_node)
    resources = Resources(ranks_per_node=ranks, gpus_per_node=args.gpus_per_node)
    args.rehearsal_dir = args.rehearsal_dir or f"runs/rehearsals/{args.kind}"
    plan = CampaignPlan(name=args.kind, output_dir=args.output_dir or f"runs/launch/{args.kind}",
                        stages=[Stage(name=args.kind, kind=args.kind, config=config, resources=resources)])
    return _launch(plan, args)


def _launch_status_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("output_dir", help="a campaign's output root (holds campaign.json and status.json)")


def _launch_status(args: argparse.Namespace) -> int:
    from pipeline.launch.campaign import CampaignPlan, CampaignStatus

    plan = CampaignPlan.load(args.output_dir)
    print(CampaignStatus(plan.output_dir).format(plan))
    return 0


GROUPS: dict[str, tuple[str, list[Command]]] = {
    "stats": ("inspect a run's per-prompt statistics store", _stats_commands()),
    "launch": ("launch stages and whole campaigns with NeMo-Run, locally or on SLURM", [
        Command("campaign", "run a campaign recipe's stages in dependency order; skips stages already done",
                _launch_campaign_arguments, _launch_campaign),
        Command("stage", "run one stage as a local task or a SLURM job", _launch_stage_arguments, _launch_stage),
        Command("status", "print each stage's state from a campaign's status.json",
                _launch_status_arguments, _launch_status),
    ]),
    "convert": ("convert checkpoints between Hugging Face and Megatron, verified by logits", _convert_commands()),
    "data": ("inspect datasets and benchmarks", [
        Command("inspect", "print counts, fields, examples and bad-row counts of a dataset",
                _data_inspect_arguments, _data_inspect, _data_inspect_inputs),
    ]),
    "config": ("print resolved configs and their documentation", [
        Command("show", "print a stage's resolved config (defaults ← YAML ← overrides)",
                _config_show_arguments, _config_show),
        Command("docs", "render docs/configuration.md from the config dataclasses",
                _config_docs_arguments, _config_docs),
    ]),
}


class WinnowParser(argparse.ArgumentParser):
    """The top-level parser: a command's ``KEY=VALUE`` overrides may come before, between and after its options.

    argparse fills a trailing ``nargs="*"`` positional from the first run of positionals
    only, so ``rl --config x.yaml a=1`` would leave ``a=1`` unrecognized. Here the
    command's own parser re-reads its words with ``parse_intermixed_args``, which collects
    them all (that method refuses parsers with subcommands, hence the two steps).
    """

    def parse_args(self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
                   ) -> argparse.Namespace:
        words = list(sys.argv[1:] if args is None else args)
        found, _ = self.parse_known_args(words)  # picks the command; a bad or missing one exits here
        # Neither this parser nor a group's takes options: a command's words follow its name.
        depth = 1 if found.group in {command.name for command in _top_level_commands()} else 2
        parsed = namespace or argparse.Namespace()
        parsed.group, parsed.command = found.group, getattr(found, "command", None)
        return found.command_parser.parse_intermixed_args(words[depth:], namespace=parsed)


def _top_level_commands() -> list[Command]:
    return [*STAGES, *_stage_commands_with_own_arguments()]


def build_parser() -> argparse.ArgumentParser:
    parser = WinnowParser(
        prog="winnow",
        description="RL post-training for reasoning LLMs: curate → train estimator → RL → evaluate → export.",
    )
    groups = parser.add_subparsers(dest="group", metavar="COMMAND", required=True,
                                   parser_class=argparse.ArgumentParser)
    for command in _top_level_commands():
        command_parser = groups.add_parser(command.name, help=command.help, description=command.help)
        command.add_arguments(command_parser)
        command_parser.set_defaults(handler=command.run, inputs=command.inputs, command_parser=command_parser)
    for group_name, (group_help, commands) in GROUPS.items():
        group_parser = groups.add_parser(group_name, help=group_help, description=group_help)
        sub = group_parser.add_subparsers(dest="command", metavar="SUBCOMMAND", required=True)
        for command in commands:
            command_parser = sub.add_parser(command.name, help=command.help, description=command.help)
            command.add_arguments(command_parser)
            command_parser.set_defaults(handler=command.run, inputs=command.inputs, command_parser=command_parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    import warnings

    for pattern in BENIGN_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    return run_handler(build_parser().parse_args(argv))
