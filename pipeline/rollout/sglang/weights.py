"""``SGLangWeights``: the ``WeightSink`` of SGLang servers, over their weight-update RPCs.

It shares its ``ServerPool`` with the ``SGLangEngine`` that generates from the servers, so both
see one weight version and one set of live servers. Every update goes to every live server
and to every stale one it brings back; a server that fails an update others passed is dropped
(its weights are unknown); if every server fails, the version stays and ``RolloutError`` is
raised.

* ``load_from_disk``: ``/update_weights_from_disk`` of a Hugging Face folder every server can
  read, then ``/flush_cache`` so no prefix computed with the old weights is reused. A server
  that restarts later loads the same folder before it serves again (``ServerPool.disk_source``).
* A streamed update (``begin_update``, ``send_bucket`` per bucket, ``end_update``), SGLang's
  own sequence. Once, the trainer's global rank 0 forms an update group with every server to
  sync (``/init_weights_update_group``: rank 0 is group rank 0, server ``i`` takes ranks
  ``1 + i·ranks_per_server …``; NCCL on GPU, gloo on CPU). Per update: one weight-update
  session on every server (``/begin_weight_update``); per bucket, ``/update_weights_from_distributed``
  announces the names, dtypes and shapes while rank 0 broadcasts the tensors in that order;
  ``/end_weight_update`` closes the session (also after a failure), and a completed update is
  followed by ``/flush_cache`` and the new version label. SGLang 0.5.23 accepts distributed
  updates only inside a session. If the group breaks (a server died), the group is closed and
  ``RolloutError`` raised; the next update forms a new group with the servers still up, and a
  server that restarted since (it reports its launch weights) joins it and is brought to the
  current weights. The servers that stayed up leave the old group first
  (``/destroy_weights_update_group``), so a server holds one group's communicator however many
  failures a campaign sees. Bytes per update at 7B: 15.2 GB out of rank 0 to every server, once.

Admin calls are retried with backoff on server faults (``max_attempts``), never the bucket
announcement: a repeated one would wait for a broadcast that never comes.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence
from urllib.parse import urlparse

import httpx
import torch

from pipeline.parallel.rendezvous import free_port
from pipeline.parallel.weight_transfer import UpdateGroup
from pipeline.rollout.sglang import protocol
from pipeline.rollout.sglang.client import Rejected, ServerFault, answer_failure, call, run_sync
from pipeline.rollout.sglang.servers import Server, ServerPool
from pipeline.rollout.types import RolloutError

__all__ = ["SGLangWeights", "UpdateGroupSettings", "update_group_address"]

logger = logging.getLogger(__name__)


def update_group_address(server_urls: Sequence[str]) -> str:
    """The address servers reach the trainer's rank 0 at: loopback when every server is local."""
    hosts = {urlparse(url).hostname for url in server_urls}
    if hosts <= {"127.0.0.1", "localhost", "::1"}:
        return "127.0.0.1"
    return socket.gethostname()


@dataclass(frozen=True, kw_only=True, slots=True)
class UpdateGroupSettings:
    """The trainer's side of the update group a streamed update broadcasts over."""

    backend: str  # "nccl" with CUDA, else "gloo"
    master_address: str  # where the servers reach the trainer's rank 0 (``update_group_address``)
    ranks_per_server: int  # a server's GPUs (its --tp-size): each takes one rank of the group
    timeout_s: float  # of the group's collectives


class SGLangWeights:
    """The ``WeightSink`` of the servers in ``pool`` (see the module docstring).

    ``update_group``: how the trainer joins the update group of a streamed update; without it
    the servers take weights from disk only.
    """

    def __init__(self, pool: ServerPool, *, update_group: UpdateGroupSettings | None = None) -> None:
        self.pool = pool
        self.update_group = update_group
        self._group: UpdateGroup | None = None
        self._members: list[tuple[str, int]] = []  # (URL, failures so far) of the servers in the current group
        self._left_behind: list[tuple[str, list[tuple[str, int]]]] = []  # closed groups' (name, members)
        self._groups_formed = 0
        self._session: list[Server] = []  # the servers in the open weight-update session
        # Group names carry this trainer process's own prefix: a server that outlived an earlier trainer (a
        # relaunch on live servers) may still hold that trainer's group of the same number, and SGLang
        # refuses a second one.
        self._name_prefix = uuid.uuid4().hex[:8]

    def _check_version(self, version: int) -> None:
        current = self.pool.weight_version
        if isinstance(version, bool) or not isinstance(version, int) or version <= current:
            raise ValueError(f"version must be an int > the current weight version {current}, got {version!r}")

    # ------------------------------------------------------------------ from disk

    def load_from_disk(self, folder: str, *, version: int) -> None:
        """Every server loads the HF folder ``folder`` and labels it ``version``."""
        self._check_version(version)
        pool = self.pool
        if not pool.syncable() and any(s.state == "down" for s in pool.servers):
            # Every server is restarting: each loads the folder when it recovers (generation waits for that).
            logger.warning("no SGLang server is up for the update to version %d; the %d down ones load %s "
                           "when they recover", version, len(pool.servers) - len(pool.retired_servers), folder)
            pool.weight_version = version
        else:
            run_sync(self._load_everywhere(folder, version=version))
        pool.disk_source = folder

    async def _load_everywhere(self, folder: str, *, version: int) -> None:
        pool = self.pool
        body = protocol.update_weights_from_disk_body(folder, version=version)
        path = protocol.UPDATE_FROM_DISK_PATH
        succeeded, failed = await self._admin_checked(path, lambda i, s: body, servers=pool.syncable())
        if not succeeded:
            details = "; ".join(f"{s.url}: {why}" for s, why in failed)
            raise RolloutError(f"{path} to version {version} failed on every server (version unchanged): {details}")
        for server, why in failed:
            pool.drop(server, f"{path} to version {version} failed while others succeeded: {why}")
        await self._flush(succeeded, version=version)
        pool.promote(succeeded, version=version)
        pool.check_enough()
        if not pool.live():
            raise RolloutError(f"no SGLang server left after updating to version {version}: {pool.dead_servers}")
        pool.weight_version = version

    # ------------------------------------------------------------ streamed updates

    def begin_update(self, *, version: int) -> None:
        """Form (or keep) the update group and open a weight-update session on its servers.

        A server restarted since the last update is no member of the group any more: it is found
        here (it reports its launch weights) and joins the new group this update forms.
        """
        if self.update_group is None:
            raise RolloutError("these SGLang servers take weights from disk only (no update group was configured)")
        try:
            self.pool.check_servers(before_update=True)
            self._connect(self.update_group)
            self._begin_session(version)
        except RuntimeError:
            self._disconnect()
            raise

    def send_bucket(self, bucket: Sequence[tuple[str, torch.Tensor]], *, version: int) -> None:
        """Announce the bucket to every server of the session while this rank broadcasts it over the group."""
        group = self._group
        if group is None:
            raise RolloutError(f"no update group is open for version {version}; call begin_update first")
        failure: BaseException | None = None
        with ThreadPoolExecutor(max_workers=1) as announcer:
            # The servers answer once they received every tensor: the announcement runs beside the broadcast.
            announced = announcer.submit(
                self._announce, [name for name, _ in bucket], dtypes=[str(t.dtype).removeprefix("torch.")
                                                                      for _, t in bucket],
                shapes=[list(t.shape) for _, t in bucket], version=version, group_name=group.name,
            )
            try:
                group.broadcast([tensor.contiguous() for _, tensor in bucket])
            except RuntimeError as broken:  # a member left the group
                failure = broken
                self._disconnect()
            try:
                announced.result()
            except RolloutError as refused:
                failure = failure or refused
                self._disconnect()
        if failure is not None:
            raise RolloutError(f"the update group failed (it is closed; the next update forms a new one with the "
                               f"servers still up: {self.pool.live_servers}): {failure}") from failure

    def end_update(self, *, version: int, completed: bool) -> None:
        """Close the session; if ``completed``, flush the servers' caches and label their weights ``version``.

        A server that fails to close it is dropped. An incomplete update leaves the version
        unchanged: the servers' weights are a mix until the next complete one.
        """
        pool = self.pool
        servers = [server for server in self._session if server.state in ("live", "stale")]
        self._session = []
        if servers:
            closed, failed = run_sync(self._admin_checked(
                protocol.END_WEIGHT_UPDATE_PATH, lambda i, s: protocol.end_weight_update_body(), servers=servers))
        else:
            closed, failed = [], []
        for server, why in failed:
            pool.drop(server, f"{protocol.END_WEIGHT_UPDATE_PATH} for version {version} failed: {why}")
        if not completed:
            return
        if not closed:
            raise RolloutError(f"no SGLang server completed the update to version {version}: {pool.dead_servers}")
        run_sync(self._flush(closed, version=version))
        pool.promote(closed, version=version)
        pool.weight_version = version
        pool.disk_source = None

    def close(self) -> None:
        """Leave the update group on this side (the servers leave it at the next group they form)."""
        self._disconnect()

    def _connect(self, settings: UpdateGroupSettings) -> UpdateGroup:
        pool = self.pool
        failures = {server.url: server.failures for server in pool.servers}
        members = [(server.url, failures[server.url]) for server in pool.syncable()]
        if self._group is not None and members == self._members:
            return self._group
        # A member failed since the group formed (a restarted process is no member of it) or left:
        # a new group. The members that stayed up leave the old one first, so a server holds one
        # group (one communicator's buffers) however many failures a campaign sees.
        self._disconnect()
        for name, old_members in self._left_behind:
            survivors = [url for url, failed_before in old_members if failures.get(url) == failed_before]
            self._destroy_group(name, urls=survivors)
        self._left_behind = []
        world_size = 1 + len(members) * settings.ranks_per_server
        port = free_port()
        name = f"winnow-weights-{self._name_prefix}-{self._groups_formed}"
        self._groups_formed += 1
        # The servers answer /init_weights_update_group only once every member joined, this rank too.
        with ThreadPoolExecutor(max_workers=1) as joiner:
            joined = joiner.submit(self._init_group, settings, master_port=port, world_size=world_size,
                                  group_name=name)
            group = UpdateGroup.join(master_address=settings.master_address, master_port=port, rank=0,
                                     world_size=world_size, name=name, backend=settings.backend,
                                     timeout_s=settings.timeout_s)
            try:
                joined.result()
            except BaseException:
                group.destroy()
                raise
        self._group = group
        self._members = members
        return group

    def _disconnect(self) -> None:
        if self._group is not None:
            self._group.destroy()
            # Its members that are still up leave it at the next connect, not now: this may be
            # the middle of a failed broadcast, with a server still blocked in it.
            self._left_behind.append((self._group.name, self._members))
            self._group = None
            self._members = []

    # ------------------------------------------------------------ the RPCs

    def _init_group(self, settings: UpdateGroupSettings, *, master_port: int, world_size: int,
                    group_name: str) -> None:
        """Every server to sync joins the trainer's broadcast group (the trainer is rank 0).

        Server ``i`` of ``pool.syncable()`` takes ranks ``1 + i·ranks_per_server …``. The servers
        answer only once the trainer has joined too: run it beside this rank's ``UpdateGroup.join``.
        """

        def body_for(index: int, server: Server) -> dict[str, Any]:
            return protocol.init_weights_update_group_body(
                master_address=settings.master_address, master_port=master_port,
                rank_offset=1 + index * settings.ranks_per_server, world_size=world_size, group_name=group_name,
                backend=settings.backend,
            )

        _, failed = run_sync(self._admin_checked(protocol.INIT_UPDATE_GROUP_PATH, body_for,
                                                 servers=self.pool.syncable()))
        if failed:
            raise RolloutError(f"init_weights_update_group failed: {'; '.join(f'{s.url}: {why}' for s, why in failed)}")

    def _destroy_group(self, group_name: str, *, urls: Sequence[str]) -> list[str]:
        """Have the live servers among ``urls`` leave ``group_name``; returns the URLs that did.

        Each group a server joins holds a communicator until it is destroyed: for NCCL, its
        buffers in GPU memory (tens of MB per group and channel count) and its sockets. Best
        effort: a server that cannot answer (it died) holds nothing any more, and one that
        refuses is logged and keeps serving.
        """
        targets = [server for server in self.pool.servers if server.url in set(urls) and server.state == "live"]
        if not targets:
            return []
        body = protocol.destroy_weights_update_group_body(group_name)
        left, failed = run_sync(self._admin_checked(protocol.DESTROY_UPDATE_GROUP_PATH, lambda i, s: body,
                                                    servers=targets))
        for server, why in failed:
            logger.warning("SGLang server %s did not leave the old update group %s: %s", server.url, group_name, why)
        return [server.url for server in left]

    def _begin_session(self, version: int) -> None:
        """Open one weight-update session on every server to sync; one that fails to open it is dropped."""
        self._check_version(version)
        pool = self.pool
        path = protocol.BEGIN_WEIGHT_UPDATE_PATH
        opened, failed = run_sync(self._admin_checked(path, lambda i, s: protocol.begin_weight_update_body(),
                                                      servers=pool.syncable()))
        for server, why in failed:
            pool.drop(server, f"{path} for version {version} failed: {why}")
        if not opened:
            raise RolloutError(f"{path} for version {version} failed on every server (version unchanged): "
                               f"{pool.dead_servers}")
        self._session = opened

    def _announce(self, names: Sequence[str], *, dtypes: Sequence[str], shapes: Sequence[Sequence[int]],
                  version: int, group_name: str) -> None:
        """Announce one bucket to every server of the open session; they then receive its broadcast.

        Never retried. An unreachable server is dropped; any failure raises ``RolloutError``
        naming the servers.
        """
        pool = self.pool
        body = protocol.update_weights_from_distributed_body(
            names, dtypes=dtypes, shapes=shapes, version=version, group_name=group_name, flush_cache=False
        )
        servers = [server for server in self._session if server.state in ("live", "stale")]
        if not servers:
            raise RolloutError(f"no server left in the weight-update session for version {version}")
        path = protocol.UPDATE_FROM_DISTRIBUTED_PATH

        async def run() -> list[str]:
            async with pool.client() as client:
                outcomes = await asyncio.gather(
                    *(call(client, "POST", s.url + path, body=body, timeout_s=pool.config.admin_timeout_s)
                      for s in servers),
                    return_exceptions=True,
                )
            failures = []
            for server, outcome in zip(servers, outcomes):
                if isinstance(outcome, BaseException) and not isinstance(outcome, (ServerFault, Rejected)):
                    raise outcome
                if isinstance(outcome, ServerFault):
                    pool.drop(server, f"unreachable during the update to version {version}: {outcome}")
                failure = answer_failure(outcome)
                if failure is not None:
                    failures.append(f"{server.url}: {failure}")
            return failures

        failures = run_sync(run())
        if failures:
            raise RolloutError(f"{path} to version {version} failed: {'; '.join(failures)}")

    async def _flush(self, servers: Sequence[Server], *, version: int) -> None:
        """``/flush_cache`` on ``servers``, so no prefix computed with the old weights is reused."""
        # SGLang refuses /flush_cache (HTTP 400) while requests run; that is worth retrying.
        for server, outcome in await self._admin_all(
            protocol.FLUSH_CACHE_PATH, lambda i, s: None, servers=servers, retry_statuses=frozenset({400})
        ):
            if isinstance(outcome, Exception):
                self.pool.drop(server, f"/flush_cache after the update to version {version} failed: {outcome}")

    async def _admin_one(
        self, client: httpx.AsyncClient, server: Server, path: str, body: Any, *, retry_statuses: frozenset[int],
    ) -> httpx.Response:
        """POST with retries and backoff on server faults; the last fault or a rejection propagates."""
        cfg = self.pool.config
        for attempt in range(1, cfg.max_attempts + 1):
            try:
                return await call(client, "POST", server.url + path, body=body, timeout_s=cfg.admin_timeout_s,
                                  retry_statuses=retry_statuses)
            except ServerFault:
                if attempt == cfg.max_attempts:
                    raise
                await asyncio.sleep(min(cfg.backoff_initial_s * 2 ** (attempt - 1), cfg.backoff_max_s))
        raise AssertionError("unreachable")

    async def _admin_all(
        self, path: str, body_for: Callable[[int, Server], Any], *, servers: Sequence[Server],
        retry_statuses: frozenset[int] = frozenset(),
    ) -> list[tuple[Server, httpx.Response | Exception]]:
        targets = list(servers)
        if not targets:
            raise RolloutError(f"no live SGLang server for {path}; dropped: {self.pool.dead_servers}")
        async with self.pool.client() as client:
            outcomes = await asyncio.gather(
                *(self._admin_one(client, s, path, body_for(i, s), retry_statuses=retry_statuses)
                  for i, s in enumerate(targets)),
                return_exceptions=True,
            )
        for outcome in outcomes:
            if isinstance(outcome, BaseException) and not isinstance(outcome, (ServerFault, Rejected)):
                raise outcome
        return list(zip(targets, outcomes))  # type: ignore[arg-type]

    async def _admin_checked(
        self, path: str, body_for: Callable[[int, Server], Any], *, servers: Sequence[Server]
    ) -> tuple[list[Server], list[tuple[Server, str]]]:
        """POST to the servers; ``(succeeded, [(failed, why)])`` by their ``{success, message}`` answers."""
        succeeded: list[Server] = []
        failed: list[tuple[Server, str]] = []
        for server, outcome in await self._admin_all(path, body_for, servers=servers):
            failure = answer_failure(outcome)
            if failure is None:
                succeeded.append(server)
            else:
                failed.append((server, failure))
        return succeeded, failed
