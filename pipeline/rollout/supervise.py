"""Supervised SGLang servers: a server process that dies or hangs is killed and started again, within a budget.

The process that launches a node's servers owns them, so it is the one that can restart them:
the ``serve`` role of a campaign's rollout nodes (``pipeline.launch.task.serve``) runs one
``Supervisor`` over that node's ``sglang.launch_server`` commands. Each round (every
``probe_interval_s``) it

* restarts a server whose process exited (a crash, the OOM killer, ``kill -9``);
* probes every running server's ``GET /health_generate`` with ``probe_timeout_s``. SGLang answers
  it with a one-token generation through its scheduler (503 after its own 20 s limit), so a hung
  scheduler behind a live HTTP front end fails it, and a stopped process (``SIGSTOP``, a stuck
  driver call), whose kernel still accepts the connection, never answers. ``max_failed_probes``
  failures in a row mark the server hung: its process group gets ``SIGKILL`` (a hung process
  ignores ``SIGTERM``) and it is started again. A scheduler busy loading weights answers no
  probe either (about a minute for a 7B folder from disk, seconds by broadcast), so the default
  window, 6 probes of up to 30 s each, is about three minutes;
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
from pipeline.rollout.sglang.protocol import HEALTH_GENERATE_PATH

__all__ = ["ServerCommand", "Supervisor"]

logger = logging.getLogger(__name__)


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
    restarts: int = 0
    retired: bool = False
    last_exit: int | None = None


class Supervisor:
    """Starts, probes, restarts and retires a node's server processes; see the module docstring.

    Servers without a URL are not probed: only their exits are seen (no hang detection).
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
        max_failed_probes: int = 6,
        startup_timeout_s: float = 1800.0,
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
        self.env = dict(env) if env is not None else None
        self.ignored_signals = tuple(ignored_signals)
        self._dispositions: dict[int, object] = {}  # what ``start`` replaced, restored by ``close``
        self._pool = ThreadPoolExecutor(max_workers=len(self._servers), thread_name_prefix="probe")
        # No proxy from the environment between a node and its own servers.
        self._client = httpx.Client(trust_env=False, timeout=httpx.Timeout(probe_timeout_s))

    # ------------------------------------------------------------------ state

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
        errors = list(self._pool.map(self._probe, running))
        now = time.monotonic()
        for server, error in zip(running, errors):
            if error is None:
                server.healthy = True
                server.failed_probes = 0
            elif not server.healthy:
                if now - server.started_at > self.startup_timeout_s:
                    self._failed(server, f"not healthy within startup_timeout_s={self.startup_timeout_s:g}: {error}")
            else:
                server.failed_probes += 1
                if server.failed_probes >= self.max_failed_probes:
                    self._failed(server, f"hung: {server.failed_probes} health probes failed in a row, last: {error}")

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
