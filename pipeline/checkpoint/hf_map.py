"""The one Hugging Face ⇄ megatron-core name/shape map for Llama-family decoders.

Covers HF ``LlamaForCausalLM`` (Llama 3.x) and ``Qwen2ForCausalLM`` (Qwen2/2.5:
q/k/v bias) with GQA, RMSNorm, SwiGLU and tied or untied embeddings, against
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

Layouts (megatron-core 0.16.1, ``SelfAttention.get_query_key_value_tensors`` and
``MLP.forward``):

* ``linear_qkv`` rows are grouped per query group ``g``:
  ``[q heads of g (num_heads / num_groups heads), k_g, v_g]`` for g = 0..G-1,
  each head ``head_dim`` rows; the bias follows the same layout. Query head ``h``
  uses group ``h // (num_heads / num_groups)`` in both HF (``repeat_kv``) and
  megatron, so the interleave is a pure row permutation.
* ``linear_fc1`` rows are ``[gate; up]``: megatron's GLU chunks the output in two
  and applies the activation to the first half.
* RoPE: both HF and megatron (``rotary_interleaved=False``) rotate halves, so
  q/k rows need no permutation (unlike Meta's original checkpoints).

Tensor parallelism (``split_tp`` / ``merge_tp``):

* column (dim 0). ``linear_qkv`` is split per query group, which with the
  interleaved layout is a contiguous dim-0 chunk: each rank gets whole groups,
  its own q/k/v. With fewer groups than ranks (``tp % groups == 0``) megatron
  0.16.1 stores a contiguous 1/tp slice and all-gathers in the forward pass; the
  same chunk. ``linear_fc1`` is split per half: rank r holds
  ``[gate_r; up_r]``, not a contiguous chunk of ``[gate; up]``.
* row (dim 1): ``linear_proj``, ``linear_fc2``.
* vocab (dim 0 of the *padded* vocabulary): ``word_embeddings``,
  ``output_layer``. Megatron-LM pads the vocabulary to a multiple of
  ``make_vocab_size_divisible_by * tp`` (``_vocab_size_with_padding`` in
  ``megatron/training/tokenizer/tokenizer.py``; megatron-core itself takes the
  padded size as ``GPTModel(vocab_size=...)``). HF → megatron appends zero rows;
  megatron → HF drops the padded rows.
* replicated: the norms; merging checks all ranks hold identical values.

Pipeline parallelism: ``LayerSplit`` reproduces megatron's layer assignment
(``get_num_layers_to_build`` / ``get_transformer_layer_offset``, without virtual
pipeline stages or ``pipeline_model_parallel_layout``). Module names inside a
stage use local layer indices; the embedding lives on the first stage, the
final norm and output layer on the last. With tied embeddings and more than one
stage megatron keeps a copy of the embedding as ``output_layer.weight`` on the
last stage; with one stage there is no ``output_layer.weight``.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Iterator, Literal, Protocol, Sequence

import torch

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

LayerSpec = Literal["local", "te"]
_LAYER_SPECS: tuple[str, ...] = ("local", "te")


class ModelDims(Protocol):
    """The fields of ``pipeline.models.ModelSpec`` the map needs."""

    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    qkv_bias: bool
    tie_embeddings: bool

    @property
    def kv_channels(self) -> int: ...


class Transform(enum.Enum):
    """How HF tensors become one megatron tensor (and back)."""

    IDENTITY = "identity"
    QKV = "qkv"  # q, k, v -> interleaved per query group
    GATE_UP = "gate_up"  # gate, up -> concatenated


class Parallel(enum.Enum):
    """Tensor-parallel mode of a megatron parameter."""

    COLUMN = "column"
    ROW = "row"
    VOCAB = "vocab"
    REPLICATED = "replicated"


class Stage(enum.Enum):
    """Which pipeline stage(s) own a parameter."""

    FIRST = "first"
    LAYER = "layer"
    LAST = "last"


class When(enum.Enum):
    """Which models have a parameter."""

    ALWAYS = "always"
    QKV_BIAS = "qkv_bias"
    UNTIED = "untied"  # the HF model has its own lm_head


@dataclass(frozen=True, slots=True, kw_only=True)
class ParamMapping:
    """One row of the map; ``{layer}`` stands for the layer index."""

    megatron: str  # local-spec name
    megatron_te: str | None = None  # TE-spec name where it differs from the local one
    hf: tuple[str, ...]
    # One symbolic shape per HF tensor: V vocab, H hidden, F ffn, Q heads * head_dim,
    # KV query_groups * head_dim.
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


def padded_vocab_size(vocab_size: int, *, make_vocab_size_divisible_by: int, tp_size: int) -> int:
    """Megatron-LM's padded vocabulary: the next multiple of ``make_vocab_size_divisible_by * tp_size``.

    Megatron-LM's ``--make-vocab-size-divisible-by`` defaults to 128.
    """
    if vocab_size < 1 or make_vocab_size_divisible_by < 1 or tp_size < 1:
        raise ValueError(
            f"vocab_size ({vocab_size}), make_vocab_size_divisible_by ({make_vocab_size_divisible_by}) "
            f"and tp_size ({tp_size}) must be positive"
        )
    multiple = make_vocab_size_divisible_by * tp_size
    return math.ceil(vocab_size / multiple) * multiple


_pad_vocab = padded_vocab_size  # MegatronLayout.build's keyword of the same name shadows it


@dataclass(frozen=True, slots=True)
class LayerSplit:
    """Decoder layers per pipeline stage, in stage order."""

    layers_per_stage: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.layers_per_stage or any(n < 0 for n in self.layers_per_stage):
            raise ValueError(f"layers_per_stage must be non-empty and non-negative, got {self.layers_per_stage}")

    @classmethod
    def build(
        cls,
        *,
        num_layers: int,
        pp_size: int,
        num_layers_in_first_stage: int | None = None,
        num_layers_in_last_stage: int | None = None,
    ) -> LayerSplit:
        """Megatron's split: even, or with explicit first/last stage sizes and the rest even.

        Mirrors ``TransformerConfig.num_layers_in_{first,last}_pipeline_stage``; like
        megatron, the remaining layers must divide evenly over the middle stages.
        """
        if pp_size < 1:
            raise ValueError(f"pp_size must be >= 1, got {pp_size}")
        if pp_size == 1:
            if num_layers_in_first_stage is not None or num_layers_in_last_stage is not None:
                raise ValueError("num_layers_in_first/last_stage need pp_size > 1")
            return cls((num_layers,))
        first = num_layers_in_first_stage
        last = num_layers_in_last_stage
        num_middle_stages = pp_size - (first is not None) - (last is not None)
        num_middle_layers = num_layers - (first or 0) - (last or 0)
        if num_middle_layers < 0 or (num_middle_stages == 0 and num_middle_layers != 0):
            raise ValueError(
                f"cannot place {num_layers} layers on {pp_size} stages with first={first}, last={last}"
            )
        if num_middle_stages > 0 and num_middle_layers % num_middle_stages != 0:
            raise ValueError(
                f"{num_middle_layers} layers do not divide evenly over {num_middle_stages} pipeline "
                f"stages (num_layers={num_layers}, pp_size={pp_size}, first={first}, last={last})"
            )
        per_middle = num_middle_layers // num_middle_stages if num_middle_stages else 0
        counts = [per_middle] * pp_size
        if first is not None:
            counts[0] = first
        if last is not None:
            counts[-1] = last
        return cls(tuple(counts))

    @property
    def pp_size(self) -> int:
        return len(self.layers_per_stage)

    @property
    def num_layers(self) -> int:
        return sum(self.layers_per_stage)

    def offset(self, pp_rank: int) -> int:
        """Global index of ``pp_rank``'s first layer."""
        self._check_rank(pp_rank)
        return sum(self.layers_per_stage[:pp_rank])

    def locate(self, global_layer: int) -> tuple[int, int]:
        """``global_layer`` → ``(pp_rank, local_layer)``."""
        if not 0 <= global_layer < self.num_layers:
            raise ValueError(f"layer {global_layer} out of range [0, {self.num_layers})")
        start = 0
        for pp_rank, count in enumerate(self.layers_per_stage):
            if global_layer < start + count:
                return pp_rank, global_layer - start
            start += count
        raise AssertionError("unreachable: the range check above covers every layer")

    def global_layer(self, pp_rank: int, local_layer: int) -> int:
        """``(pp_rank, local_layer)`` → global layer index."""
        self._check_rank(pp_rank)
        if not 0 <= local_layer < self.layers_per_stage[pp_rank]:
            raise ValueError(
                f"local layer {local_layer} out of range for pipeline stage {pp_rank} "
                f"with {self.layers_per_stage[pp_rank]} layers"
            )
        return self.offset(pp_rank) + local_layer

    def _check_rank(self, pp_rank: int) -> None:
        if not 0 <= pp_rank < self.pp_size:
            raise ValueError(f"pp_rank {pp_rank} out of range [0, {self.pp_size})")


@dataclass(frozen=True, slots=True, kw_only=True)
class MegatronLayout:
    """How a megatron model is laid out: layer spec, TP size, PP layer split, padded vocabulary."""

    layer_spec: LayerSpec = "local"
    tp_size: int = 1
    layer_split: LayerSplit
    padded_vocab_size: int

    def __post_init__(self) -> None:
        if self.layer_spec not in _LAYER_SPECS:
            raise ValueError(f"layer_spec must be one of {_LAYER_SPECS}, got {self.layer_spec!r}")
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        if self.padded_vocab_size % self.tp_size != 0:
            raise ValueError(
                f"padded_vocab_size {self.padded_vocab_size} is not divisible by tp_size {self.tp_size}"
            )

    @classmethod
    def build(
        cls,
        dims: ModelDims,
        *,
        layer_spec: LayerSpec = "local",
        tp_size: int = 1,
        pp_size: int = 1,
        num_layers_in_first_stage: int | None = None,
        num_layers_in_last_stage: int | None = None,
        make_vocab_size_divisible_by: int = 1,
        padded_vocab_size: int | None = None,
    ) -> MegatronLayout:
        """A layout for ``dims``; the vocabulary is padded by Megatron-LM's rule.

        The default ``make_vocab_size_divisible_by=1`` pads only up to a multiple of
        ``tp_size``: no padding for the vocabularies of Llama 3 and Qwen2.5 (multiples of
        128), matching ``pipeline.models.build_gpt_model``, which builds the embedding with
        ``spec.vocab_size`` rows. Pass 128 for checkpoints made by Megatron-LM with its
        default, and ``padded_vocab_size`` explicitly for a checkpoint trained at another TP
        size: its padding was fixed when it was created.
        """
        if padded_vocab_size is None:
            padded_vocab_size = _pad_vocab(
                dims.vocab_size, make_vocab_size_divisible_by=make_vocab_size_divisible_by, tp_size=tp_size
            )
        if padded_vocab_size < dims.vocab_size:
            raise ValueError(f"padded_vocab_size {padded_vocab_size} < vocab_size {dims.vocab_size}")
        layout = cls(
            layer_spec=layer_spec,
            tp_size=tp_size,
            layer_split=LayerSplit.build(
                num_layers=dims.num_layers,
                pp_size=pp_size,
                num_layers_in_first_stage=num_layers_in_first_stage,
                num_layers_in_last_stage=num_layers_in_last_stage,
            ),
            padded_vocab_size=padded_vocab_size,
        )
        layout.check(dims)
        return layout

    @property
    def pp_size(self) -> int:
        return self.layer_split.pp_size

    def check(self, dims: ModelDims) -> None:
        """Raise ``ValueError`` if ``dims`` cannot be laid out this way."""
        if self.layer_split.num_layers != dims.num_layers:
            raise ValueError(
                f"layer split {self.layer_split.layers_per_stage} covers {self.layer_split.num_layers} "
                f"layers, the model has {dims.num_layers}"
            )
        if self.padded_vocab_size < dims.vocab_size:
            raise ValueError(f"padded_vocab_size {self.padded_vocab_size} < vocab_size {dims.vocab_size}")
        _check_head_dims(dims)
        tp = self.tp_size
        groups = dims.num_query_groups
        if dims.num_attention_heads % tp != 0:
            raise ValueError(f"num_attention_heads {dims.num_attention_heads} is not divisible by tp_size {tp}")
        if groups % tp != 0 and tp % groups != 0:
            raise ValueError(f"num_query_groups {groups} and tp_size {tp}: one must divide the other")
        if dims.ffn_hidden_size % tp != 0:
            raise ValueError(f"ffn_hidden_size {dims.ffn_hidden_size} is not divisible by tp_size {tp}")


def _check_head_dims(dims: ModelDims) -> None:
    if dims.num_attention_heads % dims.num_query_groups != 0:
        raise ValueError(
            f"num_attention_heads {dims.num_attention_heads} is not divisible by "
            f"num_query_groups {dims.num_query_groups}"
        )


def _applies(entry: ParamMapping, dims: ModelDims) -> bool:
    if entry.when is When.QKV_BIAS:
        return dims.qkv_bias
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
    }


def _hf_shapes_of(entry: ParamMapping, dims: ModelDims) -> tuple[tuple[int, ...], ...]:
    sizes = _symbol_sizes(dims)
    return tuple(tuple(sizes[symbol] for symbol in shape) for shape in entry.hf_shapes)


def _megatron_full_shape(entry: ParamMapping, *, dims: ModelDims, padded_vocab: int) -> tuple[int, ...]:
    hf_shapes = _hf_shapes_of(entry, dims)
    # Every multi-tensor transform concatenates along dim 0; vocab rows are padded.
    rows = padded_vocab if entry.parallel is Parallel.VOCAB else sum(shape[0] for shape in hf_shapes)
    return (rows, *hf_shapes[0][1:])


def _megatron_shard_shape(entry: ParamMapping, *, full_shape: tuple[int, ...], tp_size: int) -> tuple[int, ...]:
    if entry.parallel in (Parallel.COLUMN, Parallel.VOCAB):
        return (full_shape[0] // tp_size, *full_shape[1:])
    if entry.parallel is Parallel.ROW:
        return (full_shape[0], full_shape[1] // tp_size, *full_shape[2:])
    return full_shape


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
            _megatron_shard_shape(param.entry, full_shape=full_shape, tp_size=layout.tp_size) if sharded else full_shape
        )
    return shapes


def _check_shape(tensor: torch.Tensor, *, expected: tuple[int, ...], what: str) -> None:
    if tuple(tensor.shape) != expected:
        raise ValueError(f"{what}: shape {tuple(tensor.shape)} does not match the expected {expected}")


def hf_to_megatron_tensor(
    param: ResolvedParam, hf_tensors: Sequence[torch.Tensor], *, dims: ModelDims, padded_vocab_size: int
) -> torch.Tensor:
    """The unsharded megatron tensor of ``param`` from its HF tensors (in ``param.hf_names`` order).

    Pure data movement: values and dtype are unchanged, so the inverse is bit-exact. An
    identity row may return its input tensor itself.
    """
    entry = param.entry
    if len(hf_tensors) != len(param.hf_names):
        raise ValueError(f"{param.megatron_name}: expected {len(param.hf_names)} HF tensors, got {len(hf_tensors)}")
    for tensor, name, shape in zip(hf_tensors, param.hf_names, _hf_shapes_of(entry, dims)):
        _check_shape(tensor, expected=shape, what=f"HF tensor {name!r}")
    if entry.transform is Transform.QKV:
        q, k, v = hf_tensors  # (Q, ...), (KV, ...), (KV, ...)
        groups = dims.num_query_groups
        rest = tuple(q.shape[1:])
        # Rows per group: [q heads of the group, k head, v head].
        grouped = torch.cat(
            (q.reshape(groups, -1, *rest), k.reshape(groups, -1, *rest), v.reshape(groups, -1, *rest)), dim=1
        )  # (G, (Q + 2 KV) / G, ...)
        return grouped.reshape(-1, *rest)
    if entry.transform is Transform.GATE_UP:
        gate, up = hf_tensors  # (F, H), (F, H)
        return torch.cat((gate, up), dim=0)  # (2F, H)
    (tensor,) = hf_tensors
    if entry.parallel is Parallel.VOCAB and padded_vocab_size != tensor.shape[0]:
        if padded_vocab_size < tensor.shape[0]:
            raise ValueError(
                f"{param.megatron_name}: padded_vocab_size {padded_vocab_size} < vocab_size {tensor.shape[0]}"
            )
        # Padded token ids never occur in inputs; zero output rows give them logit 0, so
        # consumers must slice logits to the true vocabulary before a softmax.
        padding = tensor.new_zeros((padded_vocab_size - tensor.shape[0], *tensor.shape[1:]))
        return torch.cat((tensor, padding), dim=0)  # (padded V, H)
    return tensor


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
    hf_shapes = _hf_shapes_of(entry, dims)
    if entry.transform is Transform.QKV:
        groups = dims.num_query_groups
        rest = tuple(tensor.shape[1:])
        head_dim = dims.kv_channels
        q_rows_per_group = dims.num_attention_heads // groups * head_dim
        grouped = tensor.reshape(groups, -1, *rest)  # (G, (Q + 2 KV) / G, ...)
        q, k, v = torch.split(grouped, (q_rows_per_group, head_dim, head_dim), dim=1)
        return tuple(part.reshape(shape) for part, shape in zip((q, k, v), hf_shapes))
    if entry.transform is Transform.GATE_UP:
        return tuple(torch.chunk(tensor, 2, dim=0))
    if entry.parallel is Parallel.VOCAB:
        return (tensor[: dims.vocab_size],)
    return (tensor,)


def split_tp(param: ResolvedParam, full: torch.Tensor, *, tp_size: int) -> list[torch.Tensor]:
    """The ``tp_size`` shards of the unsharded megatron tensor ``full``, rank order.

    Shards are views of ``full`` except for ``linear_fc1`` (concatenated halves); a
    replicated parameter returns ``full`` itself for every rank.
    """
    entry = param.entry
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    if entry.parallel is Parallel.REPLICATED:
        return [full] * tp_size
    dim = 1 if entry.parallel is Parallel.ROW else 0
    if full.shape[dim] % tp_size != 0:
        raise ValueError(
            f"{param.megatron_name}: dim {dim} of shape {tuple(full.shape)} is not divisible by tp_size {tp_size}"
        )
    if entry.transform is Transform.GATE_UP:
        gate, up = torch.chunk(full, 2, dim=0)  # (F, H) each
        if gate.shape[0] % tp_size != 0:
            raise ValueError(f"{param.megatron_name}: ffn size {gate.shape[0]} is not divisible by tp_size {tp_size}")
        return [
            torch.cat((gate_shard, up_shard), dim=0)  # (2F / tp, H)
            for gate_shard, up_shard in zip(torch.chunk(gate, tp_size, dim=0), torch.chunk(up, tp_size, dim=0))
        ]
    # linear_qkv included: the per-group interleave makes each contiguous chunk hold whole
    # query groups (or, with fewer groups than ranks, megatron's contiguous 1/tp slice).
    return list(torch.chunk(full, tp_size, dim=dim))


def merge_tp(param: ResolvedParam, shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """The unsharded megatron tensor from its TP shards (rank order); inverse of ``split_tp``.

    Raises ``ValueError`` if a replicated parameter differs between ranks: merging would
    otherwise silently keep one rank's copy.
    """
    entry = param.entry
    if not shards:
        raise ValueError(f"{param.megatron_name}: no shards to merge")
    shapes = {tuple(shard.shape) for shard in shards}
    if len(shapes) != 1:
        raise ValueError(f"{param.megatron_name}: TP shards have different shapes {sorted(shapes)}")
    if entry.parallel is Parallel.REPLICATED:
        for tp_rank, shard in enumerate(shards[1:], start=1):
            if not torch.equal(shard, shards[0]):
                raise ValueError(
                    f"{param.megatron_name}: replicated parameter differs between TP rank 0 and TP rank {tp_rank}"
                )
        return shards[0]
    if len(shards) == 1:
        return shards[0]
    if entry.transform is Transform.GATE_UP:
        halves = [torch.chunk(shard, 2, dim=0) for shard in shards]  # [(gate_r, up_r)]
        return torch.cat([gate for gate, _ in halves] + [up for _, up in halves], dim=0)  # (2F, H)
    return torch.cat(list(shards), dim=1 if entry.parallel is Parallel.ROW else 0)
