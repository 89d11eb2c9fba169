"""``SGLangWeights``: the ``WeightSink`` of SGLang servers, over their weight-update RPCs.

It shares its ``ServerPool`` with the ``SGLangEngine`` that generates from the servers, so both
see one weight version and one set of live servers. Every update goes to every live server
and to every stale one it brings back; a server that fails an update others passed is dropped
(its weights are unknown); if every server fails, the version stays and ``RolloutError`` is
raised. While a server loads weights it holds a lease (``ServerPool.loading``), so its node's
supervisor does not take its failing health probes for a hang.

* ``load_from_disk``: ``/update_weights_from_disk`` of a Hugging Face folder every server can
  read, then ``/flush_cache`` so no prefix computed with the old weights is reused. A server
  that restarts later loads the same folder before it serves again (``ServerPool.disk_source``).
* A streamed update (``begin_update``, ``send_bucket`` per bucket, ``end_update``), SGLang's
  own sequence. ``begin_update`` checks the servers (a restarted one is found: it reports its
  launch weights; each reports the ``tp_size`` the group expects, else ``ConfigError``), opens
  one weight-update session on each (``/begin_weight_update``; a refusal is taken for a session
  left open, which is closed and opened again once), and only then forms the update group with
  the servers whose session opened (``/init_weights_update_group``: rank 0 is group rank 0, server
  ``i`` takes ranks ``1 + i·ranks_per_server …``; NCCL on GPU, gloo on CPU). A server whose
  session did not open is dropped and never joins, so no broadcast waits for it. The group is kept
  while its members stay up. Per bucket, ``/update_weights_from_distributed`` announces the names,
  dtypes and shapes while rank 0 broadcasts the tensors in that order; ``/end_weight_update``
  closes the sessions (also after a failure), and a completed update is followed by
  ``/flush_cache`` and the new version label. SGLang 0.5.23 accepts distributed updates only
  inside a session.
* A member that dies, hangs or cannot join during an update breaks the group. The bucket's
  broadcast is abandoned (its group aborted), the server is dropped (it holds part of the update,
  ``Server.partial_weights``: it is taken back only after a full one), and a new group is formed
  with the servers still in the session, which keep their sessions open and leave the old group
  first (``/destroy_weights_update_group``, so a server holds one group's communicator however many
  failures a campaign sees); the failed bucket is sent again and the update goes on. At most
  ``max_group_reforms`` re-forms per update, then ``RolloutError``. The dropped server is left to
  its supervisor (a restart) and to ``ServerPool`` recovery, which closes any session it still holds
  and keeps it out until the next update brings it the whole of the weights.
* Timeouts: every HTTP call beside a collective (an announcement, a join) is bounded by the
  client's ``admin_timeout_s``; the group's collectives by ``collective_timeout_s`` of it, 60 s
  longer, so a member that stops answering is found by its HTTP call, which names it, and the
  client aborts the group itself (see ``COLLECTIVE_TIMEOUT_MARGIN_S``).

Bytes per update at 7B: 15.2 GB out of rank 0 to every server, once, plus one bucket (at most
``rollout.sync_bucket_mb``, 512 MiB) again per re-form. Memory: an abandoned gloo broadcast keeps
its bucket until its peer closes the connection or the collective timeout passes (NCCL's abort
ends it at once).

Admin calls are retried with backoff on server faults (``max_attempts``), never the bucket
announcement (a repeated one would wait for a broadcast that never comes) nor a join (a second
join of one group is refused; a new group is the retry).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence
from urllib.parse import urlparse

import httpx
import torch

from pipeline.config import MAX_UPDATE_GROUP_REFORMS, UPDATE_GROUP_TIMEOUT_MARGIN_S
from pipeline.parallel.rendezvous import reserved_port
from pipeline.parallel.weight_transfer import UpdateGroup
from pipeline.rollout.sglang import protocol
from pipeline.rollout.sglang.client import Rejected, ServerFault, answer_failure, call, run_sync
from pipeline.rollout.sglang.servers import Server, ServerPool
from pipeline.rollout.types import RolloutError

__all__ = ["COLLECTIVE_TIMEOUT_MARGIN_S", "MAX_GROUP_REFORMS", "SGLangWeights", "UpdateGroupSettings",
           "collective_timeout_s", "update_group_address"]

logger = logging.getLogger(__name__)

# New update groups one streamed update may form after the group failed (a member died, hung or could not
# join). Each costs the failed bucket again and a group formation (seconds); past them the update fails.
MAX_GROUP_REFORMS = MAX_UPDATE_GROUP_REFORMS  # the trainer's collective timeout counts them (pipeline.config)
# The update group's collective timeout is the HTTP limit of the calls beside its collectives (a bucket's
# announcement, a join: the client's admin_timeout_s) plus this margin, so the HTTP limit always passes first.
# That order gives the clear error: the HTTP failure names the server that stopped answering, the client
# drops it, aborts the group and re-forms it without it; a collective timeout names no server, and under
# NCCL its watchdog tears the whole trainer process down. The margin covers the announcement starting
# before the broadcast is posted and the time to abort.
COLLECTIVE_TIMEOUT_MARGIN_S = UPDATE_GROUP_TIMEOUT_MARGIN_S


def collective_timeout_s(admin_timeout_s: float) -> float:
    """The update group's collective timeout for a client whose admin calls time out after ``admin_timeout_s``."""
    return admin_timeout_s + COLLECTIVE_TIMEOUT_MARGIN_S


def update_group_address(server_urls: Sequence[str]) -> str:
    """The address servers reach the trainer's rank 0 at: loopback when every server is local."""
    hosts = {urlparse(url).hostname for url in server_urls}
    if hosts <= {"127.0.0.1", "localhost", "::1"}:
        return "127.0.0.1"
    return socket.gethostname()


@dataclass(frozen=True, kw_only=True, slots=True)
class UpdateGroupSettings:
    """The trainer's side of the update group a streamed update broadcasts over (timeout: ``collective_timeout_s``)."""

    backend: str  # "nccl" with CUDA, else "gloo"
    master_address: str  # where the servers reach the trainer's rank 0 (``update_group_address``)
    ranks_per_server: int  # a server's GPUs (its --tp-size): each takes one rank of the group


class _GroupFailed(RuntimeError):
    """The update group broke or could not be formed; a new one may succeed without the servers dropped."""


class _Broadcast:
    """One bucket's broadcast from group rank 0, in a thread of its own so that it can be abandoned.

    A failed announcement (its server died or stopped answering) wakes the caller at once; the
    broadcast, which may be waiting for that server, is then abandoned with its group: NCCL's abort
    ends it, a gloo one ends when its peer closes the connection or at the collective timeout.
    """

    def __init__(self, group: UpdateGroup, tensors: list[torch.Tensor], *, wake: threading.Event) -> None:
        # A handle of its own on the group's process group: ``destroy`` of the caller's handle (abandoning the
        # broadcast) clears that one, and a broadcast posted after it must fail, never fall back to the default
        # group, which on the trainer's rank 0 is the training world.
        assert group.group is not None, f"update group {group.name} was destroyed"
        self.group = UpdateGroup(group.group, name=group.name, rank=group.rank, world_size=group.world_size,
                                 backend=group.backend)
        self.tensors = tensors
        self.wake = wake
        self.error: RuntimeError | None = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"broadcast-{group.name}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            if self.tensors and self.tensors[0].is_cuda:
                torch.cuda.set_device(self.tensors[0].device)  # a new thread starts on device 0
            self.group.broadcast(self.tensors)
        except (RuntimeError, ValueError) as error:  # a member left the group, or it was aborted or destroyed
            self.error = error if isinstance(error, RuntimeError) else RuntimeError(str(error))
        finally:
            self.done.set()
            self.wake.set()


class _Join:
    """Rank 0 joining a new update group, in a thread of its own: it waits for every member, and one that
    never joins must not hold the caller for the collective timeout. An abandoned join destroys its group
    as soon as it has one."""

    def __init__(self, settings: UpdateGroupSettings, *, port: int, world_size: int, name: str,
                 timeout_s: float) -> None:
        self._lock = threading.Lock()
        self._abandoned = False
        self.group: UpdateGroup | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=f"join-{name}", daemon=True,
                                       args=(settings, port, world_size, name, timeout_s))
        self.thread.start()

    def _run(self, settings: UpdateGroupSettings, port: int, world_size: int, name: str, timeout_s: float) -> None:
        try:
            group = UpdateGroup.join(master_address=settings.master_address, master_port=port, rank=0,
                                     world_size=world_size, name=name, backend=settings.backend, timeout_s=timeout_s)
        except (RuntimeError, ValueError) as error:  # torch's store and rendezvous errors are RuntimeErrors
            self.error = error
            return
        with self._lock:
            if not self._abandoned:
                self.group = group
                return
        group.destroy()

    def result(self) -> UpdateGroup:
        self.thread.join()
        if self.group is None:
            raise _GroupFailed(f"this rank could not join the update group: {self.error}")
        return self.group

    def abandon(self) -> None:
        with self._lock:
            self._abandoned = True
            group, self.group = self.group, None
        if group is not None:
            group.destroy()


class SGLangWeights:
    """The ``WeightSink`` of the servers in ``pool`` (see the module docstring).

    ``update_group``: how the trainer joins the update group of a streamed update; without it
    the servers take weights from disk only. With it, every server must report ``tp_size`` =
    ``update_group.ranks_per_server`` (checked at the first contact: ``ServerPool.check_tensor_parallel``).
    ``max_group_reforms``: new groups one update may form after its group failed.
    """

    def __init__(self, pool: ServerPool, *, update_group: UpdateGroupSettings | None = None,
                 max_group_reforms: int = MAX_GROUP_REFORMS) -> None:
        if max_group_reforms < 0:
            raise ValueError(f"max_group_reforms must be >= 0, got {max_group_reforms}")
        self.pool = pool
        self.update_group = update_group
        self.max_group_reforms = max_group_reforms
        self.collective_timeout_s = collective_timeout_s(pool.config.admin_timeout_s)
        if update_group is not None:
            pool.expected_tp_size = update_group.ranks_per_server
        self._group: UpdateGroup | None = None
        self._broadcast: _Broadcast | None = None  # the current group's last broadcast
        self._members: list[tuple[str, int]] = []  # (URL, failures so far) of the servers in the current group
        self._left_behind: list[tuple[str, list[tuple[str, int]]]] = []  # closed groups' (name, members)
        self._groups_formed = 0
        self._group_failures = 0  # in the update under way
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
        servers = pool.syncable()
        with pool.loading(servers):
            succeeded, failed = await self._admin_checked(path, lambda i, s: body, servers=servers)
        if not succeeded:
            details = "; ".join(f"{s.url}: {why}" for s, why in failed)
            raise RolloutError(f"{path} to version {version} failed on every server (version unchanged): {details}")
        for server, why in failed:
            pool.drop(server, f"{path} to version {version} failed while others succeeded: {why}")
        for server in succeeded:
            server.partial_weights = False
        await self._flush(succeeded, version=version)
        pool.promote(succeeded, version=version)
        pool.check_enough()
        if not pool.live():
            raise RolloutError(f"no SGLang server left after updating to version {version}: {pool.dead_servers}")
        pool.weight_version = version

    # ------------------------------------------------------------ streamed updates

    def begin_update(self, *, version: int) -> None:
        """Check the servers, open a weight-update session on each, then form (or keep) the group of those that opened.

        A server restarted since the last update is no member of the group any more: it is found
        here (it reports its launch weights) and joins the new group this update forms. If no group
        can be formed (within ``max_group_reforms`` tries), the sessions are closed again and
        ``RolloutError`` is raised.
        """
        if self.update_group is None:
            raise RolloutError("these SGLang servers take weights from disk only (no update group was configured)")
        self._check_version(version)
        pool = self.pool
        pool.check_servers(before_update=True)
        self._group_failures = 0
        self._session = run_sync(self._open_sessions(version))
        pool.hold_leases(self._session)
        try:
            self._form_group(version)
        except BaseException:
            self._close_sessions(version)
            self._disconnect()
            raise

    def send_bucket(self, bucket: Sequence[tuple[str, torch.Tensor]], *, version: int) -> None:
        """Announce the bucket to every server of the session while this rank broadcasts it over the group.

        If the group fails, a new one is formed with the servers still in the session and the bucket
        is sent again (at most ``max_group_reforms`` times per update).
        """
        if self._group is None:
            raise RolloutError(f"no update group is open for version {version}; call begin_update first")
        names = [name for name, _ in bucket]
        dtypes = [str(tensor.dtype).removeprefix("torch.") for _, tensor in bucket]
        shapes = [list(tensor.shape) for _, tensor in bucket]
        tensors = [tensor.contiguous() for _, tensor in bucket]
        self.pool.hold_leases(self._members_of_session())  # renewed per bucket: the session goes on
        while True:
            failure = self._deliver(names, dtypes=dtypes, shapes=shapes, tensors=tensors, version=version)
            if failure is None:
                return
            self._count_group_failure(version, failure)
            self._form_group(version)

    def end_update(self, *, version: int, completed: bool) -> None:
        """Close the session; if ``completed``, flush the servers' caches and label their weights ``version``.

        A server that fails to close it is dropped. An incomplete update leaves the version
        unchanged: the servers' weights are a mix until the next complete one.
        """
        pool = self.pool
        closed = self._close_sessions(version)
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
        self.pool.release_leases(self._session)
        self._disconnect()

    def _members_of_session(self) -> list[Server]:
        return [server for server in self._session if server.state in ("live", "stale")]

    def _drop_from_session(self, server: Server, reason: str) -> None:
        """A server of the open session failed: down, and holding part of the update whatever it reports."""
        self.pool.drop(server, reason)
        server.partial_weights = True
        self.pool.release_leases([server])

    def _count_group_failure(self, version: int, why: str) -> None:
        self._group_failures += 1
        if self._group_failures > self.max_group_reforms:
            raise RolloutError(f"the update group failed {self._group_failures} times in the update to version "
                               f"{version}, more than the {self.max_group_reforms} new groups one update may form; "
                               f"last: {why}")
        logger.warning("the update group failed in the update to version %d (%s); forming a new one with %d "
                       "servers (%d of %d)", version, why, len(self._members_of_session()), self._group_failures,
                       self.max_group_reforms)

    def _form_group(self, version: int) -> None:
        """Keep or form the group of the servers in the session; each failed formation counts as a group failure."""
        assert self.update_group is not None
        while True:
            members = self._members_of_session()
            if not members:
                raise RolloutError(f"no server left in the weight-update session for version {version}: "
                                   f"{self.pool.dead_servers}")
            try:
                self._connect(self.update_group, members)
                return
            except _GroupFailed as error:
                self._count_group_failure(version, str(error))

    def _close_sessions(self, version: int) -> list[Server]:
        """``/end_weight_update`` on the session's servers (a failure drops the server); the ones that closed it."""
        servers = self._members_of_session()
        session, self._session = self._session, []
        self.pool.release_leases(session)
        if not servers:
            return []
        closed, failed = run_sync(self._admin_checked(
            protocol.END_WEIGHT_UPDATE_PATH, lambda i, s: protocol.end_weight_update_body(), servers=servers))
        for server, why in failed:
            self._drop_from_session(server, f"{protocol.END_WEIGHT_UPDATE_PATH} for version {version} failed: {why}")
        return closed

    def _connect(self, settings: UpdateGroupSettings, members: Sequence[Server]) -> None:
        """The group of ``members``: the current one if they are its members, else a new one (``_GroupFailed``)."""
        pool = self.pool
        key = [(server.url, server.failures) for server in members]
        if self._group is not None and key == self._members:
            return
        # A member failed since the group formed (a restarted process is no member of it) or left:
        # a new group. The members that stayed up leave the old one first, so a server holds one
        # group (one communicator's buffers) however many failures a campaign sees.
        self._disconnect()
        failures = {server.url: server.failures for server in pool.servers}
        for name, old_members in self._left_behind:
            survivors = [url for url, failed_before in old_members if failures.get(url) == failed_before]
            self._destroy_group(name, urls=survivors)
        self._left_behind = []
        world_size = 1 + len(members) * settings.ranks_per_server
        name = f"winnow-weights-{self._name_prefix}-{self._groups_formed}"
        self._groups_formed += 1
        # The servers answer /init_weights_update_group only once every member joined, this rank too.
        # The port stays reserved until then: this rank's store binds it from the join's thread.
        with reserved_port() as port:
            join = _Join(settings, port=port, world_size=world_size, name=name, timeout_s=self.collective_timeout_s)

            def body_for(index: int, server: Server) -> dict[str, Any]:
                return protocol.init_weights_update_group_body(
                    master_address=settings.master_address, master_port=port,
                    rank_offset=1 + index * settings.ranks_per_server, world_size=world_size, group_name=name,
                    backend=settings.backend,
                )

            # Never retried: a join that timed out may still complete on the server, which then refuses a second
            # one of the same name; a new group (another name) is the retry.
            _, failed = run_sync(self._admin_checked(protocol.INIT_UPDATE_GROUP_PATH, body_for, servers=members,
                                                     attempts=1))
            if failed:
                join.abandon()
                for server, why in failed:
                    self._drop_from_session(server, f"{protocol.INIT_UPDATE_GROUP_PATH} failed: {why}")
                raise _GroupFailed(f"{protocol.INIT_UPDATE_GROUP_PATH} failed: "
                                   f"{'; '.join(f'{s.url}: {why}' for s, why in failed)}")
            self._group = join.result()
        self._broadcast = None
        self._members = key

    def _disconnect(self) -> None:
        group = self._group
        if group is None:
            return
        self._group = None
        broadcast, self._broadcast = self._broadcast, None
        if broadcast is not None and not broadcast.done.is_set():
            # Its broadcast still waits for a member that stopped answering. Destroying the group waits for
            # the broadcast to end: aborted at once under NCCL, under gloo when the peer closes the
            # connection or at the collective timeout. A thread of its own does it; nothing waits for it.
            threading.Thread(target=group.destroy, name=f"destroy-{group.name}", daemon=True).start()
        else:
            group.destroy()
        # Its members that are still up leave it at the next connect, not now: a server may still be
        # blocked in a failed broadcast of it.
        self._left_behind.append((group.name, self._members))
        self._members = []

    def _deliver(self, names: Sequence[str], *, dtypes: Sequence[str], shapes: Sequence[Sequence[int]],
                 tensors: list[torch.Tensor], version: int) -> str | None:
        """One try at one bucket: None once every server of the session received it, else why the group failed.

        A server that could not be reached (or did not answer within ``admin_timeout_s``) is dropped
        and the broadcast abandoned with its group: the caller forms a new one. Refusals with a working
        group (the servers answered, and no member left) are no group failure: ``RolloutError``.
        """
        group = self._group
        assert group is not None
        servers = self._members_of_session()
        if not servers:
            raise RolloutError(f"no server left in the weight-update session for version {version}")
        body = protocol.update_weights_from_distributed_body(
            names, dtypes=dtypes, shapes=shapes, version=version, group_name=group.name, flush_cache=False)
        wake = threading.Event()
        with ThreadPoolExecutor(max_workers=1) as announcer:
            # The servers answer once they received every tensor: the announcement runs beside the broadcast.
            announced = announcer.submit(self._announce, servers, body, version=version, failed=wake)
            # An announcement that crashed outright wakes this rank too (its server never receives).
            announced.add_done_callback(lambda future: future.exception() is not None and wake.set())
            self._broadcast = broadcast = _Broadcast(group, tensors, wake=wake)
            wake.wait()  # the broadcast ended, or an announcement failed
            if not broadcast.done.is_set():
                self._disconnect()  # the broadcast waits for a server that failed: abandon it with its group
            unreachable, refused = announced.result()
        if broadcast.done.is_set() and broadcast.error is None and not unreachable and not refused:
            return None
        if unreachable or (broadcast.done.is_set() and broadcast.error is not None):
            self._disconnect()
            why = [error for _, error in unreachable] + refused  # each names its server
            if broadcast.error is not None:
                why.append(f"the broadcast: {broadcast.error}")
            return "; ".join(why)
        self._disconnect()
        raise RolloutError(f"{protocol.UPDATE_FROM_DISTRIBUTED_PATH} to version {version} failed: {'; '.join(refused)}")

    # ------------------------------------------------------------ the RPCs

    def _destroy_group(self, group_name: str, *, urls: Sequence[str]) -> list[str]:
        """Have the servers still up among ``urls`` leave ``group_name``; returns the URLs that did.

        Each group a server joins holds a communicator until it is destroyed: for NCCL, its
        buffers in GPU memory (tens of MB per group and channel count) and its sockets. Best
        effort: a server that cannot answer (it died) holds nothing any more, and one that
        refuses (its side already left, after a failed broadcast) is logged and keeps serving.
        """
        targets = [server for server in self.pool.servers
                   if server.url in set(urls) and server.state in ("live", "stale")]
        if not targets:
            return []
        body = protocol.destroy_weights_update_group_body(group_name)
        left, failed = run_sync(self._admin_checked(protocol.DESTROY_UPDATE_GROUP_PATH, lambda i, s: body,
                                                    servers=targets))
        for server, why in failed:
            logger.warning("SGLang server %s did not leave the old update group %s: %s", server.url, group_name, why)
        return [server.url for server in left]

    async def _open_sessions(self, version: int) -> list[Server]:
        """Open one weight-update session on every server to sync; the servers that opened one.

        A refusal is taken for a session left open (by a trainer that died mid-update, or an update
        the server was dropped from): it is closed and opened once more. A server that still fails
        is dropped. None opened: ``RolloutError``, nothing changed.
        """
        pool = self.pool
        path = protocol.BEGIN_WEIGHT_UPDATE_PATH
        outcomes = await self._admin_all(path, lambda i, s: protocol.begin_weight_update_body(),
                                         servers=pool.syncable())
        opened = [server for server, outcome in outcomes if answer_failure(outcome) is None]
        failed = [(server, str(outcome)) for server, outcome in outcomes if isinstance(outcome, ServerFault)]
        refused = [server for server, outcome in outcomes
                   if not isinstance(outcome, ServerFault) and answer_failure(outcome) is not None]
        if refused:
            closed = []
            async with pool.client() as client:
                for server, outcome in zip(refused, await asyncio.gather(
                        *(pool.close_stale_session(client, server) for server in refused), return_exceptions=True)):
                    if isinstance(outcome, BaseException) and not isinstance(outcome, ServerFault):
                        raise outcome
                    if isinstance(outcome, ServerFault):
                        failed.append((server, str(outcome)))
                    else:
                        closed.append(server)
            if closed:
                reopened, still = await self._admin_checked(path, lambda i, s: protocol.begin_weight_update_body(),
                                                            servers=closed)
                opened += reopened
                failed += still
        for server, why in failed:
            pool.drop(server, f"{path} for version {version} failed: {why}")
        if not opened:
            raise RolloutError(f"{path} for version {version} failed on every server (version unchanged): "
                               f"{pool.dead_servers}")
        order = {server.url: index for index, server in enumerate(pool.servers)}
        return sorted(opened, key=lambda server: order[server.url])

    def _announce(self, servers: Sequence[Server], body: dict[str, Any], *, version: int,
                  failed: threading.Event) -> tuple[list[tuple[Server, str]], list[str]]:
        """Announce one bucket to ``servers``; they then receive its broadcast. ``(unreachable, refused)``.

        Never retried. ``failed`` is set the moment one call fails, so the broadcast waiting for that
        server is abandoned then, not at the collective timeout. An unreachable server (no answer
        within ``admin_timeout_s``) is dropped from the session.
        """
        pool = self.pool
        path = protocol.UPDATE_FROM_DISTRIBUTED_PATH

        async def one(client: httpx.AsyncClient, server: Server) -> httpx.Response:
            try:
                response = await call(client, "POST", server.url + path, body=body,
                                      timeout_s=pool.config.admin_timeout_s)
            except (ServerFault, Rejected):
                failed.set()
                raise
            if answer_failure(response) is not None:
                failed.set()
            return response

        async def run() -> tuple[list[tuple[Server, str]], list[str]]:
            async with pool.client() as client:
                outcomes = await asyncio.gather(*(one(client, s) for s in servers), return_exceptions=True)
            unreachable: list[tuple[Server, str]] = []
            refused: list[str] = []
            for server, outcome in zip(servers, outcomes):
                if isinstance(outcome, BaseException) and not isinstance(outcome, (ServerFault, Rejected)):
                    raise outcome
                if isinstance(outcome, ServerFault):
                    self._drop_from_session(server, f"unreachable during the update to version {version}: {outcome}")
                    unreachable.append((server, str(outcome)))
                    continue
                failure = answer_failure(outcome)
                if failure is not None:
                    refused.append(f"{server.url}: {failure}")
            return unreachable, refused

        return run_sync(run())

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
        attempts: int | None = None,
    ) -> httpx.Response:
        """POST with retries (``attempts``, default ``max_attempts``) and backoff on server faults; the last fault
        or a rejection propagates."""
        cfg = self.pool.config
        attempts = cfg.max_attempts if attempts is None else attempts
        for attempt in range(1, attempts + 1):
            try:
                return await call(client, "POST", server.url + path, body=body, timeout_s=cfg.admin_timeout_s,
                                  retry_statuses=retry_statuses)
            except ServerFault:
                if attempt == attempts:
                    raise
                await asyncio.sleep(min(cfg.backoff_initial_s * 2 ** (attempt - 1), cfg.backoff_max_s))
        raise AssertionError("unreachable")

    async def _admin_all(
        self, path: str, body_for: Callable[[int, Server], Any], *, servers: Sequence[Server],
        retry_statuses: frozenset[int] = frozenset(), attempts: int | None = None,
    ) -> list[tuple[Server, httpx.Response | Exception]]:
        targets = list(servers)
        if not targets:
            raise RolloutError(f"no live SGLang server for {path}; dropped: {self.pool.dead_servers}")
        async with self.pool.client() as client:
            outcomes = await asyncio.gather(
                *(self._admin_one(client, s, path, body_for(i, s), retry_statuses=retry_statuses, attempts=attempts)
                  for i, s in enumerate(targets)),
                return_exceptions=True,
            )
        for outcome in outcomes:
            if isinstance(outcome, BaseException) and not isinstance(outcome, (ServerFault, Rejected)):
                raise outcome
        return list(zip(targets, outcomes))  # type: ignore[arg-type]

    async def _admin_checked(
        self, path: str, body_for: Callable[[int, Server], Any], *, servers: Sequence[Server],
        attempts: int | None = None,
    ) -> tuple[list[Server], list[tuple[Server, str]]]:
        """POST to the servers; ``(succeeded, [(failed, why)])`` by their ``{success, message}`` answers."""
        succeeded: list[Server] = []
        failed: list[tuple[Server, str]] = []
        for server, outcome in await self._admin_all(path, body_for, servers=servers, attempts=attempts):
            failure = answer_failure(outcome)
            if failure is None:
                succeeded.append(server)
            else:
                failed.append((server, failure))
        return succeeded, failed
