"""How one process joins (or forms) its process group, and the rank-0 object collectives.

* ``reserved_port`` / ``reserved_port_block``: ports for a rendezvous (spawned ranks, an update
  group, local servers) that nothing else on the machine can take before their server binds them.
  ``free_port`` only says a port is free now; keep it for ports nothing will listen on.
* ``single_process_rendezvous``: the rendezvous of a one-rank process that was not started by
  ``torchrun`` (``winnow rl`` on a laptop, a test, a benchmark): an in-process store, no port.
* ``initialize_process_context``: the one way a stage brings up megatron for this process:
  ``torchrun``'s environment when it launched us, else a one-rank gloo/nccl group.
* ``broadcast_from_rank0`` / ``gather_to_rank0``: pickled Python objects between global
  rank 0 (which drives the rollout engine) and the others. Both are no-ops at world size 1.
  They carry control data and graded rollouts (kilobytes to a few MB per step); weights
  never travel through them at scale.
* ``all_gather_objects``: every rank's small object on every rank (the checkpoint manager's
  agreement on whether a save failed: one short string or ``None`` per rank).
* ``single_rank_megatron``: megatron on a one-rank group for work that runs in one process
  (checkpoint conversion, loading a winnow checkpoint to evaluate), reusing the process's own
  when it already has one.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

if TYPE_CHECKING:
    from pipeline.parallel.context import ParallelContext

__all__ = [
    "all_gather_objects",
    "broadcast_from_rank0",
    "free_port",
    "gather_to_rank0",
    "initialize_process_context",
    "process_group_initialized",
    "reserved_port",
    "reserved_port_block",
    "single_process_rendezvous",
    "single_rank_megatron",
]


def free_port() -> int:
    """A TCP port on 127.0.0.1 free right now; any process may take it a moment later (see ``reserved_port``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _hold(port: int) -> socket.socket | None:
    """A socket holding ``port`` on every address, or ``None`` when anyone else has it (held or listening).

    The bind is exclusive (it fails on a port anyone holds, another reservation included); SO_REUSEADDR,
    set only after it, then lets a server that sets it too bind and listen beside this unlistening socket:
    c10d's TCPStore (libuv and legacy), the stdlib's HTTPServer and uvicorn all do. Until the socket is
    closed the kernel gives the port to no ``bind(0)`` and no outgoing connection on the machine.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("", port))
    except OSError:
        sock.close()
        return None
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    return sock


@contextmanager
def reserved_port() -> Iterator[int]:
    """A TCP port that no other process can take until the block ends, while its server may bind it.

    A rendezvous port passes from the process that picks it to the one whose server binds it
    (rank 0 of spawned ranks: seconds later, after importing torch and megatron). A port that was
    only free when picked can meanwhile go to any ``bind(0)`` or outgoing connection on the machine,
    and rank 0 then fails with EADDRINUSE: a flaky run whenever a busy neighbour (a rehearsal's
    hundreds of HTTP connections) shares the machine. Keep the block open until the ranks are done.
    """
    sock = _hold(0)
    if sock is None:
        raise OSError("no local TCP port could be reserved")
    try:
        yield sock.getsockname()[1]
    finally:
        sock.close()


# A block for local servers is searched below the kernel's ephemeral ports (32768-60999 on Linux),
# where outgoing connections are not assigned in the first place, and apart from the test cluster's
# daemon ports (20000-30000).
BLOCK_PORTS = (10_000, 20_000)


@contextmanager
def reserved_port_block(count: int, *, start: int | None = None) -> Iterator[int]:
    """The first of ``count`` consecutive ports, all reserved (``reserved_port``) until the block ends.

    The search begins at ``start`` (default: a place of this process's own, so concurrent searchers
    rarely probe the same ports) and wraps within ``BLOCK_PORTS``.
    """
    low, high = BLOCK_PORTS
    if not 0 < count < high - low:
        raise ValueError(f"count: expected 1..{high - low - 1} ports, got {count}")
    span = high - low - count
    first = low + ((os.getpid() * 97) if start is None else start - low) % span
    for offset in range(span):
        base = low + (first - low + offset) % span
        held: list[socket.socket] = []
        for port in range(base, base + count):
            sock = _hold(port)
            if sock is None:
                break
            held.append(sock)
        if len(held) == count:
            try:
                yield base
            finally:
                for sock in held:
                    sock.close()
            return
        for sock in held:
            sock.close()
    raise OSError(f"no {count} free consecutive ports between {low} and {high}")


def single_process_rendezvous() -> dict[str, Any]:
    """rank/world for a one-process run outside torchrun (torchrun's environment wins: ``{}``).

    No address: ``ParallelContext.initialize`` gives a one-rank group an in-process store.
    """
    if "RANK" in os.environ:
        return {}
    return {"rank": 0, "world_size": 1}


def process_group_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def initialize_process_context(*, tensor_parallel: int = 1, pipeline_parallel: int = 1, seed: int = 0,
                               backend: str | None = None, timeout_minutes: int | None = None):
    """This process's ``ParallelContext``: from torchrun's environment, or a fresh one-rank group.

    ``backend=None`` picks nccl with CUDA and gloo without (``ParallelContext.initialize``);
    ``timeout_minutes=None`` keeps its default collective timeout (an rl run passes
    ``pipeline.config.collective_timeout_minutes``).
    """
    from pipeline.parallel.context import ParallelContext

    exit_with_torchrun()
    timeout = {} if timeout_minutes is None else {"timeout_minutes": timeout_minutes}
    return ParallelContext.initialize(tensor_parallel=tensor_parallel, pipeline_parallel=pipeline_parallel,
                                      seed=seed, backend=backend, **timeout, **single_process_rendezvous())


def exit_with_torchrun() -> bool:
    """A rank torchrun started dies with torchrun (``lifetime.exit_with_parent``); returns whether it was one.

    torchrun SIGKILLed tells its ranks nothing, and it starts each in a session of its own, so
    killing its process group misses them. Only torchrun's ranks (``TORCHELASTIC_RUN_ID`` set):
    a process started from a shell must outlive the shell (``nohup``, a closed terminal).
    """
    from pipeline.parallel.lifetime import exit_with_parent

    if not os.environ.get("TORCHELASTIC_RUN_ID"):
        return False
    exit_with_parent(parent_pid=None)
    return True


def broadcast_from_rank0(payload: Any, *, world_size: int) -> Any:
    """Global rank 0's ``payload`` on every rank (what other ranks pass is ignored)."""
    if world_size == 1:
        return payload
    box = [payload]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_to_rank0(payload: Any, *, rank: int, world_size: int) -> list[Any] | None:
    """Every rank's ``payload`` in rank order on global rank 0; ``None`` on the others."""
    if world_size == 1:
        return [payload]
    gathered: list | None = [None] * world_size if rank == 0 else None
    dist.gather_object(payload, gathered, dst=0)
    return gathered


def all_gather_objects(payload: Any, *, world_size: int) -> list[Any]:
    """Every rank's ``payload`` in rank order, on every rank (no communication at world size 1)."""
    if world_size == 1:
        return [payload]
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, payload)
    return gathered


@contextmanager
def single_rank_megatron(seed: int, *, purpose: str = "this",
                         backend: str | None = None) -> Iterator[ParallelContext | None]:
    """A one-rank megatron layout (TP = PP = 1) for this process: reused if the process already has one.

    Without one, a one-rank group (an in-process store, no port) is brought up (``backend``; ``None`` picks nccl
    with CUDA, else gloo; torchrun's environment is ignored: the work is this process's alone),
    yielded as its ``ParallelContext`` and torn down on exit; a reused layout yields ``None``
    (its owner holds the context; models built without one are TP = PP = 1 on this process's
    device). A process that already runs megatron or torch.distributed on more than one rank
    is refused with a ``UserError`` naming ``purpose``: megatron cannot be initialized twice.
    """
    from megatron.core import parallel_state

    from pipeline.errors import UserError
    from pipeline.parallel.context import ParallelContext

    # A host process (a test session, a driver that already trains) may own the process group.
    if parallel_state.model_parallel_is_initialized():
        sizes = (
            dist.get_world_size(),
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
        )
        if sizes != (1, 1, 1):
            raise UserError(
                f"{purpose} needs a one-rank process; this one already runs megatron on {sizes[0]} ranks "
                f"(TP={sizes[1]}, PP={sizes[2]})"
            )
        yield None
        return
    if dist.is_initialized() and dist.get_world_size() != 1:
        raise UserError(
            f"{purpose} needs a one-rank process; this one is part of a {dist.get_world_size()}-rank group"
        )
    context = ParallelContext.initialize(
        tensor_parallel=1,
        pipeline_parallel=1,
        seed=seed,
        rank=0,
        world_size=1,
        local_rank=0,
        backend=backend,
    )
    try:
        yield context
    finally:
        context.destroy()
