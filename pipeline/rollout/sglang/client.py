"""The SGLang client's limits and its one HTTP call, shared by generation, health and weight updates.

Transport: asyncio + ``httpx.AsyncClient``. One event loop holds hundreds of minutes-long
``/generate`` calls without a thread each; cancelling a task closes its connection, which
SGLang takes as a client disconnect and aborts the request (freeing its KV cache);
``asyncio.wait_for`` bounds a whole call, so a server that trickles bytes cannot stall it.
``httpx`` is a declared dependency of the pinned ``leptonai`` (``aiohttp`` comes only with
the full SGLang install), and its per-call overhead is irrelevant next to seconds of
generation. ``trust_env=False``: a proxy from the environment must never sit between the
trainer and its own servers.

Every failure of a call is classified: ``ServerFault`` (unreachable, no answer in time, HTTP
5xx / 429 / 408, a body that breaks the contract: the work may succeed elsewhere) or
``Rejected`` (HTTP 4xx: the request itself is bad, resending it cannot help). The synchronous
entry points of the client run their own event loop (``run_sync``); none of them may be
called from inside one.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Coroutine, TypeVar

import httpx

from pipeline.rollout.sglang import protocol

if TYPE_CHECKING:
    from pipeline.config import RolloutConfig

__all__ = ["Rejected", "SGLangClientConfig", "ServerFault", "answer_failure", "call", "parse_json", "run_sync"]

_T = TypeVar("_T")
# Samples of one prompt sent as one /generate call: they share one prefill on the server.
DEFAULT_SAMPLES_PER_REQUEST = 8


@dataclass(kw_only=True, slots=True, frozen=True)
class SGLangClientConfig:
    """Client-side limits and timeouts (``generation``, ``servers`` and ``weights`` say how each is used)."""

    max_in_flight: int = 256  # calls; from_rollout derives both limits from the servers
    max_in_flight_per_server: int = 128
    max_samples_per_request: int = DEFAULT_SAMPLES_PER_REQUEST
    request_timeout_s: float = 3600.0
    connect_timeout_s: float = 10.0
    max_attempts: int = 4
    max_consecutive_failures: int = 3
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0
    batch_timeout_s: float | None = None
    health_path: str = protocol.HEALTH_PATH
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
    # Where the client leases a server while it loads weights into it, so the server's supervisor does not
    # take its failing health probes for a hang (``pipeline.rollout.leases``); None: no leases.
    load_leases_dir: str | None = None

    @classmethod
    def from_rollout(cls, rollout: RolloutConfig, **overrides: Any) -> SGLangClientConfig:
        """The client limits ``rollout`` (a run's ``rollout`` block, its servers filled in) sets; ``overrides``
        for the rest.

        The in-flight limits follow ``rollout_in_flight_limit`` over ``rollout.servers``, in calls: a call
        carries at most ``max_samples_per_request`` sequences (fewer when a server runs fewer at once),
        so ``max_in_flight`` calls never hold more than the limit's sequences, nor a server more than
        its ``--max-running-requests``.

        The weight-load leases go into ``rollout.weights_dir`` (``leases.load_leases_dir``), the folder
        trainer and servers share; without one there are none.
        """
        from pipeline.config import rollout_in_flight_limit
        from pipeline.rollout.leases import load_leases_dir

        limit = rollout_in_flight_limit(rollout, num_servers=len(rollout.servers))
        samples = overrides.pop("max_samples_per_request", DEFAULT_SAMPLES_PER_REQUEST)
        samples = min(samples, limit.per_server, limit.sequences)
        return cls(
            request_timeout_s=rollout.request_timeout_s, batch_timeout_s=rollout.batch_timeout_s,
            max_attempts=rollout.max_attempts, probe_timeout_s=rollout.health_timeout_s,
            max_server_failures=rollout.max_server_failures, recovery_timeout_s=rollout.server_recovery_timeout_s,
            min_servers=rollout.min_servers, max_samples_per_request=samples,
            max_in_flight=limit.sequences // samples, max_in_flight_per_server=limit.per_server // samples,
            load_leases_dir=None if rollout.weights_dir is None else str(load_leases_dir(rollout.weights_dir)),
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


class ServerFault(Exception):
    """The server failed (unreachable, hung, 5xx, garbage): the work may succeed elsewhere."""


class Rejected(Exception):
    """HTTP 4xx: the server refused the request itself; resending it elsewhere cannot help."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"HTTP {status}: {text}")
        self.status = status
        self.text = text


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


async def call(
    client: httpx.AsyncClient,
    method: str,
    url: str,
    *,
    body: Any = None,
    timeout_s: float,
    retry_statuses: frozenset[int] = frozenset(),
) -> httpx.Response:
    """One HTTP call bounded end to end; failures are classified as ``ServerFault`` or ``Rejected``."""
    try:
        response = await asyncio.wait_for(client.request(method, url, json=body), timeout_s)
    except TimeoutError as error:
        raise ServerFault(f"no answer from {url} within {timeout_s:g}s") from error
    except httpx.HTTPError as error:
        raise ServerFault(f"{url}: {type(error).__name__}: {error}") from error
    status = response.status_code
    if status >= 500 or status in (408, 429) or status in retry_statuses:
        raise ServerFault(f"{url}: HTTP {status}: {_error_text(response)}")
    if status >= 400:
        raise Rejected(status, _error_text(response))
    return response


def parse_json(response: httpx.Response) -> Any:
    try:
        return json.loads(response.content)
    except ValueError as error:
        raise ServerFault(f"{response.request.url}: malformed JSON ({error})") from error


def answer_failure(outcome: httpx.Response | Exception) -> str | None:
    """None if ``outcome`` is a ``{success: true, ...}`` weight-update answer, else why not."""
    if isinstance(outcome, Exception):
        return str(outcome)
    try:
        success, message = protocol.parse_update_response(parse_json(outcome))
    except (protocol.MalformedResponse, ServerFault) as error:
        return str(error)
    return None if success else message


def run_sync(coroutine: Coroutine[Any, Any, _T]) -> _T:
    """Run ``coroutine`` in an event loop of its own; refused from inside a running loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    coroutine.close()
    raise RuntimeError("the SGLang client's synchronous calls cannot run inside an event loop")
