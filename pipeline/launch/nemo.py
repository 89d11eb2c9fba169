"""The NeMo-Run runner: a campaign's stages as tasks on a local machine or a SLURM cluster.

Every stage runs the same script (:func:`stage_script`): ``python -m pipeline.cli.task
node`` on each trainer node, with an explicit ``torch.distributed.run`` command for a
multi-rank stage, and ``... task serve`` on the rollout nodes of an rl stage whose
SGLang servers share its allocation (one job: trainer nodes first, rollout nodes after
them; ``--kill-on-bad-exit`` ends the job when either side dies). The node role records
the stage's status in the campaign's ``status.json``, so the state survives the launcher.

Local: one stage at a time, in dependency order (nemo-run's LocalExecutor runs a
downstream task even after its upstream one failed, so the order is kept here), with the
interpreter that runs the launcher. SLURM: every pending stage is submitted at once with
``--dependency=afterok`` on its parents and ``--kill-on-invalid-dep=yes``, so SLURM
itself cancels the dependents of a failed stage, also after the launcher has gone;
``--signal=USR1@<lead>`` on rl stages, which checkpoint on the signal, exit 75 and resume
from ``latest`` when the job restarts; the lead is the planner's estimate of one checkpoint
write, at least the profile's ``signal_s`` (:func:`signal_lead_s`).

CPUs and memory (:func:`job_resources`): a GPU job asks for its GPUs' share of a node's CPUs and
memory, all of them on a profile whose GPU jobs take whole nodes (``--exclusive``); a CPU job
for one CPU per rank; ``convert`` and ``export`` for :data:`CONVERSION_CPUS` CPUs and the memory
the model's size needs (:func:`conversion_memory_bytes`). srun (SLURM 22.05 and later) does not
inherit sbatch's ``--cpus-per-task``, so the script exports ``SRUN_CPUS_PER_TASK`` to its step.

Requeue: the sbatch script, not nemo-run's retry loop (which requeues every non-zero exit),
decides. After srun returns, :func:`requeue_trap` applies
:func:`pipeline.launch.campaign.job_exit`: success and a user error (2) end the job, any
other status requeues it (``scontrol requeue``) while ``SLURM_RESTART_COUNT`` is below the
stage's ``requeues``. A batch shell that SLURM itself signals (scancel, a hard time limit,
preemption) never requeues: SLURM's own policy applies then.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import nemo_run as run
from nemo_run.config import RUNDIR_NAME

from pipeline.config import BootstrapConfig, ConvertConfig
from pipeline.configlib import ConfigError
from pipeline.launch.campaign import (
    EXIT_REQUEUE,
    EXIT_STOPPED_FOR_GOOD,
    FINAL_EXITS,
    CampaignPlan,
    CampaignResult,
    CampaignStatus,
    Stage,
    unfinished_dependency,
)
from pipeline.launch.slurm_profiles import WHOLE_NODE_MEMORY, SlurmProfile, format_slurm_memory, parse_slurm_time

REPO = Path(__file__).resolve().parents[2]
EXPERIMENTS_DIR = "launch"  # nemo-run's experiment folders inside a campaign's output directory
MASTER_PORT = 29500
# torchrun handles SIGTERM, SIGINT, SIGHUP and SIGQUIT by default; SIGUSR1 (SLURM's warning
# before the time limit) would kill it while its ranks checkpoint. Handled, it is forwarded.
TORCHRUN_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
SLURM_FINAL_STATES = frozenset({
    "BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "TIMEOUT",
})


@dataclass(kw_only=True, slots=True)
class ExecutorOverrides:
    """``--executor.<field>`` on the command line: applied on top of the profile and recipe."""

    nodes: int | None = None  # trainer nodes of every multi-rank stage
    ranks_per_node: int | None = None  # of every multi-rank stage
    time: str | None = None
    partition: str | None = None
    account: str | None = None
    container_image: str | None = None


def apply_executor_overrides(plan: CampaignPlan, overrides: ExecutorOverrides) -> CampaignPlan:
    """Trainer nodes and ranks per node of the multi-rank stages (``StageKind.multi_rank``) replaced as asked."""
    stages = []
    for stage in plan.stages:
        resources = stage.resources
        if stage.stage_kind.multi_rank:
            resources = dataclasses.replace(
                resources,
                nodes=overrides.nodes if overrides.nodes is not None else resources.nodes,
                ranks_per_node=overrides.ranks_per_node if overrides.ranks_per_node is not None
                else resources.ranks_per_node,
            )
        if overrides.time is not None:
            resources = dataclasses.replace(resources, time_limit=overrides.time)
        stages.append(dataclasses.replace(stage, resources=resources))
    return CampaignPlan(name=plan.name, output_dir=plan.output_dir, stages=stages)


def apply_profile_overrides(profile: SlurmProfile, overrides: ExecutorOverrides) -> SlurmProfile:
    changes = {name: value for name, value in (("partition", overrides.partition), ("account", overrides.account),
                                               ("container_image", overrides.container_image)) if value is not None}
    return dataclasses.replace(profile, **changes)


# ================================================================ the script every stage runs


def stage_script(plan: CampaignPlan, stage: Stage, *, python: str, workdir: str | Path,
                 signal_lead_s: int | None = None) -> str:
    """The bash a stage's task runs on every node of its job (see the module docstring).

    ``signal_lead_s``: the rl job's SIGUSR1 lead. torchrun forwards the signal to its ranks and
    kills them ``--shutdown-timeout`` seconds later (30 s by default), so it gets the whole lead:
    the ranks finish their step and checkpoint, then exit by themselves.
    """
    resources = stage.resources
    quote = shlex.quote
    task = [python, "-m", "pipeline.cli.task"]
    where = ["--campaign-dir", str(plan.output_dir), "--stage", stage.name]
    lines = [
        "set -eo pipefail",
        f"cd {quote(str(workdir))}",
        f"export PYTHONPATH={quote(str(workdir))}${{PYTHONPATH:+:$PYTHONPATH}}",
        # Every role of this attempt names it alike (the servers end when the node role marks it done).
        'export WINNOW_ATTEMPT="${SLURM_JOB_ID:-local-$$}:${SLURM_RESTART_COUNT:-0}"',
    ]
    if resources.rollout is not None and resources.rollout.colocated:
        serve = " ".join(quote(arg) for arg in [*task, "serve", *where])
        lines += [
            "# the rollout servers share the first node: started beside the node role, they end with it",
            'if [ "${SLURM_NODEID:-0}" -eq 0 ]; then',
            f"  {serve} &",
            "fi",
        ]
    elif resources.rollout is not None:
        lines += [
            f"# nodes {resources.nodes}..{resources.total_nodes - 1} of the job serve rollouts (SGLang)",
            f'if [ "${{SLURM_NODEID:-0}}" -ge {resources.nodes} ]; then',
            "  exec " + " ".join(quote(arg) for arg in [*task, "serve", *where]),
            "fi",
        ]
    node = " ".join(quote(arg) for arg in [*task, "node", *where])
    if resources.num_ranks == 1:
        lines.append(f"exec {node}")
        return "\n".join(lines) + "\n"
    if resources.nodes == 1:
        rendezvous = ["--standalone", "--nnodes", "1"]
    else:
        # Static rendezvous on the job's first node: node ranks are SLURM's node ids.
        rendezvous = ["--nnodes", str(resources.nodes), "--node-rank", '"${SLURM_NODEID:-0}"',
                      "--master-addr", '"$WINNOW_HEAD_NODE"', "--master-port", str(MASTER_PORT)]
    shutdown = ["--shutdown-timeout", str(signal_lead_s)] if signal_lead_s is not None else []
    torchrun = [
        quote(python), "-m", "torch.distributed.run", *rendezvous,
        "--nproc-per-node", str(resources.ranks_per_node), "--signals-to-handle", TORCHRUN_SIGNALS, *shutdown,
        *(quote(arg) for arg in [*task[1:], "worker", *where]),
    ]
    lines.append(f"exec {node} -- \\\n  " + " ".join(torchrun))
    return "\n".join(lines) + "\n"


# The sbatch script's own setup (nemo-run computes `nodes` and `head_node` before it): every
# node's task learns the job's host list (rollout server addresses) and the rendezvous host.
SLURM_SETUP_LINES = 'export WINNOW_NODES="${nodes[*]}"\nexport WINNOW_HEAD_NODE="$head_node"'


def requeue_trap(requeues: int) -> str:
    """Bash for the sbatch script's setup: an EXIT trap that requeues the job for a transient exit.

    nemo-run's script ends with ``exit <srun's status>`` (its own retries are off), which runs
    the trap: the table of ``pipeline.launch.campaign.job_exit``, in bash because the task may
    have been killed before it could decide anything. srun reports a task killed by signal N
    as 128 + N. A TERM to the batch shell (scancel, the hard time limit, preemption) marks the
    job as ended by SLURM: ``scontrol requeue`` would otherwise bring a cancelled job back.
    """
    final = "|".join(str(code) for code in FINAL_EXITS)
    return f"""winnow_ended_by_slurm=0
trap 'winnow_ended_by_slurm=1' TERM
winnow_job_exit() {{
    local code=$? restarts=${{SLURM_RESTART_COUNT:-0}}
    trap - EXIT
    case $code in {final}) exit "$code" ;; esac
    if [ "$winnow_ended_by_slurm" = 0 ] && [ "$restarts" -lt {requeues} ] && scontrol requeue "$SLURM_JOB_ID"; then
        echo "winnow: the stage exited $code: requeued (restart $((restarts + 1)) of {requeues})" >&2
        exit "$code"
    fi
    echo "winnow: the stage exited $code: not requeued ($restarts of {requeues} restarts used)" >&2
    [ "$code" = {EXIT_REQUEUE} ] && exit {EXIT_STOPPED_FOR_GOOD}
    exit "$code"
}}
trap winnow_job_exit EXIT"""


# ================================================================ CPUs and memory of a job

# CPUs of a conversion job (``StageKind.converts_model``) (fewer on a node with fewer): torch's intra-op threads for the fp32
# casts and the logit gate's forward passes, megatron's checkpoint file writers. More would
# wait on the shared filesystem, which bounds reading and writing the weights.
CONVERSION_CPUS = 8
# Memory of a conversion beyond its per-parameter terms: the interpreter with torch,
# megatron-core and transformers (0.4 GiB on CPU, more with a container's CUDA libraries).
CONVERSION_BASE_BYTES = 2 << 30
# Bytes per parameter of weights stored at a Hugging Face torch_dtype.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
EXPORT_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def conversion_memory_bytes(num_parameters: int, *, weight_bytes: int) -> int:
    """Host memory a ``convert`` or ``export`` job asks for: ``N × (8 + 2·w) + 2 GiB``.

    ``N`` parameters, ``w`` bytes per parameter of the Hugging Face weights (2 for bf16, 4 for
    fp32): the folder ``convert`` reads, the folder ``export`` writes. Per parameter:

    * 4 B: the unsplit megatron model in fp32, which the conversion builds and its gate runs;
    * 4 B: a second fp32 copy: what megatron's dist-checkpoint save or load stages, or the fp32
      model transformers loads for the logit gate;
    * w B: the Hugging Face weights at their dtype: read (``convert``), or written and read back
      by the gate (``export``), through the page cache that counts against the job's limit;
    * w B: what is held briefly, bounded by the model at that dtype: one export shard buffered
      before it is written (at most 5 GB), one tensor cast at a time (Qwen2.5-7B's embedding in
      fp32: 2.2 GB);

    plus :data:`CONVERSION_BASE_BYTES`. An upper bound, not a measurement: the terms are
    counted as if alive together, although each conversion frees one model before it loads the
    next and the page cache is reclaimable: host memory is plentiful on the nodes that run these
    jobs (2 TB on an 8×H100 node), and too little ends the job in an OOM kill. Qwen2.5-Math-7B
    (7.62 B parameters, bf16): 12 B per parameter, 85.1 GiB + 2 GiB, an 88 GiB request.
    """
    if num_parameters < 1 or weight_bytes not in (2, 4):
        raise ValueError(f"num_parameters {num_parameters} must be positive and weight_bytes {weight_bytes} 2 or 4")
    return num_parameters * (8 + 2 * weight_bytes) + CONVERSION_BASE_BYTES


@dataclass(frozen=True, slots=True)
class ConversionModel:
    """The model a conversion stage converts, as far as the launcher can read it before the job runs."""

    num_parameters: int
    weight_bytes: int  # bytes per parameter of the Hugging Face side (see conversion_memory_bytes)
    source: str  # where its size was read: a config.json, a checkpoint manifest, a bootstrap config


def _hf_folder_model(path: Path) -> tuple[int, int] | None:
    """(parameters, bytes per parameter at the folder's torch_dtype) of a readable config.json, else None."""
    from pipeline.launch.plan import load_model_dims

    config = path / "config.json" if path.is_dir() else path
    if not config.is_file():
        return None
    try:
        dims = load_model_dims(config)
        data = json.loads(config.read_text())
    except (ValueError, OSError):  # not a model config after all, or one the planner cannot size
        return None
    # Newer transformers write `dtype`, older `torch_dtype`; absent, the weights count as fp32.
    dtype = data.get("dtype") or data.get("torch_dtype")
    return dims.num_parameters(), DTYPE_BYTES.get(str(dtype), 4)


def _checkpoint_model(path: Path) -> tuple[int, int | None] | None:
    """(parameters, bytes per parameter of the HF dtype it came from, if recorded) of a winnow checkpoint.

    Reads the manifest of ``path`` or of the step its ``latest`` names, without verifying the
    checkpoint's files (``resolve_checkpoint`` would hash every weight file at launch).
    """
    from pipeline.launch.plan import ModelDims
    from pipeline.models.spec import ModelSpec

    step_dir = path
    if not (step_dir / "manifest.json").is_file() and (path / "latest").is_file():
        step_dir = path / (path / "latest").read_text().strip()
    try:
        manifest = json.loads((step_dir / "manifest.json").read_text())
        dims = ModelDims.from_spec(ModelSpec(**manifest["model_spec"]))
    except (OSError, ValueError, KeyError, TypeError):  # no checkpoint (yet), or a malformed one
        return None
    return dims.num_parameters(), DTYPE_BYTES.get(manifest.get("hf_dtype"))


def _bootstrap_model(cfg: Any) -> int:
    """Parameters of the policy a bootstrap stage trains (vocabulary rounded up to its multiple)."""
    from pipeline.launch.plan import ModelDims
    from pipeline.models.spec import ModelSpec

    vocab = -(-cfg.vocab_size // cfg.vocab_multiple) * cfg.vocab_multiple
    return ModelDims.from_spec(ModelSpec.from_model_config(cfg.model, vocab_size=vocab)).num_parameters()


def conversion_model(stage: Stage, plan: CampaignPlan) -> ConversionModel | None:
    """The size of the model a ``convert`` or ``export`` stage converts, or None when nothing says.

    ``convert``: its Hugging Face folder's ``config.json``. ``export``: its checkpoint's manifest
    when it exists (a relaunch), else the stages it depends on, nearest first: the Hugging Face
    folder a ``convert`` stage reads, an rl, curate or evaluate stage's policy or its servers'
    ``model_path`` (a folder of the same architecture), a bootstrap stage's model config. The
    bytes per parameter are the export's ``dtype``; ``auto`` (the dtype of the HF model the run
    came from, else fp32) takes the dtype of the folder or manifest found, else fp32.
    """
    if isinstance(stage.config, ConvertConfig):
        found = _hf_folder_model(Path(stage.config.hf))
        return ConversionModel(num_parameters=found[0], weight_bytes=found[1],
                               source=f"{stage.config.hf}/config.json") if found else None
    export_bytes = EXPORT_DTYPE_BYTES.get(stage.config.dtype)  # None: auto

    def found(num_parameters: int, source_bytes: int | None, source: str) -> ConversionModel:
        return ConversionModel(num_parameters=num_parameters, weight_bytes=export_bytes or source_bytes or 4,
                               source=source)

    checkpoint = _checkpoint_model(Path(stage.config.checkpoint))
    if checkpoint is not None:
        return found(*checkpoint, f"checkpoint {stage.config.checkpoint}")
    for ancestor in map(plan.stage, plan.dependencies(stage.name)):
        cfg, rollout = ancestor.config, ancestor.resources.rollout
        if isinstance(cfg, BootstrapConfig):
            return found(_bootstrap_model(cfg), None, f"stage {ancestor.name}'s model config")
        paths = [cfg.hf] if isinstance(cfg, ConvertConfig) else [getattr(cfg, "policy", None),
                                                                 rollout.model_path if rollout else None]
        for path in filter(None, paths):
            hf = _hf_folder_model(Path(path))
            if hf is not None:
                return found(*hf, f"stage {ancestor.name}'s {path}/config.json")
            checkpoint = _checkpoint_model(Path(path))
            if checkpoint is not None:
                return found(*checkpoint, f"stage {ancestor.name}'s checkpoint {path}")
    return None


@dataclass(frozen=True, slots=True)
class JobResources:
    """What one stage's job asks for on each of its nodes, beyond its nodes and GPUs."""

    cpus_per_task: int  # one task per node: the node's CPUs for the job
    mem: str | None  # sbatch --mem (per node): "0" all of it, a SLURM size, None the cluster's default
    exclusive: bool
    basis: str  # one line: how these were chosen (a comment in the sbatch script)
    note: str | None = None  # printed at submission when the request is a fallback


def job_resources(stage: Stage, *, plan: CampaignPlan, profile: SlurmProfile) -> JobResources:
    """CPUs, memory and ``--exclusive`` of a stage's job on the profile's nodes (table in docs/launching.md).

    * A GPU job (trainer and rollout nodes, and any stage given GPUs): on a profile whose GPU
      jobs take whole nodes (``exclusive``), all of a node's CPUs and memory; else its GPUs'
      share of them (4 of 8 GPUs: half the CPUs and half of ``mem_per_node``). A trainer node
      runs 8 ranks and a grading pool, a rollout node 8 SGLang servers: one CPU would run them all.
    * ``convert`` and ``export``: :data:`CONVERSION_CPUS` CPUs and :func:`conversion_memory_bytes`
      of the model :func:`conversion_model` finds, at most a node's memory; all of it when the
      model cannot be read before the job runs.
    * Any other CPU job: one CPU per rank (the node role and its torchrun ranks), their share of
      ``mem_per_node`` (the cluster's default memory when that is ``"0"`` and the job does not
      take every CPU).
    """
    resources = stage.resources
    node_mib = profile.mem_per_node_mib  # None: "0", size unstated

    def share(fraction: float) -> str | None:
        if fraction >= 1:
            return profile.mem_per_node
        return format_slurm_memory(max(1, int(node_mib * fraction))) if node_mib is not None else None

    if resources.gpus_per_node > 0:
        if profile.exclusive:
            return JobResources(cpus_per_task=profile.cpus_per_node, mem=profile.mem_per_node, exclusive=True,
                                basis="GPU job on whole nodes (the profile's exclusive): all of a node's CPUs "
                                      "and memory")
        fraction = resources.gpus_per_node / profile.gpus_per_node
        return JobResources(cpus_per_task=max(1, profile.cpus_per_node * resources.gpus_per_node
                                              // profile.gpus_per_node),
                            mem=share(fraction), exclusive=False,
                            basis=f"GPU job on {resources.gpus_per_node} of a node's {profile.gpus_per_node} GPUs: "
                                  "that share of its CPUs and memory")
    if stage.stage_kind.converts_model:
        cpus = min(CONVERSION_CPUS, profile.cpus_per_node)
        model = conversion_model(stage, plan)
        if model is None:
            return JobResources(
                cpus_per_task=cpus, mem=profile.mem_per_node, exclusive=False,
                basis=f"{stage.kind} of a model whose size is unknown at launch: all of a node's memory",
                note=f"{stage.name}: the model's size cannot be read before the job runs (no config.json or "
                     "checkpoint manifest among its inputs); the job asks for all of a node's memory")
        wanted_bytes = conversion_memory_bytes(model.num_parameters, weight_bytes=model.weight_bytes)
        wanted_mib = -(-wanted_bytes // (1 << 30)) * 1024  # whole GiB, rounded up
        basis = (f"{stage.kind} of {model.num_parameters / 1e9:.2f} B parameters at {model.weight_bytes} B each, "
                 f"from {model.source}: N x (8 + 2w) B + 2 GiB")
        if node_mib is not None and wanted_mib > node_mib:
            return JobResources(
                cpus_per_task=cpus, mem=profile.mem_per_node, exclusive=False, basis=basis + ", above a node's",
                note=f"{stage.name}: the conversion needs about {format_slurm_memory(wanted_mib)} of memory, more "
                     f"than the profile's mem_per_node {profile.mem_per_node}; the job asks for all of a node's")
        return JobResources(cpus_per_task=cpus, mem=format_slurm_memory(wanted_mib), exclusive=False, basis=basis)
    cpus = resources.ranks_per_node
    return JobResources(cpus_per_task=cpus, mem=share(cpus / profile.cpus_per_node), exclusive=False,
                        basis=f"CPU job of {cpus} rank(s) per node: a CPU each")


def srun_cpus_line(cpus_per_task: int) -> str:
    """The sbatch script's export that gives srun's task the job's CPUs.

    srun has not inherited sbatch's ``--cpus-per-task`` since SLURM 22.05: without it the
    step's one task per node gets one CPU, and every rank, grading worker or SGLang server of
    that node shares it.
    """
    return f"export SRUN_CPUS_PER_TASK={cpus_per_task}"


# ================================================================ executors


def rl_checkpoint_write(stage: Stage):
    """The planner's estimate of one checkpoint write of an rl stage, or None when its model is unknown yet.

    The model's dimensions come from the stage's policy (a Hugging Face folder or a winnow
    checkpoint) or its servers' ``model_path`` (the same architecture); a policy the
    campaign has not produced yet (the bootstrap's) gives None.
    """
    from pipeline.launch.plan import checkpoint_write_plan, layout_from_rl, load_model_dims, trainer_settings_from_rl

    cfg, resources = stage.config, stage.resources
    candidates = [cfg.policy, resources.rollout.model_path if resources.rollout else None]
    dims = None
    for path in (path for path in candidates if path and Path(path).exists()):
        try:
            dims = load_model_dims(path)
            break
        except (ValueError, OSError):  # not a model folder or checkpoint after all
            continue
    if dims is None:
        return None
    layout = layout_from_rl(cfg, trainer_gpus=resources.num_ranks)
    distributed = cfg.trainer.distributed_optimizer
    trainer = trainer_settings_from_rl(
        cfg, distributed_optimizer=layout.data_parallel > 1 if distributed is None else distributed,
        recompute=cfg.trainer.recompute)
    return checkpoint_write_plan(dims, layout=layout, trainer=trainer)


def signal_lead_s(stage: Stage, *, profile: SlurmProfile) -> int:
    """Seconds before its time limit an rl job gets SIGUSR1: one checkpoint write, at least ``signal_s``.

    The loop checkpoints after the step in flight; ``signal_s`` (the floor) should cover that step.
    """
    estimate = rl_checkpoint_write(stage)
    return max(profile.signal_s, estimate.signal_s if estimate is not None else 0)


def local_executor():
    return run.LocalExecutor()


def slurm_executor(stage: Stage, *, plan: CampaignPlan, profile: SlurmProfile, experiments_dir: Path,
                   out: Callable[[str], Any] = print):
    """A SlurmExecutor for one stage's job, bounded by what the profile's nodes offer.

    Its CPUs, memory and ``--exclusive`` are :func:`job_resources`'s; ``out`` gets the note of
    a fallback (a conversion whose model's size is unknown at launch).

    A local tunnel submits the scripts nemo-run writes under ``experiments_dir`` as they
    are (nothing is copied: the launcher and the nodes share that filesystem). Its
    ``job_dir`` is ``<experiments_dir>/experiments``: nemo-run appends ``<title>/<id>``
    when the executor joins the experiment, which makes it the experiment folder itself.
    That append is not idempotent, so every executor gets a tunnel of its own.
    """
    resources = stage.resources
    if resources.total_nodes > profile.nodes:
        raise ConfigError(f"stages.{stage.name}.resources: {resources.total_nodes} nodes; the cluster profile "
                          f"allows {profile.nodes} per job")
    if resources.gpus_per_node > profile.gpus_per_node:
        raise ConfigError(f"stages.{stage.name}.resources.gpus_per_node: {resources.gpus_per_node}; the cluster "
                          f"profile's nodes have {profile.gpus_per_node}")
    if resources.ranks_per_node > max(profile.cpus_per_node, profile.gpus_per_node):
        raise ConfigError(f"stages.{stage.name}.resources.ranks_per_node: {resources.ranks_per_node} exceeds the "
                          f"profile's {profile.cpus_per_node} CPUs and {profile.gpus_per_node} GPUs per node")
    if resources.gpus_per_node == 0 and resources.ranks_per_node > profile.cpus_per_node:
        raise ConfigError(f"stages.{stage.name}.resources.ranks_per_node: {resources.ranks_per_node} CPU ranks; "
                          f"the profile's nodes have {profile.cpus_per_node} CPUs")
    time_limit = resources.time_limit or profile.time_limit
    lead_s = signal_lead_s(stage, profile=profile) if stage.stage_kind.checkpoints_on_signal else None
    if lead_s is not None and lead_s >= parse_slurm_time(time_limit, field="time_limit"):
        raise ConfigError(f"stages.{stage.name}: the SIGUSR1 lead ({lead_s} s: the profile's signal_s "
                          f"{profile.signal_s} s or the planner's checkpoint-write estimate) is not below the "
                          f"job's time limit {time_limit!r}")
    additional: dict[str, Any] = {"kill_on_invalid_dep": "yes"}
    if resources.requeues:
        additional["requeue"] = True  # scontrol requeue refuses a job that is not requeueable
    shape = job_resources(stage, plan=plan, profile=profile)
    if shape.note is not None:
        out(shape.note)
    memory = {None: "the cluster's default memory", WHOLE_NODE_MEMORY: "all of a node's memory"}.get(
        shape.mem, f"{shape.mem} of memory")
    setup = [f"# resources per node: {shape.cpus_per_task} CPUs, {memory}{', exclusive' if shape.exclusive else ''}"
             f" ({shape.basis})",
             srun_cpus_line(shape.cpus_per_task), SLURM_SETUP_LINES, requeue_trap(resources.requeues)]
    executor = run.SlurmExecutor(
        account=profile.account or "",
        partition=profile.partition,
        job_name_prefix=f"winnow-{plan.name}-",
        time=time_limit,
        nodes=resources.total_nodes,
        ntasks_per_node=1,  # the node role starts the node's ranks itself
        cpus_per_task=shape.cpus_per_task,
        mem=shape.mem,
        exclusive=shape.exclusive or None,
        gpus_per_node=resources.gpus_per_node or None,
        container_image=profile.container_image,
        container_mounts=list(profile.container_mounts),
        env_vars=dict(profile.env),
        srun_args=list(profile.srun_args) or None,
        signal=f"USR1@{lead_s}" if lead_s is not None else None,
        additional_parameters=additional,
        setup_lines="\n".join(setup),
        retries=0,  # nemo-run's script would requeue every failure, user errors included
        tunnel=run.LocalTunnel(job_dir=str(experiments_dir / "experiments"))
        if profile.tunnel.kind == "local" else run.SSHTunnel(
            host=profile.tunnel.host, user=profile.tunnel.user, job_dir=profile.tunnel.job_dir,
            identity=profile.tunnel.identity, **({"port": profile.tunnel.port} if profile.tunnel.port else {})),
        packager=run.Packager(),  # the code is already on the cluster: profile.workdir
    )
    if profile.account is None:
        executor.account = None  # no --account flag; the job name prefix above stands in for it
    return executor


# ================================================================ launching


@dataclass(kw_only=True, slots=True)
class LaunchOptions:
    executor: Literal["local", "slurm"] = "local"
    profile: SlurmProfile | None = None
    dryrun: bool = False
    wait: bool = True  # SLURM: follow the jobs until every stage is final
    poll_s: float = 10.0
    experiments_dir: Path | None = None  # nemo-run's experiment folders (null: <campaign>/launch)


def _python_and_workdir(options: LaunchOptions) -> tuple[str, str]:
    if options.executor == "local":
        # nemo-run's LocalExecutor would run the `python` on PATH; the launcher's own interpreter is meant.
        return sys.executable, str(REPO)
    assert options.profile is not None
    if options.profile.workdir is None and options.profile.tunnel.kind == "ssh":
        raise ConfigError("workdir: required in a profile with an ssh tunnel (winnow's checkout on the cluster)")
    return options.profile.python, options.profile.workdir or str(REPO)


def _task(plan: CampaignPlan, stage: Stage, options: LaunchOptions):
    python, workdir = _python_and_workdir(options)
    lead_s = (signal_lead_s(stage, profile=options.profile)
              if options.executor == "slurm" and stage.stage_kind.checkpoints_on_signal else None)
    return run.Script(inline=stage_script(plan, stage, python=python, workdir=workdir, signal_lead_s=lead_s))


def launch_campaign(plan: CampaignPlan, *, options: LaunchOptions, out: Callable[[str], Any] = print
                    ) -> CampaignResult | Path:
    """Launch every stage not done yet; the result, or with ``dryrun`` the experiment folder.

    Returns when every stage is final (local, or SLURM with ``wait``) or after submitting
    (SLURM without ``wait``: the jobs go on, ``status.json`` follows them).
    """
    status = CampaignStatus(plan.output_dir)
    plan.save()
    status.initialize(plan)
    states = {name: record["state"] for name, record in status.read().items()}
    pending = [stage for stage in plan.order() if states.get(stage.name) != "done"]
    skipped = tuple(stage.name for stage in plan.stages if states.get(stage.name) == "done")
    for name in skipped:
        out(f"{name}: done before, skipped")
    experiments_dir = options.experiments_dir or plan.output_dir / EXPERIMENTS_DIR
    if options.executor == "local":
        return _launch_local(plan, pending, skipped=skipped, options=options, experiments_dir=experiments_dir, out=out)
    assert options.profile is not None, "a SLURM launch needs a cluster profile"
    return _launch_slurm(plan, pending, skipped=skipped, options=options, experiments_dir=experiments_dir, out=out)


def _launch_local(plan, pending: list[Stage], *, skipped, options, experiments_dir: Path, out) -> CampaignResult | Path:
    status = CampaignStatus(plan.output_dir)
    if options.dryrun:
        with run.Experiment(plan.name, base_dir=str(experiments_dir), log_level="WARN") as exp:
            for stage in pending:
                exp.add(_task(plan, stage, options), executor=local_executor(), name=stage.name)
            exp.dryrun(log=False, delete_exp_dir=False)
            return Path(exp._exp_dir)
    states = dict.fromkeys(skipped, "done")
    blocked = []
    for stage in pending:
        unfinished = unfinished_dependency(stage, states)
        if unfinished is not None:
            out(f"{stage.name}: not run, {unfinished} did not finish")
            states[stage.name] = "pending"
            blocked.append(stage.name)
            continue
        out(f"{stage.name}: running ({stage.kind}, {stage.resources.num_ranks} rank(s))")
        with run.Experiment(f"{plan.name}-{stage.name}", base_dir=str(experiments_dir), log_level="WARN") as exp:
            exp.add(_task(plan, stage, options), executor=local_executor(), name=stage.name)
            exp.run(sequential=True, detach=False, tail_logs=False)
            task_state = str(exp.status(return_dict=True)[stage.name]["status"])
        record = status.read().get(stage.name, {})
        state = record.get("state", "pending")
        stopped = state == "pending" and "stopped by a signal" in (record.get("error") or "")
        if state in ("running", "pending") and not stopped:
            # The task died before it could record its end (killed, interpreter crash, bad arguments).
            status.update(stage.name, "failed", error=f"task ended {task_state}; see its log under {experiments_dir}")
            state = "failed"
        states[stage.name] = state
        out(f"{stage.name}: {state}")
        if stopped:
            break  # a signal asked this machine to stop; relaunch to resume
    for stage in pending:
        states.setdefault(stage.name, "pending")
    return CampaignResult(states=states, skipped=skipped, blocked=tuple(blocked))


def _launch_slurm(plan, pending: list[Stage], *, skipped, options, experiments_dir: Path, out) -> CampaignResult | Path:
    profile = options.profile
    if profile.slurm_conf is not None:
        os.environ["SLURM_CONF"] = profile.slurm_conf  # sbatch, scontrol and scancel run from this process
    _refuse_rundir_paths(plan, options=options, experiments_dir=experiments_dir)
    handles: dict[str, Any] = {}
    # Its status table at exit asks sacct, which clusters without accounting (the dev cluster) lack;
    # follow_slurm_jobs asks scontrol instead.
    with run.Experiment(plan.name, base_dir=str(experiments_dir), log_level="WARN", skip_status_at_exit=True) as exp:
        pending_names = {stage.name for stage in pending}
        for stage in pending:
            # Done parents need no dependency: their outputs are already there.
            parents = [handles[dep] for dep in stage.depends_on if dep in pending_names]
            handles[stage.name] = exp.add(_task(plan, stage, options), name=stage.name, dependencies=parents,
                                          executor=slurm_executor(stage, plan=plan, profile=profile,
                                                                  experiments_dir=experiments_dir, out=out))
        if options.dryrun:
            exp.dryrun(log=False, delete_exp_dir=False)
            return Path(exp._exp_dir)
        exp.run(detach=True)
        job_ids = {job.id: _job_id(job.handle) for job in exp.jobs}
    status = CampaignStatus(plan.output_dir)
    for name, job_id in job_ids.items():
        out(f"{name}: submitted as SLURM job {job_id}")
        status.update(name, "pending", job_id=str(job_id))
    if not options.wait:
        return CampaignResult(states={s.name: status.state(s.name) for s in plan.stages}, skipped=skipped, blocked=())
    return follow_slurm_jobs(plan, job_ids, skipped=skipped, poll_s=options.poll_s, out=out)


def _refuse_rundir_paths(plan: CampaignPlan, *, options: LaunchOptions, experiments_dir: Path) -> None:
    """ConfigError when a path the SLURM job sees contains ``/nemo_run``.

    nemo-run's SLURM scripts name the job folder ``/nemo_run`` (the container mount point)
    and, without a container, rewrite every ``/nemo_run`` substring of the sbatch script
    and of the stage scripts into the job folder (``SlurmBatchRequest.materialize``,
    ``Script.to_command``): ``/runs/nemo_run/x`` would become a path that does not exist
    and the job would die before its task starts. The stage scripts name only the paths
    checked here (the stage configs travel in ``campaign.json``).
    """
    marker = f"/{RUNDIR_NAME}"
    profile = options.profile
    assert profile is not None
    python, workdir = _python_and_workdir(options)
    named = {"the campaign output_dir": str(plan.output_dir), "the experiments folder": str(experiments_dir),
             "the profile's python": python, "the profile's workdir": workdir,
             "the profile's tunnel.job_dir": profile.tunnel.job_dir or "",
             **{f"the profile's env.{key}": value for key, value in profile.env.items()}}
    for what, path in named.items():
        if marker in path:
            raise ConfigError(f"{what} {path!r} contains {marker!r}, which nemo-run rewrites in SLURM scripts; "
                              "use another folder name")


def _job_id(handle: str) -> int:
    # nemo-run's handles end in the SLURM job id: "<scheme>://<experiment>/<id>".
    return int(handle.rstrip("/").rsplit("/", 1)[-1])


def slurm_job_state(job_id: int) -> tuple[str, str]:
    """(JobState, Reason) from ``scontrol`` (no accounting database needed)."""
    result = subprocess.run(["scontrol", "-o", "show", "job", str(job_id)], capture_output=True, text=True,
                            stdin=subprocess.DEVNULL, check=False, timeout=60)
    fields = dict(token.partition("=")[::2] for token in result.stdout.split())
    return fields.get("JobState", "UNKNOWN"), fields.get("Reason", "")


def follow_slurm_jobs(plan: CampaignPlan, job_ids: dict[str, int], *, skipped: tuple[str, ...], poll_s: float,
                      out: Callable[[str], Any] = print,
                      job_state: Callable[[int], tuple[str, str]] = slurm_job_state) -> CampaignResult:
    """Poll until every submitted job is final; reconcile ``status.json`` with what SLURM says.

    A job that ended without its task recording ``done`` (killed, timed out, cancelled
    because a parent failed) is recorded ``failed``, or ``pending`` when it never ran.
    """
    status = CampaignStatus(plan.output_dir)
    final: dict[str, str] = {}
    while len(final) < len(job_ids):
        for name, job_id in job_ids.items():
            if name in final:
                continue
            state, reason = job_state(job_id)
            if state not in SLURM_FINAL_STATES:
                continue
            recorded = status.state(name)
            if state == "COMPLETED" and recorded == "done":
                final[name] = "done"
            elif recorded == "pending" and state == "CANCELLED" and "Dependency" in reason:
                final[name] = "pending"  # never ran: a parent failed
            else:
                final[name] = "failed"
                if recorded != "failed":
                    status.update(name, "failed", error=f"SLURM job {job_id} ended {state} ({reason})")
            out(f"{name}: {final[name]} (SLURM job {job_id} {state})")
        if len(final) < len(job_ids):
            time.sleep(poll_s)
    blocked = tuple(name for name, state in final.items() if state == "pending")
    return CampaignResult(states={**dict.fromkeys(skipped, "done"), **final}, skipped=skipped, blocked=blocked)
