"""The collectives of a weight sync: the TP gather of one parameter, the stage-to-rank-0 relay, the update group.

A sync streams the actor's weights out one parameter at a time (``pipeline.rollout.weight_export``
drives it); this module holds every communication it needs, so the rollout floor never
touches ``torch.distributed``. Sizes below are for a 7B model (Qwen2.5-7B: 7.6·10⁹
parameters, bf16, largest tensor the 152,064 × 3,584 embedding = 1.09 GB) on 8×H100 at
TP = 4, PP = 2, DP = 1, with the default 512 MB bucket.

* ``gather_tp_shards``: one parameter's shards onto TP rank 0 of its group (``dist.gather``).
  At most one unsharded parameter is in flight per TP group: ≤ 1.09 GB on TP rank 0 (the
  embedding), the parameter's shard size (≤ 272 MB) sent by each other rank. Over a whole
  sync each TP group moves its stage's share of the model once: 15.2 GB / PP = 7.6 GB into
  each stage's TP rank 0, (TP − 1)/TP of it over NVLink.
* ``BucketRelay``: the buckets of pipeline stages 1 … PP − 1 to global rank 0 (the one rank
  that talks to an in-process engine or leads the update group), point to point: a pickled
  header of names, shapes and dtypes (a few kB), then each tensor with ``send``/``recv`` on the
  tensors' device. Rank 0 receives (PP − 1)/PP of the model per sync (7.6 GB at PP = 2) and
  holds one received bucket (≤ 512 MB) at a time.
* ``UpdateGroup``: the process group between the trainer's rank 0 (group rank 0) and the
  rollout servers' GPUs (ranks 1 …), apart from the training world, formed the way SGLang's
  ``init_weights_update_group`` forms its side (a TCP rendezvous at ``master_address:port``,
  the group's store prefixed with its name), so the two sides meet. ``broadcast`` sends one
  bucket tensor by tensor from rank 0: the whole model, 15.2 GB, per sync, to every server.
  NCCL on GPU, gloo on CPU.
* ``sync_gather`` / ``sync_broadcast``: small control objects (a sync's plan, the file lists
  of a disk export: a few kB) over the training world: ``pipeline.parallel.rendezvous``'s
  ``gather_to_rank0`` / ``broadcast_from_rank0``, offered here under the sync's names.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

# A sync's control objects travel through the rank-0 object collectives of ``rendezvous``.
from pipeline.parallel.rendezvous import broadcast_from_rank0 as sync_broadcast
from pipeline.parallel.rendezvous import gather_to_rank0 as sync_gather

__all__ = [
    "BucketRelay",
    "UpdateGroup",
    "export_role",
    "gather_tp_shards",
    "sync_broadcast",
    "sync_gather",
]


@dataclass(frozen=True, slots=True)
class ExportRole:
    """What one rank does in a sync.

    ``exports``: it belongs to the TP groups that assemble the weights (data-parallel and
    context-parallel replicas hold copies and take no part). ``source``: it is TP rank 0 of
    such a group, so it holds each assembled parameter. ``stage_sources``: the global ranks of
    every stage's source, in stage order (stage 0's is global rank 0).
    """

    exports: bool
    source: bool
    stage_sources: tuple[int, ...]


def export_role(context) -> ExportRole:
    """This rank's ``ExportRole`` (no communication)."""
    exports = context.dp_rank == 0 and context.cp_rank == 0
    source = exports and context.tp_rank == 0
    if context.world_size == 1:
        return ExportRole(exports=True, source=True, stage_sources=(0,))
    # Global rank 0 is (tp, dp, cp) = 0; its pipeline group is exactly the stages' sources.
    pipeline = tuple(dist.get_process_group_ranks(context.pp_group)) if source else ()
    return ExportRole(exports=exports, source=source, stage_sources=pipeline)


def gather_tp_shards(shard: torch.Tensor, *, context) -> list[torch.Tensor] | None:
    """Every TP rank's shard of one parameter, in TP rank order, on TP rank 0; ``None`` elsewhere.

    All ranks of the TP group call it with the same parameter (megatron shards equally, so
    the shapes agree). Size: one unsharded parameter on TP rank 0.
    """
    if context.tensor_parallel == 1:
        return [shard]
    group = context.tp_group
    shard = shard.detach().contiguous()
    dst = dist.get_global_rank(group, 0)
    if context.tp_rank == 0:
        shards = [torch.empty_like(shard) for _ in range(context.tensor_parallel)]
        dist.gather(shard, shards, dst=dst, group=group)
        return shards
    dist.gather(shard, None, dst=dst, group=group)
    return None


class BucketRelay:
    """Buckets from the source rank of a later pipeline stage to global rank 0, in order.

    A bucket is a list of ``(name, tensor)``; ``finish`` sends the end marker. The header
    travels as a pickled object between ranks of one training job (trusted peers), the
    tensors as tensors on ``device``.
    """

    def __init__(self, *, device: torch.device) -> None:
        self.device = device

    def send(self, bucket: Sequence[tuple[str, torch.Tensor]]) -> None:
        header = [[(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in bucket]]
        dist.send_object_list(header, dst=0, device=self.device)
        for _, tensor in bucket:
            dist.send(tensor.contiguous(), dst=0)

    def finish(self) -> None:
        dist.send_object_list([None], dst=0, device=self.device)

    def receive(self, src: int) -> list[tuple[str, torch.Tensor]] | None:
        """The next bucket from global rank ``src``; ``None`` once it finished."""
        header: list[Any] = [None]
        dist.recv_object_list(header, src=src, device=self.device)
        if header[0] is None:
            return None
        bucket = []
        for name, shape, dtype in header[0]:
            tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=self.device)
            dist.recv(tensor, src=src)
            bucket.append((name, tensor))
        return bucket


class UpdateGroup:
    """A process group outside the training world: trainer rank 0 plus the rollout servers' ranks.

    ``join`` blocks until all ``world_size`` members joined (the servers join when they get
    ``init_weights_update_group``). The group is registered with identity rank maps, as
    SGLang registers its side, so ``src=0`` means group rank 0 on every member.
    """

    def __init__(self, group: dist.ProcessGroup | None, *, name: str, rank: int, world_size: int, backend: str) -> None:
        self.group = group
        self.name = name
        self.rank = rank
        self.world_size = world_size
        self.backend = backend

    @classmethod
    def join(cls, *, master_address: str, master_port: int, rank: int, world_size: int, name: str,
             backend: str, timeout_s: float) -> UpdateGroup:
        timeout = datetime.timedelta(seconds=timeout_s)
        # The store is made here, not by ``c10d.rendezvous``: in a torchrun rank (TORCHELASTIC_USE_AGENT_STORE
        # set) that would make rank 0 a client of the training job's agent store, and the servers, which
        # connect to master_port, would wait for a store nobody serves.
        store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout,
                              wait_for_workers=False, multi_tenant=True)
        store = c10d.PrefixStore(name, store)
        group, _ = c10d._new_process_group_helper(world_size, rank, [], backend, store, group_name=name,
                                                  timeout=timeout)
        c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
        return cls(group, name=name, rank=rank, world_size=world_size, backend=backend)

    def broadcast(self, tensors: Sequence[torch.Tensor]) -> None:
        """Each tensor from group rank 0 to every member, in order (receivers pass empty tensors)."""
        handles = [dist.broadcast(t, src=0, group=self.group, async_op=True) for t in tensors]
        for handle in handles:
            handle.wait()

    def destroy(self) -> None:
        """Leave the group; members blocked in a broadcast of it fail instead of waiting."""
        if self.group is None:
            return
        group, self.group = self.group, None
        # abort() closes the connections now; destroy alone would leave them open until the
        # object is collected, and a surviving member would wait out the whole timeout.
        group.abort()
        try:
            dist.destroy_process_group(group)
        except (RuntimeError, ValueError, KeyError):
            c10d._world.pg_group_ranks.pop(group, None)
