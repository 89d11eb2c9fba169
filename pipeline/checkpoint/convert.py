"""Streaming HF ⇄ megatron state conversion driven by ``hf_map.PARAM_MAP``.

These functions do no I/O and no communication: they take tensors (a mapping, or a
callable that reads one tensor by name, e.g. ``HFCheckpointReader.get_tensor``) and
yield ``(name, tensor)`` pairs one parameter at a time, so a caller can write, load
or broadcast each tensor before the next is read. The CLI converter and rollout
weight sync both use them.

Guarantees (tested): HF → megatron → HF is bit-exact for every tensor, whole, TP
sharded or PP split; every megatron parameter of the requested stage is produced
exactly once; converting back refuses a state with a missing or unexpected name, a
replicated parameter that differs between TP ranks, or a tied output-layer copy that
differs from the embedding.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, Mapping, Sequence, Union

import torch

from pipeline.checkpoint.hf_map import (
    MegatronLayout,
    ModelDims,
    ResolvedParam,
    hf_to_megatron_tensor,
    merge_tp,
    megatron_to_hf_tensors,
    resolve_params,
    split_tp,
)

__all__ = [
    "TensorSource",
    "copy_into_model",
    "hf_to_megatron_state",
    "megatron_to_hf_state",
]

TensorSource = Union[Mapping[str, torch.Tensor], Callable[[str], torch.Tensor]]

# megatron's linear layers register `_extra_state` (FP8 metadata; None without TE) in
# their state dicts. It carries no weights.
_EXTRA_STATE_SUFFIX = "._extra_state"


def _getter(source: TensorSource) -> Callable[[str], torch.Tensor]:
    if isinstance(source, Mapping):

        def get(name: str) -> torch.Tensor:
            if name not in source:
                raise KeyError(f"missing tensor {name!r}")
            return source[name]

        return get
    return source


def hf_to_megatron_state(
    hf_tensors: TensorSource,
    *,
    spec: ModelDims,
    layout: MegatronLayout,
    tp_rank: int | None = None,
    pp_rank: int | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the megatron ``(name, tensor)`` pairs of one TP rank of one pipeline stage.

    ``tp_rank=None`` yields unsharded tensors; ``pp_rank=None`` yields every layer under
    its global index (the unsplit model), otherwise stage-local names as megatron builds
    them. Only the HF tensors the requested stage needs are read. Unsharded identity
    tensors may be the source tensors themselves; TP shards are fresh contiguous copies, so
    holding one does not keep the whole tensor alive.
    """
    if tp_rank is not None and not 0 <= tp_rank < layout.tp_size:
        raise ValueError(f"tp_rank {tp_rank} out of range [0, {layout.tp_size})")
    get = _getter(hf_tensors)
    for param in resolve_params(spec, layout=layout, pp_rank=pp_rank):
        full = hf_to_megatron_tensor(
            param, [get(name) for name in param.hf_names], dims=spec, padded_vocab_size=layout.padded_vocab_size
        )
        if tp_rank is None or layout.tp_size == 1:
            yield param.megatron_name, full
        else:
            shard = split_tp(param, full, tp_size=layout.tp_size)[tp_rank]
            yield param.megatron_name, shard.clone(memory_format=torch.contiguous_format)


def _check_names(
    state: Mapping[str, torch.Tensor], expected: set[str], *, pp_rank: int, tp_rank: int
) -> None:
    names = {name for name in state if not name.endswith(_EXTRA_STATE_SUFFIX)}
    missing = sorted(expected - names)
    unexpected = sorted(names - expected)
    if missing or unexpected:
        raise ValueError(
            f"megatron state of pp_rank {pp_rank}, tp_rank {tp_rank} does not match the model: "
            f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}"
        )


def megatron_to_hf_state(
    states: Sequence[Sequence[Mapping[str, torch.Tensor]]],
    *,
    spec: ModelDims,
    layout: MegatronLayout,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the HF ``(name, tensor)`` pairs of a megatron model, in HF order.

    ``states[pp_rank][tp_rank]`` is that rank's state dict with stage-local names (a
    ``model.state_dict()``; ``_extra_state`` entries are ignored). A whole unsharded model
    is ``[[state]]`` with a ``tp_size=1, pp_size=1`` layout. Mappings are read lazily, one
    parameter at a time. Yielded tensors may be views of the given ones.
    """
    if len(states) != layout.pp_size or any(len(stage) != layout.tp_size for stage in states):
        raise ValueError(
            f"expected states for {layout.pp_size} pipeline stages x {layout.tp_size} TP ranks, got "
            f"{[len(stage) for stage in states]}"
        )
    params_by_stage: list[list[ResolvedParam]] = []
    for pp_rank, stage in enumerate(states):
        params = list(resolve_params(spec, layout=layout, pp_rank=pp_rank))
        expected = {param.megatron_name for param in params}
        for tp_rank, state in enumerate(stage):
            _check_names(state, expected, pp_rank=pp_rank, tp_rank=tp_rank)
        params_by_stage.append(params)

    def merged(param: ResolvedParam, *, pp_rank: int, name: str) -> torch.Tensor:
        return merge_tp(param, [state[name] for state in states[pp_rank]])

    for pp_rank, params in enumerate(params_by_stage):
        for param in params:
            full = merged(param, pp_rank=pp_rank, name=param.megatron_name)
            if param.entry.copy_of is not None:
                original = merged(param, pp_rank=0, name=param.entry.copy_of)
                if not torch.equal(full, original):
                    raise ValueError(
                        f"tied embeddings: {param.megatron_name} on pipeline stage {pp_rank} differs from "
                        f"{param.entry.copy_of} on stage 0; the stages were not kept in sync"
                    )
                continue
            hf_tensors = megatron_to_hf_tensors(param, full, dims=spec, padded_vocab_size=layout.padded_vocab_size)
            yield from zip(param.hf_names, hf_tensors)


@torch.no_grad()
def copy_into_model(model: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy ``(name, tensor)`` pairs into ``model``'s parameters, requiring an exact match.

    Every parameter must be given exactly once with its exact shape; unknown names raise.
    Values are cast to the parameter's dtype by ``copy_`` (bit-exact when they agree).
    Parameters are written as the pairs arrive, so after an error the model holds a mix
    of old and new values and must not be used.
    """
    params = dict(model.named_parameters())
    assigned: set[str] = set()
    for name, tensor in named_tensors:
        if name not in params:
            raise ValueError(f"unexpected tensor {name!r}: the model has no such parameter")
        if name in assigned:
            raise ValueError(f"tensor {name!r} given twice")
        param = params[name]
        if param.shape != tensor.shape:
            raise ValueError(f"{name}: tensor shape {tuple(tensor.shape)} != parameter shape {tuple(param.shape)}")
        param.copy_(tensor)
        assigned.add(name)
    missing = sorted(set(params) - assigned)
    if missing:
        raise ValueError(f"missing tensors for parameters {missing[:5]}{' ...' if len(missing) > 5 else ''}")
