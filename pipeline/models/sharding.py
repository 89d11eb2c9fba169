"""Slice a full (TP=1, PP=1) megatron state dict into one rank's shard of a ``GPTModel``.

The layout is read from the model itself, not from a table of names:

* pipeline position: ``decoder.layers.<i>`` of a stage is global layer
  ``layers[i].layer_number - 1`` (megatron numbers layers from 1 across stages);
* tensor-parallel split: megatron marks every split parameter with
  ``tensor_model_parallel``, ``partition_dim`` and ``partition_stride``. A
  parameter of stride ``s`` is the concatenation of ``s`` blocks per rank, taken
  round-robin (SwiGLU's ``linear_fc1`` has stride 2: each rank holds
  ``[gate_r; up_r]``), exactly as ``_initialize_affine_weight_cpu`` slices a
  master weight. Unmarked parameters (norms) are replicated. megatron-core
  0.16.1 sets these marks inside its weight initializers only, which is why
  ``build_transformer_config`` refuses ``perform_initialization=False``.

With tied embeddings, a last pipeline stage owns its own copy of the output
weight (``output_layer.weight``) that megatron keeps equal to the embedding; a
full state dict of a tied model has no such key, so the embedding is used.
"""

from __future__ import annotations

import re

import torch
from megatron.core.models.gpt import GPTModel

__all__ = ["global_parameter_name", "shard_full_state_dict"]

_LAYER_PREFIX = re.compile(r"^decoder\.layers\.(\d+)\.")
_TIED_OUTPUT = "output_layer.weight"
_EMBEDDING = "embedding.word_embeddings.weight"


def global_parameter_name(model: GPTModel, name: str) -> str:
    """The name ``name`` (local to this pipeline stage) has in a full, unsplit model."""
    match = _LAYER_PREFIX.match(name)
    if match is None:
        return name
    global_index = model.decoder.layers[int(match.group(1))].layer_number - 1
    return f"decoder.layers.{global_index}.{name[match.end():]}"


def shard_full_state_dict(
    model: GPTModel,
    full_state_dict: dict[str, torch.Tensor],
    *,
    tp_rank: int,
    tp_size: int,
) -> dict[str, torch.Tensor]:
    """This rank's ``state_dict`` for ``model`` cut from ``full_state_dict``.

    Non-parameter entries of the model's own state dict (buffers, Transformer
    Engine ``_extra_state``) are kept as they are: they are run state, not weights.
    The result loads with ``model.load_state_dict(..., strict=True)``.
    """
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank: {tp_rank} is outside [0, tp_size={tp_size})")
    parameters = dict(model.named_parameters())
    local: dict[str, torch.Tensor] = {}
    for name, value in model.state_dict(keep_vars=True).items():
        if name not in parameters:
            local[name] = value
            continue
        full_name = global_parameter_name(model, name)
        if full_name not in full_state_dict and full_name == _TIED_OUTPUT and model.share_embeddings_and_output_weights:
            full_name = _EMBEDDING
        if full_name not in full_state_dict:
            raise ValueError(f"full_state_dict: missing {full_name!r} (needed for this rank's {name!r})")
        local[name] = _tp_shard(
            full_state_dict[full_name], like=value, name=full_name, tp_rank=tp_rank, tp_size=tp_size
        )
    return local


def _tp_shard(
    full: torch.Tensor, *, like: torch.nn.Parameter, name: str, tp_rank: int, tp_size: int
) -> torch.Tensor:
    if not getattr(like, "tensor_model_parallel", False):
        if full.shape != like.shape:
            raise ValueError(f"{name}: shape {tuple(full.shape)} != model's {tuple(like.shape)}")
        return full
    dim = like.partition_dim
    stride = like.partition_stride
    expected = list(like.shape)
    expected[dim] *= tp_size
    if list(full.shape) != expected:
        raise ValueError(
            f"{name}: shape {tuple(full.shape)} != {tuple(expected)} "
            f"(model shard {tuple(like.shape)} x tensor_parallel={tp_size} along dim {dim})"
        )
    block = like.shape[dim] // stride
    return torch.cat(full.split(block, dim=dim)[tp_rank::tp_size], dim=dim)
