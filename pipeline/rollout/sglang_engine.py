"""``SGLangEngine``: rollouts from SGLang servers over HTTP, with failover that never loses a sample.

Servers are either launched here (``SGLangEngine.launch``: ``python -m
sglang.launch_server`` per ``SGLangServerSpec``, loopback by default, logs to files,
killed with their process group on ``close``) or attached to by base URL. Either way
the engine first waits for every server's ``/health`` to answer 200, with a deadline.

One ``generate`` call:

* Every requested sample is a key ``(request index, sample index)``; the samples of a
  prompt are cut into work items of at most ``max_samples_per_request``, each sent as
  one batch ``/generate`` call (``sglang_api.generate_body``).
* At most ``max_in_flight`` calls run at once (``max_in_flight_per_server`` per
  server); ``from_rollout`` derives both from the servers' ``--max-running-requests``
  (``pipeline.config.rollout_in_flight_limit``). A work item goes to the live,
  not-backing-off server with the fewest calls in flight, ties broken round-robin,
  avoiding the server it last failed on when another one is free.
* An attempt fails on a connection error, no answer within ``request_timeout_s``
  (the whole call, so a server that trickles bytes cannot stall it), HTTP 5xx / 429 /
  408, or a 200 whose body breaks the response contract. The server then backs off
  exponentially (``backoff_initial_s · 2^(k−1)``, capped at ``backoff_max_s``) and is
  dropped for good after ``max_consecutive_failures`` failures in a row. The item goes
  back to the front of the queue; after ``max_attempts`` failures of its own it raises
  ``RolloutError``. An HTTP 4xx (other than 408/429) means the request itself is bad:
  ``RolloutError`` at once, naming the prompt and the server's message.
* When a server is dropped, every attempt still in flight on it is *abandoned*: its
  work item is re-queued at once and its task cancelled; should its result arrive
  anyway it is discarded. Results are stored under their sample keys, each key
  exactly once, so no sample is lost or duplicated whatever fails when.
* A watchdog probes ``/health`` of every server with calls in flight every
  ``watchdog_interval_s``; failed probes count as failures, so a hung server is
  dropped within seconds instead of after ``request_timeout_s`` (which must be long
  enough for a full reasoning-length generation).
* No live server left, or the optional ``batch_timeout_s`` passed: ``RolloutError``.
  The batch never hangs: every wait above is bounded.

Failed servers come back (``max_server_failures`` > 0; the launcher restarts them, see
``pipeline.rollout.supervise``). A dropped server is *down*: it gets no requests while a
recovery task polls its ``/health``; once it answers, ``/model_info`` must report the engine's
weight version. A restarted server reports its launch weights, so it first loads the newest
``update_weights_from_disk`` folder again; after a tensor or distributed update the engine
cannot resend the weights itself, and the server waits as *stale* until the next update, which
includes it (a new update group). Only then is it live. ``generate`` starts with one pass of
that check over every server, so a server that restarted between two steps never answers a
request with its launch weights. Each failure counts; the one after ``max_server_failures``,
or ``recovery_timeout_s`` without recovery, *retires* the server for good (one ``error`` log
line, ``metrics()["rollout/servers_retired"]``), and fewer than ``min_servers`` servers not
retired is a ``RolloutError``. With ``max_server_failures=0`` the first failure retires.

Transport: asyncio + ``httpx.AsyncClient``. One event loop holds hundreds of
minutes-long ``/generate`` calls without a thread each; cancelling a task closes its
connection, which SGLang takes as a client disconnect and aborts the request (freeing
its KV cache); ``asyncio.wait_for`` bounds a whole call. ``httpx`` is a declared
dependency of the pinned ``leptonai`` (``aiohttp`` comes only with the full SGLang
install), and its per-call overhead is irrelevant next to seconds of generation.
``trust_env=False``: a proxy from the environment must never sit between the trainer
and its own servers.

Weights: ``update_weights_from_disk`` (an HF export directory the servers can read),
``update_weights_from_tensor`` (CUDA-IPC payloads, co-located servers) and
``update_weights_from_distributed`` (NCCL broadcast after
``init_weights_update_group``) go to every live server, label the weights with the
new version, and are followed by ``/flush_cache`` so no prefix computed with the old
weights is reused. Tensor and distributed updates run inside SGLang's weight-update
session: ``/begin_weight_update`` on every live server first, ``/end_weight_update`` on
every server that opened one afterwards, also when the update failed. A server that
fails to open or close the session, or fails an update others passed, is dropped (its
weights are unknown); if every server fails, the version stays and ``RolloutError`` is raised.
A bucketed distributed update (``begin_weight_update``, one ``send_distributed_bucket`` per
bucket while the trainer broadcasts it, ``end_weight_update``) keeps one session open over
all buckets and flushes and relabels once, at the end.
``release_memory_occupation`` / ``resume_memory_occupation`` free and restore GPU
memory when the trainer shares the GPUs (servers need ``enable_memory_saver``).

The synchronous methods run their own event loop (``asyncio.run``); from async code
use ``agenerate``. The engine is not thread-safe: one call at a time.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Coroutine, Literal, Sequence, TypeVar

import httpx
import torch
from tqdm.auto import tqdm

from pipeline.rollout import sglang_api as api
from pipeline.rollout.types import (
    Completion,
    GenerationRequest,
    RolloutError,
    SamplingParams,
    check_requests,
)

if TYPE_CHECKING:
    from pipeline.config import RolloutConfig

__all__ = ["SGLangClientConfig", "SGLangEngine", "SGLangServerProcess"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_LOG_TAIL_BYTES = 4000
# Samples of one prompt sent as one /generate call: they share one prefill on the server.
_DEFAULT_SAMPLES_PER_REQUEST = 8


@dataclass(kw_only=True, slots=True, frozen=True)
class SGLangClientConfig:
    """Client-side limits and timeouts (see the module docstring for how each is used)."""

    max_in_flight: int = 256  # calls; from_rollout derives both limits from the servers
    max_in_flight_per_server: int = 128
    max_samples_per_request: int = _DEFAULT_SAMPLES_PER_REQUEST
    request_timeout_s: float = 3600.0
    connect_timeout_s: float = 10.0
    max_attempts: int = 4
    max_consecutive_failures: int = 3
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0
    batch_timeout_s: float | None = None
    health_path: str = api.HEALTH_PATH
    startup_timeout_s: float = 900.0
    health_poll_s: float = 1.0
    watchdog_interval_s: float | None = 30.0
    probe_timeout_s: float = 20.0
    admin_timeout_s: float = 900.0
    api_key: str | None = None
    show_progress: bool = True
    progress_delay_s: float = 2.0
    max_server_failures: int = 0
    recovery_timeout_s: float = 1800.0
    min_servers: int = 1

    @classmethod
    def from_rollout(cls, rollout: RolloutConfig, **overrides: Any) -> SGLangClientConfig:
        """The client limits ``rollout`` (a run's ``rollout`` block, its servers filled in) sets; ``overrides``
        for the rest.

        The in-flight limits follow ``rollout_in_flight_limit`` over ``rollout.servers``, in calls: a call
        carries at most ``max_samples_per_request`` sequences (fewer when a server runs fewer at once),
        so ``max_in_flight`` calls never hold more than the limit's sequences, nor a server more than
        its ``--max-running-requests``.
        """
        from pipeline.config import rollout_in_flight_limit

        limit = rollout_in_flight_limit(rollout, num_servers=len(rollout.servers))
        samples = overrides.pop("max_samples_per_request", _DEFAULT_SAMPLES_PER_REQUEST)
        samples = min(samples, limit.per_server, limit.sequences)
        return cls(
            request_timeout_s=rollout.request_timeout_s, batch_timeout_s=rollout.batch_timeout_s,
            max_attempts=rollout.max_attempts, probe_timeout_s=rollout.health_timeout_s,
            max_server_failures=rollout.max_server_failures, recovery_timeout_s=rollout.server_recovery_timeout_s,
            min_servers=rollout.min_servers, max_samples_per_request=samples,
            max_in_flight=limit.sequences // samples, max_in_flight_per_server=limit.per_server // samples,
            **overrides,
        )

    def __post_init__(self) -> None:
        for name in ("max_in_flight", "max_in_flight_per_server", "max_samples_per_request", "max_attempts"):
            if getattr(self, name) < 1:
                raise ValueError(f"SGLangClientConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_consecutive_failures < 1:
            raise ValueError(f"max_consecutive_failures must be >= 1, got {self.max_consecutive_failures}")
        if self.max_server_failures < 0 or self.min_servers < 1:
            raise ValueError(f"need max_server_failures >= 0 and min_servers >= 1, got {self.max_server_failures}, "
                             f"{self.min_servers}")
        timeouts = (
            "request_timeout_s",
            "connect_timeout_s",
            "startup_timeout_s",
            "health_poll_s",
            "probe_timeout_s",
            "admin_timeout_s",
            "recovery_timeout_s",
        )
        for name in timeouts:
            if not getattr(self, name) > 0:
                raise ValueError(f"SGLangClientConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.backoff_initial_s < 0 or self.backoff_max_s < self.backoff_initial_s:
            raise ValueError("need 0 <= backoff_initial_s <= backoff_max_s")
        if self.watchdog_interval_s is not None and not self.watchdog_interval_s > 0:
            raise ValueError(f"watchdog_interval_s must be > 0 or None, got {self.watchdog_interval_s}")
        if self.batch_timeout_s is not None and not self.batch_timeout_s > 0:
            raise ValueError(f"batch_timeout_s must be > 0 or None, got {self.batch_timeout_s}")


class _ServerFault(Exception):
    """The server failed (unreachable, hung, 5xx, garbage): the work may succeed elsewhere."""


class _Rejected(Exception):
    """HTTP 4xx: the server refused the request itself; resending it elsewhere cannot help."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"HTTP {status}: {text}")
        self.status = status
        self.text = text


# live: takes requests. down: failed; waits to answer /health again and be re-synced.
# stale: healthy, but behind on weights the engine cannot resend itself (tensor or distributed
# updates); the next weight update includes it. retired: failed too often, never used again.
_ServerState = Literal["live", "down", "stale", "retired"]


@dataclass(eq=False)
class _Server:
    url: str
    in_flight: int = 0
    consecutive_failures: int = 0
    available_at: float = 0.0  # time.monotonic() before which it gets no new work (backoff)
    state: _ServerState = "live"
    dead_reason: str = ""  # why it is not live
    failures: int = 0  # times it went down
    down_since: float = 0.0  # time.monotonic() of its last failure

    @property
    def dead(self) -> bool:
        """Out of the rotation: down, stale or retired."""
        return self.state != "live"


@dataclass(eq=False)
class _Work:
    request_index: int
    sample_indices: tuple[int, ...]
    seeds: tuple[int, ...]
    failures: int = 0
    avoid: _Server | None = None
    errors: list[str] = field(default_factory=list)


@dataclass(eq=False)
class _Attempt:
    work: _Work
    server: _Server
    abandoned: bool = False


def _error_text(response: httpx.Response) -> str:
    text = response.text
    try:
        payload = json.loads(text)
    except ValueError:
        return text[:500]
    if isinstance(payload, dict):
        error = payload.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])[:500]
        for key in ("error", "message"):
            if isinstance(payload.get(key), str):
                return payload[key][:500]
    return text[:500]


async def _request(
    client: httpx.AsyncClient,
    method: str,
    url: str,
    *,
    body: Any = None,
    timeout_s: float,
    retry_statuses: frozenset[int] = frozenset(),
) -> httpx.Response:
    """One HTTP call bounded end to end; failures are classified as ``_ServerFault`` or ``_Rejected``."""
    try:
        response = await asyncio.wait_for(client.request(method, url, json=body), timeout_s)
    except TimeoutError as error:
        raise _ServerFault(f"no answer from {url} within {timeout_s:g}s") from error
    except httpx.HTTPError as error:
        raise _ServerFault(f"{url}: {type(error).__name__}: {error}") from error
    status = response.status_code
    if status >= 500 or status in (408, 429) or status in retry_statuses:
        raise _ServerFault(f"{url}: HTTP {status}: {_error_text(response)}")
    if status >= 400:
        raise _Rejected(status, _error_text(response))
    return response


def _json(response: httpx.Response) -> Any:
    try:
        return json.loads(response.content)
    except ValueError as error:
        raise _ServerFault(f"{response.request.url}: malformed JSON ({error})") from error


def _answer_failure(outcome: httpx.Response | Exception) -> str | None:
    """None if ``outcome`` is a ``{success: true, ...}`` weight-update answer, else why not."""
    if isinstance(outcome, Exception):
        return str(outcome)
    try:
        success, message = api.parse_update_response(_json(outcome))
    except (api.MalformedResponse, _ServerFault) as error:
        return str(error)
    return None if success else message


def _run_sync(coroutine: Coroutine[Any, Any, _T]) -> _T:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    coroutine.close()
    raise RuntimeError("SGLangEngine's synchronous methods cannot run inside an event loop; await agenerate() instead")


class SGLangServerProcess:
    """A launched ``sglang.launch_server`` process group, logging to ``log_path``."""

    def __init__(self, spec: api.SGLangServerSpec, *, log_path: Path, env: dict[str, str] | None = None) -> None:
        self.spec = spec
        self.log_path = log_path
        self.command = api.launch_command(spec)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            # A session of its own, so close() reaches the scheduler/detokenizer children too.
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


class SGLangEngine:
    """``RolloutEngine`` over SGLang HTTP servers; see the module docstring.

    ``base_urls`` are ``http://host:port`` of running servers. ``weight_version`` is the
    version of the weights they serve now (what ``"default"`` means in their answers).
    The constructor does not contact the servers: use ``attach`` / ``launch``, or call
    ``wait_until_healthy``.
    """

    def __init__(
        self,
        base_urls: Sequence[str],
        *,
        config: SGLangClientConfig = SGLangClientConfig(),
        weight_version: int = 0,
        processes: Sequence[SGLangServerProcess] = (),
    ) -> None:
        urls = [url.rstrip("/") for url in base_urls]
        if not urls:
            raise ValueError("SGLangEngine needs at least one server URL")
        if len(set(urls)) != len(urls):
            raise ValueError(f"duplicate server URLs in {urls}")
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"server URL {url!r} must start with http:// or https://")
        self.config = config
        self._servers = [_Server(url=url) for url in urls]
        self._processes = list(processes)
        self._initial_version = int(weight_version)
        self._weight_version = int(weight_version)
        self._memory_released = False
        self._next_server = 0
        self._session: list[_Server] = []  # servers in an open bucketed weight update
        # (folder, load_format) of the last update_weights_from_disk: what a recovered server loads.
        # None before any update (a restarted server is at the initial weights) and after a tensor or
        # distributed update (only the next one can bring a restarted server up to date).
        self._disk_source: tuple[str, str | None] | None = None
        self._num_recoveries = 0

    # ----------------------------------------------------------------- lifecycle

    @classmethod
    def attach(
        cls, base_urls: Sequence[str], *, config: SGLangClientConfig = SGLangClientConfig(), weight_version: int = 0
    ) -> SGLangEngine:
        """Connect to running servers and wait until every one is healthy."""
        engine = cls(base_urls, config=config, weight_version=weight_version)
        engine.wait_until_healthy()
        return engine

    @classmethod
    def launch(
        cls,
        specs: Sequence[api.SGLangServerSpec],
        *,
        log_dir: str | os.PathLike[str],
        config: SGLangClientConfig = SGLangClientConfig(),
        env: dict[str, str] | None = None,
    ) -> SGLangEngine:
        """Start one server per spec (all with one ``weight_version``) and wait until all are healthy."""
        if not specs:
            raise ValueError("launch needs at least one SGLangServerSpec")
        versions = {spec.weight_version for spec in specs}
        if len(versions) != 1:
            raise ValueError(f"all servers must start with one weight_version, got {sorted(versions)}")
        processes: list[SGLangServerProcess] = []
        try:
            for index, spec in enumerate(specs):
                log_path = Path(log_dir) / f"sglang-{index}-port{spec.port}.log"
                processes.append(SGLangServerProcess(spec, log_path=log_path, env=env))
            engine = cls(
                [p.base_url for p in processes], config=config, weight_version=versions.pop(), processes=processes
            )
            engine.wait_until_healthy()
        except BaseException:
            for process in processes:
                process.terminate(grace_s=5.0)
            raise
        return engine

    def close(self) -> None:
        """Stop the servers this engine launched (attached servers are left running)."""
        for process in self._processes:
            process.terminate()
        self._processes = []

    def __enter__(self) -> SGLangEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def weight_version(self) -> int:
        return self._weight_version

    @property
    def live_servers(self) -> list[str]:
        return [s.url for s in self._servers if not s.dead]

    @property
    def dead_servers(self) -> dict[str, str]:
        """URL → why it takes no requests (down, stale or retired)."""
        return {s.url: s.dead_reason for s in self._servers if s.dead}

    @property
    def retired_servers(self) -> dict[str, str]:
        """URL → why it was retired for good."""
        return {s.url: s.dead_reason for s in self._servers if s.state == "retired"}

    @property
    def servers_to_sync(self) -> list[str]:
        """The servers the next weight update goes to: the live ones and the stale ones it brings back."""
        return [s.url for s in self._syncable()]

    @property
    def server_failures(self) -> dict[str, int]:
        """URL → how many times it failed so far (a restarted server has failed at least once more)."""
        return {s.url: s.failures for s in self._servers}

    def metrics(self) -> dict[str, float]:
        """Server counts by state and the recoveries so far (``rollout/...`` metrics of a step)."""
        counts = {state: 0 for state in ("live", "down", "stale", "retired")}
        for server in self._servers:
            counts[server.state] += 1
        return {**{f"rollout/servers_{state}": float(n) for state, n in counts.items()},
                "rollout/server_recoveries": float(self._num_recoveries)}

    def _live(self) -> list[_Server]:
        return [s for s in self._servers if not s.dead]

    def _syncable(self) -> list[_Server]:
        return [s for s in self._servers if s.state in ("live", "stale")]

    def _client(self) -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else None
        connections = self.config.max_in_flight + 4 * len(self._servers)
        return httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=self.config.connect_timeout_s),
            limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
            headers=headers,
            trust_env=False,
        )

    def _drop(self, server: _Server, reason: str) -> None:
        """A failure: the server is down until it recovers, or retired past ``max_server_failures``."""
        if server.state in ("down", "retired"):
            return
        server.failures += 1
        if server.failures > self.config.max_server_failures:
            self._retire(server, f"failure {server.failures} (max_server_failures="
                                 f"{self.config.max_server_failures}): {reason}")
            return
        server.state = "down"
        server.dead_reason = reason
        server.down_since = time.monotonic()
        logger.warning("SGLang server %s is down (failure %d of %d allowed): %s; no requests until it answers "
                       "%s and serves weight version %d", server.url, server.failures,
                       self.config.max_server_failures, reason, self.config.health_path, self._weight_version)

    def _retire(self, server: _Server, reason: str) -> None:
        server.state = "retired"
        server.dead_reason = reason
        remaining = sum(s.state != "retired" for s in self._servers)
        logger.error("retiring SGLang server %s for good: %s; %d of %d servers left (min_servers=%d)",
                     server.url, reason, remaining, len(self._servers), self.config.min_servers)

    def _promote(self, updated: Sequence[_Server], *, version: int) -> None:
        """Stale servers that took a full weight update serve again."""
        for server in updated:
            if server.state == "stale":
                server.state = "live"
                self._num_recoveries += 1
                logger.warning("SGLang server %s is back at weight version %d", server.url, version)

    def _check_enough(self) -> None:
        """``RolloutError`` once retirements leave fewer than ``min_servers`` servers."""
        remaining = sum(s.state != "retired" for s in self._servers)
        if remaining < self.config.min_servers:
            n = len(self._servers)
            left = f"no SGLang server left (all {n} retired)" if remaining == 0 else (
                f"only {remaining} of {n} SGLang servers left")
            raise RolloutError(f"{left}, below rollout.min_servers={self.config.min_servers}; "
                               f"retired: {self.retired_servers}")

    async def _served_version(self, client: httpx.AsyncClient, server: _Server) -> int:
        response = await _request(client, "GET", server.url + api.MODEL_INFO_PATH, timeout_s=self.config.probe_timeout_s)
        try:
            return api.parse_model_info_version(
                _json(response), initial_version=self._initial_version, current_version=self._weight_version
            )
        except api.MalformedResponse as error:
            raise _ServerFault(f"{server.url}{api.MODEL_INFO_PATH}: {error}") from error

    async def _recover_once(self, client: httpx.AsyncClient, server: _Server) -> str | None:
        """One try at bringing a down server back; None once it is settled (live or stale), else why not yet.

        Healthy, then at the current weights (re-loaded from the newest folder if need be), then
        live. A server still behind after a tensor or distributed update becomes ``stale``: the
        next update includes it.
        """
        cfg = self.config
        try:
            await _request(client, "GET", server.url + cfg.health_path, timeout_s=cfg.probe_timeout_s)
            version = await self._served_version(client, server)
            if version != self._weight_version and self._disk_source is not None:
                folder, load_format = self._disk_source
                body = api.update_weights_from_disk_body(folder, version=self._weight_version, load_format=load_format)
                answer = await _request(client, "POST", server.url + api.UPDATE_FROM_DISK_PATH, body=body,
                                        timeout_s=cfg.admin_timeout_s)
                failure = _answer_failure(answer)
                if failure is not None:
                    raise _ServerFault(f"re-loading {folder}: {failure}")
                version = await self._served_version(client, server)
        except (_ServerFault, _Rejected) as error:
            return str(error)
        if version == self._weight_version:
            server.state = "live"
            server.consecutive_failures = 0
            server.available_at = 0.0
            self._num_recoveries += 1
            logger.warning("SGLang server %s is back at weight version %d after failure %d", server.url, version,
                           server.failures)
            return None
        if self._disk_source is None:
            server.state = "stale"
            server.dead_reason = (f"serves weight version {version}, not {self._weight_version}; the next weight "
                                  "update brings it back")
            logger.warning("SGLang server %s is healthy again but %s", server.url, server.dead_reason)
            return None
        return f"still serves weight version {version} after re-loading, not {self._weight_version}"

    def _recovery_overdue(self, server: _Server, last_error: str) -> bool:
        """Retire a down server once ``recovery_timeout_s`` since its failure passed."""
        if time.monotonic() < server.down_since + self.config.recovery_timeout_s:
            return False
        self._retire(server, f"not back within recovery_timeout_s={self.config.recovery_timeout_s:g} of failure "
                             f"{server.failures}; last: {last_error}")
        return True

    async def _recover(self, client: httpx.AsyncClient, server: _Server) -> None:
        """Retry ``_recover_once`` until the server is settled or retired (``recovery_timeout_s``)."""
        last_error = server.dead_reason
        while not self._recovery_overdue(server, last_error):
            why = await self._recover_once(client, server)
            if why is None:
                return
            last_error = why
            await asyncio.sleep(self.config.health_poll_s)

    async def _check_servers(self, client: httpx.AsyncClient, *, before_update: bool = False) -> None:
        """One pass over the servers: a live one that is unreachable or serves another weight version
        (it restarted since the last call) goes down; a down one gets one recovery try.

        ``before_update``: a server *ahead* of the engine's version holds part of an update that
        failed elsewhere; the coming update replaces it, so only servers behind (restarted) go down.
        """
        live = self._live()
        outcomes = await asyncio.gather(*(self._served_version(client, s) for s in live), return_exceptions=True)
        for server, outcome in zip(live, outcomes):
            if isinstance(outcome, BaseException) and not isinstance(outcome, (_ServerFault, _Rejected)):
                raise outcome
            if isinstance(outcome, BaseException):
                self._drop(server, f"{api.MODEL_INFO_PATH} failed: {outcome}")
            elif outcome < self._weight_version or (outcome != self._weight_version and not before_update):
                self._drop(server, f"serves weight version {outcome}, not {self._weight_version} (restarted?)")
        down = [s for s in self._servers if s.state == "down"]
        whys = await asyncio.gather(*(self._recover_once(client, s) for s in down))
        for server, why in zip(down, whys):
            if why is not None:
                self._recovery_overdue(server, why)

    def check_servers(self, *, before_update: bool = False) -> None:
        """Take down every live server that restarted or stopped answering since the last call, and give
        every down one a recovery try, without waiting. ``generate`` starts with this pass; a
        weight sync calls it first (``before_update``) so that a restarted server is not taken for
        a member of the update group. ``RolloutError`` once fewer than ``min_servers`` are left."""

        async def run() -> None:
            async with self._client() as client:
                await self._check_servers(client, before_update=before_update)

        _run_sync(run())
        self._check_enough()

    async def _probe(self, client: httpx.AsyncClient, server: _Server, *, timeout_s: float) -> str | None:
        """None if ``/health`` answers 200 within ``timeout_s``, else why not."""
        try:
            await _request(client, "GET", server.url + self.config.health_path, timeout_s=timeout_s)
        except (_ServerFault, _Rejected) as error:
            return str(error)
        return None

    def wait_until_healthy(self, timeout_s: float | None = None) -> None:
        """Block until every live server's ``/health`` is 200.

        ``RolloutError`` at the deadline, or as soon as a server this engine launched exits.
        """
        _run_sync(self._wait_until_healthy(self.config.startup_timeout_s if timeout_s is None else timeout_s))

    async def _wait_until_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        processes = {p.base_url.rstrip("/"): p for p in self._processes}
        waiting = self._live()
        last_error: dict[str, str] = {}
        async with self._client() as client:
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
                errors = await asyncio.gather(*(self._probe(client, s, timeout_s=probe_s) for s in waiting))
                for server, error in zip(waiting, errors):
                    if error is not None:
                        last_error[server.url] = error
                waiting = [s for s, error in zip(waiting, errors) if error is not None]
                if waiting:
                    await asyncio.sleep(min(self.config.health_poll_s, max(0.0, deadline - time.monotonic())))

    def recover_servers(self) -> None:
        """Wait until every down server is back (live, or stale until the next update) or retired.

        ``generate`` does this on its own for the servers it needs; call it to have every server
        back before something else, e.g. a weight sync. Bounded by ``recovery_timeout_s``;
        ``RolloutError`` once fewer than ``min_servers`` are left.
        """

        async def run() -> None:
            async with self._client() as client:
                await asyncio.gather(*(self._recover(client, s) for s in self._servers if s.state == "down"))

        _run_sync(run())
        self._check_enough()

    # ---------------------------------------------------------------- generation

    def generate(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> list[Completion]:
        """One ``Completion`` per requested sample, ordered by request then sample index."""
        return _run_sync(self.agenerate(requests, params))

    async def agenerate(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> list[Completion]:
        total = check_requests(requests)
        if self._memory_released:
            raise RolloutError("server memory is released; call resume_memory_occupation() before generating")
        if total == 0:
            return []
        base_seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        chunk = self.config.max_samples_per_request
        works = []
        for r, request in enumerate(requests):
            for start in range(0, request.num_samples, chunk):
                samples = tuple(range(start, min(start + chunk, request.num_samples)))
                seeds = tuple(api.sample_seed(base_seed, request.prompt_id, s) for s in samples)
                works.append(_Work(request_index=r, sample_indices=samples, seeds=seeds))
        with tqdm(
            total=total,
            desc="rollout",
            unit="sample",
            disable=not self.config.show_progress,
            delay=self.config.progress_delay_s,
            leave=False,
        ) as bar:
            async with self._client() as client:
                batch = _Batch(self, client=client, requests=requests, params=params, bar=bar)
                results = await batch.run(works)
        assert len(results) == total, (len(results), total)
        completions = []
        for r, request in enumerate(requests):
            for s in range(request.num_samples):
                out = results[(r, s)]
                completions.append(
                    Completion(
                        prompt_id=request.prompt_id,
                        sample_index=s,
                        token_ids=torch.tensor(out.token_ids, dtype=torch.long),
                        logprobs=torch.tensor(out.logprobs, dtype=torch.float32),
                        finish_reason=out.finish_reason,  # type: ignore[arg-type]
                        weight_version=out.weight_version,
                    )
                )
        return completions

    # ------------------------------------------------------------ admin endpoints

    async def _admin_one(
        self,
        client: httpx.AsyncClient,
        server: _Server,
        path: str,
        body: Any,
        *,
        retry_statuses: frozenset[int],
    ) -> httpx.Response:
        """POST with retries and backoff on server faults; the last fault or a rejection propagates."""
        cfg = self.config
        for attempt in range(1, cfg.max_attempts + 1):
            try:
                return await _request(
                    client, "POST", server.url + path, body=body, timeout_s=cfg.admin_timeout_s,
                    retry_statuses=retry_statuses,
                )
            except _ServerFault:
                if attempt == cfg.max_attempts:
                    raise
                await asyncio.sleep(min(cfg.backoff_initial_s * 2 ** (attempt - 1), cfg.backoff_max_s))
        raise AssertionError("unreachable")

    async def _admin_all(
        self,
        path: str,
        body_for: Callable[[int, _Server], Any],
        *,
        servers: Sequence[_Server] | None = None,
        retry_statuses: frozenset[int] = frozenset(),
    ) -> list[tuple[_Server, httpx.Response | Exception]]:
        targets = self._live() if servers is None else list(servers)
        if not targets:
            raise RolloutError(f"no live SGLang server for {path}; dropped: {self.dead_servers}")
        async with self._client() as client:
            outcomes = await asyncio.gather(
                *(
                    self._admin_one(client, s, path, body_for(i, s), retry_statuses=retry_statuses)
                    for i, s in enumerate(targets)
                ),
                return_exceptions=True,
            )
        for outcome in outcomes:
            if isinstance(outcome, BaseException) and not isinstance(outcome, (_ServerFault, _Rejected)):
                raise outcome
        return list(zip(targets, outcomes))  # type: ignore[arg-type]

    async def _admin_checked(
        self, path: str, body_for: Callable[[int, _Server], Any], *, servers: Sequence[_Server] | None = None
    ) -> tuple[list[_Server], list[tuple[_Server, str]]]:
        """POST to the servers; ``(succeeded, [(failed, why)])`` by their ``{success, message}`` answers."""
        succeeded: list[_Server] = []
        failed: list[tuple[_Server, str]] = []
        for server, outcome in await self._admin_all(path, body_for, servers=servers):
            failure = _answer_failure(outcome)
            if failure is None:
                succeeded.append(server)
            else:
                failed.append((server, failure))
        return succeeded, failed

    async def _update_all(self, path: str, body_for: Callable[[int, _Server], Any], *, version: int) -> None:
        """Update every live server, and every stale one (which the full update brings up to date)."""
        targets = self._syncable()
        if path not in api.SESSION_UPDATE_PATHS:
            succeeded, failed = await self._admin_checked(path, body_for, servers=targets)
        else:
            opened, failed = await self._admin_checked(
                api.BEGIN_WEIGHT_UPDATE_PATH, lambda i, s: api.begin_weight_update_body(), servers=targets
            )
            if not opened:
                details = "; ".join(f"{s.url}: {why}" for s, why in failed)
                raise RolloutError(f"{api.BEGIN_WEIGHT_UPDATE_PATH} for version {version} failed on every server "
                                   f"(version unchanged): {details}")
            failed = [(server, f"{api.BEGIN_WEIGHT_UPDATE_PATH}: {why}") for server, why in failed]
            try:
                succeeded, update_failed = await self._admin_checked(path, body_for, servers=opened)
                failed += update_failed
            finally:
                closed, close_failed = await self._admin_checked(
                    api.END_WEIGHT_UPDATE_PATH, lambda i, s: api.end_weight_update_body(), servers=opened
                )
                for server, why in close_failed:
                    self._drop(server, f"{api.END_WEIGHT_UPDATE_PATH} after the update to version {version} "
                                       f"failed: {why}")
            succeeded = [server for server in succeeded if server in closed]
        if not succeeded:
            details = "; ".join(f"{s.url}: {why}" for s, why in failed)
            raise RolloutError(f"{path} to version {version} failed on every server (version unchanged): {details}")
        for server, why in failed:
            self._drop(server, f"{path} to version {version} failed while others succeeded: {why}")
        # SGLang refuses /flush_cache (HTTP 400) while requests run; that is worth retrying.
        for server, outcome in await self._admin_all(
            api.FLUSH_CACHE_PATH, lambda i, s: None, servers=succeeded, retry_statuses=frozenset({400})
        ):
            if isinstance(outcome, Exception):
                self._drop(server, f"/flush_cache after the update to version {version} failed: {outcome}")
        self._promote(succeeded, version=version)
        self._check_enough()
        if not self._live():
            raise RolloutError(f"no SGLang server left after updating to version {version}: {self.dead_servers}")
        self._weight_version = version

    def _check_version(self, version: int) -> None:
        if isinstance(version, bool) or not isinstance(version, int) or version <= self._weight_version:
            raise ValueError(
                f"version must be an int > the current weight version {self._weight_version}, got {version!r}"
            )

    def update_weights_from_disk(self, model_path: str, *, version: int, load_format: str | None = None) -> None:
        """Load an HF export directory (readable by every server) and label it ``version``."""
        self._check_version(version)
        body = api.update_weights_from_disk_body(model_path, version=version, load_format=load_format)
        if not self._syncable() and any(s.state == "down" for s in self._servers):
            # Every server is restarting: each loads the folder when it recovers (generate waits for that).
            logger.warning("no SGLang server is up for the update to version %d; the %d down ones load %s "
                           "when they recover", version, len(self._servers) - len(self.retired_servers), model_path)
            self._weight_version = version
        else:
            _run_sync(self._update_all(api.UPDATE_FROM_DISK_PATH, lambda i, s: body, version=version))
        self._disk_source = (model_path, load_format)

    def update_weights_from_tensor(
        self,
        serialized_named_tensors: Sequence[str | bytes],
        *,
        version: int,
        load_format: str | None = None,
    ) -> None:
        """Send CUDA-IPC tensor payloads (one per TP rank) to every live, co-located server."""
        self._check_version(version)
        body = api.update_weights_from_tensor_body(serialized_named_tensors, version=version, load_format=load_format)
        _run_sync(self._update_all(api.UPDATE_FROM_TENSOR_PATH, lambda i, s: body, version=version))
        self._disk_source = None

    def init_weights_update_group(
        self,
        *,
        master_address: str,
        master_port: int,
        world_size: int,
        ranks_per_server: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> None:
        """Make every live server join the trainer's broadcast group (trainer = rank 0).

        Server ``i`` of ``servers_to_sync`` (the live ones and the stale ones the next update
        brings back) takes ranks ``1 + i·ranks_per_server …``; ``world_size`` must be
        ``1 + len(servers_to_sync)·ranks_per_server``. The servers answer only once the trainer has
        joined too, so call this from a thread while rank 0 runs ``init_process_group``.
        """
        live = self._syncable()
        if world_size != 1 + len(live) * ranks_per_server:
            raise ValueError(
                f"world_size {world_size} != 1 + {len(live)} servers to sync x {ranks_per_server} ranks per server"
            )

        def body_for(index: int, server: _Server) -> dict[str, Any]:
            return api.init_weights_update_group_body(
                master_address=master_address,
                master_port=master_port,
                rank_offset=1 + index * ranks_per_server,
                world_size=world_size,
                group_name=group_name,
                backend=backend,
            )

        _, failed = _run_sync(self._admin_checked(api.INIT_UPDATE_GROUP_PATH, body_for, servers=live))
        if failed:
            raise RolloutError(f"init_weights_update_group failed: {'; '.join(f'{s.url}: {why}' for s, why in failed)}")

    def destroy_weights_update_group(self, group_name: str, *, urls: Sequence[str]) -> list[str]:
        """Have the live servers among ``urls`` leave ``group_name``; returns the URLs that did.

        Each group a server joins holds a communicator until it is destroyed: for NCCL, its
        buffers in GPU memory (tens of MB per group and channel count) and its sockets. A new
        group forms after every server failure, so without this a long campaign's survivors
        would keep one per failure. Best effort: a server that cannot answer (it died) holds
        nothing any more, and one that refuses is logged and keeps serving.
        """
        targets = [server for server in self._servers if server.url in set(urls) and server.state == "live"]
        if not targets:
            return []
        body = api.destroy_weights_update_group_body(group_name)
        left, failed = _run_sync(self._admin_checked(api.DESTROY_UPDATE_GROUP_PATH, lambda i, s: body,
                                                     servers=targets))
        for server, why in failed:
            logger.warning("SGLang server %s did not leave the old update group %s: %s", server.url, group_name, why)
        return [server.url for server in left]

    def update_weights_from_distributed(
        self,
        names: Sequence[str],
        *,
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        version: int,
        group_name: str = "weight_update_group",
    ) -> None:
        """Announce tensors the trainer broadcasts in ``group_name`` (run it alongside the broadcast)."""
        self._check_version(version)
        body = api.update_weights_from_distributed_body(
            names, dtypes=dtypes, shapes=shapes, version=version, group_name=group_name
        )
        _run_sync(self._update_all(api.UPDATE_FROM_DISTRIBUTED_PATH, lambda i, s: body, version=version))
        self._disk_source = None

    # ------------------------------------------------ bucketed distributed updates

    def begin_weight_update(self, *, version: int) -> list[str]:
        """Open one weight-update session on every live server for a bucketed update to ``version``.

        A server that fails to open it is dropped; none opened: ``RolloutError``. Then
        ``send_distributed_bucket`` per bucket and ``end_weight_update`` once. Returns the
        URLs in the session.
        """
        self._check_version(version)
        opened, failed = _run_sync(self._admin_checked(
            api.BEGIN_WEIGHT_UPDATE_PATH, lambda i, s: api.begin_weight_update_body(), servers=self._syncable()))
        for server, why in failed:
            self._drop(server, f"{api.BEGIN_WEIGHT_UPDATE_PATH} for version {version} failed: {why}")
        if not opened:
            raise RolloutError(f"{api.BEGIN_WEIGHT_UPDATE_PATH} for version {version} failed on every server "
                               f"(version unchanged): {self.dead_servers}")
        self._session = opened
        return [server.url for server in opened]

    def send_distributed_bucket(
        self, names: Sequence[str], *, dtypes: Sequence[str], shapes: Sequence[Sequence[int]], version: int,
        group_name: str,
    ) -> None:
        """Announce one bucket to every server of the open session; they then receive its broadcast.

        Run it alongside the broadcast (the servers answer once they received every tensor).
        Never retried: a repeated announcement would wait for a broadcast that never comes.
        An unreachable server is dropped; any failure raises ``RolloutError`` naming the servers.
        """
        body = api.update_weights_from_distributed_body(
            names, dtypes=dtypes, shapes=shapes, version=version, group_name=group_name, flush_cache=False
        )
        servers = [server for server in self._session if server.state in ("live", "stale")]
        if not servers:
            raise RolloutError(f"no server left in the weight-update session for version {version}")

        async def run() -> list[str]:
            async with self._client() as client:
                outcomes = await asyncio.gather(
                    *(_request(client, "POST", s.url + api.UPDATE_FROM_DISTRIBUTED_PATH, body=body,
                               timeout_s=self.config.admin_timeout_s) for s in servers),
                    return_exceptions=True,
                )
            failures = []
            for server, outcome in zip(servers, outcomes):
                if isinstance(outcome, BaseException) and not isinstance(outcome, (_ServerFault, _Rejected)):
                    raise outcome
                if isinstance(outcome, _ServerFault):
                    self._drop(server, f"unreachable during the update to version {version}: {outcome}")
                failure = _answer_failure(outcome)
                if failure is not None:
                    failures.append(f"{server.url}: {failure}")
            return failures

        failures = _run_sync(run())
        if failures:
            raise RolloutError(f"{api.UPDATE_FROM_DISTRIBUTED_PATH} to version {version} failed: {'; '.join(failures)}")

    def end_weight_update(self, *, version: int, completed: bool) -> None:
        """Close the session; if ``completed``, flush the servers' caches and label their weights ``version``.

        A server that fails to close it is dropped. An incomplete update leaves the version
        unchanged: the servers' weights are a mix until the next complete one.
        """
        servers = [server for server in self._session if server.state in ("live", "stale")]
        self._session = []
        if servers:
            closed, failed = _run_sync(self._admin_checked(
                api.END_WEIGHT_UPDATE_PATH, lambda i, s: api.end_weight_update_body(), servers=servers))
        else:
            closed, failed = [], []
        for server, why in failed:
            self._drop(server, f"{api.END_WEIGHT_UPDATE_PATH} for version {version} failed: {why}")
        if not completed:
            return
        if not closed:
            raise RolloutError(f"no SGLang server completed the update to version {version}: {self.dead_servers}")

        async def flush() -> None:
            for server, outcome in await self._admin_all(
                api.FLUSH_CACHE_PATH, lambda i, s: None, servers=closed, retry_statuses=frozenset({400})
            ):
                if isinstance(outcome, Exception):
                    self._drop(server, f"/flush_cache after the update to version {version} failed: {outcome}")

        _run_sync(flush())
        self._promote(closed, version=version)
        self._weight_version = version
        self._disk_source = None

    def _memory(self, path: str, tags: Sequence[str] | None) -> None:
        body = api.memory_occupation_body(tags)

        async def run() -> None:
            failures = [
                f"{server.url}: {outcome}"
                for server, outcome in await self._admin_all(path, lambda i, s: body)
                if isinstance(outcome, Exception)
            ]
            if failures:
                raise RolloutError(f"{path} failed: {'; '.join(failures)}")

        _run_sync(run())

    def release_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """Free the servers' GPU memory (weights and KV cache, or just ``tags``) for a co-located trainer."""
        self._memory(api.RELEASE_MEMORY_PATH, tags)
        self._memory_released = True

    def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """Re-allocate what ``release_memory_occupation`` freed; generation is allowed again."""
        self._memory(api.RESUME_MEMORY_PATH, tags)
        self._memory_released = False


class _Batch:
    """The state of one ``agenerate`` call: queue, in-flight attempts, results."""

    def __init__(
        self,
        engine: SGLangEngine,
        *,
        client: httpx.AsyncClient,
        requests: Sequence[GenerationRequest],
        params: SamplingParams,
        bar: tqdm,
    ) -> None:
        self.engine = engine
        self.config = engine.config
        self.client = client
        self.requests = requests
        self.params = params
        self.bar = bar
        self.pending: deque[_Work] = deque()
        self.tasks: dict[asyncio.Task[list[api.SampleOutput]], _Attempt] = {}
        self.recoveries: dict[asyncio.Task[None], _Server] = {}
        self.results: dict[tuple[int, int], api.SampleOutput] = {}

    async def run(self, works: list[_Work]) -> dict[tuple[int, int], api.SampleOutput]:
        cfg = self.config
        self.pending.extend(works)
        deadline = None if cfg.batch_timeout_s is None else time.monotonic() + cfg.batch_timeout_s
        if cfg.max_server_failures > 0:
            # Servers may come back: one that restarted since the last batch must not serve its launch
            # weights. (Without recovery its first answer in another version retires it; nothing to check.)
            await self.engine._check_servers(self.client)
        watchdog = asyncio.create_task(self._watchdog()) if cfg.watchdog_interval_s is not None else None
        try:
            while self.pending or self.tasks:
                self._start_recoveries()
                self._start_attempts()
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    raise RolloutError(
                        f"batch_timeout_s={cfg.batch_timeout_s:g} passed with {len(self.results)} of "
                        f"{sum(len(w.sample_indices) for w in works)} samples done"
                    )
                self.engine._check_enough()
                live = self.engine._live()
                if not live and not self.recoveries:
                    raise RolloutError(f"no SGLang server can take requests: {self.engine.dead_servers}")
                # Wake when a backing-off server can take queued work again, or at the deadline.
                wake_at = [s.available_at for s in live if s.available_at > now] if self.pending else []
                if deadline is not None:
                    wake_at.append(deadline)
                timeout = max(0.0, min(wake_at) - now) if wake_at else None
                if not self.tasks and not self.recoveries:
                    # Only reachable while every live server backs off, so timeout is set.
                    assert timeout is not None
                    await asyncio.sleep(timeout)
                    continue
                done, _ = await asyncio.wait(
                    [*self.tasks, *self.recoveries], timeout=timeout, return_when=asyncio.FIRST_COMPLETED
                )
                for task in done:
                    if task in self.recoveries:
                        del self.recoveries[task]
                        task.result()  # _recover settles the server's state; anything else is a bug
                    else:
                        self._finish(task, self.tasks.pop(task))  # type: ignore[arg-type]
        finally:
            leftovers = [*self.tasks, *self.recoveries] + ([watchdog] if watchdog is not None else [])
            for task in leftovers:
                task.cancel()
            await asyncio.gather(*leftovers, return_exceptions=True)
            for attempt in self.tasks.values():
                attempt.server.in_flight -= 1
            self.tasks.clear()
        return self.results

    def _start_recoveries(self) -> None:
        """One recovery task per down server; the batch waits on them when no server is live."""
        recovering = set(self.recoveries.values())
        for server in self.engine._servers:
            if server.state == "down" and server not in recovering:
                self.recoveries[asyncio.create_task(self.engine._recover(self.client, server))] = server

    def _pick_server(self, avoid: _Server | None) -> _Server | None:
        now = time.monotonic()
        servers = self.engine._servers
        start = self.engine._next_server
        rotation = servers[start:] + servers[:start]
        ready = [
            s
            for s in rotation
            if not s.dead and s.available_at <= now and s.in_flight < self.config.max_in_flight_per_server
        ]
        preferred = [s for s in ready if s is not avoid] or ready
        if not preferred:
            return None
        server = min(preferred, key=lambda s: s.in_flight)  # first minimum in rotation order
        self.engine._next_server = (servers.index(server) + 1) % len(servers)
        return server

    def _start_attempts(self) -> None:
        while self.pending and len(self.tasks) < self.config.max_in_flight:
            work = self.pending[0]
            server = self._pick_server(work.avoid)
            if server is None:
                return
            self.pending.popleft()
            attempt = _Attempt(work=work, server=server)
            server.in_flight += 1
            self.tasks[asyncio.create_task(self._attempt(attempt))] = attempt

    async def _attempt(self, attempt: _Attempt) -> list[api.SampleOutput]:
        work = attempt.work
        request = self.requests[work.request_index]
        body = api.generate_body(request.prompt_token_ids, sampling_seeds=work.seeds, params=self.params)
        response = await _request(
            self.client, "POST", attempt.server.url + api.GENERATE_PATH, body=body,
            timeout_s=self.config.request_timeout_s,
        )
        try:
            outputs = api.parse_generate_response(
                _json(response),
                num_samples=len(work.seeds),
                initial_version=self.engine._initial_version,
                current_version=self.engine._weight_version,
            )
        except api.MalformedResponse as error:
            raise _ServerFault(f"{attempt.server.url}: malformed /generate response: {error}") from error
        stale = {o.weight_version for o in outputs} - {self.engine._weight_version}
        if stale:
            # Every update goes to every live server, so another version means the server
            # missed one (e.g. it restarted): its samples would be silently off-policy.
            raise _ServerFault(
                f"{attempt.server.url} serves weight version {sorted(stale)}, expected {self.engine._weight_version}"
            )
        return outputs

    def _finish(self, task: asyncio.Task[list[api.SampleOutput]], attempt: _Attempt) -> None:
        server, work = attempt.server, attempt.work
        server.in_flight -= 1
        if attempt.abandoned:
            if not task.cancelled():
                task.exception()  # retrieved, so asyncio does not log it as lost
            return  # its work was re-queued when the server was dropped; a late result is discarded
        assert not task.cancelled(), "only abandoned attempts are cancelled"
        error = task.exception()
        if error is None:
            server.consecutive_failures = 0
            for sample_index, output in zip(work.sample_indices, task.result()):
                key = (work.request_index, sample_index)
                assert key not in self.results, f"sample {key} delivered twice"
                self.results[key] = output
            self.bar.update(len(work.sample_indices))
            return
        prompt_id = self.requests[work.request_index].prompt_id
        if isinstance(error, _Rejected):
            raise RolloutError(
                f"{server.url} rejected /generate for prompt {prompt_id!r} (samples {list(work.sample_indices)}): "
                f"{error}"
            ) from error
        if not isinstance(error, _ServerFault):
            raise error
        work.failures += 1
        work.errors.append(str(error))
        work.avoid = server
        self._server_failed(server, str(error))
        if work.failures >= self.config.max_attempts:
            raise RolloutError(
                f"prompt {prompt_id!r} samples {list(work.sample_indices)} failed {work.failures} times: "
                + " | ".join(work.errors)
            ) from error
        self.pending.appendleft(work)

    def _server_failed(self, server: _Server, reason: str) -> None:
        cfg = self.config
        server.consecutive_failures += 1
        if server.consecutive_failures >= cfg.max_consecutive_failures:
            self.engine._drop(server, f"{server.consecutive_failures} consecutive failures, last: {reason}")
            self._abandon(server)
            return
        delay = min(cfg.backoff_initial_s * 2 ** (server.consecutive_failures - 1), cfg.backoff_max_s)
        server.available_at = max(server.available_at, time.monotonic() + delay)

    def _abandon(self, server: _Server) -> None:
        """Re-queue every unfinished attempt on a dropped server and cancel it."""
        for task, attempt in self.tasks.items():
            if attempt.server is server and not attempt.abandoned:
                attempt.abandoned = True
                attempt.work.avoid = server
                self.pending.appendleft(attempt.work)
                task.cancel()

    async def _watchdog(self) -> None:
        cfg = self.config
        assert cfg.watchdog_interval_s is not None
        while True:
            await asyncio.sleep(cfg.watchdog_interval_s)
            busy = [s for s in self.engine._servers if not s.dead and s.in_flight > 0]
            errors = await asyncio.gather(
                *(self.engine._probe(self.client, s, timeout_s=cfg.probe_timeout_s) for s in busy)
            )
            for server, error in zip(busy, errors):
                if error is not None and not server.dead:
                    self._server_failed(server, f"health probe failed: {error}")
