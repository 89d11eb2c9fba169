"""``ParallelContext``: the one object through which winnow touches process groups.

``ParallelContext.initialize`` brings up ``torch.distributed`` (from torchrun's
environment or an explicit rank/world/address), turns on the CPU compatibility
layer when there is no CUDA, initializes megatron-core's ``parallel_state`` and
seeds the random generators. The backend decides where this rank's tensors live
(``device_for_backend``): NCCL on this rank's GPU, gloo on the CPU, also on a CUDA
machine, where the compatibility layer then keeps megatron's own allocations on the CPU
too. Everything the trainer needs from the process
layout (ranks, sizes, groups, pipeline position, this rank's vocabulary shard,
reducers) is a property or method here, so no other module imports
``parallel_state``.

Megatron's layout order is the default ``tp-cp-ep-dp-pp``: tensor-parallel
ranks are adjacent global ranks and pipeline stages are the outermost split.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

from pipeline.parallel import cpu_compat, reducers
from pipeline.parallel.reducers import GroupReducer

__all__ = ["ParallelContext", "device_for_backend"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelContext:
    """Sizes and ranks of an initialized megatron process layout; groups are looked up live.

    Build it with ``ParallelContext.initialize``; the constructor only records values.
    """

    rank: int
    world_size: int
    local_rank: int
    backend: str
    seed: int
    tensor_parallel: int
    pipeline_parallel: int
    data_parallel: int
    context_parallel: int
    # Where this rank's model, batches and every collective's tensors live: cuda:local_rank
    # under NCCL, the CPU under gloo (device_for_backend). Fixed at initialization; the
    # collectives below check it.
    device: torch.device
    owns_process_group: bool = field(repr=False)
    enabled_cpu_compat: bool = field(repr=False)

    @classmethod
    def initialize(
        cls,
        *,
        tensor_parallel: int,
        pipeline_parallel: int,
        seed: int,
        data_parallel: int | None = None,
        context_parallel: int = 1,
        backend: str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        local_rank: int | None = None,
        master_addr: str | None = None,
        master_port: int | None = None,
        timeout_minutes: int = 30,
    ) -> ParallelContext:
        """Initialize ``torch.distributed`` (unless already up), megatron ``parallel_state`` and RNGs.

        ``rank``/``world_size``/``local_rank``/``master_addr``/``master_port``
        default to torchrun's ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
        ``MASTER_ADDR`` and ``MASTER_PORT``; a one-rank group needs no address (an
        in-process store). An already initialized default
        process group is reused (and then left alone by ``destroy``).
        ``data_parallel`` is derived as ``world_size / (TP * PP * CP)``; when
        given it must match. ``backend`` defaults to NCCL with CUDA, gloo without; it
        decides ``device`` (``device_for_backend``).
        """
        for name, value in (
            ("tensor_parallel", tensor_parallel),
            ("pipeline_parallel", pipeline_parallel),
            ("context_parallel", context_parallel),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        has_cuda = torch.cuda.is_available()
        backend = backend or ("nccl" if has_cuda else "gloo")
        device_for_backend(backend, local_rank=0, has_cuda=has_cuda)  # an unusable backend fails before any I/O

        owns_process_group = not dist.is_initialized()
        if owns_process_group:
            rank = _from_env(rank, "RANK")
            world_size = _from_env(world_size, "WORLD_SIZE")
            if rank is None or world_size is None:
                raise ValueError(
                    "rank/world_size: pass them or launch under torchrun (RANK and WORLD_SIZE unset)"
                )
            master_addr = master_addr or os.environ.get("MASTER_ADDR")
            master_port = master_port or _from_env(None, "MASTER_PORT")
            if (master_addr is None or master_port is None) and world_size != 1:
                raise ValueError("master_addr/master_port: pass them or set MASTER_ADDR and MASTER_PORT")
        else:
            if rank is not None and rank != dist.get_rank():
                raise ValueError(f"rank: {rank} differs from the initialized process group's {dist.get_rank()}")
            rank, world_size, backend = dist.get_rank(), dist.get_world_size(), dist.get_backend()
        local_rank = _from_env(local_rank, "LOCAL_RANK")
        local_rank = rank if local_rank is None else local_rank

        # Validate the layout before bringing anything up.
        model_parallel = tensor_parallel * pipeline_parallel * context_parallel
        if world_size % model_parallel:
            raise ValueError(
                f"tensor_parallel*pipeline_parallel*context_parallel = {model_parallel} does not "
                f"divide world_size={world_size}"
            )
        derived_data_parallel = world_size // model_parallel
        if data_parallel is not None and data_parallel != derived_data_parallel:
            raise ValueError(
                f"data_parallel: {data_parallel} != world_size / (TP*PP*CP) = {derived_data_parallel}"
            )

        device = device_for_backend(backend, local_rank=local_rank, has_cuda=has_cuda)
        if device.type == "cuda":
            # NCCL binds a communicator to the current device at first use, and megatron
            # allocates on torch.cuda.current_device(): both must be this rank's GPU, also
            # when someone else brought the process group up.
            torch.cuda.set_device(local_rank)
        if owns_process_group:
            # A one-rank group without an address meets nobody: an in-process store, no port to race for.
            rendezvous = ({"init_method": f"tcp://{master_addr}:{master_port}"}
                          if master_addr is not None and master_port is not None else {"store": dist.HashStore()})
            dist.init_process_group(
                backend=backend,
                rank=rank,
                world_size=world_size,
                timeout=timedelta(minutes=timeout_minutes),
                **rendezvous,
            )
        enabled_cpu_compat = False
        if device.type == "cpu":
            enabled_cpu_compat = not cpu_compat.is_enabled()
            cpu_compat.enable(with_cuda=True)  # a gloo context on a CUDA machine computes on the CPU too
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tensor_parallel,
            pipeline_model_parallel_size=pipeline_parallel,
            context_parallel_size=context_parallel,
            distributed_timeout_minutes=timeout_minutes,
        )
        context = cls(
            rank=rank,
            world_size=world_size,
            local_rank=local_rank,
            backend=backend,
            seed=seed,
            tensor_parallel=tensor_parallel,
            pipeline_parallel=pipeline_parallel,
            data_parallel=derived_data_parallel,
            context_parallel=context_parallel,
            device=device,
            owns_process_group=owns_process_group,
            enabled_cpu_compat=enabled_cpu_compat,
        )
        context.reseed(seed)
        logger.info("initialized %s", context)
        return context

    def reseed(self, seed: int) -> None:
        """Seed the default CPU generator and megatron's (CUDA) RNG tracker."""
        # CPU-side initialization (use_cpu_initialization) draws from the default CPU
        # generator, which must agree across tensor-parallel ranks so that each one
        # slices the same master weight.
        torch.manual_seed(seed)
        # On the CPU there are no CUDA generators to fork (the compatibility layer saves
        # an empty CUDA state), so megatron's "inference" tracker (fork is a no-op) is the
        # only one that works. Consequence: dropout inside tensor-parallel regions draws
        # the same mask on every TP rank on CPU.
        model_parallel_cuda_manual_seed(
            seed, inference_rng_tracker=self.device.type == "cpu", force_reset_rng=True
        )

    def destroy(self) -> None:
        """Tear down megatron's groups, and what ``initialize`` itself brought up."""
        parallel_state.destroy_model_parallel()
        if self.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
        if self.enabled_cpu_compat:
            cpu_compat.disable()

    # Ranks within the groups.

    @property
    def tp_rank(self) -> int:
        return parallel_state.get_tensor_model_parallel_rank()

    @property
    def pp_rank(self) -> int:
        return parallel_state.get_pipeline_model_parallel_rank()

    @property
    def dp_rank(self) -> int:
        return parallel_state.get_data_parallel_rank()

    @property
    def cp_rank(self) -> int:
        return parallel_state.get_context_parallel_rank()

    @property
    def is_pipeline_first(self) -> bool:
        return parallel_state.is_pipeline_first_stage(ignore_virtual=True)

    @property
    def is_pipeline_last(self) -> bool:
        return parallel_state.is_pipeline_last_stage(ignore_virtual=True)

    # Process groups.

    @property
    def tp_group(self) -> dist.ProcessGroup:
        return parallel_state.get_tensor_model_parallel_group()

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return parallel_state.get_pipeline_model_parallel_group()

    @property
    def dp_group(self) -> dist.ProcessGroup:
        """Data-parallel replicas of this rank's model shard (context-parallel ranks excluded)."""
        return parallel_state.get_data_parallel_group()

    @property
    def dp_cp_group(self) -> dist.ProcessGroup:
        """Data-parallel x context-parallel ranks: all ranks holding tokens of other sequences/chunks."""
        return parallel_state.get_data_parallel_group(with_context_parallel=True)

    @property
    def model_parallel_group(self) -> dist.ProcessGroup:
        """TP x PP ranks that together hold one full model (for global grad norms)."""
        return parallel_state.get_model_parallel_group()

    @property
    def embedding_group(self) -> dist.ProcessGroup | None:
        """First and last pipeline stage (tied embedding gradients); ``None`` off that group."""
        if not parallel_state.is_rank_in_embedding_group(ignore_virtual=True):
            return None
        return parallel_state.get_embedding_group()

    @property
    def pipeline_last_rank(self) -> int:
        """Global rank of the last pipeline stage in this rank's pipeline."""
        return parallel_state.get_pipeline_model_parallel_last_rank()

    # Vocabulary sharding and reducers.

    def vocab_range(self, vocab_size: int) -> tuple[int, int]:
        """``[start, end)`` of the vocabulary held by this TP rank (megatron's equal contiguous split)."""
        if vocab_size % self.tensor_parallel:
            raise ValueError(
                f"vocab_size: {vocab_size} is not divisible by tensor_parallel={self.tensor_parallel}"
            )
        per_rank = vocab_size // self.tensor_parallel
        start = self.tp_rank * per_rank
        return start, start + per_rank

    def tp_vocab_reducer(self) -> GroupReducer:
        """``Reducer`` across the vocabulary shards of the tensor-parallel group."""
        return GroupReducer(self.tp_group, device=self.device)

    def dp_sum(self, tensor: torch.Tensor, *, with_context_parallel: bool = False) -> torch.Tensor:
        """Sum of a metric or normalizer over data-parallel ranks (detached; input untouched).

        ``with_context_parallel=True`` also sums over context-parallel ranks, for
        per-token counts whose tokens are split across them.
        """
        group = self.dp_cp_group if with_context_parallel else self.dp_group
        return reducers.all_reduce(tensor.detach().clone(), op=dist.ReduceOp.SUM, group=group, device=self.device,
                                   name="dp_sum")

    def world_min(self, tensor: torch.Tensor) -> torch.Tensor:
        """Minimum over every rank (detached; input untouched): e.g. a step all ranks skip together."""
        return reducers.all_reduce(tensor.detach().clone(), op=dist.ReduceOp.MIN, group=None, device=self.device,
                                   name="world_min")

    def broadcast_from_last_stage(self, tensor: torch.Tensor) -> torch.Tensor:
        """Broadcast in place from the last pipeline stage (losses live only there) to the others."""
        reducers.check_device(tensor, self.device, op="broadcast_from_last_stage")
        if self.pipeline_parallel > 1:
            reducers.broadcast(tensor, src=self.pipeline_last_rank, group=self.pp_group, device=self.device,
                               name="broadcast_from_last_stage")
        return tensor

    def broadcast_object_from_last_stage(self, payload: object) -> object:
        """A picklable object from the last pipeline stage to every stage of this pipeline.

        torch pickles it through a tensor on the current device (set to ``device`` at
        initialization, so NCCL gets a CUDA tensor).
        """
        if self.pipeline_parallel == 1:
            return payload
        box = [payload]
        dist.broadcast_object_list(box, src=self.pipeline_last_rank, group=self.pp_group)
        return box[0]

    def barrier(self) -> None:
        dist.barrier()


def device_for_backend(backend: str, *, local_rank: int, has_cuda: bool) -> torch.device:
    """Where a rank's model and collective tensors live under ``backend``.

    NCCL reduces only CUDA tensors and gloo (in torch 2.11) only CPU ones
    (``ProcessGroupGloo::allreduce_coalesced: unsupported device type cuda``), so the
    backend decides the device, not whether the machine has a GPU: a gloo context on a
    CUDA machine (a one-rank checkpoint load, the CPU test fixtures) runs on the CPU.
    """
    if backend == "gloo":
        return torch.device("cpu")
    if backend == "nccl":
        if not has_cuda:
            raise ValueError("backend: 'nccl' needs CUDA; use 'gloo' on a CPU-only machine")
        return torch.device("cuda", local_rank)
    raise ValueError(f"backend: expected 'nccl' or 'gloo', got {backend!r}")


def _from_env(value: int | None, name: str) -> int | None:
    if value is not None:
        return value
    raw = os.environ.get(name)
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}: expected an integer environment variable, got {raw!r}") from None
