"""What runs on a node for one campaign stage: ``python -m pipeline.cli.task ROLE ...`` (``pipeline/cli/task.py``).

Every stage's job (local or SLURM) runs the script :func:`pipeline.launch.nemo.stage_script`
writes, which calls one of three roles:

* ``node``: one per trainer node. On the first node it records the stage's status
  (running → done/failed, with the SLURM job id and restart count), waits for the
  rollout servers and hands their URLs to the trainer; then it runs the stage in
  this process (one rank) or the torchrun command given after ``--`` (more ranks).
  A stage stopped by SIGTERM/SIGUSR1 after a checkpoint exits 75, so the job is
  requeued and resumes from ``latest``; a user error exits 2 and is not requeued
  (``pipeline.launch.campaign.job_exit``). torchrun dies with this process, and each
  ``worker`` with torchrun (``pipeline.parallel.lifetime``): a kill -9 of the node role
  leaves no rank training into the stage's output, and no megatron checkpoint writer
  of this process or of a rank writing into it.
* ``worker``: one torchrun rank; runs the stage with torchrun's rendezvous, in a process
  group whose collective timeout is ``pipeline.config.collective_timeout_minutes``.
  torchrun exits 1 whatever its failed rank exited with, so a failing rank also leaves a
  record in the node's rank-exit folder. The node reports the first failure in time, the root
  cause (a rank that crashes takes its peers down with "connection closed" errors a moment
  later), and exits 2 only when that first failure is a user error.
* ``serve``: one per rollout node; runs its rollout servers under a ``Supervisor``
  (``pipeline.rollout.supervise``: a dead or hung server is restarted, one that fails past
  ``rollout.max_server_failures`` retired) until the first trainer node marks the attempt
  finished. Servers serve rl, curate and evaluate stages alike; the stage's ``rollout`` block
  is pointed at them (``with_servers``). The role and its servers ignore SIGUSR1 (SLURM's
  time-limit warning reaches every process of the step; it asks the trainer for a checkpoint),
  and die of SIGTERM, the end of the job.

The plan (``campaign.json``) and status file live in the campaign directory on a
filesystem every node shares.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

from pipeline.errors import EXIT_USER_ERROR, UserError
from pipeline.launch.campaign import (
    EXIT_REQUEUE,
    CampaignPlan,
    CampaignStatus,
    Stage,
    job_exit,
    rl_finished,
    run_stage,
)
from pipeline.parallel.lifetime import (
    exit_with_parent,
    exit_with_parent_preexec,
)

SERVERS_ENV = "WINNOW_ROLLOUT_SERVERS"  # comma-separated URLs, from the first trainer node to its ranks
NODES_ENV = "WINNOW_NODES"  # the job's host names, in SLURM's order (set by the sbatch script)
# A node-local folder, from the node role to its torchrun ranks: a rank that fails writes one JSON
# record (when, whether a user error, its error line) to rank_<RANK> there before exiting.
RANK_EXIT_DIR_ENV = "WINNOW_RANK_EXIT_DIR"
# What a stage exits with on a user error, and what its job script never requeues.
USER_ERRORS = (UserError, FileNotFoundError)
ROLLOUT_DIR = "rollout"
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


ATTEMPT_ENV = "WINNOW_ATTEMPT"  # set by the stage script: one value for every role of one attempt of a job


def _attempt_token() -> str:
    """Names one attempt of one job: a requeued job is a new attempt with the same id.

    Outside SLURM (the local executor) every run of the stage script is an attempt of its own:
    the script names it by its shell's pid, which the node role takes over (``exec``), so a
    relaunched stage's servers do not take the previous attempt's done marker for theirs.
    """
    if ATTEMPT_ENV in os.environ:
        return os.environ[ATTEMPT_ENV]
    return f"{os.environ.get('SLURM_JOB_ID', 'local')}:{os.environ.get('SLURM_RESTART_COUNT', '0')}"


def _done_marker(plan: CampaignPlan, stage: Stage) -> Path:
    return plan.output_dir / ROLLOUT_DIR / f"{stage.name}.done"


# ================================================================ rollout servers


def rollout_urls(stage: Stage, *, hosts: Sequence[str]) -> list[str]:
    """URLs of the SGLang servers: rollout nodes come after the trainer nodes in the job's node list."""
    rollout = stage.resources.rollout
    assert rollout is not None
    first = 0 if rollout.colocated else stage.resources.nodes  # co-located: on the trainer's first node
    rollout_hosts = list(hosts[first : first + rollout.nodes])
    if len(rollout_hosts) != rollout.nodes:
        raise RuntimeError(f"{NODES_ENV}: {len(hosts)} hosts; stage {stage.name} needs {stage.resources.nodes} "
                           f"trainer and {rollout.nodes} rollout nodes")
    return [f"http://{host}:{rollout.port + index}" for host in rollout_hosts
            for index in range(rollout.servers_per_node)]


def server_commands(stage: Stage, *, host: str, python: str = sys.executable) -> list[list[str]]:
    """One command per server of a rollout node, on disjoint GPUs (``RolloutBackend.serve_command``).

    Servers bind ``host``, the node's own name — the address in the URLs the trainer
    uses — not every interface: SGLang's admin endpoints (weight loading, memory release)
    have no authentication. Co-located servers take the GPUs after the trainer's ranks.
    ``rollout.server`` picks the program (SGLang, or the CPU stand-in of a rehearsal), and with
    it the backend whose flags it takes. Each runs at most the stage's
    ``config.rollout.max_running_requests_per_server`` sequences at once, the number the
    trainer's client derives its in-flight limit from.
    """
    from pipeline.rollout.backends import ServerLaunch, serving_backend

    rollout = stage.resources.rollout
    assert rollout is not None
    cfg = stage.config
    backend = serving_backend(rollout.server)
    # The servers' own HF folder when the trainer's policy is its converted checkpoint.
    model_path = rollout.model_path or cfg.policy
    tokenizer = rollout.model_path or cfg.tokenizer or cfg.policy
    first_gpu = stage.resources.ranks_per_node if rollout.colocated else 0
    return [
        backend.serve_command(rollout.server, ServerLaunch(
            python=python, model_path=model_path, tokenizer=tokenizer, host=host, port=rollout.port + index,
            tensor_parallel=rollout.tensor_parallel, base_gpu_id=first_gpu + index * rollout.tensor_parallel,
            max_running_requests=cfg.rollout.max_running_requests_per_server, extra_args=tuple(rollout.extra_args)))
        for index in range(rollout.servers_per_node)
    ]


# How often the trainer's node role asks the servers whether they are up, and the serve role looks
# for the trainer's done marker: a stage's start and end each wait up to this long for the other role.
ROLE_POLL_S = 1.0
HEALTH_REQUEST_TIMEOUT_S = 5.0


def wait_for_servers(urls: Sequence[str], *, timeout_s: float, poll_s: float = ROLE_POLL_S) -> None:
    """Block until every server answers ``GET /health`` with 200; RuntimeError naming the laggards."""
    deadline = time.monotonic() + timeout_s
    waiting = list(urls)
    while waiting:
        for url in list(waiting):
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=HEALTH_REQUEST_TIMEOUT_S) as response:
                    if response.status == 200:
                        waiting.remove(url)
            except (urllib.error.URLError, OSError):
                pass
        if waiting and time.monotonic() > deadline:
            raise RuntimeError(f"rollout servers not healthy after {timeout_s:.0f} s: {', '.join(waiting)}")
        if waiting:
            time.sleep(poll_s)


def serve(commands: Sequence[Sequence[str]], *, done_marker: Path, token: str, poll_s: float = 5.0,
          urls: Sequence[str] = (), max_restarts: int = 0, health_timeout_s: float = 30.0,
          startup_timeout_s: float = 1800.0, min_servers: int = 1, servers_elsewhere: int = 0,
          load_leases_dir: Path | None = None) -> int:
    """Run the servers under a ``Supervisor`` until ``done_marker`` holds ``token``.

    ``urls`` (one per command) turn on the health probes that find hung servers; without them
    only exits are seen. A server is restarted ``max_restarts`` times, then retired. The role
    ends early, with the last server's exit status (non-zero: srun's --kill-on-bad-exit then
    ends the trainer too, and the job fails or is requeued), only once this node's remaining
    servers plus the ``servers_elsewhere`` of the other rollout nodes are below ``min_servers``:
    the trainer cannot go on then either. Else 0. ``load_leases_dir``: where the trainer's client
    leaves a lease while it has a server load weights (``pipeline.rollout.leases``); the failed
    health probes of a leased server do not count towards its hang window.

    SIGUSR1 is ignored by this process and every server it starts or restarts, always: it means
    nothing to a server, and SLURM's ``--signal=USR1@N`` (the trainer's cue to checkpoint) reaches
    every process of the job step. Its default action would kill them, srun's --kill-on-bad-exit
    would end the trainer's tasks, and the checkpoint it asks for would never be written. Ignoring it
    run by hand too keeps the role the same in and out of SLURM. SIGTERM keeps its default action.
    """
    from pipeline.rollout.leases import WeightLoadLeases
    from pipeline.rollout.supervise import ServerCommand, Supervisor

    addresses: list[str | None] = list(urls) if urls else [None] * len(commands)
    if len(addresses) != len(commands):
        raise ValueError(f"{len(commands)} server commands but {len(addresses)} URLs")
    supervisor = Supervisor([ServerCommand(command=tuple(c), url=u) for c, u in zip(commands, addresses)],
                            max_restarts=max_restarts, probe_timeout_s=health_timeout_s, probe_interval_s=poll_s,
                            startup_timeout_s=startup_timeout_s, ignored_signals=(signal.SIGUSR1,),
                            load_leases=None if load_leases_dir is None else WeightLoadLeases(load_leases_dir))
    next_check = time.monotonic()
    with supervisor:
        # The done marker is looked for every ROLE_POLL_S (the job ends that much after the trainer),
        # the servers are checked every poll_s (each check probes every server's health).
        while not (done_marker.is_file() and done_marker.read_text().strip() == token):
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + poll_s
                supervisor.check()
                if supervisor.num_active + servers_elsewhere < min_servers:
                    print(f"rollout servers: {supervisor.num_active} of {len(commands)} left on this node, "
                          f"{servers_elsewhere} elsewhere, below rollout.min_servers={min_servers}", file=sys.stderr)
                    code = supervisor.last_exit
                    return code if code is not None and code > 0 else 1  # killed by a signal (negative): 1
            time.sleep(max(0.0, min(ROLE_POLL_S, next_check - time.monotonic())))
    return 0


# ================================================================ trainer roles


def with_servers(stage: Stage, servers: Sequence[str]) -> Stage:
    """The stage (rl, curate or evaluate) generating through ``servers``, the rollout servers of its
    ``resources.rollout``, with the backend their program serves, instead of the local engine."""
    if not servers:
        return stage
    from pipeline.rollout.backends import serving_backend

    if stage.resources.rollout is None:
        raise ValueError(f"stage {stage.name}: rollout servers {list(servers)} but no resources.rollout")
    backend = serving_backend(stage.resources.rollout.server)
    cfg = stage.config
    # rl syncs its weights, curate and evaluate export a winnow checkpoint once, through a folder the
    # servers read: the stage's output directory is on the shared filesystem.
    output_dir = cfg.logging.output_dir if stage.kind == "rl" else cfg.output_dir
    weights_dir = cfg.rollout.weights_dir or str(Path(output_dir) / f"{backend.name}_weights")
    rollout = dataclasses.replace(cfg.rollout, engine=backend.name, servers=list(servers), weights_dir=weights_dir)
    return dataclasses.replace(stage, config=dataclasses.replace(cfg, rollout=rollout))


def _servers_from_env() -> list[str]:
    text = os.environ.get(SERVERS_ENV, "")
    return [url for url in text.split(",") if url]


class _Signals:
    """Remembers SIGTERM/SIGINT/SIGUSR1 and passes them on to the child.

    Under SLURM the step's signal reaches every process of the step, the child included,
    so it is only remembered; run by hand, the child hears it only from here.
    """

    def __init__(self) -> None:
        self.received: int | None = None
        self.child: subprocess.Popen | None = None

    def __enter__(self) -> _Signals:
        self._previous = {sig: signal.signal(sig, self._handle) for sig in FORWARDED_SIGNALS}
        return self

    def _handle(self, signum, frame) -> None:  # noqa: ARG002
        self.received = signum
        if self.child is not None and "SLURM_JOB_ID" not in os.environ and self.child.poll() is None:
            self.child.send_signal(signum)

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def run_node(plan: CampaignPlan, stage: Stage, *, launcher: Sequence[str]) -> int:
    """The ``node`` role; ``launcher`` is the torchrun command for a multi-rank stage (else empty).

    Returns the node's exit status: 0, 75 (stopped after a checkpoint), 2 (a user error,
    also one a torchrun rank hit) or the trainer's failure; a user error of this process
    itself is recorded and re-raised (the CLI prints it and exits 2).
    """
    node_id = int(os.environ.get("SLURM_NODEID", "0"))
    first = node_id == 0
    status = CampaignStatus(plan.output_dir)
    token = _attempt_token()
    restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    if first:
        status.update(stage.name, "running", job_id=os.environ.get("SLURM_JOB_ID"), restarts=restarts)
    code, error = 1, "did not finish"
    with _Signals() as signals:
        try:
            if stage.resources.rollout is not None:
                # Outside SLURM (NeMo-Run's local executor) this machine is the job's only node.
                urls = rollout_urls(stage, hosts=os.environ.get(NODES_ENV, "").split() or [socket.gethostname()])
                print(f"waiting for rollout servers: {', '.join(urls)}", flush=True)
                wait_for_servers(urls, timeout_s=stage.resources.rollout.startup_timeout_s)
                os.environ[SERVERS_ENV] = ",".join(urls)
            if launcher:
                code, error = _run_ranks(launcher, signals=signals)
            else:
                # One rank: no peer to wait for, so the stage's own process group will do.
                with _helpers_ignore_usr1():
                    outcome = run_stage(with_servers(stage, _servers_from_env()))
                code = 0 if outcome == "done" else EXIT_REQUEUE
        except Exception as caught:  # noqa: BLE001 - recorded in the status file, then re-raised
            error = f"{type(caught).__name__}: {caught}"
            if first:
                status.update(stage.name, "failed", error=error)
                _mark_attempt_done(plan, stage, token)
            raise
    if stage.stage_kind.checkpoints_on_signal and code != EXIT_USER_ERROR and (code in (0, EXIT_REQUEUE) or signals.received is not None):
        # A signal stops the loop after a checkpoint; torchrun, signalled too, exits non-zero meanwhile.
        code = 0 if rl_finished(stage.config) else EXIT_REQUEUE
    if first:
        requeued, _ = job_exit(code, restarts=restarts, requeues=stage.resources.requeues)
        then = "; requeued" if requeued else ("; no requeue left, relaunch to resume" if code == EXIT_REQUEUE else "")
        if code == 0:
            status.update(stage.name, "done")
        elif code == EXIT_REQUEUE:
            status.update(stage.name, "pending", error="stopped by a signal after a checkpoint" + then)
        else:
            status.update(stage.name, "failed", error=error + then)
        _mark_attempt_done(plan, stage, token)
    return code


def _run_ranks(launcher: Sequence[str], *, signals: _Signals) -> tuple[int, str]:
    """Run torchrun; (exit status, error). A rank's user error turns torchrun's 1 into 2."""
    exit_dir = Path(tempfile.mkdtemp(prefix="winnow-rank-exits-"))
    try:
        # torchrun dies with this process (a kill -9 of the node role), and its ranks with it (``run_role``).
        signals.child = subprocess.Popen(list(launcher), env={**os.environ, RANK_EXIT_DIR_ENV: str(exit_dir)},
                                         preexec_fn=exit_with_parent_preexec())
        code = signals.child.wait()
        failures = [RankFailure.read(path) for path in sorted(exit_dir.glob("rank_*"))]
    finally:
        shutil.rmtree(exit_dir, ignore_errors=True)
    if code == 0 or not failures:
        return code, f"trainer exited with {code}"
    first = root_cause(failures)
    if first.user_error:
        return EXIT_USER_ERROR, first.line
    return code, f"trainer exited with {code}: {first.line}"


@dataclasses.dataclass(frozen=True)
class RankFailure:
    """What one torchrun rank failed with, as it leaves it in the node's rank-exit folder."""

    time_ns: int  # wall clock when the rank caught it: the ranks of a node share the clock
    user_error: bool
    line: str  # "rank N: Type: message", the first line shown in the campaign's status

    @classmethod
    def of(cls, error: BaseException, *, rank: int) -> RankFailure:
        message = str(error).splitlines()[0] if str(error) else ""
        return cls(time.time_ns(), isinstance(error, USER_ERRORS), f"rank {rank}: {type(error).__name__}: {message}")

    def write(self, exit_dir: str | Path, rank: int) -> None:
        Path(exit_dir, f"rank_{rank:05d}").write_text(json.dumps(dataclasses.asdict(self)) + "\n")

    @classmethod
    def read(cls, path: Path) -> RankFailure:
        try:
            return cls(**json.loads(path.read_text()))
        except (ValueError, TypeError):  # a rank killed mid-write: still a failure of that rank
            return cls(path.stat().st_mtime_ns, False, f"{path.name}: {path.read_text().strip()[:200]}")


def root_cause(failures: Sequence[RankFailure]) -> RankFailure:
    """The failure that came first: the others are usually its consequences.

    A rank that hits a bug exits, and its peers then fail in their next collective or checkpoint
    exchange ("Connection closed by peer", which megatron's loader raises as a CheckpointError):
    later, and misleading. Reporting the earliest keeps the root cause, and decides whether the
    job is a user error (exit 2, no requeue) or a crash (torchrun's status, requeued).
    """
    return min(failures, key=lambda failure: failure.time_ns)


def _mark_attempt_done(plan: CampaignPlan, stage: Stage, token: str) -> None:
    if stage.resources.rollout is None:
        return
    marker = _done_marker(plan, stage)
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(token + "\n")


@contextlib.contextmanager
def _helpers_ignore_usr1() -> Iterator[None]:
    """Under SLURM, SIGUSR1 ignored by default while the stage runs, so its helper processes inherit that.

    ``--signal=USR1@N`` reaches every process of the job step: the grading pool's workers and
    multiprocessing's resource tracker would die of it (their default action) and fail the
    checkpoint the signal asks for. The rl loop installs its own handler (``StopRequest``)
    for itself; a Python handler is reset by exec, an ignored signal stays ignored.
    """
    if "SLURM_JOB_ID" not in os.environ:
        yield
        return
    previous = signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGUSR1, previous)


def stage_context(stage: Stage):
    """An rl stage's process group, with the collective timeout its rollout timeouts need; else None.

    None lets every other stage bring up its own group as it does when run by hand.
    """
    if stage.kind != "rl":
        return None
    from pipeline.config import collective_timeout_minutes
    from pipeline.parallel.rendezvous import initialize_process_context

    cfg = stage.config
    return initialize_process_context(
        tensor_parallel=cfg.parallel.tensor_parallel, pipeline_parallel=cfg.parallel.pipeline_parallel,
        seed=cfg.seed, backend=None if cfg.parallel.backend == "auto" else cfg.parallel.backend,
        timeout_minutes=collective_timeout_minutes(parallel=cfg.parallel, rollout=cfg.rollout))


def run_worker(stage: Stage) -> int:
    """One torchrun rank: the stage under torchrun's RANK/WORLD_SIZE/MASTER_ADDR.

    Any failure is recorded in the node's rank-exit folder (torchrun would report it as a plain
    failure of some rank) and re-raised: the CLI prints a user error and exits 2, a crash has its
    traceback.
    """
    try:
        with _helpers_ignore_usr1():
            run_stage(with_servers(stage, _servers_from_env()), context=stage_context(stage))
    except Exception as error:  # noqa: BLE001 - recorded for the node role, then re-raised
        exit_dir = os.environ.get(RANK_EXIT_DIR_ENV)
        if exit_dir:
            rank = int(os.environ.get("RANK", "0"))
            RankFailure.of(error, rank=rank).write(exit_dir, rank)
        raise
    return 0


ROLES = ("node", "worker", "serve")


def run_role(role: str, *, campaign_dir: str, stage_name: str, launcher: Sequence[str] = ()) -> int:
    """Run this node's part of one stage: start its ranks (``node``), be one rank (``worker``), or serve SGLang."""
    plan = CampaignPlan.load(campaign_dir)
    stage = plan.stage(stage_name)
    if role == "worker":
        # Die with torchrun: a torchrun SIGKILLed (by hand, or with the node role) tells its ranks nothing.
        # Armed here, in the rank's own process, not in run_worker, which tests call in theirs.
        exit_with_parent(parent_pid=None)
        return run_worker(stage)
    if role == "serve":
        host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        servers = stage.resources.rollout
        assert servers is not None
        rollout = stage.config.rollout
        if servers.colocated:
            # Started in the background by the first node's script, which then becomes the node role:
            # the servers go with it (a kill -9 of the node role leaves no server behind).
            exit_with_parent(parent_pid=None)
        from pipeline.rollout.leases import load_leases_dir

        urls = [f"http://{host}:{servers.port + i}" for i in range(servers.servers_per_node)]
        # The trainer's client writes its leases under the weights folder with_servers gives the stage.
        leases = load_leases_dir(with_servers(stage, urls).config.rollout.weights_dir)
        return serve(server_commands(stage, host=host), done_marker=_done_marker(plan, stage),
                     token=_attempt_token(), urls=urls,
                     max_restarts=rollout.max_server_failures, health_timeout_s=rollout.health_timeout_s,
                     startup_timeout_s=servers.startup_timeout_s, min_servers=rollout.min_servers,
                     servers_elsewhere=(servers.nodes - 1) * servers.servers_per_node, load_leases_dir=leases)
    return run_node(plan, stage, launcher=launcher)
