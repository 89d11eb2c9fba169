"""Weights from the Megatron actor to a rollout engine: three transports on one streamed export.

Every transport reads the actor through ``pipeline.rollout.weight_export``: HF-named full
tensors in buckets of at most ``rollout.sync_bucket_mb``, each pipeline stage assembling
its own layers inside its TP group, through the one HF⇄Megatron map
(``pipeline.checkpoint.hf_map``). No rank ever holds the whole model (unless TP = PP = 1,
where the model is its shard) or more than about two buckets beyond its shard; see that
module for the bound and the sizes at 7B.

Global rank 0 holds the engine, wrapped in the transport its rollout backend chose
(``pipeline.rollout.backends``, ``trainer_engine``); ``sync_actor_to_engine`` is the one
call, made by every rank. Rank 0 first broadcasts the sync's ``SyncPlan`` (a few bytes), so
the other ranks, which hold no engine, know their part. Weights that leave the trainer's
processes go to a ``WeightSink`` (``pipeline.rollout.types``), whatever receives them.

* ``LocalSyncedEngine`` (the in-process engine): the buckets reach rank 0 (later stages'
  through the point-to-point relay) and are copied into the engine's model: device to
  device when it lives on the buckets' GPU, else through one bucket's CPU copy at a time
  (the process engine's children read host shared memory).
* ``DiskSyncedEngine`` (``sync=disk``): every stage's source rank writes its own buckets as
  ``model-ppSSS-KKKKK.safetensors`` into one staging folder under ``weights_dir``; after all
  stages wrote (their file lists gathered on rank 0, a few kB), rank 0 alone writes
  ``model.safetensors.index.json``, ``config.json``, ``generation_config.json`` and the
  tokenizer, publishes the folder as ``v<version>`` with one rename (``pipeline.io``) and has
  the sink load it (``WeightSink.load_from_disk``). The previous export is removed once the
  receivers run the new one. For trainers and servers that share only a filesystem.
* ``DistributedSyncedEngine`` (``sync=distributed``): the buckets stream to the sink as rank 0
  receives them: ``begin_update``, one ``send_bucket`` per bucket, ``end_update``. A receiver
  that fails mid-sync is the sink's to handle (for SGLang: the failed server is dropped and the
  update goes on in a new update group with the others, ``pipeline.rollout.sglang.weights``). If
  the sink gives up, the sync drains the remaining buckets so every trainer rank finishes its
  part, ends the update incomplete and raises one ``RolloutError`` (a ``UserError`` of the sink,
  such as a server parallelism the config does not match, is raised as it is); the next sync
  starts a new update. Bytes per sync at 7B: 15.2 GB out of rank 0 to every server, once.

``actor_hf_state`` gives the same stream as ``(name, tensor)`` pairs on rank 0, for tools
that copy the weights somewhere themselves.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from pipeline.checkpoint.artifact import tokenizer_files
from pipeline.checkpoint.hf_io import INDEX_FILE, generation_values_for, write_hf_configs
from pipeline.checkpoint.hf_map import expected_hf_shapes
from pipeline.errors import CheckpointError, UserError
from pipeline.io import publish_directory
from pipeline.models.spec import ModelSpec
from pipeline.parallel.weight_transfer import export_role, sync_broadcast, sync_gather
from pipeline.rollout.types import RolloutError, WeightSink
from pipeline.rollout.weight_export import Bucket, stage_buckets, stream_to_rank0

__all__ = [
    "DiskSyncedEngine",
    "DistributedSyncedEngine",
    "LocalSyncedEngine",
    "SyncPlan",
    "SyncedEngine",
    "actor_hf_state",
    "build_hf_model",
    "sync_actor_to_engine",
]

MB = 1024**2


def build_hf_model(spec: ModelSpec, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
    """An HF causal LM with ``spec``'s architecture on ``device`` (random weights until the first sync).

    Built and initialized on ``device`` itself: drawing a 4B model's random weights on the
    host and then moving them costs a CPU pass over every parameter for values the first
    sync overwrites.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = dict(spec.to_hf_config())
    model_type = hf_config.pop("model_type")
    hf_config.pop("architectures")
    config = AutoConfig.for_model(model_type, **hf_config)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


@dataclass(frozen=True, slots=True)
class SyncPlan:
    """What every rank needs to know about one sync; global rank 0 decides and broadcasts it."""

    transport: Literal["local", "disk", "distributed"]
    bucket_bytes: int
    staging: str | None = None  # disk: the folder every stage writes its files into


def sync_actor_to_engine(actor, engine, *, version: int) -> None:
    """Push the actor's weights to the rollout engine as weight ``version``.

    Collective: every rank calls it. ``engine`` is global rank 0's transport-wrapped engine
    (``LocalSyncedEngine``, ``DiskSyncedEngine``, ``DistributedSyncedEngine``) and ``None``
    on the other ranks.
    """
    context = actor.context
    plan = sync_broadcast(engine.plan(version) if context.rank == 0 else None, world_size=context.world_size)
    if plan.transport == "disk":
        written = _write_stage_files(actor, Path(plan.staging), bucket_bytes=plan.bucket_bytes)
        listing = sync_gather(written, rank=context.rank, world_size=context.world_size)
        if listing is not None:
            engine.publish([entry for rank_files in listing for entry in rank_files], version=version)
        return
    buckets = stream_to_rank0(actor, bucket_bytes=plan.bucket_bytes)
    if context.rank == 0:
        engine.consume(buckets, version=version)
    else:
        for _ in buckets:
            pass


def actor_hf_state(actor, *, bucket_bytes: int = 256 * MB) -> Iterator[tuple[str, torch.Tensor]] | None:
    """HF-named CPU tensors of the actor's current weights on global rank 0; ``None`` elsewhere.

    Every rank must call it. On rank 0 it returns a lazy iterator that must be exhausted
    (the other ranks are inside the export until it is); elsewhere it runs this rank's part
    of the export before returning.
    """
    buckets = stream_to_rank0(actor, bucket_bytes=bucket_bytes)
    if actor.context.rank == 0:
        return ((name, tensor.cpu()) for bucket in buckets for name, tensor in bucket)
    for _ in buckets:
        pass
    return None


class SyncedEngine:
    """A rollout engine wrapped in its weight-sync transport; generation and lifetime pass through."""

    def __init__(self, engine, *, bucket_bytes: int) -> None:
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.engine = engine
        self.bucket_bytes = bucket_bytes

    def generate(self, requests, params):
        return self.engine.generate(requests, params)

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    def metrics(self) -> dict[str, float]:
        """The wrapped engine's own metrics (a server client's counts by state); {} for an engine without them."""
        metrics = getattr(self.engine, "metrics", None)
        return metrics() if metrics is not None else {}

    def close(self) -> None:
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()


class LocalSyncedEngine(SyncedEngine):
    """The in-process engine; each sync copies the streamed buckets into its model.

    Where the copy goes through (``staging_device``): an in-process ``LocalEngine`` takes
    each tensor on its model's device, so a GPU engine next to a GPU actor gets device-to-
    device copies and the host is never involved; any other engine (the process engine,
    whose children read host shared memory) gets CPU tensors. Memory at 7B (bf16, 15.2 GB
    of weights, ``rollout.sync_bucket_mb`` = 512): on the GPU path nothing beyond the
    export's own bound (``pipeline.rollout.weight_export``), the engine's model being a
    second 15.2 GB on rank 0's GPU; on the host path one bucket's CPU copy, ≤ 512 MB (or
    the 1.09 GB embedding, the largest single tensor), at a time.
    """

    def plan(self, version: int) -> SyncPlan:
        return SyncPlan(transport="local", bucket_bytes=self.bucket_bytes)

    def staging_device(self) -> torch.device:
        """Where the buckets' tensors are handed to the engine."""
        from pipeline.rollout.local import LocalEngine

        if isinstance(self.engine, LocalEngine):
            return next(self.engine.model.parameters()).device
        return torch.device("cpu")

    def consume(self, buckets: Iterator[Bucket], *, version: int) -> None:
        device = self.staging_device()
        # One bucket at a time; .to() of a tensor already on ``device`` is the tensor itself, and
        # the engine copies each into its parameter before the export produces the next bucket.
        pairs = ((name, tensor.to(device)) for bucket in buckets for name, tensor in bucket)
        self.engine.update_weights(pairs, version=version)


def _stage_file_name(pp_rank: int, index: int) -> str:
    return f"model-pp{pp_rank:03d}-{index:05d}.safetensors"


def _write_stage_files(actor, folder: Path, *, bucket_bytes: int) -> list[tuple[str, list[tuple[str, int, str]]]]:
    """This stage's buckets as safetensors files in ``folder`` (on its source rank; ``[]`` elsewhere).

    Returns ``[(file name, [(tensor name, bytes, dtype), ...]), ...]``. Memory: one bucket's
    CPU copy on top of the export's bound (safetensors refuses tensors sharing storage, and
    q/k/v are views of one fused tensor).
    """
    from safetensors.torch import save_file

    written = []
    buckets = stage_buckets(actor, bucket_bytes=bucket_bytes)
    if not export_role(actor.context).source:
        for _ in buckets:
            pass
        return written
    for index, bucket in enumerate(buckets, start=1):
        name = _stage_file_name(actor.context.pp_rank, index)
        tensors = {key: tensor.detach().to("cpu", copy=True).contiguous() for key, tensor in bucket}
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        written.append((name, [(key, t.numel() * t.element_size(), str(t.dtype)) for key, t in tensors.items()]))
    return written


class DiskSyncedEngine(SyncedEngine):
    """An engine whose weights follow the actor through a folder its ``sink``'s receivers can all read."""

    def __init__(self, engine, *, sink: WeightSink, weights_dir: str | Path, spec: ModelSpec,
                 tokenizer_dir: str | Path, bucket_bytes: int) -> None:
        super().__init__(engine, bucket_bytes=bucket_bytes)
        self.sink = sink
        self.weights_dir = Path(weights_dir)
        self.weights_dir.mkdir(parents=True, exist_ok=True)
        self.spec = spec
        self.tokenizer_files = tokenizer_files(Path(tokenizer_dir))
        if not self.tokenizer_files:
            raise CheckpointError(f"tokenizer folder {tokenizer_dir} holds no tokenizer files")
        self._generation_values = generation_values_for(Path(tokenizer_dir), None)
        self._current: Path | None = None

    def _staging(self, version: int) -> Path:
        return self.weights_dir / f".v{version}.staging"

    def plan(self, version: int) -> SyncPlan:
        staging = self._staging(version)
        # A crashed earlier attempt at this version may have left files; no rank writes yet.
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        return SyncPlan(transport="disk", bucket_bytes=self.bucket_bytes, staging=str(staging))

    def publish(self, files: list[tuple[str, list[tuple[str, int, str]]]], *, version: int) -> Path:
        """Index, configs and tokenizer into the staging folder the stages filled; publish; load it."""
        staging = self._staging(version)
        try:
            weight_map: dict[str, str] = {}
            dtypes: dict[str, str] = {}
            total = 0
            for file_name, tensors in files:
                for name, num_bytes, dtype in tensors:
                    if name in weight_map:
                        raise CheckpointError(f"tensor {name!r} written twice ({weight_map[name]}, {file_name})")
                    weight_map[name] = file_name
                    dtypes[name] = dtype
                    total += num_bytes
            expected = set(expected_hf_shapes(self.spec))
            if set(weight_map) != expected:
                missing, extra = sorted(expected - set(weight_map)), sorted(set(weight_map) - expected)
                raise CheckpointError(f"the stages wrote the wrong tensor set: missing {missing[:3]}, extra {extra[:3]}")
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (staging / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
            dtype = getattr(torch, dtypes["model.embed_tokens.weight"].removeprefix("torch."))
            write_hf_configs(staging, spec=self.spec, generation_values=self._generation_values, dtype=dtype)
            for file in self.tokenizer_files:
                shutil.copyfile(file, staging / file.name)
            export = self.weights_dir / f"v{version}"
            publish_directory(staging, export, overwrite=True)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        self.sink.load_from_disk(str(export), version=version)
        if self._current is not None and self._current != export:
            shutil.rmtree(self._current, ignore_errors=True)
        self._current = export
        return export


class DistributedSyncedEngine(SyncedEngine):
    """An engine whose weights stream to its ``sink`` bucket by bucket, as rank 0 receives them."""

    def __init__(self, engine, *, sink: WeightSink, bucket_bytes: int) -> None:
        super().__init__(engine, bucket_bytes=bucket_bytes)
        self.sink = sink

    def plan(self, version: int) -> SyncPlan:
        return SyncPlan(transport="distributed", bucket_bytes=self.bucket_bytes)

    def consume(self, buckets: Iterator[Bucket], *, version: int) -> None:
        error: BaseException | None = None
        try:
            self.sink.begin_update(version=version)
        except (RuntimeError, UserError) as failure:  # RolloutError, the transport's own, or a config mismatch
            error = failure
        in_update = error is None
        for bucket in buckets:
            # After a failure the later stages still send their buckets: take them, so
            # every trainer rank leaves the sync together.
            if error is not None:
                continue
            try:
                self.sink.send_bucket(bucket, version=version)
            except RuntimeError as failure:
                error = failure
        if in_update:
            self.sink.end_update(version=version, completed=error is None)
        if isinstance(error, UserError):
            raise error
        if error is not None:
            raise RolloutError(f"weight sync to version {version} failed; the next sync starts a new update: "
                               f"{error}") from error

    def close(self) -> None:
        self.sink.close()
        super().close()
