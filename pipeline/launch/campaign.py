"""Campaigns: a DAG of named stages, a status file, and the in-process runner.

A campaign is bootstrap → curate → train-estimator (when a variant filters with DEPO)
→ rl (one or more variants) → evaluate and export each variant, every stage a typed
config plus the resources it runs on. :func:`wire_campaign` derives every path between
stages from one output root, so a recipe states only sizes and methods. The same :class:`CampaignPlan`
runs in one process (:func:`run_campaign_inprocess`, one ``ParallelContext`` shared by
every stage: megatron initializes once per process) or as NeMo-Run tasks on a
local machine or a SLURM cluster (:mod:`pipeline.launch.nemo`).

``<output_dir>/campaign.json`` holds the plan (what the SLURM tasks read back) and
``<output_dir>/status.json`` each stage's state (pending/running/done/failed) with
times and attempts. Only ``done`` is final: a relaunch skips done stages and reruns
the others, and a failed stage stops every stage that depends on it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pipeline import configlib
from pipeline.config import (
    STAGE_KINDS,
    BootstrapConfig,
    ConvertConfig,
    CurateConfig,
    EvaluateConfig,
    ExportConfig,
    Resources,
    RLConfig,
    StageKind,
    TrainEstimatorConfig,
)
from pipeline.configlib import ConfigError
from pipeline.errors import EXIT_USER_ERROR
from pipeline.io import atomic_write_json, resolve_cache_dir
from pipeline.stages.preflight import PREFLIGHTS, CheckpointInputs, HfFolderInputs, preflight, register_preflight

PLAN_FILE = "campaign.json"
STATUS_FILE = "status.json"
STATES = ("pending", "running", "done", "failed")
# EX_TEMPFAIL: a stage stopped early on SIGTERM/SIGUSR1 after checkpointing. The SLURM
# task exits with it so the job is requeued (``job_exit``) and resumes from ``latest``.
EXIT_REQUEUE = 75
# The exit statuses of a stage's job that are final whatever the requeue budget: success, and
# a user error (bad config or data, a malformed checkpoint, a failed conversion gate: the same
# inputs fail the same way again). Every other status is transient: a checkpointed stop (75),
# a task killed by signal N (srun reports 128 + N), torchrun's 1 when a rank died, an
# unexpected exception (1) — the job script cannot tell a bug from a peer lost mid-collective.
FINAL_EXITS = (0, EXIT_USER_ERROR)
# What a job exits with instead of 75 when it is not requeued: clusters that set
# RequeueExit=75 in slurm.conf would otherwise requeue it past the stage's ``requeues``.
EXIT_STOPPED_FOR_GOOD = 1
StageOutcome = Literal["done", "stopped"]


# ================================================================ launch-only stage inputs, the DAG, job exits


# The two launch-only stages check what `winnow convert` checks.
@register_preflight(ExportConfig)
def _export_inputs(cfg: ExportConfig, found) -> None:
    PREFLIGHTS[CheckpointInputs](CheckpointInputs(checkpoint=cfg.checkpoint, out=cfg.out, tokenizer=cfg.tokenizer),
                                 found)


@register_preflight(ConvertConfig)
def _convert_inputs(cfg: ConvertConfig, found) -> None:
    PREFLIGHTS[HfFolderInputs](HfFolderInputs(hf=cfg.hf, out=cfg.out), found)


def dependency_order(depends_on: Mapping[str, Sequence[str]]) -> list[str]:
    """The names of ``depends_on`` (name → the names it depends on), each after all it depends on.

    Among names that are ready at once, the mapping's order: a plan runs as it is listed where
    its edges allow. A cycle is a ``ConfigError`` naming the stages on or behind it.
    """
    placed: set[str] = set()
    order: list[str] = []
    remaining = list(depends_on)
    while remaining:
        ready = next((name for name in remaining if all(dep in placed for dep in depends_on[name])), None)
        if ready is None:
            raise ConfigError(f"stages: dependency cycle among {', '.join(remaining)}")
        placed.add(ready)
        order.append(ready)
        remaining.remove(ready)
    return order


def reachable(start: str, edges: Mapping[str, Sequence[str]]) -> list[str]:
    """Every name reachable from ``start`` along ``edges`` (name → next names), nearest first.

    Breadth-first, each name once, ``start`` itself left out: along "depends on" edges the
    stages a stage needs, along the reverse ones the stages that need it.
    """
    found: list[str] = []
    seen = {start}
    frontier = [start]
    while frontier:
        current = frontier.pop(0)
        for name in edges.get(current, ()):
            if name not in seen:
                seen.add(name)
                found.append(name)
                frontier.append(name)
    return found


def job_exit(code: int, *, restarts: int, requeues: int) -> tuple[bool, int]:
    """(requeue the job?, the status it exits with) for a stage whose task exited ``code``.

    ``restarts``: ``SLURM_RESTART_COUNT`` of this attempt; ``requeues``: the stage's budget
    (``Resources.requeues``). The job script (``pipeline.launch.nemo.requeue_trap``) applies
    the same table in bash, after srun returns, so it also holds for a task that was killed.
    """
    if code in FINAL_EXITS:
        return False, code
    if restarts < requeues:
        return True, code
    return False, EXIT_STOPPED_FOR_GOOD if code == EXIT_REQUEUE else code


@dataclass(kw_only=True, slots=True)
class Stage:
    name: str
    kind: str
    config: Any
    depends_on: tuple[str, ...] = ()
    resources: Resources = dataclasses.field(default_factory=Resources)

    def __post_init__(self) -> None:
        if self.kind not in STAGE_KINDS:
            raise ConfigError(f"stages.{self.name}.kind: {self.kind!r} is not one of {STAGE_KINDS.names()}")
        kind = self.stage_kind
        if not isinstance(self.config, kind.config):
            raise ConfigError(f"stages.{self.name}.config: a {self.kind} stage takes a "
                              f"{kind.config.__name__}, got {type(self.config).__name__}")
        if self.resources.num_ranks > 1 and not kind.multi_rank:
            multi_rank = [other.name for other in STAGE_KINDS.values() if other.multi_rank]
            raise ConfigError(f"stages.{self.name}.resources: a {self.kind} stage runs on one rank "
                              f"(got {self.resources.num_ranks}); only {', '.join(multi_rank)} run on more")
        if self.resources.rollout is not None and not kind.rollout_servers:
            with_servers = [other.name for other in STAGE_KINDS.values() if other.rollout_servers]
            raise ConfigError(f"stages.{self.name}.resources.rollout: only {', '.join(with_servers)} stages use "
                              "rollout servers")
        servers = self.resources.rollout
        if servers is not None and kind.servers_need_model_path and not servers.model_path:
            article = "an" if self.kind[:1] in "aeiou" else "a"
            raise ConfigError(f"stages.{self.name}.resources.rollout.model_path: the servers of {article} {self.kind} "
                              "stage start from a Hugging Face folder of the policy's architecture (they then load "
                              "the policy itself)")
        if self.resources.rollout is not None and not (self.resources.rollout.model_path or self.config.policy):
            raise ConfigError(f"stages.{self.name}.config.policy: SGLang servers need a Hugging Face policy "
                              "folder to serve (the bootstrap policy is a winnow checkpoint)")
        if kind.check_resources is not None:
            kind.check_resources(self.name, self.config, self.resources)
        if servers is not None and self.config.rollout.min_servers > servers.nodes * servers.servers_per_node:
            raise ConfigError(f"stages.{self.name}.config.rollout.min_servers: {self.config.rollout.min_servers} "
                              f"exceeds the {servers.nodes * servers.servers_per_node} servers of "
                              f"resources.rollout ({servers.nodes} nodes x {servers.servers_per_node})")

    @property
    def stage_kind(self) -> StageKind:
        """What this stage's kind is (``pipeline.config.STAGE_KINDS``)."""
        return STAGE_KINDS.get(self.kind)


@dataclass(kw_only=True, slots=True)
class CampaignPlan:
    name: str
    output_dir: Path
    stages: list[Stage]

    def __post_init__(self) -> None:
        self.output_dir = Path(self.output_dir)
        names = [stage.name for stage in self.stages]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ConfigError(f"stages: {duplicates[0]!r} is named twice")
        for stage in self.stages:
            missing = [dep for dep in stage.depends_on if dep not in names]
            if missing:
                raise ConfigError(f"stages.{stage.name}.depends_on: no stage named {missing[0]!r}")
        self.order()  # refuses cycles

    def stage(self, name: str) -> Stage:
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise ConfigError(f"no stage named {name!r} in campaign {self.name!r} (stages: "
                          f"{', '.join(s.name for s in self.stages)})")

    def order(self) -> list[Stage]:
        """Stages in dependency order; among ready stages, the order they were listed in."""
        by_name = {stage.name: stage for stage in self.stages}
        return [by_name[name] for name in dependency_order({s.name: s.depends_on for s in self.stages})]

    def dependencies(self, name: str) -> list[str]:
        """Every stage ``name`` depends on, directly or through others, nearest first."""
        return reachable(name, {stage.name: stage.depends_on for stage in self.stages})

    def dependents(self, name: str) -> list[str]:
        """Every stage that depends on ``name``, directly or through others, nearest first."""
        needed_by: dict[str, list[str]] = {stage.name: [] for stage in self.stages}
        for stage in self.stages:
            for dep in stage.depends_on:
                needed_by[dep].append(stage.name)
        return reachable(name, needed_by)

    # ------------------------------------------------------------ campaign.json
    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "output_dir": str(self.output_dir), "stages": [
            {"name": s.name, "kind": s.kind, "depends_on": list(s.depends_on),
             "resources": configlib.to_dict(s.resources), "config": configlib.to_dict(s.config)}
            for s in self.stages]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CampaignPlan:
        stages = []
        for entry in data["stages"]:
            kind = entry["kind"]
            if kind not in STAGE_KINDS:
                raise ConfigError(f"stages.{entry['name']}.kind: {kind!r} is not one of {STAGE_KINDS.names()}")
            stages.append(Stage(
                name=entry["name"], kind=kind, depends_on=tuple(entry["depends_on"]),
                resources=configlib.from_dict(Resources, entry["resources"], path=f"stages.{entry['name']}.resources"),
                config=configlib.from_dict(STAGE_KINDS.get(kind).config, entry["config"],
                                           path=f"stages.{entry['name']}.config"),
            ))
        return cls(name=data["name"], output_dir=Path(data["output_dir"]), stages=stages)

    def save(self) -> Path:
        self.output_dir.mkdir(parents=True, exist_ok=True)
        path = self.output_dir / PLAN_FILE
        atomic_write_json(path, self.to_dict())
        return path

    @classmethod
    def load(cls, output_dir: str | Path) -> CampaignPlan:
        path = Path(output_dir) / PLAN_FILE
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except FileNotFoundError:
            raise ConfigError(f"{path}: no campaign plan here (launch the campaign first)") from None

    def with_overrides(self, overrides: list[str]) -> CampaignPlan:
        """``<stage>.<dotted option>=value`` overrides, e.g. ``rl-grpo.steps=5``, validated per stage."""
        by_stage: dict[str, list[str]] = {}
        for text in overrides:
            name, sep, rest = text.partition(".")
            if not sep:
                raise ConfigError(f"override {text!r}: expected <stage>.<option>=value")
            self.stage(name)
            by_stage.setdefault(name, []).append(rest)
        stages = [dataclasses.replace(s, config=configlib.load(type(s.config), base=s.config,
                                                               overrides=by_stage.get(s.name, [])))
                  for s in self.stages]
        plan = CampaignPlan(name=self.name, output_dir=self.output_dir, stages=stages)
        # A bootstrap writes its policy to <cache_dir>/<hash of its config>, the folder every later stage
        # was wired to read: an override of the bootstrap moves that folder, so the readers follow it.
        from pipeline.stages.bootstrap import config_hash

        for before, after in zip(self.stages, stages):
            if isinstance(before.config, BootstrapConfig) and config_hash(before.config) != config_hash(after.config):
                old = str(Path(before.config.cache_dir) / config_hash(before.config))
                new = str(Path(after.config.cache_dir) / config_hash(after.config))
                plan = plan.with_paths_moved(old, new)
                # rl stages name the base policy by its bootstrap section (built or reused from the cache).
                plan = CampaignPlan(name=plan.name, output_dir=plan.output_dir, stages=[
                    dataclasses.replace(s, config=dataclasses.replace(s.config, bootstrap=after.config))
                    if isinstance(s.config, RLConfig) and s.config.bootstrap == before.config else s
                    for s in plan.stages])
        return plan

    def with_paths_moved(self, old: str, new: str) -> CampaignPlan:
        """The plan with every stage path equal to ``old``, or under it, now under ``new``."""

        def move(value: Any) -> Any:
            if isinstance(value, str) and (value == old or value.startswith(old + "/")):
                return new + value[len(old):]
            if isinstance(value, list):
                return [move(item) for item in value]
            if isinstance(value, dict):
                return {key: move(item) for key, item in value.items()}
            return value

        data = self.to_dict()
        data["stages"] = move(data["stages"])
        return CampaignPlan.from_dict(data)


# ================================================================ the status file


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


class CampaignStatus:
    """``status.json``: one record per stage, updated under an exclusive lock.

    Stages of one campaign may run at once on different nodes and write their own
    record; every update is read-modify-write under ``flock`` on ``status.lock`` and
    replaces the file atomically, so readers never see half a file.
    """

    def __init__(self, output_dir: str | Path) -> None:
        self.directory = Path(output_dir)
        self.path = self.directory / STATUS_FILE

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.directory.mkdir(parents=True, exist_ok=True)
        with open(self.directory / "status.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def read(self) -> dict[str, dict[str, Any]]:
        if not self.path.is_file():
            return {}
        return json.loads(self.path.read_text())["stages"]

    def state(self, name: str) -> str:
        return self.read().get(name, {}).get("state", "pending")

    def update(self, name: str, state: str, **fields: Any) -> dict[str, Any]:
        assert state in STATES, state
        with self._locked():
            stages = self.read()
            record = stages.setdefault(name, {"attempts": 0})
            if state == "running":
                record.update(started=_now(), finished=None, error=None, attempts=record["attempts"] + 1)
            elif state in ("done", "failed"):
                record["finished"] = _now()
            record.update(state=state, **fields)
            atomic_write_json(self.path, {"stages": stages})
            return record

    def initialize(self, plan: CampaignPlan) -> None:
        """Records for new stages; a stage left ``running`` by a dead launcher stays as it was."""
        with self._locked():
            stages = self.read()
            for stage in plan.stages:
                stages.setdefault(stage.name, {"state": "pending", "attempts": 0})
            atomic_write_json(self.path, {"stages": stages})

    def format(self, plan: CampaignPlan) -> str:
        stages = self.read()
        lines = [f"{'stage':<22} {'state':<8} {'attempts':>8}  finished"]
        for stage in plan.order():
            record = stages.get(stage.name, {})
            lines.append(f"{stage.name:<22} {record.get('state', 'pending'):<8} {record.get('attempts', 0):>8}  "
                         f"{record.get('finished') or ''}")
        from pipeline.launch.ledger import read_ledger  # the tokens each stage has spent so far

        return "\n".join([*lines, "", read_ledger(plan).format()])


# ================================================================ running one stage

StageRunner = Callable[..., StageOutcome]


def stage_runner(kind: str) -> Callable[[StageRunner], StageRunner]:
    """Decorator: the function runs stages of ``kind`` in this process (``StageKind.runner``)."""

    entry = STAGE_KINDS.get(kind)

    def attach(runner: StageRunner) -> StageRunner:
        if entry.runner is not None:
            raise ValueError(f"stage kind {kind!r} has two runners: {entry.runner.__qualname__} and "
                             f"{runner.__qualname__}")
        entry.runner = runner
        return runner

    return attach


@stage_runner("bootstrap")
def _run_bootstrap(cfg: BootstrapConfig, *, context, out) -> StageOutcome:
    from pipeline.stages.bootstrap import run_bootstrap

    result = run_bootstrap(cfg, context=context)
    out(f"base policy {'reused' if result.cached else 'trained'}: {result.directory}")
    return "done"


@stage_runner("curate")
def _run_curate(cfg: CurateConfig, *, context, out) -> StageOutcome:
    from pipeline.stages.curate import run_curate

    run_curate(cfg, context=context, out=out)
    return "done"


@stage_runner("train-estimator")
def _run_train_estimator(cfg: TrainEstimatorConfig, *, context, out) -> StageOutcome:  # noqa: ARG001 - no megatron
    from pipeline.stages.train_estimator import run_train_estimator

    run_train_estimator(cfg, out=out)
    return "done"


def rl_finished(cfg: RLConfig) -> bool:
    """The run checkpointed its last step (the loop always saves the final one)."""
    # The artifact layout, not the manager: the node role asks this after its ranks exit, and
    # importing megatron for a directory listing costs every rl stage ~4 s of CPU.
    from pipeline.checkpoint.artifact import list_steps

    steps = list_steps(cfg.checkpoint.directory)
    return bool(steps) and steps[-1] >= cfg.steps


@stage_runner("rl")
def _run_rl(cfg: RLConfig, *, context, out) -> StageOutcome:
    from pipeline.stages.rl import run_rl

    last = run_rl(cfg, context=context)
    out("  ".join(f"{key}={last[key]:.4g}" for key in ("reward_mean", "eval/pass@1") if key in last))
    # run_rl returns normally after SIGTERM/SIGUSR1 too, with a checkpoint at the step it stopped at.
    return "done" if rl_finished(cfg) else "stopped"


@stage_runner("evaluate")
def _run_evaluate(cfg: EvaluateConfig, *, context, out) -> StageOutcome:
    from pipeline.stages.evaluate import run_evaluate

    run_evaluate(cfg, context=context, out=out)
    return "done"


@stage_runner("export")
def _run_export(cfg: ExportConfig, *, context, out) -> StageOutcome:  # noqa: ARG001 - reuses the process's megatron
    from pipeline.checkpoint.convert import megatron_to_hf

    Path(cfg.out).parent.mkdir(parents=True, exist_ok=True)
    # overwrite: a rerun after a crash between publishing and recording `done` replaces the folder atomically.
    summary = megatron_to_hf(checkpoint=cfg.checkpoint, out=cfg.out, tokenizer=cfg.tokenizer, dtype=cfg.dtype,
                             verify=cfg.verify, overwrite=True)
    out(summary.format())
    return "done"


@stage_runner("convert")
def _run_convert(cfg: ConvertConfig, *, context, out) -> StageOutcome:  # noqa: ARG001 - its own one-rank megatron
    from pipeline.checkpoint.convert import hf_to_megatron

    Path(cfg.out).parent.mkdir(parents=True, exist_ok=True)
    summary = hf_to_megatron(hf=cfg.hf, out=cfg.out, verify=cfg.verify, overwrite=True)
    out(summary.format())
    return "done"


assert all(kind.runner is not None for kind in STAGE_KINDS.values()), "a stage kind has no @stage_runner"


def run_stage(stage: Stage, *, context=None, out: Callable[[str], Any] = print) -> StageOutcome:
    """Run one stage in this process: ``done``, or ``stopped`` when it checkpointed on a signal.

    Its inputs are checked first (``pipeline.stages.preflight``): by now every stage it depends
    on has written them, so a missing or malformed one is a ``UserError`` before any work starts.
    """
    for note in preflight(stage.config):
        out(f"{stage.name}: {note}")
    return stage.stage_kind.runner(stage.config, context=context, out=out)


# ================================================================ the in-process runner


@dataclass(frozen=True, slots=True)
class CampaignResult:
    states: dict[str, str]  # stage name → final state this launch left it in
    skipped: tuple[str, ...]  # done before this launch
    blocked: tuple[str, ...]  # not run: a stage they depend on failed

    @property
    def ok(self) -> bool:
        return all(state == "done" for state in self.states.values())


def unfinished_dependency(stage: Stage, states: dict[str, str]) -> str | None:
    """The first stage ``stage`` depends on that is not ``done`` in ``states`` (then it must not run)."""
    return next((dep for dep in stage.depends_on if states.get(dep) != "done"), None)


def run_campaign_inprocess(plan: CampaignPlan, *, context=None, out: Callable[[str], Any] = print,
                           runner: Callable[..., StageOutcome] = run_stage) -> CampaignResult:
    """Run every stage not yet done, in dependency order, in this process.

    One ``ParallelContext`` (``context``, or a one-rank one created here) serves every
    stage. A failed stage is recorded with its error and blocks its dependents; stages
    that do not depend on it still run. ``runner`` is the stage runner (tests pass fakes).
    """
    status = CampaignStatus(plan.output_dir)
    plan.save()
    status.initialize(plan)
    previous = status.read()
    skipped = tuple(s.name for s in plan.stages if previous[s.name]["state"] == "done")
    if context is None and any(previous[s.name]["state"] != "done" for s in plan.stages):
        context = _one_rank_context(plan)
    states: dict[str, str] = {name: "done" for name in skipped}
    blocked: list[str] = []
    for number, stage in enumerate(plan.order(), start=1):
        prefix = f"[{number}/{len(plan.stages)}] {stage.name}"
        if stage.name in skipped:
            out(f"{prefix}: done before, skipped")
            continue
        unfinished = unfinished_dependency(stage, states)
        if unfinished is not None:
            out(f"{prefix}: not run, {unfinished} did not finish")
            states[stage.name] = "pending"
            blocked.append(stage.name)
            continue
        out(f"{prefix} ({stage.kind})")
        status.update(stage.name, "running", job_id=None)
        started = time.perf_counter()
        try:
            outcome = runner(stage, context=context, out=out)
        except Exception as error:  # noqa: BLE001 - recorded, then dependents are stopped
            status.update(stage.name, "failed", error=f"{type(error).__name__}: {error}")
            states[stage.name] = "failed"
            out(f"{prefix}: FAILED: {type(error).__name__}: {error}")
            continue
        if outcome == "stopped":
            # A signal asked the process to stop; the stage resumes from its checkpoint next time.
            status.update(stage.name, "pending", error="stopped by a signal after a checkpoint")
            states[stage.name] = "pending"
            out(f"{prefix}: stopped after a checkpoint; relaunch to resume")
            break
        status.update(stage.name, "done", seconds=round(time.perf_counter() - started, 1))
        states[stage.name] = "done"
    for stage in plan.stages:  # stages after a stop
        if stage.name not in states:
            states[stage.name] = "pending"
    return CampaignResult(states=states, skipped=skipped, blocked=tuple(blocked))


def _one_rank_context(plan: CampaignPlan):
    from pipeline.parallel.rendezvous import initialize_process_context

    seeds = [s.config.seed for s in plan.stages if isinstance(s.config, BootstrapConfig)]
    return initialize_process_context(seed=seeds[0] if seeds else 0)


# ================================================================ wiring a campaign from one root

# The one stage a campaign has only when a variant reads it: DEPO's pre-trained estimator.
ESTIMATOR_STAGE = "train-estimator"


def reads_estimator(rl: RLConfig) -> bool:
    """Whether an rl variant reads the campaign's pre-trained estimator (its DEPO prompt filter does)."""
    return rl.algorithm.prompt_filter == "depo"


def wire_campaign(
    *,
    name: str,
    output_dir: str | Path,
    curate: CurateConfig,
    estimator: TrainEstimatorConfig,
    rl_variants: dict[str, RLConfig],
    evaluate: EvaluateConfig,
    bootstrap: BootstrapConfig | None = None,
    export_dtype: str = "auto",
    resources: dict[str, Resources] | None = None,
) -> CampaignPlan:
    """The standard campaign DAG with every path between stages derived from ``output_dir``.

    The base policy is the bootstrap's cache entry (``<cache_dir>/<config hash>``, known
    before it is trained) when ``bootstrap`` is given, else every variant's ``policy``
    (a Hugging Face folder; all variants must share it). Stage names: ``bootstrap``,
    ``curate``, ``train-estimator``, ``rl-<variant>``, ``evaluate-<variant>``,
    ``export-<variant>``. ``resources`` maps stage names to their resources.

    ``train-estimator`` trains ``estimator`` only when some variant reads it (``reads_estimator``):
    a campaign without DEPO would spend a GPU job on a model nobody loads. ``estimator`` and
    its resources describe how to train it if needed, so neither is an error when it is not.
    """
    from pipeline.stages.bootstrap import config_hash
    from pipeline.stats.curation import KEPT_FILE
    from pipeline.stages.train_estimator import ESTIMATOR_DIR

    if not rl_variants:
        raise ConfigError("rl_variants: a campaign needs at least one rl variant")
    root = Path(output_dir)
    resources = resources or {}
    stages: list[Stage] = []

    def add(stage_name: str, kind: str, config: Any, depends_on: tuple[str, ...]) -> None:
        stages.append(Stage(name=stage_name, kind=kind, config=config, depends_on=depends_on,
                            resources=resources.get(stage_name, Resources())))

    if bootstrap is not None:
        # The plan names the entry by its absolute folder, resolved once here under the launching
        # user's cache root, so every later stage (and every node) reads the folder the bootstrap writes.
        bootstrap = dataclasses.replace(bootstrap, cache_dir=str(resolve_cache_dir(bootstrap.cache_dir)))
        policy_dir = Path(bootstrap.cache_dir) / config_hash(bootstrap)
        policy, tokenizer = str(policy_dir), str(policy_dir / "tokenizer")
        add("bootstrap", "bootstrap", bootstrap, ())
        base_deps: tuple[str, ...] = ("bootstrap",)
    else:
        starts = {(cfg.policy, cfg.tokenizer) for cfg in rl_variants.values()}
        if len(starts) != 1 or next(iter(starts))[0] is None:
            raise ConfigError(f"rl_variants: without a bootstrap every variant starts from the same policy "
                              f"(policy, tokenizer); got {sorted(str(start) for start in starts)}")
        policy, tokenizer_or_none = next(iter(starts))
        tokenizer = tokenizer_or_none or policy
        base_deps = ()

    curation_dir = root / "curate"
    add("curate", "curate", dataclasses.replace(curate, policy=policy, tokenizer=None if bootstrap else tokenizer,
                                                output_dir=str(curation_dir)), base_deps)
    estimator_dir = root / "estimator"
    if any(reads_estimator(rl) for rl in rl_variants.values()):
        add(ESTIMATOR_STAGE, "train-estimator",
            dataclasses.replace(estimator, curation_dir=str(curation_dir), output_dir=str(estimator_dir)),
            ("curate",))
    for variant, rl in rl_variants.items():
        run_dir = root / "rl" / variant
        algorithm = rl.algorithm
        uses_estimator = reads_estimator(rl)
        if uses_estimator:
            algorithm = dataclasses.replace(algorithm, depo=dataclasses.replace(
                algorithm.depo, estimator_dir=str(estimator_dir / ESTIMATOR_DIR)))
        rl = dataclasses.replace(
            rl, algorithm=algorithm, curation_dir=str(curation_dir),
            data=dataclasses.replace(rl.data, train=[str(curation_dir / KEPT_FILE)]),
            checkpoint=dataclasses.replace(rl.checkpoint, directory=str(run_dir / "checkpoints")),
            logging=dataclasses.replace(rl.logging, output_dir=str(run_dir)),
            bootstrap=bootstrap if bootstrap is not None else rl.bootstrap,
        )
        add(f"rl-{variant}", "rl", rl, ("curate", ESTIMATOR_STAGE) if uses_estimator else ("curate",))
        add(f"evaluate-{variant}", "evaluate",
            dataclasses.replace(evaluate, policy=str(run_dir / "checkpoints"), tokenizer=tokenizer,
                                output_dir=str(root / "eval" / variant)), (f"rl-{variant}",))
        add(f"export-{variant}", "export",
            ExportConfig(checkpoint=str(run_dir / "checkpoints"), out=str(root / "export" / variant),
                         tokenizer=tokenizer, dtype=export_dtype), (f"rl-{variant}",))
    unknown = sorted(set(resources) - {s.name for s in stages} - {ESTIMATOR_STAGE})
    if unknown:
        raise ConfigError(f"resources: no stage named {unknown[0]!r}")
    return CampaignPlan(name=name, output_dir=root, stages=stages)
