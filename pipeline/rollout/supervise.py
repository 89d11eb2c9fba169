"""Supervised SGLang servers: a server process that dies or hangs is killed and started again, within a budget.

The process that launches a node's servers owns them, so it is the one that can restart them:
the ``serve`` role of a campaign's rollout nodes (``pipeline.launch.task.serve``) runs one
``Supervisor`` over that node's ``sglang.launch_server`` commands. Each round (every
``probe_interval_s``) it

* restarts a server whose process exited (a crash, the OOM killer, ``kill -9``);
* probes every running server's ``GET /health_generate`` with ``probe_timeout_s``. SGLang answers
  it with a one-token generation through its scheduler (503 after its own 20 s limit), so a hung
  scheduler behind a live HTTP front end fails it, and a stopped process (``SIGSTOP``, a stuck
  driver call), whose kernel still accepts the connection, never answers. A server that answered
  no probe for ``hang_window_s`` is hung: its process group gets ``SIGKILL`` (a hung process
  ignores ``SIGTERM``) and it is started again. The window is ``max_failed_probes`` probes'
  timeouts (``MAX_FAILED_PROBES`` = 6 × ``rollout.health_timeout_s`` = 30 s: three minutes),
  measured on the clock from the start of the first failed probe: counting failed probes instead
  made it depend on how fast each failed (6 × 20 s = two minutes for SGLang's own 503, 6 × 30 s
  for a stopped process, less for a refused connection);
* does not count failed probes while the trainer has the server load weights: a scheduler inside
  a load answers no probe either (about a minute for a 7B folder from shared storage, longer when
  eight servers read it at once; seconds per bucket of a broadcast). The trainer's client leases
  the server for the load (``load_leases``: ``pipeline.rollout.leases``, a file per server
  in the folder trainer and servers share); the hang window starts again when the lease ends;
* gives a (re)started server ``startup_timeout_s`` to answer its first probe (a 7B server loads
  in one to three minutes), then treats it as hung.

Signals the servers must outlive (``ignored_signals``: the ``serve`` role passes SIGUSR1, which SLURM's
``--signal=USR1@N`` sends to every process of the job step as the trainer's cue to checkpoint) are
ignored by the supervising process itself while it supervises, so every server it starts or restarts
inherits the ignored disposition: exec keeps an ignored signal ignored, where it resets a handler to
the default action (for SIGUSR1: death). SGLang installs no SIGUSR1 handler of its own, so the
disposition reaches its scheduler and detokenizer processes too.

Every server is restarted at most ``max_restarts`` times (``rollout.max_server_failures``); its
next failure retires it: one ``error`` log line, the process group killed, the server left down.
The trainer's ``SGLangEngine`` sees the same failures from its side, counts them against the
same budget and retires the server too; the run continues while ``rollout.min_servers`` remain.

What a restart costs is the trainer's re-sync: a restarted server serves the weights it was
launched with, so the engine takes it back only after it reports the current weight version
(``update_weights_from_disk`` of the newest export, or the next distributed sync's new update
group). At 7B: the server's load time plus one full weight transfer, 15.2 GB in bf16, per restart.

The supervisor itself holds no per-step buffers: one ``Popen`` and one probe thread per server.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx

from pipeline.parallel.lifetime import exit_with_parent_preexec
from pipeline.rollout.leases import WeightLoadLeases
from pipeline.rollout.sglang.protocol import HEALTH_GENERATE_PATH

__all__ = ["MAX_FAILED_PROBES", "ServerCommand", "Supervisor"]

logger = logging.getLogger(__name__)

# A hang is this many health probes' timeouts without an answered probe: at the default probe timeout
# (rollout.health_timeout_s, 30 s) three minutes, above a scheduler's longest legitimate silence that no
# lease covers (CUDA graph capture after a restart is covered by startup_timeout_s instead).
MAX_FAILED_PROBES = 6


@dataclass(kw_only=True, slots=True, frozen=True)
class ServerCommand:
    """One server: the argv that starts it and the base URL it answers at once up (None: not probed)."""

    command: tuple[str, ...]
    url: str | None = None

    def __post_init__(self) -> None:
        if not self.command:
            raise ValueError("ServerCommand.command is empty")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"ServerCommand.url {self.url!r} must start with http:// or https://")
        object.__setattr__(self, "command", tuple(self.command))
        object.__setattr__(self, "url", None if self.url is None else self.url.rstrip("/"))


@dataclass(eq=False)
class _Supervised:
    spec: ServerCommand
    process: subprocess.Popen | None = None
    started_at: float = 0.0  # time.monotonic() of its last (re)start
    healthy: bool = False  # answered a probe since its last (re)start
    failed_probes: int = 0  # in a row
    failing_since: float | None = None  # time.monotonic() at the start of the first of them
    loading: bool = False  # its last failed probe came while the trainer had it load weights
    restarts: int = 0
    retired: bool = False
    last_exit: int | None = None


class Supervisor:
    """Starts, probes, restarts and retires a node's server processes; see the module docstring.

    Servers without a URL are not probed: only their exits are seen (no hang detection).
    ``probe_interval_s``: how often ``run`` checks; the hang window (``hang_window_s`` =
    ``max_failed_probes × probe_timeout_s``) does not depend on it. ``load_leases``: where the
    trainer leases a server while it loads weights into it (None: no lease is looked for).
    ``env``: the servers' environment (None: this process's). ``ignored_signals``: ignored by this
    process from ``start`` to ``close`` (then restored), hence by every server started or restarted
    in between; ``start`` must then run in the main thread (Python sets dispositions only there).
    """

    def __init__(
        self,
        servers: Sequence[ServerCommand],
        *,
        max_restarts: int,
        health_path: str = HEALTH_GENERATE_PATH,
        probe_timeout_s: float = 30.0,
        probe_interval_s: float = 10.0,
        max_failed_probes: int = MAX_FAILED_PROBES,
        startup_timeout_s: float = 1800.0,
        load_leases: WeightLoadLeases | None = None,
        env: Mapping[str, str] | None = None,
        ignored_signals: Sequence[int] = (),
    ) -> None:
        if not servers:
            raise ValueError("Supervisor needs at least one server")
        if max_restarts < 0 or max_failed_probes < 1:
            raise ValueError(f"need max_restarts >= 0 and max_failed_probes >= 1, got {max_restarts}, "
                             f"{max_failed_probes}")
        for name, value in (("probe_timeout_s", probe_timeout_s), ("probe_interval_s", probe_interval_s),
                            ("startup_timeout_s", startup_timeout_s)):
            if not value > 0:
                raise ValueError(f"Supervisor {name} must be > 0, got {value}")
        self._servers = [_Supervised(spec=spec) for spec in servers]
        self.max_restarts = max_restarts
        self.health_path = health_path
        self.probe_timeout_s = probe_timeout_s
        self.probe_interval_s = probe_interval_s
        self.max_failed_probes = max_failed_probes
        self.startup_timeout_s = startup_timeout_s
        self.load_leases = load_leases
        self.env = dict(env) if env is not None else None
        self.ignored_signals = tuple(ignored_signals)
        self._dispositions: dict[int, object] = {}  # what ``start`` replaced, restored by ``close``
        self._pool = ThreadPoolExecutor(max_workers=len(self._servers), thread_name_prefix="probe")
        # No proxy from the environment between a node and its own servers.
        self._client = httpx.Client(trust_env=False, timeout=httpx.Timeout(probe_timeout_s))

    # ------------------------------------------------------------------ state

    @property
    def hang_window_s(self) -> float:
        """How long a running server may answer no health probe before it counts as hung."""
        return self.max_failed_probes * self.probe_timeout_s

    @property
    def pids(self) -> list[int | None]:
        """The current process id of each server (None once retired)."""
        return [None if s.retired or s.process is None else s.process.pid for s in self._servers]

    @property
    def restarts(self) -> list[int]:
        return [s.restarts for s in self._servers]

    @property
    def retired(self) -> list[bool]:
        return [s.retired for s in self._servers]

    @property
    def num_active(self) -> int:
        """Servers not retired (running, starting or about to be restarted)."""
        return sum(not s.retired for s in self._servers)

    @property
    def last_exit(self) -> int | None:
        """The exit status of the most recent server process that exited on its own."""
        codes = [s.last_exit for s in self._servers if s.last_exit is not None]
        return codes[-1] if codes else None

    # -------------------------------------------------------------- lifecycle

    def start(self) -> None:
        for sig in self.ignored_signals:
            self._dispositions.setdefault(sig, signal.signal(sig, signal.SIG_IGN))
        for server in self._servers:
            self._start(server)

    def close(self) -> None:
        """SIGTERM every server's process group, SIGKILL what is left after 60 s; restore ``ignored_signals``."""
        for server in self._servers:
            self._signal(server, signal.SIGTERM)
        deadline = time.monotonic() + 60.0
        for server in self._servers:
            if server.process is not None:
                try:
                    server.process.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
            self._signal(server, signal.SIGKILL)
            if server.process is not None:
                server.process.wait()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._client.close()
        for sig, disposition in self._dispositions.items():
            if disposition is not None:  # None: set outside Python, which Python cannot set back
                signal.signal(sig, disposition)
        self._dispositions.clear()

    def __enter__(self) -> Supervisor:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def run(self, *, until: Callable[[], bool]) -> None:
        """Check every ``probe_interval_s`` until ``until()`` is true."""
        while not until():
            started = time.monotonic()
            self.check()
            time.sleep(max(0.0, self.probe_interval_s - (time.monotonic() - started)))

    # ---------------------------------------------------------------- a round

    def check(self) -> None:
        """One round: restart the exited servers, probe the running ones, restart the hung ones."""
        running: list[_Supervised] = []
        for server in self._servers:
            if server.retired or server.process is None:
                continue
            code = server.process.poll()
            if code is not None:
                server.last_exit = code
                self._failed(server, f"exited with code {code}")
            elif server.spec.url is not None:
                running.append(server)
        if not running:
            return
        probed_at = time.monotonic()
        errors = list(self._pool.map(self._probe, running))
        now = time.monotonic()
        for server, error in zip(running, errors):
            if error is None:
                server.healthy = True
                server.failed_probes = 0
                server.failing_since = None
                server.loading = False
            elif not server.healthy:
                if now - server.started_at > self.startup_timeout_s:
                    self._failed(server, f"not healthy within startup_timeout_s={self.startup_timeout_s:g}: {error}")
            elif self._loading_weights(server):
                # Busy with a load the trainer asked for: not a hang; the window starts again after it.
                server.failed_probes = 0
                server.failing_since = None
            else:
                server.failed_probes += 1
                if server.failing_since is None:
                    server.failing_since = probed_at
                if now - server.failing_since >= self.hang_window_s:
                    self._failed(server, f"hung: no health probe answered for {now - server.failing_since:.0f} s "
                                         f"(hang window {self.hang_window_s:g} s = {self.max_failed_probes} × "
                                         f"probe_timeout_s={self.probe_timeout_s:g}; {server.failed_probes} "
                                         f"probes failed), last: {error}")

    def _loading_weights(self, server: _Supervised) -> bool:
        """Whether the trainer holds a weight-load lease on the server (logged once per load)."""
        loading = (self.load_leases is not None and server.spec.url is not None
                   and self.load_leases.active(server.spec.url))
        if loading and not server.loading:
            logger.info("rollout server %s fails its health probes while the trainer has it load weights; not "
                        "counted as a hang", self._name(server))
        server.loading = loading
        return loading

    def _probe(self, server: _Supervised) -> str | None:
        assert server.spec.url is not None
        try:
            response = self._client.get(server.spec.url + self.health_path)
        except httpx.HTTPError as error:
            return f"{type(error).__name__}: {error}"
        return None if response.status_code == 200 else f"HTTP {response.status_code}"

    def _failed(self, server: _Supervised, reason: str) -> None:
        # Kill the whole group even when the leader exited: SGLang's scheduler processes would
        # otherwise keep the GPUs and the port.
        self._signal(server, signal.SIGKILL)
        if server.process is not None:
            server.process.wait()
        if server.restarts >= self.max_restarts:
            server.retired = True
            server.process = None  # reaped: its group id may be reused, so it is never signalled again
            logger.error("retiring rollout server %s after %d restarts (max_server_failures=%d): %s",
                         self._name(server), server.restarts, self.max_restarts, reason)
            return
        server.restarts += 1
        logger.warning("restarting rollout server %s (restart %d of %d): %s", self._name(server), server.restarts,
                       self.max_restarts, reason)
        self._start(server)

    def _start(self, server: _Supervised) -> None:
        # A session of its own, so one killpg reaches the server's children too; and it dies with the
        # supervising process (a kill -9 of the serve role leaves no server holding its port and GPU).
        server.process = subprocess.Popen(list(server.spec.command), stdin=subprocess.DEVNULL, start_new_session=True,
                                          env=self.env, preexec_fn=exit_with_parent_preexec())
        server.started_at = time.monotonic()
        server.healthy = False
        server.failed_probes = 0
        server.failing_since = None
        server.loading = False

    @staticmethod
    def _name(server: _Supervised) -> str:
        return server.spec.url or " ".join(server.spec.command[:6])

    @staticmethod
    def _signal(server: _Supervised, sig: int) -> None:
        if server.process is None:
            return
        try:
            os.killpg(server.process.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
