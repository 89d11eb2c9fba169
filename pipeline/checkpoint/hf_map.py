"""The one Hugging Face ⇄ megatron-core name/shape map for Llama-family decoders.

Covers HF ``LlamaForCausalLM`` (Llama 3.x), ``Qwen2ForCausalLM`` (Qwen2/2.5: q/k/v
bias) and ``Qwen3ForCausalLM`` (dense Qwen3: per-head q/k RMSNorm, ``self_attn.q_norm`` /
``k_norm`` ⇄ ``self_attention.q_layernorm`` / ``k_layernorm``, one ``head_dim`` vector each,
replicated over TP ranks and named alike in both layer specs) with GQA, RMSNorm, SwiGLU and
tied or untied embeddings, against
megatron-core 0.16.1 ``GPTModel`` built from either layer spec
(``megatron/core/models/gpt/gpt_layer_specs.py``):

* ``"local"`` (``get_gpt_layer_local_spec``): separate norms,
  ``decoder.layers.{i}.input_layernorm.weight`` and
  ``decoder.layers.{i}.pre_mlp_layernorm.weight``;
* ``"te"`` (``get_gpt_layer_with_transformer_engine_spec``): the norms are fused
  into the following linear, ``decoder.layers.{i}.self_attention.linear_qkv.
  layer_norm_weight`` and ``decoder.layers.{i}.mlp.linear_fc1.layer_norm_weight``
  (the local spec's ``sharded_state_dict_keys_map`` names the same pairs).

``PARAM_MAP`` is data: one row per megatron parameter with its HF source(s), the
tensor transform and the tensor-parallel mode. Every function below — HF →
megatron, megatron → HF, TP split, TP merge, the expected shapes — reads that
table; no direction has its own hand-written copy.

The layout rules (fused q/k/v and gate/up rows, which dimension each tensor-parallel
mode splits, vocabulary padding, the pipeline layer split) live once in
``pipeline.models.layout``; this module binds them to names and shapes. ``LayerSplit``,
``MegatronLayout``, ``ModelDims``, ``Parallel``, ``Transform`` and ``padded_vocab_size``
are re-exported from there. A map row's TP partition is
``layout.tp_partition(row.parallel, row.transform)``; ``split_tp`` / ``merge_tp`` here take
a ``ResolvedParam`` and name it in errors.

Pipeline stages: module names inside a stage use local layer indices; the embedding
lives on the first stage, the final norm and output layer on the last. With tied
embeddings and more than one stage megatron keeps a copy of the embedding as
``output_layer.weight`` on the last stage; with one stage there is no
``output_layer.weight``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from pipeline.models import layout as _layout
from pipeline.models.layout import (
    LayerSpec,
    LayerSplit,
    MegatronLayout,
    ModelDims,
    Parallel,
    Transform,
    padded_vocab_size,
)

__all__ = [
    "LayerSpec",
    "LayerSplit",
    "MegatronLayout",
    "ModelDims",
    "PARAM_MAP",
    "Parallel",
    "ParamMapping",
    "ResolvedParam",
    "Stage",
    "Transform",
    "When",
    "expected_hf_shapes",
    "expected_megatron_shapes",
    "hf_to_megatron_tensor",
    "merge_tp",
    "megatron_to_hf_tensors",
    "padded_vocab_size",
    "resolve_params",
    "split_tp",
]


class Stage(enum.Enum):
    """Which pipeline stage(s) own a parameter."""

    FIRST = "first"
    LAYER = "layer"
    LAST = "last"


class When(enum.Enum):
    """Which models have a parameter."""

    ALWAYS = "always"
    QKV_BIAS = "qkv_bias"
    QK_LAYERNORM = "qk_layernorm"
    UNTIED = "untied"  # the HF model has its own lm_head


@dataclass(frozen=True, slots=True, kw_only=True)
class ParamMapping:
    """One row of the map; ``{layer}`` stands for the layer index."""

    megatron: str  # local-spec name
    megatron_te: str | None = None  # TE-spec name where it differs from the local one
    hf: tuple[str, ...]
    # One symbolic shape per HF tensor: V vocab, H hidden, F ffn, Q heads * head_dim,
    # KV query_groups * head_dim, D head_dim.
    hf_shapes: tuple[tuple[str, ...], ...]
    transform: Transform
    parallel: Parallel
    stage: Stage
    when: When = When.ALWAYS
    # Set on rows that hold a copy of another megatron parameter (the tied output layer
    # on the last pipeline stage); converting back checks the copy instead of emitting it.
    copy_of: str | None = None

    def megatron_name(self, layer_spec: LayerSpec) -> str:
        return self.megatron_te if layer_spec == "te" and self.megatron_te else self.megatron


_LAYER = "decoder.layers.{layer}"
_HF_LAYER = "model.layers.{layer}"

PARAM_MAP: tuple[ParamMapping, ...] = (
    ParamMapping(
        megatron="embedding.word_embeddings.weight",
        hf=("model.embed_tokens.weight",),
        hf_shapes=(("V", "H"),),
        transform=Transform.IDENTITY,
        parallel=Parallel.VOCAB,
        stage=Stage.FIRST,
    ),
    ParamMapping(
        megatron=f"{_LAYER}.input_layernorm.weight",
        megatron_te=f"{_LAYER}.self_attention.linear_qkv.layer_norm_weight",
        hf=(f"{_HF_LAYER}.input_layernorm.weight",),
        hf_shapes=(("H",),),
        transform=Transform.IDENTITY,
        parallel=Parallel.REPLICATED,
        stage=Stage.LAYER,
    ),
    ParamMapping(
        megatron=f"{_LAYER}.self_attention.linear_qkv.weight",
        hf=(
            f"{_HF_LAYER}.self_attn.q_proj.weight",
            f"{_HF_LAYER}.self_attn.k_proj.weight",
            f"{_HF_LAYER}.self_attn.v_proj.weight",
        ),
        hf_shapes=(("Q", "H"), ("KV", "H"), ("KV", "H")),
        transform=Transform.QKV,
        parallel=Parallel.COLUMN,
        stage=Stage.LAYER,
    ),
    ParamMapping(
        megatron=f"{_LAYER}.self_attention.linear_qkv.bias",
        hf=(
            f"{_HF_LAYER}.self_attn.q_proj.bias",
            f"{_HF_LAYER}.self_attn.k_proj.bias",
            f"{_HF_LAYER}.self_attn.v_proj.bias",
        ),
        hf_shapes=(("Q",), ("KV",), ("KV",)),
        transform=Transform.QKV,
        parallel=Parallel.COLUMN,
        stage=Stage.LAYER,
        when=When.QKV_BIAS,
    ),
    ParamMapping(
        megatron=f"{_LAYER}.self_attention.q_layernorm.weight",
        hf=(f"{_HF_LAYER}.self_attn.q_norm.weight",),
        hf_shapes=(("D",),),
        transform=Transform.IDENTITY,
        parallel=Parallel.REPLICATED,
        stage=Stage.LAYER,
        when=When.QK_LAYERNORM,
    ),
    ParamMapping(
        megatron=f"{_LAYER}.self_attention.k_layernorm.weight",
        hf=(f"{_HF_LAYER}.self_attn.k_norm.weight",),
        hf_shapes=(("D",),),
        transform=Transform.IDENTITY,
        parallel=Parallel.REPLICATED,
        stage=Stage.LAYER,
        when=When.QK_LAYERNORM,
    ),
    ParamMapping(
        megatron=f"{_LAYER}.self_attention.linear_proj.weight",
        hf=(f"{_HF_LAYER}.self_attn.o_proj.weight",),
        hf_shapes=(("H", "Q"),),
        transform=Transform.IDENTITY,
        parallel=Parallel.ROW,
        stage=Stage.LAYER,
    ),
    ParamMapping(
        megatron=f"{_LAYER}.pre_mlp_layernorm.weight",
        megatron_te=f"{_LAYER}.mlp.linear_fc1.layer_norm_weight",
        hf=(f"{_HF_LAYER}.post_attention_layernorm.weight",),
        hf_shapes=(("H",),),
        transform=Transform.IDENTITY,
        parallel=Parallel.REPLICATED,
        stage=Stage.LAYER,
    ),
    ParamMapping(
        megatron=f"{_LAYER}.mlp.linear_fc1.weight",
        hf=(f"{_HF_LAYER}.mlp.gate_proj.weight", f"{_HF_LAYER}.mlp.up_proj.weight"),
        hf_shapes=(("F", "H"), ("F", "H")),
        transform=Transform.GATE_UP,
        parallel=Parallel.COLUMN,
        stage=Stage.LAYER,
    ),
    ParamMapping(
        megatron=f"{_LAYER}.mlp.linear_fc2.weight",
        hf=(f"{_HF_LAYER}.mlp.down_proj.weight",),
        hf_shapes=(("H", "F"),),
        transform=Transform.IDENTITY,
        parallel=Parallel.ROW,
        stage=Stage.LAYER,
    ),
    ParamMapping(
        megatron="decoder.final_layernorm.weight",
        hf=("model.norm.weight",),
        hf_shapes=(("H",),),
        transform=Transform.IDENTITY,
        parallel=Parallel.REPLICATED,
        stage=Stage.LAST,
    ),
    ParamMapping(
        megatron="output_layer.weight",
        hf=("lm_head.weight",),
        hf_shapes=(("V", "H"),),
        transform=Transform.IDENTITY,
        parallel=Parallel.VOCAB,
        stage=Stage.LAST,
        when=When.UNTIED,
    ),
)

_EMBEDDING = PARAM_MAP[0]
_OUTPUT = PARAM_MAP[-1]
assert _EMBEDDING.megatron == "embedding.word_embeddings.weight"
assert _OUTPUT.megatron == "output_layer.weight"


def _applies(entry: ParamMapping, dims: ModelDims) -> bool:
    if entry.when is When.QKV_BIAS:
        return dims.qkv_bias
    if entry.when is When.QK_LAYERNORM:
        return dims.qk_layernorm
    if entry.when is When.UNTIED:
        return not dims.tie_embeddings
    return True


@dataclass(frozen=True, slots=True)
class ResolvedParam:
    """A map row bound to one layer and one pipeline stage.

    ``megatron_name`` uses the stage-local layer index; ``hf_names`` the global one.
    ``hf_names`` is the embedding for the tied output-layer copy on the last stage.
    """

    entry: ParamMapping
    megatron_name: str
    hf_names: tuple[str, ...]
    global_layer: int | None


# With tied embeddings and pp > 1 the last stage holds the embedding as output_layer.weight.
_TIED_OUTPUT_COPY = ParamMapping(
    megatron=_OUTPUT.megatron,
    hf=_EMBEDDING.hf,
    hf_shapes=_EMBEDDING.hf_shapes,
    transform=Transform.IDENTITY,
    parallel=Parallel.VOCAB,
    stage=Stage.LAST,
    copy_of=_EMBEDDING.megatron,
)


def resolve_params(
    dims: ModelDims, *, layout: MegatronLayout, pp_rank: int | None = None
) -> Iterator[ResolvedParam]:
    """Every megatron parameter of stage ``pp_rank`` (all stages if ``None``), in HF order.

    With ``pp_rank=None`` the names are those of an unsplit model (global layer indices,
    no tied output-layer copy), whatever ``layout.layer_split`` says.
    """
    layout.check(dims)
    split = layout.layer_split
    if pp_rank is None:
        is_first = is_last = True
        layer_offset, num_local_layers = 0, dims.num_layers
        has_tied_copy = False
    else:
        split._check_rank(pp_rank)
        is_first, is_last = pp_rank == 0, pp_rank == split.pp_size - 1
        layer_offset, num_local_layers = split.offset(pp_rank), split.layers_per_stage[pp_rank]
        has_tied_copy = dims.tie_embeddings and split.pp_size > 1 and is_last

    def whole_model_rows(stage: Stage) -> Iterator[ResolvedParam]:
        for entry in PARAM_MAP:
            if entry.stage is stage and _applies(entry, dims):
                yield ResolvedParam(entry, entry.megatron_name(layout.layer_spec), entry.hf, None)

    if is_first:
        yield from whole_model_rows(Stage.FIRST)
    for local_layer in range(num_local_layers):
        global_layer = layer_offset + local_layer
        for entry in PARAM_MAP:
            if entry.stage is Stage.LAYER and _applies(entry, dims):
                yield ResolvedParam(
                    entry,
                    entry.megatron_name(layout.layer_spec).format(layer=local_layer),
                    tuple(name.format(layer=global_layer) for name in entry.hf),
                    global_layer,
                )
    if is_last:
        yield from whole_model_rows(Stage.LAST)
        if has_tied_copy:
            yield ResolvedParam(_TIED_OUTPUT_COPY, _OUTPUT.megatron, _EMBEDDING.hf, None)


def _symbol_sizes(dims: ModelDims) -> dict[str, int]:
    head_dim = dims.kv_channels
    return {
        "V": dims.vocab_size,
        "H": dims.hidden_size,
        "F": dims.ffn_hidden_size,
        "Q": dims.num_attention_heads * head_dim,
        "KV": dims.num_query_groups * head_dim,
        "D": head_dim,
    }


def _hf_shapes_of(entry: ParamMapping, dims: ModelDims) -> tuple[tuple[int, ...], ...]:
    sizes = _symbol_sizes(dims)
    return tuple(tuple(sizes[symbol] for symbol in shape) for shape in entry.hf_shapes)


def _megatron_full_shape(entry: ParamMapping, *, dims: ModelDims, padded_vocab: int) -> tuple[int, ...]:
    hf_shapes = _hf_shapes_of(entry, dims)
    # Every multi-tensor transform concatenates along dim 0; vocab rows are padded.
    rows = padded_vocab if entry.parallel is Parallel.VOCAB else sum(shape[0] for shape in hf_shapes)
    return (rows, *hf_shapes[0][1:])


def _partition(entry: ParamMapping) -> _layout.TPPartition:
    return _layout.tp_partition(entry.parallel, entry.transform)


def expected_hf_shapes(dims: ModelDims) -> dict[str, tuple[int, ...]]:
    """Every tensor an HF checkpoint of this model must contain, with its shape."""
    shapes: dict[str, tuple[int, ...]] = {}
    full = MegatronLayout(layer_split=LayerSplit((dims.num_layers,)), padded_vocab_size=dims.vocab_size)
    for param in resolve_params(dims, layout=full):
        shapes.update(zip(param.hf_names, _hf_shapes_of(param.entry, dims)))
    return shapes


def expected_megatron_shapes(
    dims: ModelDims, *, layout: MegatronLayout, pp_rank: int | None = None, sharded: bool = True
) -> dict[str, tuple[int, ...]]:
    """Megatron parameter shapes of stage ``pp_rank`` (whole model if ``None``).

    ``sharded=True`` gives one TP rank's shapes (identical on every rank), ``False`` the
    unsharded shapes.
    """
    shapes: dict[str, tuple[int, ...]] = {}
    for param in resolve_params(dims, layout=layout, pp_rank=pp_rank):
        full_shape = _megatron_full_shape(param.entry, dims=dims, padded_vocab=layout.padded_vocab_size)
        shapes[param.megatron_name] = (
            _layout.tp_shard_shape(full_shape, partition=_partition(param.entry), tp_size=layout.tp_size)
            if sharded
            else full_shape
        )
    return shapes


def _check_shape(tensor: torch.Tensor, *, expected: tuple[int, ...], what: str) -> None:
    if tuple(tensor.shape) != expected:
        raise ValueError(f"{what}: shape {tuple(tensor.shape)} does not match the expected {expected}")


def hf_to_megatron_tensor(
    param: ResolvedParam, hf_tensors: Sequence[torch.Tensor], *, dims: ModelDims, padded_vocab_size: int
) -> torch.Tensor:
    """The unsharded megatron tensor of ``param`` from its HF tensors (in ``param.hf_names`` order).

    Pure data movement (``layout.fuse``, ``layout.pad_vocab``): values and dtype are
    unchanged, so the inverse is bit-exact. An identity row may return its input tensor itself.
    """
    entry = param.entry
    if len(hf_tensors) != len(param.hf_names):
        raise ValueError(f"{param.megatron_name}: expected {len(param.hf_names)} HF tensors, got {len(hf_tensors)}")
    for tensor, name, shape in zip(hf_tensors, param.hf_names, _hf_shapes_of(entry, dims)):
        _check_shape(tensor, expected=shape, what=f"HF tensor {name!r}")
    fused = _layout.fuse(entry.transform, hf_tensors, dims=dims)
    if entry.parallel is Parallel.VOCAB:
        return _layout.pad_vocab(fused, padded_vocab_size=padded_vocab_size, name=param.megatron_name)
    return fused


def megatron_to_hf_tensors(
    param: ResolvedParam, tensor: torch.Tensor, *, dims: ModelDims, padded_vocab_size: int
) -> tuple[torch.Tensor, ...]:
    """The HF tensors (in ``param.hf_names`` order) of the unsharded megatron tensor of ``param``.

    Exact inverse of ``hf_to_megatron_tensor``; the vocabulary padding is dropped. The
    results may be views of ``tensor``.
    """
    entry = param.entry
    _check_shape(
        tensor,
        expected=_megatron_full_shape(entry, dims=dims, padded_vocab=padded_vocab_size),
        what=f"megatron tensor {param.megatron_name!r} (unsharded)",
    )
    if entry.parallel is Parallel.VOCAB:
        tensor = _layout.unpad_vocab(tensor, vocab_size=dims.vocab_size)
    return _layout.unfuse(entry.transform, tensor, dims=dims)


def split_tp(param: ResolvedParam, full: torch.Tensor, *, tp_size: int) -> list[torch.Tensor]:
    """The ``tp_size`` shards of the unsharded megatron tensor ``full``, rank order (``layout.split_tp``).

    Shards are views of ``full`` except for ``linear_fc1`` (concatenated halves); a
    replicated parameter returns ``full`` itself for every rank.
    """
    return _layout.split_tp(full, partition=_partition(param.entry), tp_size=tp_size, name=param.megatron_name)


def merge_tp(param: ResolvedParam, shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """The unsharded megatron tensor from its TP shards (rank order); inverse of ``split_tp``.

    Raises ``ValueError`` if a replicated parameter differs between ranks: merging would
    otherwise silently keep one rank's copy.
    """
    return _layout.merge_tp(shards, partition=_partition(param.entry), name=param.megatron_name)
