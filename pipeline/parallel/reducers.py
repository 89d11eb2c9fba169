"""Distributed implementations of the ``Reducer`` protocol (``pipeline.algorithms.reducers``).

``GroupReducer`` combines a value spread over the ranks of one process group,
typically the tensor-parallel group holding vocabulary shards:

* ``sum``: all-reduce SUM in the forward pass; the backward pass is the
  identity. Every rank computes the same replicated result from the reduced
  value, so the upstream gradient it receives already is the gradient with
  respect to its own contribution (megatron's "reduce from tensor-model-parallel
  region"). Summing gradients across ranks here would multiply them by the
  group size.
* ``max``: all-reduce MAX of a detached copy; used for numerical shifts only
  (a shift cancels in exact arithmetic), so it carries no gradient.

Neither method modifies its input. A group of size one short-circuits to the
local behaviour without communication.

Every collective winnow issues itself goes through this module (``all_reduce``,
``broadcast``, ``GroupReducer``), and each first checks that its tensor lives on
the rank's device (``ParallelContext.device``). NCCL only moves CUDA tensors: a CPU
tensor handed to it fails deep inside torch ("no backend type associated with
device type cpu"). On CPU the same check runs against ``cpu``, so a CPU test that
builds a context whose device is ``cuda`` (no GPU needed) catches a tensor left
behind before it ever meets NCCL.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["DeviceMismatchError", "GroupReducer", "all_reduce", "broadcast", "check_device"]


class _AllReduceSumIdentityBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        del ctx
        reduced = tensor.clone()
        dist.all_reduce(reduced, op=dist.ReduceOp.SUM, group=group)
        return reduced

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        del ctx
        return grad_output, None


class DeviceMismatchError(RuntimeError):
    """A collective was handed a tensor that is not on this rank's device."""


def check_device(tensor: torch.Tensor, device: torch.device | None, *, op: str) -> None:
    """Raise ``DeviceMismatchError`` unless ``tensor`` is on ``device`` (``None``: no check).

    A device without an index (``cuda``) accepts any index of its type.
    """
    if device is None:
        return
    actual = tensor.device
    if actual.type != device.type or (device.index is not None and actual.index != device.index):
        raise DeviceMismatchError(
            f"{op}: tensor of shape {tuple(tensor.shape)} is on {actual}, but this rank's collectives run on "
            f"{device}; move it there first (NCCL refuses CPU tensors: 'no backend type associated with "
            f"device type cpu')"
        )


def all_reduce(tensor: torch.Tensor, *, op: dist.ReduceOp, group: dist.ProcessGroup | None,
               device: torch.device | None, name: str) -> torch.Tensor:
    """In-place ``dist.all_reduce`` of ``tensor`` after the device check; returns ``tensor``."""
    check_device(tensor, device, op=name)
    dist.all_reduce(tensor, op=op, group=group)
    return tensor


def broadcast(tensor: torch.Tensor, *, src: int, group: dist.ProcessGroup | None,
              device: torch.device | None, name: str) -> torch.Tensor:
    """In-place ``dist.broadcast`` from global rank ``src`` after the device check; returns ``tensor``."""
    check_device(tensor, device, op=name)
    dist.broadcast(tensor, src=src, group=group)
    return tensor


class GroupReducer:
    """``Reducer`` over the ranks of ``group`` (see module docstring for the autograd contract).

    ``device``: where the reduced tensors must live (``ParallelContext.device``); checked
    on every call, also for a group of one, so a CPU run exercises the check.
    """

    def __init__(self, group: dist.ProcessGroup, *, device: torch.device | None = None) -> None:
        self.group = group
        self.group_size = dist.get_world_size(group)
        self.device = device

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        check_device(tensor, self.device, op="GroupReducer.sum")
        if self.group_size == 1:
            return tensor
        return _AllReduceSumIdentityBackward.apply(tensor, self.group)

    def max(self, tensor: torch.Tensor) -> torch.Tensor:
        check_device(tensor, self.device, op="GroupReducer.max")
        reduced = tensor.detach().clone()
        if self.group_size > 1:
            dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=self.group)
        return reduced

    def __repr__(self) -> str:
        return f"GroupReducer(group_size={self.group_size})"
