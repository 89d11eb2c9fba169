"""``SGLangEngine``: rollouts from SGLang servers over HTTP, with failover that never loses a sample.

The servers (launched here or attached to, their health and recovery) are a ``ServerPool``
(``pipeline.rollout.sglang.servers``); their weights change through ``SGLangWeights``
(``pipeline.rollout.sglang.weights``), which shares the pool. One ``generate`` call:

* Every requested sample is a key ``(request index, sample index)``; the samples of a
  prompt are cut into work items of at most ``max_samples_per_request``, each sent as
  one batch ``/generate`` call (``protocol.generate_body``).
* At most ``max_in_flight`` calls run at once (``max_in_flight_per_server`` per
  server); ``SGLangClientConfig.from_rollout`` derives both from the servers'
  ``--max-running-requests`` (``pipeline.config.rollout_in_flight_limit``). A work item goes
  to the live, not-backing-off server with the fewest calls in flight, ties broken
  round-robin, avoiding the server it last failed on when another one is free.
* An attempt fails on a connection error, no answer within ``request_timeout_s``
  (the whole call, so a server that trickles bytes cannot stall it), HTTP 5xx / 429 /
  408, or a 200 whose body breaks the response contract. The server then backs off
  exponentially (``backoff_initial_s · 2^(k−1)``, capped at ``backoff_max_s``) and is
  dropped after ``max_consecutive_failures`` failures in a row. The item goes back to the
  front of the queue; after ``max_attempts`` failures of its own it raises
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
* With ``max_server_failures`` > 0 the call starts with one pass over the servers
  (``ServerPool.check``) and gives every down server a recovery task while it runs. A server
  contacted for the first time (or again after a failure) must report the update group's
  ``tp_size`` when one is expected (``ServerPool.check_tensor_parallel``).
* No live server left, or the optional ``batch_timeout_s`` passed: ``RolloutError``.
  The batch never hangs: every wait above is bounded.

``generate`` runs its own event loop (``client.run_sync``). The engine is not thread-safe:
one call at a time.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import httpx
import torch
from tqdm.auto import tqdm

from pipeline.rollout.sglang import protocol
from pipeline.rollout.sglang.client import Rejected, ServerFault, SGLangClientConfig, call, parse_json, run_sync
from pipeline.rollout.sglang.servers import Server, ServerPool, SGLangServerProcess
from pipeline.rollout.types import Completion, GenerationRequest, RolloutError, SamplingParams, check_requests

__all__ = ["SGLangEngine"]


class SGLangEngine:
    """``RolloutEngine`` over SGLang HTTP servers; see the module docstring.

    ``base_urls`` are ``http://host:port`` of running servers; ``weight_version`` is the version
    of the weights they serve now. The constructor does not contact the servers: use ``attach``
    or ``launch``.
    """

    def __init__(
        self,
        base_urls: Sequence[str],
        *,
        config: SGLangClientConfig = SGLangClientConfig(),
        weight_version: int = 0,
        processes: Sequence[SGLangServerProcess] = (),
    ) -> None:
        self.pool = ServerPool(base_urls, config=config, weight_version=weight_version, processes=processes)

    @classmethod
    def attach(
        cls, base_urls: Sequence[str], *, config: SGLangClientConfig = SGLangClientConfig(), weight_version: int = 0
    ) -> SGLangEngine:
        """Connect to running servers and wait until every one is healthy."""
        engine = cls(base_urls, config=config, weight_version=weight_version)
        engine.pool.wait_until_healthy()
        return engine

    @classmethod
    def launch(
        cls,
        specs: Sequence[protocol.SGLangServerSpec],
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
            engine.pool.wait_until_healthy()
        except BaseException:
            for process in processes:
                process.terminate(grace_s=5.0)
            raise
        return engine

    @property
    def config(self) -> SGLangClientConfig:
        return self.pool.config

    @property
    def weight_version(self) -> int:
        return self.pool.weight_version

    def metrics(self) -> dict[str, float]:
        """Server counts by state and the recoveries so far (``rollout/...`` metrics of a step)."""
        return self.pool.metrics()

    def close(self) -> None:
        """Stop the servers this engine launched (attached servers are left running)."""
        self.pool.close()

    def generate(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> list[Completion]:
        """One ``Completion`` per requested sample, ordered by request then sample index."""
        return run_sync(self._generate(requests, params))

    async def _generate(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> list[Completion]:
        total = check_requests(requests)
        if total == 0:
            return []
        base_seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        chunk = self.config.max_samples_per_request
        works = []
        for r, request in enumerate(requests):
            for start in range(0, request.num_samples, chunk):
                samples = tuple(range(start, min(start + chunk, request.num_samples)))
                seeds = tuple(protocol.sample_seed(base_seed, request.prompt_id, s) for s in samples)
                works.append(_Work(request_index=r, sample_indices=samples, seeds=seeds))
        with tqdm(
            total=total,
            desc="rollout",
            unit="sample",
            disable=not self.config.show_progress,
            delay=self.config.progress_delay_s,
            leave=False,
        ) as bar:
            async with self.pool.client() as client:
                batch = _Batch(self.pool, client=client, requests=requests, params=params, bar=bar)
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


@dataclass(eq=False)
class _Work:
    request_index: int
    sample_indices: tuple[int, ...]
    seeds: tuple[int, ...]
    failures: int = 0
    avoid: Server | None = None
    errors: list[str] = field(default_factory=list)


@dataclass(eq=False)
class _Attempt:
    work: _Work
    server: Server
    abandoned: bool = False


class _Batch:
    """The state of one ``generate`` call: queue, in-flight attempts, results."""

    def __init__(
        self,
        pool: ServerPool,
        *,
        client: httpx.AsyncClient,
        requests: Sequence[GenerationRequest],
        params: SamplingParams,
        bar: tqdm,
    ) -> None:
        self.pool = pool
        self.config = pool.config
        self.client = client
        self.requests = requests
        self.params = params
        self.bar = bar
        self.pending: deque[_Work] = deque()
        self.tasks: dict[asyncio.Task[list[protocol.SampleOutput]], _Attempt] = {}
        self.recoveries: dict[asyncio.Task[None], Server] = {}
        self.results: dict[tuple[int, int], protocol.SampleOutput] = {}

    async def run(self, works: list[_Work]) -> dict[tuple[int, int], protocol.SampleOutput]:
        cfg = self.config
        self.pending.extend(works)
        deadline = None if cfg.batch_timeout_s is None else time.monotonic() + cfg.batch_timeout_s
        if cfg.max_server_failures > 0:
            # Servers may come back: one that restarted since the last batch must not serve its launch
            # weights. (Without recovery its first answer in another version retires it; nothing to check.)
            await self.pool.check(self.client)
        # The first contact with each server: a wrong rollout.server_tensor_parallel fails here, not at the
        # first weight sync after a whole step of generation.
        await self.pool.check_tensor_parallel(self.client, self.pool.live())
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
                self.pool.check_enough()
                live = self.pool.live()
                if not live and not self.recoveries:
                    raise RolloutError(f"no SGLang server can take requests: {self.pool.dead_servers}")
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
        for server in self.pool.servers:
            if server.state == "down" and server not in recovering:
                self.recoveries[asyncio.create_task(self.pool.recover(self.client, server))] = server

    def _pick_server(self, avoid: Server | None) -> Server | None:
        now = time.monotonic()
        servers = self.pool.servers
        start = self.pool.next_server
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
        self.pool.next_server = (servers.index(server) + 1) % len(servers)
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

    async def _attempt(self, attempt: _Attempt) -> list[protocol.SampleOutput]:
        work = attempt.work
        request = self.requests[work.request_index]
        body = protocol.generate_body(request.prompt_token_ids, sampling_seeds=work.seeds, params=self.params)
        response = await call(
            self.client, "POST", attempt.server.url + protocol.GENERATE_PATH, body=body,
            timeout_s=self.config.request_timeout_s,
        )
        try:
            outputs = protocol.parse_generate_response(
                parse_json(response),
                num_samples=len(work.seeds),
                initial_version=self.pool.initial_version,
                current_version=self.pool.weight_version,
            )
        except protocol.MalformedResponse as error:
            raise ServerFault(f"{attempt.server.url}: malformed /generate response: {error}") from error
        stale = {o.weight_version for o in outputs} - {self.pool.weight_version}
        if stale:
            # Every update goes to every live server, so another version means the server
            # missed one (e.g. it restarted): its samples would be silently off-policy.
            raise ServerFault(
                f"{attempt.server.url} serves weight version {sorted(stale)}, expected {self.pool.weight_version}"
            )
        return outputs

    def _finish(self, task: asyncio.Task[list[protocol.SampleOutput]], attempt: _Attempt) -> None:
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
        if isinstance(error, Rejected):
            raise RolloutError(
                f"{server.url} rejected /generate for prompt {prompt_id!r} (samples {list(work.sample_indices)}): "
                f"{error}"
            ) from error
        if not isinstance(error, ServerFault):
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

    def _server_failed(self, server: Server, reason: str) -> None:
        cfg = self.config
        server.consecutive_failures += 1
        if server.consecutive_failures >= cfg.max_consecutive_failures:
            self.pool.drop(server, f"{server.consecutive_failures} consecutive failures, last: {reason}")
            self._abandon(server)
            return
        delay = min(cfg.backoff_initial_s * 2 ** (server.consecutive_failures - 1), cfg.backoff_max_s)
        server.available_at = max(server.available_at, time.monotonic() + delay)

    def _abandon(self, server: Server) -> None:
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
            busy = [s for s in self.pool.servers if not s.dead and s.in_flight > 0]
            errors = await asyncio.gather(
                *(self.pool.probe(self.client, s, timeout_s=cfg.probe_timeout_s) for s in busy)
            )
            for server, error in zip(busy, errors):
                if error is not None and not server.dead:
                    self._server_failed(server, f"health probe failed: {error}")
