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
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["GroupReducer"]


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


class GroupReducer:
    """``Reducer`` over the ranks of ``group`` (see module docstring for the autograd contract)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.group_size = dist.get_world_size(group)

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.group_size == 1:
            return tensor
        return _AllReduceSumIdentityBackward.apply(tensor, self.group)

    def max(self, tensor: torch.Tensor) -> torch.Tensor:
        reduced = tensor.detach().clone()
        if self.group_size > 1:
            dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=self.group)
        return reduced

    def __repr__(self) -> str:
        return f"GroupReducer(group_size={self.group_size})"
