"""Reference TP/PP/vocab sharding, written independently of ``pipeline.models.layout``.

Two oracles, each spelled differently from the production code it checks:

* model-driven (``shard_full_state_dict``): slices a full (TP=1, PP=1) megatron state dict
  into one rank's shard of a built ``GPTModel``, reading the layout from the model itself:
  the pipeline position from ``layers[i].layer_number`` (megatron numbers layers from 1
  across stages) and each parameter's ``partition_dim`` / ``partition_stride`` marks.
  Used by the TP/PP parity tests on gloo ranks.
* table-driven (``MEGATRON_PARTITIONS``, ``megatron_full_state``, ``stage_shard``): the
  same from a table of name suffixes, with loops for the fused q/k/v rows and the padded
  vocabulary, for fast pure-tensor checks at many layouts. ``tests/models/test_gpt_factory.py``
  checks the table against the marks of a real model.

Tensor-parallel slicing is written as megatron's ``_initialize_affine_weight_cpu`` does it:
a parameter of stride ``s`` is cut into ``tp * s`` equal blocks along its partition
dimension and rank ``r`` takes blocks ``r, r + tp, r + 2 tp, ...`` (SwiGLU's ``linear_fc1``
has stride 2: each rank holds ``[gate_r; up_r]``).
"""

from __future__ import annotations

import re

import torch

__all__ = [
    "MEGATRON_PARTITIONS",
    "global_parameter_name",
    "megatron_full_state",
    "padded_vocab_size",
    "partition_of",
    "shard_full_state_dict",
    "stage_layers",
    "stage_shard",
    "tp_shard",
]

_LAYER_PREFIX = re.compile(r"^decoder\.layers\.(\d+)\.")
_TIED_OUTPUT = "output_layer.weight"
_EMBEDDING = "embedding.word_embeddings.weight"


def tp_shard(full: torch.Tensor, *, dim: int | None, stride: int, tp_rank: int, tp_size: int) -> torch.Tensor:
    """Rank ``tp_rank``'s blocks of ``full``, round-robin; ``dim=None`` is replicated."""
    if dim is None:
        return full
    block = full.shape[dim] // (tp_size * stride)
    assert block * tp_size * stride == full.shape[dim], (tuple(full.shape), dim, stride, tp_size)
    return torch.cat(full.split(block, dim=dim)[tp_rank::tp_size], dim=dim)


# --- model-driven -------------------------------------------------------------------------------


def global_parameter_name(model, name: str) -> str:
    """The name ``name`` (local to this pipeline stage) has in a full, unsplit model."""
    match = _LAYER_PREFIX.match(name)
    if match is None:
        return name
    global_index = model.decoder.layers[int(match.group(1))].layer_number - 1
    return f"decoder.layers.{global_index}.{name[match.end():]}"


def shard_full_state_dict(
    model, full_state_dict: dict[str, torch.Tensor], *, tp_rank: int, tp_size: int
) -> dict[str, torch.Tensor]:
    """This rank's ``state_dict`` for ``model`` cut from ``full_state_dict``.

    Non-parameter entries (buffers, ``_extra_state``) are kept as they are. With tied
    embeddings a last stage's ``output_layer.weight`` is cut from the embedding.
    """
    assert 0 <= tp_rank < tp_size, (tp_rank, tp_size)
    parameters = dict(model.named_parameters())
    local: dict[str, torch.Tensor] = {}
    for name, value in model.state_dict(keep_vars=True).items():
        if name not in parameters:
            local[name] = value
            continue
        full_name = global_parameter_name(model, name)
        if full_name not in full_state_dict and full_name == _TIED_OUTPUT and model.share_embeddings_and_output_weights:
            full_name = _EMBEDDING
        full = full_state_dict[full_name]
        if getattr(value, "tensor_model_parallel", False):
            dim, stride = value.partition_dim, value.partition_stride
        else:
            dim, stride = None, 1
        shard = tp_shard(full, dim=dim, stride=stride, tp_rank=tp_rank, tp_size=tp_size)
        assert shard.shape == value.shape, (full_name, tuple(shard.shape), tuple(value.shape))
        local[name] = shard
    return local


# --- table-driven -------------------------------------------------------------------------------

# (partition_dim, partition_stride) as megatron-core 0.16.1 marks the parameters of a local-spec
# GPTModel; every other parameter (the norms) is replicated.
MEGATRON_PARTITIONS: dict[str, tuple[int, int]] = {
    "embedding.word_embeddings.weight": (0, 1),
    "self_attention.linear_qkv.weight": (0, 1),
    "self_attention.linear_qkv.bias": (0, 1),
    "self_attention.linear_proj.weight": (1, 1),
    "mlp.linear_fc1.weight": (0, 2),
    "mlp.linear_fc2.weight": (1, 1),
    "output_layer.weight": (0, 1),
}


def partition_of(name: str) -> tuple[int | None, int]:
    """``(dim, stride)`` of a megatron parameter name; ``(None, 1)`` if replicated."""
    for suffix, partition in MEGATRON_PARTITIONS.items():
        if name.endswith(suffix):
            return partition
    return None, 1


def padded_vocab_size(vocab_size: int, *, make_vocab_size_divisible_by: int, tp_size: int) -> int:
    """Megatron-LM's ``_vocab_size_with_padding``, counted up one at a time."""
    padded = vocab_size
    while padded % (make_vocab_size_divisible_by * tp_size) != 0:
        padded += 1
    return padded


def stage_layers(*, num_layers: int, pp_size: int, pp_rank: int) -> list[int]:
    """Global indices of the layers of stage ``pp_rank`` under megatron's even split."""
    assert num_layers % pp_size == 0, (num_layers, pp_size)
    return [layer for layer in range(num_layers) if layer * pp_size // num_layers == pp_rank]


def _padded_rows(tensor: torch.Tensor, num_rows: int) -> torch.Tensor:
    padded = torch.zeros((num_rows, *tensor.shape[1:]), dtype=tensor.dtype)
    padded[: tensor.shape[0]] = tensor
    return padded


def _interleaved_qkv(q, k, v, *, num_heads: int, num_groups: int, head_dim: int) -> torch.Tensor:
    """Per query group: its query heads, then its k head, then its v head."""
    rows = []
    heads_per_group = num_heads // num_groups
    for group in range(num_groups):
        for head in range(group * heads_per_group, (group + 1) * heads_per_group):
            rows.append(q[head * head_dim : (head + 1) * head_dim])
        rows.append(k[group * head_dim : (group + 1) * head_dim])
        rows.append(v[group * head_dim : (group + 1) * head_dim])
    return torch.cat(rows, dim=0)


def megatron_full_state(hf_state: dict[str, torch.Tensor], *, dims, padded_vocab_size: int) -> dict[str, torch.Tensor]:
    """The full (TP=1, PP=1) local-spec megatron state dict of an HF Llama/Qwen2 state dict."""
    head_dim = dims.kv_channels
    state = {_EMBEDDING: _padded_rows(hf_state["model.embed_tokens.weight"], padded_vocab_size)}
    for layer in range(dims.num_layers):
        hf, mg = f"model.layers.{layer}", f"decoder.layers.{layer}"
        state[f"{mg}.input_layernorm.weight"] = hf_state[f"{hf}.input_layernorm.weight"]
        for kind in ("weight", "bias") if dims.qkv_bias else ("weight",):
            q, k, v = (hf_state[f"{hf}.self_attn.{p}_proj.{kind}"] for p in "qkv")
            state[f"{mg}.self_attention.linear_qkv.{kind}"] = _interleaved_qkv(
                q, k, v, num_heads=dims.num_attention_heads, num_groups=dims.num_query_groups, head_dim=head_dim
            )
        state[f"{mg}.self_attention.linear_proj.weight"] = hf_state[f"{hf}.self_attn.o_proj.weight"]
        state[f"{mg}.pre_mlp_layernorm.weight"] = hf_state[f"{hf}.post_attention_layernorm.weight"]
        state[f"{mg}.mlp.linear_fc1.weight"] = torch.cat(
            [hf_state[f"{hf}.mlp.gate_proj.weight"], hf_state[f"{hf}.mlp.up_proj.weight"]]
        )
        state[f"{mg}.mlp.linear_fc2.weight"] = hf_state[f"{hf}.mlp.down_proj.weight"]
    state["decoder.final_layernorm.weight"] = hf_state["model.norm.weight"]
    if not dims.tie_embeddings:
        state[_TIED_OUTPUT] = _padded_rows(hf_state["lm_head.weight"], padded_vocab_size)
    return state


def stage_shard(
    full_state: dict[str, torch.Tensor],
    *,
    num_layers: int,
    tie_embeddings: bool,
    pp_rank: int,
    pp_size: int,
    tp_rank: int,
    tp_size: int,
) -> dict[str, torch.Tensor]:
    """What TP rank ``tp_rank`` of pipeline stage ``pp_rank`` holds, under stage-local names."""
    names: dict[str, str] = {}  # local -> global
    is_first, is_last = pp_rank == 0, pp_rank == pp_size - 1
    if is_first:
        names[_EMBEDDING] = _EMBEDDING
    for local, layer in enumerate(stage_layers(num_layers=num_layers, pp_size=pp_size, pp_rank=pp_rank)):
        for name in full_state:
            match = _LAYER_PREFIX.match(name)
            if match is not None and int(match.group(1)) == layer:
                names[f"decoder.layers.{local}.{name[match.end():]}"] = name
    if is_last:
        names["decoder.final_layernorm.weight"] = "decoder.final_layernorm.weight"
        if not tie_embeddings:
            names[_TIED_OUTPUT] = _TIED_OUTPUT
        elif pp_size > 1:
            names[_TIED_OUTPUT] = _EMBEDDING  # megatron's copy of the embedding on the last stage
    shard = {}
    for local, name in names.items():
        dim, stride = partition_of(local)
        shard[local] = tp_shard(full_state[name], dim=dim, stride=stride, tp_rank=tp_rank, tp_size=tp_size)
    return shard
