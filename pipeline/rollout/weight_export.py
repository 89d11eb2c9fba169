"""The actor's weights as a stream of Hugging Face-named buckets, assembled where they live.

``stage_buckets`` walks this rank's pipeline stage one megatron parameter at a time, in
the order of ``pipeline.checkpoint.hf_map.resolve_params``: the TP group gathers the
parameter's shards onto its TP rank 0 (``gather_tp_shards``), which merges them
(``merge_tp``), turns the result into its HF tensors (``megatron_to_hf_tensors``) and
adds them to the open bucket; a bucket is yielded before it would pass ``bucket_bytes``
(a tensor larger than the bucket travels alone). Every pipeline stage does this for its
own layers at the same time; data-parallel and context-parallel replicas take no part.
The tied output layer that the last stage keeps with tied embeddings is a copy of the
first stage's embedding, which exports it.

``stream_to_rank0`` adds the relay for consumers that live on global rank 0 (the local
engine, the leader of the distributed update group): rank 0 yields its own stage's
buckets, then each later stage's as that stage's source rank sends them.

Memory bound (extra, beyond the rank's own shard of the weights; ``P`` = the largest
unsharded parameter, ``B`` = ``bucket_bytes``):

* a stage's TP rank 0: ≤ 2·B + 2·P — the bucket its consumer still holds (a ``for`` loop
  keeps the last item while it asks for the next), the open bucket, and one parameter's
  gathered shards (P) with their merge or unfused copies (P); shards are dropped once merged;
* global rank 0 with PP > 1 while relaying: the bucket being received and the one its
  consumer holds, ≤ 2·max(B, P);
* every other rank: its shard's contiguous copy for the gather, ≤ P / TP.

At 7B (bf16, B = 512 MB, P = the 1.09 GB embedding, TP = 4, PP = 2) that is ≤ 3.2 GB on a
stage's TP rank 0 against 15.2 GB for the whole model, which the old path gathered onto
global rank 0 as pickled shards of every rank. A sync moves the model once: 15.2 GB, each
stage's half gathered inside its own TP group.

Yielded tensors stay on the actor's device and may be views of its parameters: read them
before the next ``train_step``, never write to them.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from pipeline.checkpoint.hf_map import (
    MegatronLayout,
    expected_megatron_shapes,
    megatron_to_hf_tensors,
    merge_tp,
    resolve_params,
)
from pipeline.parallel.weight_transfer import BucketRelay, export_role, gather_tp_shards

__all__ = ["Bucket", "bucket_nbytes", "extra_memory_bound", "layout_of", "stage_buckets", "stream_to_rank0"]

Bucket = list[tuple[str, torch.Tensor]]


def bucket_nbytes(bucket: Bucket) -> int:
    return sum(tensor.numel() * tensor.element_size() for _, tensor in bucket)


def layout_of(actor) -> MegatronLayout:
    context = actor.context
    return MegatronLayout.build(actor.spec, layer_spec=actor.layer_spec_choice.name,
                                tp_size=context.tensor_parallel, pp_size=context.pipeline_parallel)


def extra_memory_bound(actor, *, bucket_bytes: int) -> int:
    """The stated bound on any rank's extra memory during a sync: 2 × ``bucket_bytes`` + 2 × the
    largest unsharded parameter (its element size as the actor holds it)."""
    shapes = expected_megatron_shapes(actor.spec, layout=layout_of(actor), sharded=False)
    element_size = next(iter(actor.module.parameters())).element_size()
    largest = max(math.prod(shape) for shape in shapes.values()) * element_size
    return 2 * bucket_bytes + 2 * largest


def _check_names(state, expected: set[str], *, context) -> None:
    # A layer spec other than the actor's names its norms differently: say so before any gather.
    names = {name for name in state if not name.endswith("_extra_state")}
    missing, unexpected = sorted(expected - names), sorted(names - expected)
    if missing or unexpected:
        raise ValueError(f"megatron state of pp_rank {context.pp_rank}, tp_rank {context.tp_rank} does not match the "
                         f"model: missing {missing[:5]}, unexpected {unexpected[:5]}")


def stage_buckets(actor, *, bucket_bytes: int) -> Iterator[Bucket]:
    """This rank's pipeline stage as HF buckets of at most ``bucket_bytes`` (collective in the TP group).

    Yields on the stage's source rank (TP rank 0 of data-parallel replica 0); every other
    rank of the group must exhaust it too (it takes part in the gathers) and gets nothing.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    context = actor.context
    if not export_role(context).exports:
        return
    layout = layout_of(actor)
    state = actor.module.state_dict()  # references to the live tensors, no copies
    params = list(resolve_params(actor.spec, layout=layout, pp_rank=context.pp_rank))
    _check_names(state, {param.megatron_name for param in params}, context=context)
    bucket: Bucket = []
    size = 0
    for param in params:
        if param.entry.copy_of is not None:
            continue
        shards = gather_tp_shards(state[param.megatron_name], context=context)
        if shards is None:
            continue
        full = merge_tp(param, shards)
        del shards
        hf_tensors = megatron_to_hf_tensors(param, full, dims=actor.spec, padded_vocab_size=layout.padded_vocab_size)
        del full
        for name, tensor in zip(param.hf_names, hf_tensors):
            tensor = tensor.detach()
            num_bytes = tensor.numel() * tensor.element_size()
            if bucket and size + num_bytes > bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.append((name, tensor))
            size += num_bytes
    if bucket:
        yield bucket


def stream_to_rank0(actor, *, bucket_bytes: int) -> Iterator[Bucket]:
    """Every bucket of the model on global rank 0: its own stage's, then each later stage's in order.

    Collective over the whole world: every rank must exhaust it; only global rank 0 gets
    buckets. A later stage's source sends each bucket as it is assembled (the send waits for
    rank 0 to take it, which bounds what it holds), so stages assemble in parallel.
    """
    context = actor.context
    role = export_role(context)
    relay = BucketRelay(device=context.device)
    if context.rank == 0:
        yield from stage_buckets(actor, bucket_bytes=bucket_bytes)
        for src in role.stage_sources[1:]:
            while (bucket := relay.receive(src)) is not None:
                yield bucket
        return
    if role.source:
        for bucket in stage_buckets(actor, bucket_bytes=bucket_bytes):
            relay.send(bucket)
        relay.finish()
        return
    for _ in stage_buckets(actor, bucket_bytes=bucket_bytes):
        raise AssertionError("only a stage's source rank yields buckets")
