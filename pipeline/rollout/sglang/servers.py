"""SGLang server processes and their health: who is live, who is down, who is retired.

Servers are either launched here (``SGLangServerProcess``: ``python -m sglang.launch_server``
per ``SGLangServerSpec``, loopback by default, logs to files, killed with their process group
on ``close``) or attached to by base URL. Either way the client first waits for every
server's ``/health`` to answer 200, with a deadline (``ServerPool.wait_until_healthy``).

``ServerPool`` holds what generation (``pipeline.rollout.sglang.generation``) and the weight
updates (``pipeline.rollout.sglang.weights``) share: every server's state and the weight
version the live ones serve.

Failed servers come back (``max_server_failures`` > 0; the launcher restarts them, see
``pipeline.rollout.supervise``). A dropped server is *down*: it gets no requests while a
recovery task polls its ``/health``; once it answers, ``/model_info`` must report the pool's
weight version. A restarted server reports its launch weights, so it first loads the newest
folder the weights came from (``disk_source``) again; after a streamed update the client
cannot resend the weights itself, and the server waits as *stale* until the next update,
which includes it (a new update group). A server dropped in the middle of a streamed update
holds part of it (``Server.partial_weights``), whatever version it reports (SGLang relabels its
weights at every bucket): it is taken back only after a full update too. Before a recovered
server is taken back, a weight-update session it may still hold is closed (SGLang refuses every
later update while one is open). Only then is it live. A batch starts with one pass of
that check over every server (``check``), so a server that restarted between two steps never
answers a request with its launch weights. Each failure counts; the one after
``max_server_failures``, or ``recovery_timeout_s`` without recovery, *retires* the server for
good (one ``error`` log line, ``metrics()["rollout/servers_retired"]``), and fewer than
``min_servers`` servers not retired is a ``RolloutError``. With ``max_server_failures=0`` the
first failure retires.

While the client has a server load weights (from disk, here or in ``weights``, or a streamed
update's session) it leases the server (``loading``, ``pipeline.rollout.leases``), so the
supervisor of the server's node does not take its failing health probes for a hang.

With ``expected_tp_size`` set (the update group's ranks per server), every server's
``/server_info`` must report that ``tp_size`` the first time it is contacted (and again after each
failure: a restart): else ``ConfigError`` naming ``rollout.server_tensor_parallel``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Sequence

import httpx

from pipeline.configlib import ConfigError
from pipeline.rollout.sglang import protocol
from pipeline.rollout.sglang.client import (
    Rejected,
    ServerFault,
    SGLangClientConfig,
    answer_failure,
    call,
    parse_json,
    run_sync,
)
from pipeline.rollout.leases import WeightLoadLeases
from pipeline.rollout.types import RolloutError

__all__ = ["SGLangServerProcess", "Server", "ServerPool"]

logger = logging.getLogger(__name__)

_LOG_TAIL_BYTES = 4000


class SGLangServerProcess:
    """A launched ``sglang.launch_server`` process group, logging to ``log_path``."""

    def __init__(self, spec: protocol.SGLangServerSpec, *, log_path: Path, env: dict[str, str] | None = None) -> None:
        self.spec = spec
        self.log_path = log_path
        self.command = protocol.launch_command(spec)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            # A session of its own, so terminate() reaches the scheduler/detokenizer children too.
            self.process = subprocess.Popen(
                self.command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=env,
            )

    @property
    def base_url(self) -> str:
        return self.spec.base_url

    def exit_code(self) -> int | None:
        return self.process.poll()

    def log_tail(self) -> str:
        try:
            with open(self.log_path, "rb") as log:
                log.seek(0, os.SEEK_END)
                log.seek(max(0, log.tell() - _LOG_TAIL_BYTES))
                return log.read().decode(errors="replace")
        except OSError:
            return ""

    def terminate(self, *, grace_s: float = 30.0) -> None:
        """SIGTERM the process group, then SIGKILL whatever is left after ``grace_s``."""
        if self.process.poll() is not None:
            return
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.process.wait(timeout=wait_s)
                return
            except subprocess.TimeoutExpired:
                continue


# live: takes requests. down: failed; waits to answer /health again and be re-synced.
# stale: healthy, but behind on weights the client cannot resend itself (a streamed update);
# the next weight update includes it. retired: failed too often, never used again.
ServerState = Literal["live", "down", "stale", "retired"]


@dataclass(eq=False)
class Server:
    url: str
    in_flight: int = 0
    consecutive_failures: int = 0
    available_at: float = 0.0  # time.monotonic() before which it gets no new work (backoff)
    state: ServerState = "live"
    dead_reason: str = ""  # why it is not live
    failures: int = 0  # times it went down
    down_since: float = 0.0  # time.monotonic() of its last failure
    # Dropped in the middle of a streamed update: it holds part of it, whatever version it reports.
    partial_weights: bool = False

    @property
    def dead(self) -> bool:
        """Out of the rotation: down, stale or retired."""
        return self.state != "live"


class ServerPool:
    """The servers one client talks to, their states, and the weight version the live ones serve.

    ``base_urls`` are ``http://host:port`` of running servers; ``weight_version`` is the version
    they serve now (what ``"default"`` means in their answers). The constructor does not contact
    them: call ``wait_until_healthy``.
    """

    def __init__(
        self,
        base_urls: Sequence[str],
        *,
        config: SGLangClientConfig,
        weight_version: int = 0,
        processes: Sequence[SGLangServerProcess] = (),
    ) -> None:
        urls = [url.rstrip("/") for url in base_urls]
        if not urls:
            raise ValueError("an SGLang client needs at least one server URL")
        if len(set(urls)) != len(urls):
            raise ValueError(f"duplicate server URLs in {urls}")
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"server URL {url!r} must start with http:// or https://")
        self.config = config
        self.servers = [Server(url=url) for url in urls]
        self.processes = list(processes)
        self.initial_version = int(weight_version)
        self.weight_version = int(weight_version)
        self.next_server = 0  # where generation's round-robin resumes
        # The folder of the last load from disk: what a recovered server loads. None before any update (a
        # restarted server is at the initial weights) and after a streamed update (only the next one can
        # bring a restarted server up to date).
        self.disk_source: str | None = None
        self.num_recoveries = 0
        self.leases = None if config.load_leases_dir is None else WeightLoadLeases(config.load_leases_dir)
        # The tp_size every server must report (the update group's ranks per server); None: not checked.
        self.expected_tp_size: int | None = None
        self._tp_checked: set[tuple[str, int]] = set()  # (URL, failures) of the servers that reported it

    def close(self) -> None:
        """Stop the servers this client launched (attached servers are left running)."""
        for process in self.processes:
            process.terminate()
        self.processes = []

    # ------------------------------------------------------------------ views

    @property
    def live_servers(self) -> list[str]:
        return [s.url for s in self.servers if not s.dead]

    @property
    def dead_servers(self) -> dict[str, str]:
        """URL → why it takes no requests (down, stale or retired)."""
        return {s.url: s.dead_reason for s in self.servers if s.dead}

    @property
    def retired_servers(self) -> dict[str, str]:
        """URL → why it was retired for good."""
        return {s.url: s.dead_reason for s in self.servers if s.state == "retired"}

    def metrics(self) -> dict[str, float]:
        """Server counts by state and the recoveries so far (``rollout/...`` metrics of a step)."""
        counts = {state: 0 for state in ("live", "down", "stale", "retired")}
        for server in self.servers:
            counts[server.state] += 1
        return {**{f"rollout/servers_{state}": float(n) for state, n in counts.items()},
                "rollout/server_recoveries": float(self.num_recoveries)}

    def live(self) -> list[Server]:
        return [s for s in self.servers if not s.dead]

    def syncable(self) -> list[Server]:
        """The servers the next weight update goes to: the live ones and the stale ones it brings back."""
        return [s for s in self.servers if s.state in ("live", "stale")]

    def client(self) -> httpx.AsyncClient:
        """One connection pool for a batch or an admin call: every call in flight plus a few probes per server."""
        headers = {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else None
        connections = self.config.max_in_flight + 4 * len(self.servers)
        return httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=self.config.connect_timeout_s),
            limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
            headers=headers,
            trust_env=False,
        )

    # ------------------------------------------------------------ transitions

    def drop(self, server: Server, reason: str) -> None:
        """A failure: the server is down until it recovers, or retired past ``max_server_failures``."""
        if server.state in ("down", "retired"):
            return
        server.failures += 1
        if server.failures > self.config.max_server_failures:
            self.retire(server, f"failure {server.failures} (max_server_failures="
                                f"{self.config.max_server_failures}): {reason}")
            return
        server.state = "down"
        server.dead_reason = reason
        server.down_since = time.monotonic()
        logger.warning("SGLang server %s is down (failure %d of %d allowed): %s; no requests until it answers "
                       "%s and serves weight version %d", server.url, server.failures,
                       self.config.max_server_failures, reason, self.config.health_path, self.weight_version)

    def retire(self, server: Server, reason: str) -> None:
        server.state = "retired"
        server.dead_reason = reason
        remaining = sum(s.state != "retired" for s in self.servers)
        logger.error("retiring SGLang server %s for good: %s; %d of %d servers left (min_servers=%d)",
                     server.url, reason, remaining, len(self.servers), self.config.min_servers)

    def promote(self, updated: Sequence[Server], *, version: int) -> None:
        """Stale servers that took a full weight update serve again."""
        for server in updated:
            server.partial_weights = False
            if server.state == "stale":
                server.state = "live"
                self.num_recoveries += 1
                logger.warning("SGLang server %s is back at weight version %d", server.url, version)

    def check_enough(self) -> None:
        """``RolloutError`` once retirements leave fewer than ``min_servers`` servers."""
        remaining = sum(s.state != "retired" for s in self.servers)
        if remaining < self.config.min_servers:
            n = len(self.servers)
            left = f"no SGLang server left (all {n} retired)" if remaining == 0 else (
                f"only {remaining} of {n} SGLang servers left")
            raise RolloutError(f"{left}, below rollout.min_servers={self.config.min_servers}; "
                               f"retired: {self.retired_servers}")

    # ------------------------------------------------------------ weight-load leases

    @property
    def lease_s(self) -> float:
        """How long a lease lasts: the longest the client keeps asking one server to load (all its attempts)."""
        return self.config.admin_timeout_s * self.config.max_attempts

    def hold_leases(self, servers: Sequence[Server]) -> None:
        """Lease ``servers`` for ``lease_s`` from now (renews); nothing without a lease folder."""
        if self.leases is not None:
            self.leases.hold([server.url for server in servers], seconds=self.lease_s)

    def release_leases(self, servers: Sequence[Server]) -> None:
        if self.leases is not None:
            self.leases.release([server.url for server in servers])

    @contextlib.contextmanager
    def loading(self, servers: Sequence[Server]) -> Iterator[None]:
        """The servers hold a lease while the block runs (they load weights the client asked for)."""
        self.hold_leases(servers)
        try:
            yield
        finally:
            self.release_leases(servers)

    # ------------------------------------------------------- health and recovery

    async def served_version(self, client: httpx.AsyncClient, server: Server) -> int:
        response = await call(client, "GET", server.url + protocol.MODEL_INFO_PATH,
                                 timeout_s=self.config.probe_timeout_s)
        try:
            return protocol.parse_model_info_version(
                parse_json(response), initial_version=self.initial_version, current_version=self.weight_version
            )
        except protocol.MalformedResponse as error:
            raise ServerFault(f"{server.url}{protocol.MODEL_INFO_PATH}: {error}") from error

    async def recover_once(self, client: httpx.AsyncClient, server: Server) -> str | None:
        """One try at bringing a down server back; None once it is settled (live or stale), else why not yet.

        Healthy, then at the current weights (re-loaded from the newest folder if need be), then
        live. A server still behind after a streamed update becomes ``stale``: the next update
        includes it.
        """
        cfg = self.config
        try:
            await call(client, "GET", server.url + cfg.health_path, timeout_s=cfg.probe_timeout_s)
            await self.close_stale_session(client, server)
            version = await self.served_version(client, server)
            if (version != self.weight_version or server.partial_weights) and self.disk_source is not None:
                folder = self.disk_source
                body = protocol.update_weights_from_disk_body(folder, version=self.weight_version)
                with self.loading([server]):
                    answer = await call(client, "POST", server.url + protocol.UPDATE_FROM_DISK_PATH, body=body,
                                        timeout_s=cfg.admin_timeout_s)
                failure = answer_failure(answer)
                if failure is not None:
                    raise ServerFault(f"re-loading {folder}: {failure}")
                server.partial_weights = False
                version = await self.served_version(client, server)
        except (ServerFault, Rejected) as error:
            return str(error)
        if version == self.weight_version and not server.partial_weights:
            server.state = "live"
            server.consecutive_failures = 0
            server.available_at = 0.0
            self.num_recoveries += 1
            logger.warning("SGLang server %s is back at weight version %d after failure %d", server.url, version,
                           server.failures)
            return None
        if self.disk_source is None:
            server.state = "stale"
            behind = ("holds part of a weight update that did not complete on it" if server.partial_weights
                      else f"serves weight version {version}, not {self.weight_version}")
            server.dead_reason = f"{behind}; the next weight update brings it back"
            logger.warning("SGLang server %s is healthy again but %s", server.url, server.dead_reason)
            return None
        return f"still serves weight version {version} after re-loading, not {self.weight_version}"

    async def close_stale_session(self, client: httpx.AsyncClient, server: Server) -> None:
        """Close a weight-update session ``server`` may still hold before it is taken back.

        It holds one when it was dropped in the middle of a streamed update (its part of the update
        timed out, yet the process lived on) or a trainer died mid-update on it; SGLang would refuse
        every later ``/begin_weight_update``. Usually none is open, and SGLang refuses the close
        (HTTP 400): nothing to do. A fault propagates (the recovery tries again later).
        """
        try:
            answer = await call(client, "POST", server.url + protocol.END_WEIGHT_UPDATE_PATH,
                                body=protocol.end_weight_update_body(), timeout_s=self.config.admin_timeout_s)
        except Rejected:
            return
        if answer_failure(answer) is None:
            logger.warning("closed the weight-update session SGLang server %s still held", server.url)

    async def check_tensor_parallel(self, client: httpx.AsyncClient, servers: Sequence[Server]) -> None:
        """Each of ``servers`` not checked since its last failure must report ``expected_tp_size`` at ``/server_info``.

        A mismatch is the user's: ``ConfigError`` naming ``rollout.server_tensor_parallel``, before any
        update group is formed with the wrong ranks (it would wait for ranks that never join, or give
        two servers one rank). An unreachable server is checked when it answers again; a server
        without the endpoint or the field is a ``RolloutError``. One GET per server and restart.
        """
        expected = self.expected_tp_size
        todo = [s for s in servers if expected is not None and (s.url, s.failures) not in self._tp_checked]
        if not todo:
            return
        outcomes = await asyncio.gather(
            *(call(client, "GET", s.url + protocol.SERVER_INFO_PATH, timeout_s=self.config.probe_timeout_s)
              for s in todo),
            return_exceptions=True,
        )
        mismatched: list[str] = []
        for server, outcome in zip(todo, outcomes):
            if isinstance(outcome, ServerFault):
                continue
            if isinstance(outcome, BaseException) and not isinstance(outcome, Rejected):
                raise outcome
            try:
                if isinstance(outcome, Rejected):
                    raise protocol.MalformedResponse(str(outcome))
                tp_size = protocol.parse_server_info_tp_size(parse_json(outcome))
            except (protocol.MalformedResponse, ServerFault) as error:
                raise RolloutError(f"{server.url}{protocol.SERVER_INFO_PATH}: cannot check the server's tp_size "
                                   f"against rollout.server_tensor_parallel={expected}: {error}") from error
            if tp_size == expected:
                self._tp_checked.add((server.url, server.failures))
            else:
                mismatched.append(f"{server.url} runs tp_size={tp_size}")
        if mismatched:
            raise ConfigError(
                f"rollout.server_tensor_parallel={expected} (each server's ranks in the weight update group), but "
                f"{'; '.join(mismatched)}: set it to the servers' --tp-size (a campaign's "
                f"resources.rollout.tensor_parallel)")

    def recovery_overdue(self, server: Server, last_error: str) -> bool:
        """Retire a down server once ``recovery_timeout_s`` since its failure passed."""
        if time.monotonic() < server.down_since + self.config.recovery_timeout_s:
            return False
        self.retire(server, f"not back within recovery_timeout_s={self.config.recovery_timeout_s:g} of failure "
                            f"{server.failures}; last: {last_error}")
        return True

    async def recover(self, client: httpx.AsyncClient, server: Server) -> None:
        """Retry ``recover_once`` until the server is settled or retired (``recovery_timeout_s``)."""
        last_error = server.dead_reason
        while not self.recovery_overdue(server, last_error):
            why = await self.recover_once(client, server)
            if why is None:
                return
            last_error = why
            await asyncio.sleep(self.config.health_poll_s)

    async def check(self, client: httpx.AsyncClient, *, before_update: bool = False) -> None:
        """One pass over the servers: a live one that is unreachable or serves another weight version
        (it restarted since the last call) goes down; a down one gets one recovery try.

        ``before_update``: a server *ahead* of the pool's version holds part of an update that
        failed elsewhere; the coming update replaces it, so only servers behind (restarted) go down.
        """
        live = self.live()
        outcomes = await asyncio.gather(*(self.served_version(client, s) for s in live), return_exceptions=True)
        for server, outcome in zip(live, outcomes):
            if isinstance(outcome, BaseException) and not isinstance(outcome, (ServerFault, Rejected)):
                raise outcome
            if isinstance(outcome, BaseException):
                self.drop(server, f"{protocol.MODEL_INFO_PATH} failed: {outcome}")
            elif outcome < self.weight_version or (outcome != self.weight_version and not before_update):
                self.drop(server, f"serves weight version {outcome}, not {self.weight_version} (restarted?)")
        down = [s for s in self.servers if s.state == "down"]
        whys = await asyncio.gather(*(self.recover_once(client, s) for s in down))
        for server, why in zip(down, whys):
            if why is not None:
                self.recovery_overdue(server, why)

    def check_servers(self, *, before_update: bool = False) -> None:
        """``check`` without waiting for anything else, then ``check_tensor_parallel``: a streamed weight
        update runs it first (``before_update``) so that a restarted server is not taken for a member of
        the update group. ``RolloutError`` once fewer than ``min_servers`` are left."""

        async def run() -> None:
            async with self.client() as client:
                await self.check(client, before_update=before_update)
                await self.check_tensor_parallel(client, self.syncable())

        run_sync(run())
        self.check_enough()

    async def probe(self, client: httpx.AsyncClient, server: Server, *, timeout_s: float) -> str | None:
        """None if ``/health`` answers 200 within ``timeout_s``, else why not."""
        try:
            await call(client, "GET", server.url + self.config.health_path, timeout_s=timeout_s)
        except (ServerFault, Rejected) as error:
            return str(error)
        return None

    def wait_until_healthy(self, timeout_s: float | None = None) -> None:
        """Block until every live server's ``/health`` is 200.

        ``RolloutError`` at the deadline, or as soon as a server this client launched exits.
        """
        run_sync(self._wait_until_healthy(self.config.startup_timeout_s if timeout_s is None else timeout_s))

    async def _wait_until_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        processes = {p.base_url.rstrip("/"): p for p in self.processes}
        waiting = self.live()
        last_error: dict[str, str] = {}
        async with self.client() as client:
            while waiting:
                for server in waiting:
                    process = processes.get(server.url)
                    if process is not None and process.exit_code() is not None:
                        raise RolloutError(
                            f"SGLang server {server.url} exited with code {process.exit_code()} before becoming "
                            f"healthy; command: {' '.join(process.command)}; "
                            f"log {process.log_path}:\n{process.log_tail()}"
                        )
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    details = "; ".join(f"{s.url}: {last_error.get(s.url, 'no answer')}" for s in waiting)
                    raise RolloutError(f"SGLang servers not healthy within {timeout_s:g}s: {details}")
                probe_s = min(self.config.probe_timeout_s, remaining)
                errors = await asyncio.gather(*(self.probe(client, s, timeout_s=probe_s) for s in waiting))
                for server, error in zip(waiting, errors):
                    if error is not None:
                        last_error[server.url] = error
                waiting = [s for s, error in zip(waiting, errors) if error is not None]
                if waiting:
                    await asyncio.sleep(min(self.config.health_poll_s, max(0.0, deadline - time.monotonic())))
