"""The tensor/pipeline/vocabulary layout of a megatron-core 0.16.1 ``GPTModel``, written once.

Everything that decides which slice of a full (TP=1, PP=1) tensor a rank holds lives
here; ``pipeline.checkpoint.hf_map`` adds only names and shapes on top, and the actor's
``load_full_state_dict`` uses ``shard_full_state_dict``. No megatron import: this module
is plain tensor arithmetic and loads in a bare CPU venv.

Fused tensors (``SelfAttention.get_query_key_value_tensors`` and ``MLP.forward``):

* ``linear_qkv`` rows are grouped per query group ``g``:
  ``[q heads of g (num_heads / num_groups heads), k_g, v_g]`` for g = 0..G-1, each head
  ``head_dim`` rows; the bias follows the same layout. Query head ``h`` uses group
  ``h // (num_heads / num_groups)`` in both HF (``repeat_kv``) and megatron, so the
  interleave is a pure row permutation.
* ``linear_fc1`` rows are ``[gate; up]``: megatron's GLU chunks the output in two and
  applies the activation to the first half.

Tensor parallelism: a split parameter has a partition dimension and a stride, the
``partition_dim`` / ``partition_stride`` megatron marks it with. A full tensor of stride
``s`` is ``s`` equal blocks along that dimension (``[gate; up]`` for ``linear_fc1``,
stride 2); rank ``r`` holds the ``r``-th of ``tp`` equal pieces of every block, in block
order (``[gate_r; up_r]``), exactly as ``_initialize_affine_weight_cpu`` slices a master
weight. By kind:

* column (dim 0): ``linear_qkv`` (stride 1: the per-group interleave makes a contiguous
  chunk hold whole query groups; with fewer groups than ranks, ``tp % groups == 0``,
  megatron stores the same contiguous 1/tp slice and all-gathers in the forward pass),
  ``linear_fc1`` (stride 2);
* row (dim 1): ``linear_proj``, ``linear_fc2``;
* vocab (dim 0 of the *padded* vocabulary): ``word_embeddings``, ``output_layer``.
  Megatron-LM pads the vocabulary to a multiple of ``make_vocab_size_divisible_by * tp``
  (``_vocab_size_with_padding`` in ``megatron/training/tokenizer/tokenizer.py``;
  megatron-core takes the padded size as ``GPTModel(vocab_size=...)``). Padding appends
  zero rows; unpadding drops them;
* replicated: the norms; merging checks every rank holds identical values.

Pipeline parallelism: ``LayerSplit`` reproduces megatron's layer assignment
(``get_num_layers_to_build`` / ``get_transformer_layer_offset``, without virtual pipeline
stages or ``pipeline_model_parallel_layout``). Module names inside a stage use local layer
indices (``layer_number - 1`` is the global one); the embedding lives on the first stage,
the final norm and output layer on the last. With tied embeddings and more than one stage
megatron keeps a copy of the embedding as ``output_layer.weight`` on the last stage; a full
state dict of a tied model has no such key.
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol, Sequence

import torch

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel

__all__ = [
    "GATE_UP_STRIDE",
    "LayerSpec",
    "LayerSplit",
    "MegatronLayout",
    "ModelDims",
    "Parallel",
    "TPPartition",
    "Transform",
    "fuse",
    "global_parameter_name",
    "merge_tp",
    "pad_vocab",
    "padded_vocab_size",
    "shard_full_state_dict",
    "shard_tp",
    "split_tp",
    "tp_partition",
    "tp_shard_shape",
    "unfuse",
    "unpad_vocab",
]

LayerSpec = Literal["local", "te"]
_LAYER_SPECS: tuple[str, ...] = ("local", "te")


class ModelDims(Protocol):
    """The fields of ``pipeline.models.ModelSpec`` the layout needs."""

    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    qkv_bias: bool
    tie_embeddings: bool

    @property
    def qk_layernorm(self) -> bool: ...

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


# SwiGLU's linear_fc1 is [gate; up]; each rank holds [gate_r; up_r].
GATE_UP_STRIDE = 2


@dataclass(frozen=True, slots=True)
class TPPartition:
    """How a parameter is split over tensor-parallel ranks; ``dim=None`` is replicated."""

    dim: int | None
    stride: int = 1

    def __post_init__(self) -> None:
        if self.dim is not None and self.dim < 0:
            raise ValueError(f"partition dim must be >= 0, got {self.dim}")
        if self.stride < 1:
            raise ValueError(f"partition stride must be >= 1, got {self.stride}")

    @classmethod
    def of_megatron_parameter(cls, parameter: torch.Tensor) -> TPPartition:
        """The partition megatron marked ``parameter`` with when it built it (unmarked: replicated).

        megatron-core 0.16.1 sets the marks inside its weight initializers only, which is why
        ``build_transformer_config`` refuses ``perform_initialization=False``.
        """
        if not getattr(parameter, "tensor_model_parallel", False):
            return cls(None)
        return cls(parameter.partition_dim, parameter.partition_stride)


_PARTITION_DIM = {Parallel.COLUMN: 0, Parallel.ROW: 1, Parallel.VOCAB: 0, Parallel.REPLICATED: None}


def tp_partition(parallel: Parallel, transform: Transform = Transform.IDENTITY) -> TPPartition:
    """The partition of a parameter of this tensor-parallel mode built by this transform."""
    dim = _PARTITION_DIM[parallel]
    stride = GATE_UP_STRIDE if transform is Transform.GATE_UP and dim is not None else 1
    return TPPartition(dim, stride)


def tp_shard_shape(full_shape: Sequence[int], *, partition: TPPartition, tp_size: int) -> tuple[int, ...]:
    """One rank's shape of a tensor of ``full_shape``."""
    shape = list(full_shape)
    if partition.dim is not None:
        shape[partition.dim] //= tp_size
    return tuple(shape)


def _check_divisible(full: torch.Tensor, *, partition: TPPartition, tp_size: int, name: str) -> None:
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    dim = partition.dim
    if dim is None:
        return
    if full.shape[dim] % tp_size != 0:
        raise ValueError(f"{name}: dim {dim} of shape {tuple(full.shape)} is not divisible by tp_size {tp_size}")
    if full.shape[dim] % (tp_size * partition.stride) != 0:
        raise ValueError(
            f"{name}: block size {full.shape[dim] // partition.stride} (dim {dim} of shape {tuple(full.shape)} "
            f"in {partition.stride} blocks) is not divisible by tp_size {tp_size}"
        )


def shard_tp(
    full: torch.Tensor, *, partition: TPPartition, tp_rank: int, tp_size: int, name: str = "tensor"
) -> torch.Tensor:
    """Rank ``tp_rank``'s shard of ``full``: a view for stride 1, ``full`` itself if replicated."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank: {tp_rank} is outside [0, tp_size={tp_size})")
    _check_divisible(full, partition=partition, tp_size=tp_size, name=name)
    dim = partition.dim
    if dim is None:
        return full
    if partition.stride == 1:
        return torch.chunk(full, tp_size, dim=dim)[tp_rank]
    blocks = torch.chunk(full, partition.stride, dim=dim)  # e.g. (gate, up)
    return torch.cat([torch.chunk(block, tp_size, dim=dim)[tp_rank] for block in blocks], dim=dim)


def split_tp(full: torch.Tensor, *, partition: TPPartition, tp_size: int, name: str = "tensor") -> list[torch.Tensor]:
    """The ``tp_size`` shards of ``full``, rank order (see ``shard_tp``)."""
    _check_divisible(full, partition=partition, tp_size=tp_size, name=name)
    if partition.dim is None:
        return [full] * tp_size
    if partition.stride == 1:
        return list(torch.chunk(full, tp_size, dim=partition.dim))
    return [shard_tp(full, partition=partition, tp_rank=r, tp_size=tp_size, name=name) for r in range(tp_size)]


def merge_tp(shards: Sequence[torch.Tensor], *, partition: TPPartition, name: str = "tensor") -> torch.Tensor:
    """The full tensor from its TP shards (rank order); inverse of ``split_tp``.

    Raises ``ValueError`` if a replicated parameter differs between ranks: merging would
    otherwise silently keep one rank's copy.
    """
    if not shards:
        raise ValueError(f"{name}: no shards to merge")
    shapes = {tuple(shard.shape) for shard in shards}
    if len(shapes) != 1:
        raise ValueError(f"{name}: TP shards have different shapes {sorted(shapes)}")
    dim = partition.dim
    if dim is None:
        for tp_rank, shard in enumerate(shards[1:], start=1):
            if not torch.equal(shard, shards[0]):
                raise ValueError(f"{name}: replicated parameter differs between TP rank 0 and TP rank {tp_rank}")
        return shards[0]
    if len(shards) == 1:
        return shards[0]
    if partition.stride == 1:
        return torch.cat(list(shards), dim=dim)
    pieces = [torch.chunk(shard, partition.stride, dim=dim) for shard in shards]  # [(gate_r, up_r)]
    return torch.cat([rank_pieces[block] for block in range(partition.stride) for rank_pieces in pieces], dim=dim)


# --- fused tensors ------------------------------------------------------------------------------


def fuse(transform: Transform, tensors: Sequence[torch.Tensor], *, dims: ModelDims) -> torch.Tensor:
    """The megatron tensor made of the HF ``tensors`` (one tensor for ``IDENTITY``, returned as is).

    Pure data movement: values and dtype are unchanged, so ``unfuse`` inverts it bit-exactly.
    """
    if transform is Transform.QKV:
        q, k, v = tensors  # (Q, ...), (KV, ...), (KV, ...)
        groups = dims.num_query_groups
        rest = tuple(q.shape[1:])
        # Rows per group: [q heads of the group, k head, v head].
        grouped = torch.cat(
            (q.reshape(groups, -1, *rest), k.reshape(groups, -1, *rest), v.reshape(groups, -1, *rest)), dim=1
        )  # (G, (Q + 2 KV) / G, ...)
        return grouped.reshape(-1, *rest)
    if transform is Transform.GATE_UP:
        gate, up = tensors  # (F, H), (F, H)
        return torch.cat((gate, up), dim=0)  # (2F, H)
    (tensor,) = tensors
    return tensor


def unfuse(transform: Transform, fused: torch.Tensor, *, dims: ModelDims) -> tuple[torch.Tensor, ...]:
    """The HF tensors of the megatron tensor ``fused``; exact inverse of ``fuse``. May return views."""
    if transform is Transform.QKV:
        groups = dims.num_query_groups
        rest = tuple(fused.shape[1:])
        head_dim = dims.kv_channels
        q_rows_per_group = dims.num_attention_heads // groups * head_dim
        grouped = fused.reshape(groups, -1, *rest)  # (G, (Q + 2 KV) / G, ...)
        q, k, v = torch.split(grouped, (q_rows_per_group, head_dim, head_dim), dim=1)
        return tuple(part.reshape(-1, *rest) for part in (q, k, v))  # (Q, ...), (KV, ...), (KV, ...)
    if transform is Transform.GATE_UP:
        return tuple(torch.chunk(fused, 2, dim=0))  # (F, H), (F, H)
    return (fused,)


# --- vocabulary padding -------------------------------------------------------------------------


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


def pad_vocab(tensor: torch.Tensor, *, padded_vocab_size: int, name: str = "tensor") -> torch.Tensor:
    """``tensor`` (V, ...) with zero rows appended up to ``padded_vocab_size``; itself if no padding."""
    if padded_vocab_size == tensor.shape[0]:
        return tensor
    if padded_vocab_size < tensor.shape[0]:
        raise ValueError(f"{name}: padded_vocab_size {padded_vocab_size} < vocab_size {tensor.shape[0]}")
    # Padded token ids never occur in inputs; zero output rows give them logit 0, so
    # consumers must slice logits to the true vocabulary before a softmax.
    padding = tensor.new_zeros((padded_vocab_size - tensor.shape[0], *tensor.shape[1:]))
    return torch.cat((tensor, padding), dim=0)  # (padded V, ...)


def unpad_vocab(tensor: torch.Tensor, *, vocab_size: int) -> torch.Tensor:
    """The first ``vocab_size`` rows of a padded vocabulary tensor (a view); padded rows may have drifted."""
    return tensor[:vocab_size]


# --- pipeline stages ----------------------------------------------------------------------------


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
        if dims.num_attention_heads % dims.num_query_groups != 0:
            raise ValueError(
                f"num_attention_heads {dims.num_attention_heads} is not divisible by "
                f"num_query_groups {dims.num_query_groups}"
            )
        tp = self.tp_size
        groups = dims.num_query_groups
        if dims.num_attention_heads % tp != 0:
            raise ValueError(f"num_attention_heads {dims.num_attention_heads} is not divisible by tp_size {tp}")
        if groups % tp != 0 and tp % groups != 0:
            raise ValueError(f"num_query_groups {groups} and tp_size {tp}: one must divide the other")
        if dims.ffn_hidden_size % tp != 0:
            raise ValueError(f"ffn_hidden_size {dims.ffn_hidden_size} is not divisible by tp_size {tp}")


# --- one rank's shard of a built model ----------------------------------------------------------

_LAYER_PREFIX = re.compile(r"^decoder\.layers\.(\d+)\.")
_TIED_OUTPUT = "output_layer.weight"
_EMBEDDING = "embedding.word_embeddings.weight"


def global_parameter_name(model: GPTModel, name: str) -> str:
    """The name ``name`` (local to this pipeline stage) has in a full, unsplit model.

    megatron numbers layers from 1 across stages: local ``decoder.layers.<i>`` is global
    layer ``layers[i].layer_number - 1``.
    """
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
    """This rank's ``state_dict`` for ``model`` (one TP rank of one stage) cut from ``full_state_dict``.

    The pipeline position and each parameter's partition are read from the model itself
    (``global_parameter_name``, ``TPPartition.of_megatron_parameter``). Non-parameter
    entries of the model's own state dict (buffers, Transformer Engine ``_extra_state``)
    are kept as they are: they are run state, not weights. With tied embeddings the last
    stage's ``output_layer.weight`` is cut from the embedding. The result loads with
    ``model.load_state_dict(..., strict=True)``.
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
        full = full_state_dict[full_name]
        partition = TPPartition.of_megatron_parameter(value)
        if partition.dim is None:
            if full.shape != value.shape:
                raise ValueError(f"{full_name}: shape {tuple(full.shape)} != model's {tuple(value.shape)}")
        else:
            expected = list(value.shape)
            expected[partition.dim] *= tp_size
            if list(full.shape) != expected:
                raise ValueError(
                    f"{full_name}: shape {tuple(full.shape)} != {tuple(expected)} "
                    f"(model shard {tuple(value.shape)} x tensor_parallel={tp_size} along dim {partition.dim})"
                )
        local[name] = shard_tp(full, partition=partition, tp_rank=tp_rank, tp_size=tp_size, name=full_name)
    return local
