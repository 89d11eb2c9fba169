"""Rehearse a cluster campaign on this machine: the exact plan, run end to end, before it meets a cluster.

``winnow launch campaign --recipe NAME --rehearse`` builds the plan the recipe would submit,
checks it as ``winnow launch`` does (the planner at full size against the model's published
``config.json``: memory, context of every generating stage), then runs it here with these
changes only, each stated in the report:

* **The model**: the recipe's own architecture scaled down in width and depth
  (:mod:`pipeline.launch.rehearsal_model`): positions, RoPE, vocabulary rows, special-token
  ids and chat template are kept, so every context and token check runs at full size. It
  is fitted briefly to answer the campaign's first prompts, so rewards are mixed.
* **The hardware**: GPUs become gloo ranks with the recipe's TP and PP on one node (DP is
  reduced to 1; the report says from what); GPU devices and dtypes become the CPU's fp32.
* **The rollout servers**: SGLang becomes winnow's CPU stand-in (``pipeline.cli.standin``),
  same command line and HTTP protocol (weight loads from disk and the update group
  included), launched by the real ``serve`` role under the real supervisor, on the
  trainer's node (``RolloutServers.colocated``).
* **Volumes**: prompts, samples per prompt, steps and evaluated problems scaled down
  (:class:`RehearsalScale`). Token budgets and positions are never scaled.

Everything else is what the cluster would run: configs, stage wiring, preflight, transports,
signal handling, requeue and checkpoint cadence, through NeMo-Run's local executor
(one process tree per stage, as a node runs it) or, with ``--executor slurm``, real
sbatch/srun on a cluster profile (the one-node dev cluster).

At every stage boundary the output must mean something (:func:`check_stage`), and two
events are played during the rl stages: SIGUSR1 during the first variant (checkpoint, exit
75, requeue or relaunch, resume; the resumed rows must equal an uninterrupted run of the
same stage) and a SIGKILL of one rollout server during the second (restarted by the
supervisor and re-synced before it serves again). The report has one row per stage:
PASS or FAIL, the first error line, the time taken and what was scaled.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline import configlib
from pipeline.errors import UserError
from pipeline.launch.campaign import CampaignPlan, CampaignStatus, Stage
from pipeline.launch.rehearsal_model import RehearsalModel, build_rehearsal_model, fit_answers, published_config
from pipeline.parallel.rendezvous import reserved_port_block

# Metrics columns that differ between two runs of the same steps for reasons of time, not of content.
TIMING_PREFIXES = ("time/", "rollout/seconds", "throughput", "mfu", "perf/")
TIMING_KEYS = frozenset({"wall_s", "elapsed_s", "timestamp", "time"})
CONTROL_SUFFIX = "-control"  # the uninterrupted copy of the stage the stop event is played on
@dataclass(frozen=True, slots=True)
class RehearsalScale:
    """How much less of everything a rehearsal runs (never token budgets or positions)."""

    prompts: int = 16  # curation prompts per source (the model is fitted to answer these)
    samples: int = 8  # curation's k
    rl_steps: int = 3
    prompts_per_step: int = 4
    group_size: int = 4
    eval_problems: int = 2  # per benchmark, evaluate stages and the rl stages' held-out set
    eval_samples: int = 4
    servers_per_node: int = 1  # stand-ins of a stage with servers: one serves a rehearsal's volumes
    servers_killed_stage: int = 2  # the stage whose stand-in is killed: another serves while it restarts
    grading_workers: int = 2
    # The online DEPO estimator's AdamW steps per rl step and prompts per step: the recipes' 4 × 32 of
    # MiniLM (22M parameters) take ~10 CPU-seconds a step here, on rank 0 while the others wait.
    estimator_updates: int = 1
    estimator_minibatch: int = 8

    @property
    def ports_per_stage(self) -> int:
        """Ports a stage's stand-ins may take: its stand-ins, or the killed stage's if more."""
        return max(self.servers_per_node, self.servers_killed_stage)


@dataclass(slots=True)
class StageRow:
    name: str
    kind: str
    state: str = "not run"  # PASS, FAIL or not run
    error: str = ""
    seconds: float = 0.0
    scaled: list[str] = field(default_factory=list)


@dataclass(slots=True)
class RehearsalReport:
    recipe: str
    model: RehearsalModel | None = None
    notes: list[str] = field(default_factory=list)  # plan-wide changes and events
    rows: dict[str, StageRow] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return bool(self.rows) and all(row.state == "PASS" for row in self.rows.values())

    def format(self) -> str:
        lines = [f"rehearsal of {self.recipe}: {'PASS' if self.ok else 'FAIL'} in {self.seconds:.0f} s"]
        if self.model is not None:
            lines.append(f"model: {self.model.source}, scaled: {'; '.join(self.model.changes)}")
        lines += [f"- {note}" for note in self.notes]
        lines.append(f"{'stage':<20} {'result':<7} {'time':>7}  first error / what was scaled")
        for row in self.rows.values():
            detail = row.error or "; ".join(row.scaled)
            lines.append(f"{row.name:<20} {row.state:<7} {row.seconds:>6.0f}s  {detail}")
        return "\n".join(lines)


# ================================================================ the plan


def model_dir_of(plan: CampaignPlan) -> str:
    """The Hugging Face folder a cluster plan starts from: its convert stage's, else its generating stages' policy."""
    for stage in plan.stages:
        if stage.kind == "convert":
            return stage.config.hf
    policies = {(stage.resources.rollout.model_path if stage.resources.rollout and stage.resources.rollout.model_path
                 else stage.config.policy) for stage in plan.stages if stage.stage_kind.rollout_servers}
    if len(policies) != 1 or None in policies:
        raise UserError(f"--rehearse: {plan.name} does not start from one Hugging Face folder (found "
                        f"{sorted(map(str, policies))}); a campaign that bootstraps its policy runs on this machine "
                        "as it is: launch it without --rehearse")
    return next(iter(policies))


def with_model(plan: CampaignPlan, *, model_dir: str, folder: Path) -> CampaignPlan:
    """``plan`` with every path naming ``model_dir`` (or a file in it) pointing at ``folder`` instead."""
    return plan.with_paths_moved(model_dir.rstrip("/"), str(folder))


def _scale_resources(resources: dict[str, Any], *, ranks: int, servers_here: int, notes: list[str]) -> None:
    gpus = resources["gpus_per_node"] * resources["nodes"]
    if gpus:
        notes.append(f"{resources['nodes']} nodes x {resources['gpus_per_node']} GPUs -> 1 node x {ranks} gloo "
                     f"rank(s)")
    resources.update(nodes=1, ranks_per_node=ranks, gpus_per_node=0)
    rollout = resources.get("rollout")
    if rollout is not None:
        servers = rollout["nodes"] * rollout["servers_per_node"]
        kept = min(servers, servers_here)
        notes.append(f"{servers} SGLang servers (TP {rollout['tensor_parallel']}) on {rollout['nodes']} node(s) -> "
                     f"{kept} CPU stand-ins (TP 1) beside the trainer")
        rollout.update(nodes=1, servers_per_node=kept, server="standin", colocated=True, tensor_parallel=1,
                       startup_timeout_s=min(rollout["startup_timeout_s"], 600.0))


def _cpu(config: dict[str, Any], notes: list[str]) -> None:
    if config.get("device") not in (None, "cpu", "auto"):
        notes.append(f"device {config['device']} -> cpu")
        config["device"] = "cpu"
    if config.get("dtype") not in (None, "float32"):
        notes.append(f"dtype {config['dtype']} -> float32")
        config["dtype"] = "float32"


def _scaled(config: dict[str, Any], path: str, value: Any, notes: list[str]) -> None:
    """Set ``config[a][b]...`` (``path`` dotted) to ``value``, noting the change."""
    *parents, key = path.split(".")
    target = config
    for part in parents:
        target = target[part]
    if target.get(key) != value:
        notes.append(f"{path} {target.get(key)} -> {value}")
        target[key] = value


def rehearsal_stage(stage: Stage, *, scale: RehearsalScale, request_logs: Path, port: int, killed: bool = False
                    ) -> tuple[Stage, list[str]]:
    """One stage as the rehearsal runs it, and what changed (the report's ``scaled`` column).

    Its stand-in servers listen from ``port`` on (stages a cluster runs at once, on nodes of their
    own, share the one node here) and log each request to ``request_logs/<stage>.jsonl``; the
    stage on which a stand-in is killed (``killed``) gets ``scale.servers_killed_stage`` of them.
    """
    servers_here = scale.servers_killed_stage if killed else scale.servers_per_node
    config = configlib.to_dict(stage.config)
    resources = configlib.to_dict(stage.resources)
    notes: list[str] = []
    ranks = 1
    if stage.kind == "curate":
        _scaled(config, "limit", scale.prompts, notes)
        _scaled(config, "num_samples", scale.samples, notes)
        _scaled(config, "shard_size", max(1, scale.prompts // 2), notes)
        _scaled(config, "reward.num_workers", scale.grading_workers, notes)
        _cpu(config, notes)
    elif stage.kind == "train-estimator":
        _scaled(config, "epochs", 1, notes)
        _scaled(config, "batch_size", min(config["batch_size"], 8), notes)
    elif stage.kind == "rl":
        parallel = config["parallel"]
        ranks = parallel["tensor_parallel"] * parallel["pipeline_parallel"]
        trained = resources["nodes"] * resources["ranks_per_node"]
        if trained != ranks:
            notes.append(f"DP {trained // ranks} -> 1 (TP {parallel['tensor_parallel']}, "
                         f"PP {parallel['pipeline_parallel']} kept)")
        _scaled(config, "steps", scale.rl_steps, notes)
        _scaled(config, "prompts_per_step", scale.prompts_per_step, notes)
        _scaled(config, "group_size", scale.group_size, notes)
        # The stream the model was fitted on: a raw-stream run (DEPO in place of curation) reads the
        # curation's sources, of which the rehearsal model answers only the first prompts.
        _scaled(config, "data.limit", scale.prompts, notes)
        # Multi-round samplers' volumes scale with the group; the DEPO event is at most their pool.
        ada_seq = config["algorithm"]["ada_seq"]
        _scaled(config, "algorithm.ada_seq.round_size", min(ada_seq["round_size"], scale.group_size), notes)
        _scaled(config, "algorithm.ada_seq.max_samples", min(ada_seq["max_samples"], 2 * scale.group_size), notes)
        if config["algorithm"]["depo"]["zero_variance_samples"] is not None:
            _scaled(config, "algorithm.depo.zero_variance_samples",
                    min(config["algorithm"]["depo"]["zero_variance_samples"], ada_seq["max_samples"]), notes)
        depo = config["algorithm"]["depo"]
        _scaled(config, "algorithm.depo.minibatches", min(depo["minibatches"], scale.estimator_updates), notes)
        _scaled(config, "algorithm.depo.minibatch_size", min(depo["minibatch_size"], scale.estimator_minibatch), notes)
        _scaled(config, "eval_limit", scale.eval_problems, notes)
        _scaled(config, "eval_samples", min(config["eval_samples"], 2), notes)
        _scaled(config, "reward.num_workers", scale.grading_workers, notes)
        _scaled(config, "trainer.precision", "fp32", notes)
        _scaled(config, "parallel.backend", "gloo", notes)
        rollout = config["rollout"]
        servers = resources.get("rollout")
        if servers is not None:
            _scaled(config, "rollout.min_servers", min(rollout["min_servers"], servers_here), notes)
            _scaled(config, "rollout.server_tensor_parallel", 1, notes)  # a stand-in plays one update-group rank
    elif stage.kind == "evaluate":
        _scaled(config, "eval.limit", scale.eval_problems, notes)
        _scaled(config, "eval.num_samples", scale.eval_samples, notes)
        _scaled(config, "eval.ks", [k for k in config["eval"]["ks"] if k <= scale.eval_samples], notes)
        _scaled(config, "eval.bootstrap_samples", min(config["eval"]["bootstrap_samples"], 100), notes)
        _scaled(config, "reward.num_workers", scale.grading_workers, notes)
        _cpu(config, notes)
    _scale_resources(resources, ranks=ranks, servers_here=servers_here, notes=notes)
    if resources.get("rollout") is not None:
        resources["rollout"]["port"] = port
        resources["rollout"]["extra_args"] = [*resources["rollout"]["extra_args"], "--request-log",
                                              str(request_logs / f"{stage.name}.jsonl")]
    kind_config = type(stage.config)
    rehearsed = dataclasses.replace(
        stage, config=configlib.from_dict(kind_config, config, path=f"stages.{stage.name}.config"),
        resources=configlib.from_dict(type(stage.resources), resources, path=f"stages.{stage.name}.resources"))
    return rehearsed, notes


def rehearsal_plan(plan: CampaignPlan, *, scale: RehearsalScale, request_logs: Path, first_port: int,
                   killed: str | None = None) -> tuple[CampaignPlan, dict[str, list[str]]]:
    """Every stage of ``plan`` as the rehearsal runs it (model paths already replaced), with the changes.

    Stage ``i``'s stand-ins listen from ``first_port + i × scale.ports_per_stage`` on (a block the
    caller holds: ``reserved_port_block``); stage
    ``killed`` (the one a stand-in is killed in) has more of them.
    """
    request_logs.mkdir(parents=True, exist_ok=True)
    stages, changes = [], {}
    for index, stage in enumerate(plan.stages):
        stage_port = first_port + index * scale.ports_per_stage
        rehearsed, notes = rehearsal_stage(stage, scale=scale, request_logs=request_logs, port=stage_port,
                                           killed=stage.name == killed)
        stages.append(rehearsed)
        changes[stage.name] = notes
    stages = [_on_answered_prompts(stage, stages, changes[stage.name]) for stage in stages]
    return CampaignPlan(name=f"{plan.name}-rehearsal", output_dir=plan.output_dir, stages=stages), changes


def _on_answered_prompts(stage: Stage, stages: list[Stage], notes: list[str]) -> Stage:
    """An rl stage on the raw stream of the curation's sources trains on the curation's kept prompts instead.

    The rehearsal model is fitted to answer the curation's prompts with a spread of skill (the
    first barely, the last well: ``fit_answers``), so that curation keeps some. A raw stream of
    them hands step 1 four of the sixteen at random, often all-wrong groups, and the check that
    step 1 has a gradient would fail for the model, not for the wiring. The kept prompts are the
    ones it answers sometimes (1 to 3 of k); the stage then also waits for the curation.
    """
    curate = next((other for other in stages if other.kind == "curate"), None)
    config = stage.config
    if (stage.kind != "rl" or curate is None or config.curation_dir is not None
            or list(config.data.train) != list(curate.config.sources)):
        return stage
    from pipeline.stats.curation import KEPT_FILE

    kept = str(Path(curate.config.output_dir) / KEPT_FILE)
    notes.append(f"data.train {list(config.data.train)} -> [{kept}] (the prompts the rehearsal model answers "
                 f"sometimes; data.split {config.data.split} -> None: a file has none)")
    data = dataclasses.replace(config.data, train=[kept], split=None)
    depends_on = stage.depends_on if curate.name in stage.depends_on else (*stage.depends_on, curate.name)
    return dataclasses.replace(stage, config=dataclasses.replace(config, data=data), depends_on=depends_on)


def published_model_folder(model_dir: str, out: Path) -> Path:
    """A folder holding only the model's ``config.json``: what the full-size plan check reads."""
    config, _ = published_config(model_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


# ================================================================ checks at stage boundaries


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _artifact_paths(stage: Stage) -> list[str]:
    """What a stage writes that only a later stage can give a meaning to."""
    cfg = stage.config
    if stage.kind == "curate":
        return [cfg.output_dir]
    if stage.kind == "train-estimator":
        return [cfg.output_dir]
    if stage.kind == "rl":
        return [cfg.checkpoint.directory]
    if stage.kind == "convert":
        return [cfg.out]
    return []


def unread_artifacts(plan: CampaignPlan) -> list[str]:
    """Stages whose output no later stage reads (a trained artifact must be read, or not trained)."""
    unread = []
    for stage in plan.stages:
        readers = [json.dumps(configlib.to_dict(other.config)) for other in plan.stages if other is not stage]
        for path in _artifact_paths(stage):
            if not any(path in text for text in readers):
                unread.append(f"{stage.name} writes {path}, which no later stage reads")
    return unread


def check_stage(stage: Stage, plan: CampaignPlan) -> list[str]:
    """Raise ``AssertionError`` naming what is wrong when a finished stage's output means nothing.

    Returns notes for the report: what a check could not see in this run, and why that is no break.
    """
    cfg = stage.config
    notes: list[str] = []
    if stage.kind == "curate":
        kept = _read_jsonl(Path(cfg.output_dir) / "kept.jsonl")
        assert kept, "curation kept no prompt"
    elif stage.kind == "rl":
        rows = _read_jsonl(Path(cfg.logging.output_dir) / "metrics.jsonl")
        steps = [row for row in rows if "grad_norm" in row]
        assert steps, "no rl step was logged"
        assert steps[0].get("budget/samples_per_prompt_mean", 0) > 0, "step 1 trained on an empty stream"
        # A step whose groups all got equal rewards has a zero gradient by the math (no advantage), however
        # well it is wired: the rehearsal model answers its prompts only sometimes (curation keeps those solved
        # 1-3 times in 8; at 1 in 8 a group of 4 is all wrong 59% of the time), so a step of 4 groups of 4 is
        # now and then uniform by chance. The break to catch is a gradient that is zero although a group
        # had signal (a masked loss, dropped advantages), or a run with no signal at all.
        with_signal = [row for row in steps if row.get("zero_signal_group_fraction", 0.0) < 1.0]
        for row in with_signal:
            assert row["grad_norm"] > 0, (
                f"step {row.get('step')} has a zero gradient although "
                f"{1.0 - row.get('zero_signal_group_fraction', 0.0):.0%} of its groups had unequal rewards "
                f"(reward_mean {row.get('reward_mean')})")
        assert with_signal, (f"no step had a group with unequal rewards in {len(steps)} steps (reward_mean "
                             f"{[row.get('reward_mean') for row in steps]}): the stream teaches nothing")
        if with_signal[0] is not steps[0]:
            notes.append(f"{stage.name}: every group of step {steps[0].get('step')} got equal rewards (reward_mean "
                         f"{steps[0].get('reward_mean')}), so its gradient is zero; step "
                         f"{with_signal[0].get('step')} is the first with signal, and its gradient is not")
    elif stage.kind == "evaluate":
        results = json.loads((Path(cfg.output_dir) / "results.json").read_text())
        benchmarks = results.get("benchmarks", {})
        missing = [name for name in cfg.eval.benchmarks if not any(name in key for key in benchmarks)]
        assert not missing, f"no results for {missing}"
    elif stage.kind == "export":
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(cfg.out, local_files_only=True, trust_remote_code=False)
        model = AutoModelForCausalLM.from_pretrained(cfg.out, local_files_only=True, trust_remote_code=False)
        expected = (config.architectures or [""])[0]
        assert type(model).__name__ == expected, f"the export reloads as {type(model).__name__}, not {expected}"
    return notes


def metric_rows(path: Path) -> list[dict[str, Any]]:
    """The content of each logged step: timing columns dropped, one row per step (the last logged)."""
    by_step: dict[Any, dict[str, Any]] = {}
    for row in _read_jsonl(path):
        if "grad_norm" not in row:
            continue
        kept = {key: value for key, value in row.items()
                if key not in TIMING_KEYS and not key.startswith(TIMING_PREFIXES)}
        by_step[row.get("step")] = kept
    return [by_step[step] for step in sorted(by_step, key=lambda s: (s is None, s))]


# ================================================================ events


def _processes_with(*runs: tuple[str, ...]) -> list[int]:
    """Pids (this machine's /proc) whose argv holds each of ``runs`` as consecutive arguments."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if all(any(tuple(argv[i : i + len(run)]) == run for i in range(len(argv))) for run in runs):
            pids.append(int(entry.name))
    return pids


class EventPlayer(threading.Thread):
    """Plays the rehearsal's events once each, when their stage has logged its first step."""

    def __init__(self, plan: CampaignPlan, *, stop_stage: str | None, kill_stage: str | None, executor: str,
                 out: Callable[[str], Any]) -> None:
        super().__init__(daemon=True)
        self.plan = plan
        self.stop_stage = stop_stage
        self.kill_stage = kill_stage
        self.executor = executor
        self.out = out
        self.done = threading.Event()
        self.played: dict[str, str] = {}

    def _first_step_logged(self, name: str) -> bool:
        stage = self.plan.stage(name)
        return any("grad_norm" in row for row in _read_jsonl(Path(stage.config.logging.output_dir) / "metrics.jsonl"))

    def _signal_stop(self, name: str) -> str:
        status = CampaignStatus(self.plan.output_dir).read().get(name, {})
        if self.executor == "slurm" and status.get("job_id"):
            # As `sbatch --signal=USR1@lead` does at the time limit: every task of the job's steps.
            subprocess.run(["scancel", "--signal=USR1", str(status["job_id"])], check=True)
            return f"scancel --signal=USR1 {status['job_id']}"
        pids = _processes_with(("-m", "pipeline.cli.task", "node"), ("--campaign-dir", str(self.plan.output_dir)),
                               ("--stage", name))
        for pid in pids:  # the node role forwards it to torchrun, torchrun to its ranks
            os.kill(pid, signal.SIGUSR1)
        return f"SIGUSR1 to the node role (pid {', '.join(map(str, pids))})"

    def _kill_server(self, name: str) -> str:
        port = self.plan.stage(name).resources.rollout.port
        pids = _processes_with(("-m", "pipeline.cli.standin"), ("--port", str(port)))
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        return f"SIGKILL to the stand-in server on port {port} (pid {', '.join(map(str, pids))})"

    def run(self) -> None:
        while not self.done.wait(1.0):
            for name, action in ((self.stop_stage, self._signal_stop), (self.kill_stage, self._kill_server)):
                if name and name not in self.played and self._first_step_logged(name):
                    try:
                        self.played[name] = action(name)
                    except (OSError, subprocess.CalledProcessError) as error:
                        self.played[name] = f"could not be played: {error}"
                    self.out(f"rehearsal event, {name}: {self.played[name]}")


# ================================================================ the run


def _stage_seconds(status: dict[str, Any], name: str) -> float:
    record = status.get(name, {})
    if record.get("seconds") is not None:
        return float(record["seconds"])
    started, finished = record.get("started"), record.get("finished")
    if started and finished:
        fmt = "%Y-%m-%dT%H:%M:%S%z"
        return time.mktime(time.strptime(finished, fmt)) - time.mktime(time.strptime(started, fmt))
    return 0.0


def _first_line(text: str | None) -> str:
    return (text or "").strip().splitlines()[0][:200] if (text or "").strip() else ""


def control_stage(stage: Stage, *, root: Path, port: int) -> Stage:
    """An uninterrupted copy of ``stage``: its own folders under ``root`` and stand-ins from ``port`` on.

    It joins the rehearsed plan with the same dependencies, so a cluster runs it beside the
    campaign; after the signalled stage resumed, the two must have logged the same rows.
    """
    cfg = stage.config
    run_dir = root / stage.name
    config = dataclasses.replace(
        cfg, checkpoint=dataclasses.replace(cfg.checkpoint, directory=str(run_dir / "checkpoints")),
        logging=dataclasses.replace(cfg.logging, output_dir=str(run_dir)),
        rollout=dataclasses.replace(cfg.rollout, weights_dir=None))
    resources = stage.resources
    if resources.rollout is not None:
        extra = list(resources.rollout.extra_args)
        if "--request-log" in extra:  # a log of its own
            at = extra.index("--request-log") + 1
            extra[at] = str(Path(extra[at]).with_name(f"{stage.name}{CONTROL_SUFFIX}.jsonl"))
        resources = dataclasses.replace(resources, rollout=dataclasses.replace(resources.rollout, port=port,
                                                                                extra_args=extra))
    return Stage(name=f"{stage.name}{CONTROL_SUFFIX}", kind=stage.kind, config=config, depends_on=stage.depends_on,
                 resources=resources)


def prompt_sources(plan: CampaignPlan) -> tuple[list[str], str | None, str]:
    """(sources, split, template) of the first prompts the plan generates for: its curation's, else its rl's."""
    for stage in plan.order():
        if stage.kind == "curate":
            return list(stage.config.sources), stage.config.split, stage.config.template
        if stage.kind == "rl":
            return list(stage.config.data.train), stage.config.data.split, stage.config.data.template
    raise UserError(f"--rehearse: campaign {plan.name} has no stage that generates (curate or rl)")


def rebased(plan: CampaignPlan, root: Path) -> CampaignPlan:
    """``plan`` with every path under its output folder moved under ``root``."""
    moved = plan.with_paths_moved(str(plan.output_dir.absolute()), str(root))
    return CampaignPlan(name=moved.name, output_dir=root, stages=moved.stages)


def run_rehearsal(plan: CampaignPlan, *, output_dir: str | Path, check_plan: Callable[[CampaignPlan], None],
                  executor: str = "local", profile=None, scale: RehearsalScale = RehearsalScale(),
                  events: bool = True, out: Callable[[str], Any] = print) -> RehearsalReport:
    """Rehearse ``plan`` (a recipe's campaign or one stage) under ``output_dir``; the report.

    ``check_plan``: the check `winnow launch` makes before it submits (it raises a ``UserError``
    to refuse), run here on the full-size plan.
    """
    from pipeline.data.sources import load_prompts
    from pipeline.launch.nemo import LaunchOptions, launch_campaign

    started = time.perf_counter()
    root = Path(output_dir).absolute()
    report = RehearsalReport(recipe=plan.name)
    source = model_dir_of(plan)
    # Every rehearsal starts afresh (a done stage would be skipped, its events never played); the
    # scaled model is kept: it depends on the recipe's model and prompts only.
    for previous in ("campaign", "control", "requests", "published", "report.txt"):
        path = root / previous
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    plan = rebased(plan, root / "campaign")

    # 1. The checks `winnow launch` makes, at full size, against the model's (published) config.
    published = published_model_folder(source, root / "published" / Path(source).name)
    full_size = with_model(plan, model_dir=source, folder=published)
    check_plan(full_size)
    unread = unread_artifacts(plan)
    if unread:
        raise UserError("the campaign trains what nothing reads: " + "; ".join(unread))

    # 2. The model: the recipe's architecture, scaled down, fitted to answer the first curation prompts.
    tensor_parallel = max((s.config.parallel.tensor_parallel for s in plan.stages if s.kind == "rl"), default=1)
    model_folder = root / "model"
    saved = json.loads((root / "model.json").read_text()) if (root / "model.json").is_file() else {}
    if saved.get("model_dir") != source or saved.get("tensor_parallel") != tensor_parallel:
        shutil.rmtree(model_folder, ignore_errors=True)
        out(f"building the rehearsal model of {source}")
        model = build_rehearsal_model(source, model_folder, tensor_parallel=tensor_parallel)
        sources, split, template = prompt_sources(plan)
        problems = []
        for spec in sources:
            prompts, _ = load_prompts(spec, split=split, limit=scale.prompts)
            problems += [(p.problem, p.answer) for p in prompts]
        losses = fit_answers(model_folder, problems=problems, template=template)
        model.changes.append(f"fitted to answer its {len(problems)} curation prompts (loss "
                             f"{losses['first_loss']:.2f} -> {losses['last_loss']:.2f})")
        (root / "model.json").write_text(json.dumps({"model_dir": source, "tensor_parallel": tensor_parallel,
                                                     "source": model.source, "changes": model.changes}, indent=2))
    else:
        model = RehearsalModel(folder=model_folder, source=saved["source"], changes=saved["changes"])
        out(f"reusing the rehearsal model in {model_folder}")
    report.model = model

    # 3. The plan the rehearsal runs.
    # The events' stages: the first rl variant with servers is stopped, a stand-in of the second killed.
    served = [stage.name for stage in plan.order() if stage.kind == "rl" and stage.resources.rollout is not None]
    stop_stage = served[0] if events and served else None
    kill_stage = served[1] if events and len(served) > 1 else None  # one variant: only the stop is played
    # One port block, held until the launches end (ports a stand-in restarts on stay its own): every stage's
    # stand-ins, then the control run's.
    with reserved_port_block((len(plan.stages) + 1) * scale.ports_per_stage) as first_port:
        control_port = first_port + len(plan.stages) * scale.ports_per_stage
        rehearsed, changes = rehearsal_plan(with_model(plan, model_dir=source, folder=model_folder), scale=scale,
                                            request_logs=root / "requests", first_port=first_port, killed=kill_stage)
        options = LaunchOptions(executor=executor, profile=profile, wait=True, poll_s=2.0)
        if stop_stage is not None:
            control = control_stage(rehearsed.stage(stop_stage), root=root / "control", port=control_port)
            rehearsed = CampaignPlan(name=rehearsed.name, output_dir=rehearsed.output_dir,
                                     stages=[*rehearsed.stages, control])
            changes[control.name] = [f"an uninterrupted copy of {stop_stage}, whose rows its resumed run must equal"]
        report.rows = {stage.name: StageRow(name=stage.name, kind=stage.kind, scaled=changes[stage.name])
                       for stage in rehearsed.order()}
        player = EventPlayer(rehearsed, stop_stage=stop_stage, kill_stage=kill_stage, executor=executor, out=out)
        player.start()
        try:
            for attempt in range(3):  # a signalled stop ends a local launch; relaunching resumes it
                result = launch_campaign(rehearsed, options=options, out=out)
                if result.ok or not any(state == "pending" for state in result.states.values()) or result.blocked:
                    break
        finally:
            player.done.set()
            player.join()

    report.notes += [f"event, {name}: {what}" for name, what in player.played.items()]
    for name in (stop_stage, kill_stage):
        if name and name not in player.played:
            report.notes.append(f"event for {name} not played (it logged no step)")

    # 4. Each stage's outcome, then what its output means.
    status = CampaignStatus(rehearsed.output_dir).read()
    for stage in rehearsed.order():
        row = report.rows[stage.name]
        record = status.get(stage.name, {})
        row.seconds = _stage_seconds(status, stage.name)
        if record.get("state") != "done":
            blocker = next((dep for dep in stage.depends_on if status.get(dep, {}).get("state") != "done"), None)
            if record.get("state") == "pending" and blocker is not None:
                row.error = f"{blocker} did not finish"
            else:
                row.state, row.error = "FAIL", _first_line(record.get("error")) or f"state {record.get('state')}"
            continue
        try:
            report.notes += check_stage(stage, rehearsed)
            row.state = "PASS"
        except (AssertionError, OSError, ValueError, KeyError) as error:
            row.state, row.error = "FAIL", _first_line(f"{type(error).__name__}: {error}")
    if stop_stage and report.rows[stop_stage].state == "PASS":
        _check_resume(rehearsed, stop_stage, report, played=stop_stage in player.played)
    if kill_stage and report.rows[kill_stage].state == "PASS":
        _check_restart(rehearsed, kill_stage, report, played=kill_stage in player.played)
    report.seconds = time.perf_counter() - started
    return report


def _check_resume(plan: CampaignPlan, name: str, report: RehearsalReport, *, played: bool) -> None:
    row = report.rows[name]
    status = CampaignStatus(plan.output_dir).read().get(name, {})
    if not played:
        row.state, row.error = "FAIL", "the SIGUSR1 event was not played"
        return
    if status.get("attempts", 0) < 2 and not status.get("restarts"):
        row.state, row.error = "FAIL", "SIGUSR1 did not stop the stage (it finished in one attempt)"
        return
    resumed = metric_rows(Path(plan.stage(name).config.logging.output_dir) / "metrics.jsonl")
    if report.rows[name + CONTROL_SUFFIX].state != "PASS":
        row.state, row.error = "FAIL", f"its uninterrupted copy {name}{CONTROL_SUFFIX} did not pass"
        return
    control = metric_rows(Path(plan.stage(name + CONTROL_SUFFIX).config.logging.output_dir) / "metrics.jsonl")
    if resumed != control:
        differing = sorted({key for a, b in zip(resumed, control) for key in set(a) | set(b)
                            if a.get(key) != b.get(key)})
        row.state = "FAIL"
        row.error = (f"the resumed rows differ from an uninterrupted run ({len(resumed)} vs {len(control)} rows; "
                     f"columns {differing[:5]})")
        return
    report.notes.append(f"{name}: stopped by SIGUSR1, resumed; its {len(resumed)} rows equal an uninterrupted run's")


def _check_restart(plan: CampaignPlan, name: str, report: RehearsalReport, *, played: bool) -> None:
    row = report.rows[name]
    if not played:
        row.state, row.error = "FAIL", "the server-kill event was not played"
        return
    log = _read_jsonl(plan.output_dir.parent / "requests" / f"{name}.jsonl")
    port = plan.stage(name).resources.rollout.port
    mine = [entry for entry in log if entry.get("port") == port]
    pids = list(dict.fromkeys(entry["pid"] for entry in mine))
    if len(pids) < 2:
        row.state, row.error = "FAIL", f"the killed server on port {port} was never restarted"
        return
    after = [entry for entry in mine if entry["pid"] == pids[-1]]
    first_generate = next((i for i, entry in enumerate(after) if entry["path"] == "/generate"), None)
    synced = any(entry["path"].startswith("/update_weights") for entry in after[:first_generate])
    if first_generate is not None and not synced:
        row.state, row.error = "FAIL", "the restarted server generated before it was re-synced"
        return
    report.notes.append(f"{name}: the server on port {port} was killed, restarted (pid {pids[0]} -> {pids[-1]}) "
                        f"and re-synced before it served again")
