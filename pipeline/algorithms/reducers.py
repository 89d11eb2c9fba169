"""Reducers: how pure loss/log-prob code combines values held by several ranks.

Algorithm code never imports ``torch.distributed``. Where a value is spread over
ranks (a vocabulary sharded across tensor-parallel ranks, tokens spread across
data-parallel ranks) the caller injects a reducer. ``LocalReducer`` is the
single-process identity; ``pipeline.parallel.reducers`` supplies the
distributed ones.

Autograd contract of ``sum``: forward all-reduces, backward passes the gradient
through unchanged. Every rank computes the same replicated result from the
reduced value, so the gradient w.r.t. its local contribution is exactly the
gradient of the replicated output (Megatron's "reduce from model-parallel
region" semantics). ``max`` is used only for numerical shifts and carries no
gradient.
"""

from __future__ import annotations

from typing import Protocol

import torch


class Reducer(Protocol):
    def sum(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def max(self, tensor: torch.Tensor) -> torch.Tensor: ...


class LocalReducer:
    """The identity reducer for a value that lives whole in this process."""

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def max(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach()


LOCAL = LocalReducer()
