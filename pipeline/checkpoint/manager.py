"""Atomic, verified, resharding checkpoints of the actor and of everything else a run changes.

``CheckpointManager`` writes and restores them; what a checkpoint on disk is (and how
readers resolve, verify and load one) is ``pipeline.checkpoint.artifact``.

Layout of one checkpoint (``<directory>/step_00000120/``)::

    weights/               megatron dist_checkpointing: model + optimizer (which layouts load: below)
    ranks/rank_00003.json  per-rank state: RNG states, learning-rate schedule
    state.json             run state from rank 0 (step, data position, stats, schedulers, ...)
    tensors.safetensors    run tensors from rank 0 (estimator weights, stats arrays, ...)
    manifest.json          written last: every file with its size (and sha256 for small files),
                           the layout, the layer-spec choice and the optimizer it was saved under

A save writes everything into ``step_00000120.tmp`` and renames it into place
only after every rank has finished and the manifest is written; ``latest`` (a
one-line file) is replaced atomically afterwards, so a crash at any point
leaves the previous checkpoint and pointer intact. ``load_latest`` checks the
manifest before trusting a checkpoint and falls back to older ones, saying why.
Only safetensors, JSON and megatron's weights-only ``torch.load`` are read back:
no pickle of untrusted files.

Resharding on resume (``check_resume_layout``, from the manifest, before any tensor is read):
the regular optimizer's state is keyed by parameter and loads under any TP/PP/DP layout; the
distributed optimizer's loads under any DP size, bit for bit, but only under the TP/PP layout
that saved it; a change of optimizer kind, or of TP/PP with the distributed optimizer, is refused
with what to set or which ``winnow convert`` commands to run.
"""

from __future__ import annotations

import base64
import json
import logging
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from pickle import UnpicklingError
from typing import Any, NoReturn

import numpy as np
import torch
from megatron.core import dist_checkpointing
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import CheckpointException

from pipeline.checkpoint.artifact import (
    HASHED_FILE_LIMIT,
    LATEST_FILE,
    MANIFEST_FILE,
    WEIGHTS_DIR,
    describe_failure,
    file_sha256,
    list_steps,
    load_sharded_weights,
    newest_valid,
    step_dir_name,
    verify_checkpoint,
)
from pipeline.errors import CheckpointError, CheckpointWriteError
from pipeline.io import atomic_write_text
from pipeline.parallel.lifetime import megatron_checkpoint_writers_die_with_this_process
from pipeline.parallel.rendezvous import all_gather_objects

__all__ = ["CheckpointManager", "LoadedCheckpoint", "capture_rng_state", "check_resume_layout", "restore_rng_state"]

# How megatron lays out a distributed optimizer's state on disk. "dp_reshardable": every DP rank
# writes its own shard of Adam's moments and fp32 master weights in parallel, with no gather (at 7B
# on 8 ranks, 12 bytes × 7.6e9 / 8 ≈ 11 GB per rank, never 91 GB on one). Its limit: a resume
# must keep the TP/PP layout (DP may change; ``check_resume_layout`` refuses a TP/PP change before
# loading). Each bucket is one tensor of its unpadded size, and DP only changes how ranks slice it;
# the buckets themselves do not depend on DP because the actor's DDP does not overlap the grad
# reduce (megatron sizes buckets by DP only for that overlap). megatron-core 0.16.1's default for
# this optimizer, "fully_sharded_model_space", raises "ShardedTensor.flattened_range is not supported" at save.
# The regular (unsharded) optimizer ignores this metadata and stays fully reshardable.
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}

logger = logging.getLogger(__name__)

# How a failed write (ENOSPC, EFBIG, EROFS, EIO) reaches us from each writer: OSError from our
# JSON files; SafetensorError from safetensors' Rust writer; RuntimeError from torch.save's C++
# stream, which drops the errno ("basic_ios::clear: iostream error", megatron's common.pt); torch
# DCP's CheckpointException (a BaseException) gathering every rank's writer failure (.distcp).
_WRITE_FAILURES = (OSError, SafetensorError, RuntimeError, CheckpointException)


@dataclass(slots=True)
class LoadedCheckpoint:
    path: Path
    step: int
    state: dict[str, Any]
    tensors: dict[str, torch.Tensor]


def _write_json(path: Path, payload: Any) -> None:
    # json.dump's bytes exactly (indent 1, sorted keys, no trailing newline), written atomically.
    atomic_write_text(path, json.dumps(payload, indent=1, sort_keys=True))


def _encode_bytes(tensor: torch.Tensor) -> str:
    return base64.b64encode(tensor.numpy().tobytes()).decode("ascii")


def _decode_bytes(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()


def capture_rng_state() -> dict[str, Any]:
    """Every RNG that training touches on this rank, as JSON-serializable data."""
    numpy_state = np.random.get_state()
    state = {
        "torch": _encode_bytes(torch.get_rng_state()),
        "python": json.loads(json.dumps(random.getstate())),
        "numpy": [numpy_state[0], numpy_state[1].tolist(), *numpy_state[2:]],
    }
    if torch.cuda.is_available():
        from megatron.core import tensor_parallel

        state["cuda"] = _encode_bytes(torch.cuda.get_rng_state())
        state["megatron_tracker"] = {
            name: _encode_bytes(value) for name, value in tensor_parallel.get_cuda_rng_tracker().get_states().items()
        }
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(_decode_bytes(state["torch"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        from megatron.core import tensor_parallel

        torch.cuda.set_rng_state(_decode_bytes(state["cuda"]))
        tensor_parallel.get_cuda_rng_tracker().set_states(
            {name: _decode_bytes(value) for name, value in state["megatron_tracker"].items()}
        )



def _zero_uninitialized_padding(optimizer_state: Any, actor) -> None:
    """Zero the gap tensors megatron adds to a ``dp_reshardable`` optimizer state.

    Why: megatron-core 0.16.1 fills the gaps between parameters in a distributed-optimizer
    bucket with ``torch.empty`` tensors, so two saves of the same state write different bytes
    (whatever memory held) and a checkpoint is not a deterministic function of the training
    state. Every real tensor of that state is a view of the optimizer's own storage; any
    ShardedTensor whose data lives elsewhere is padding, and padding is never read back.
    """
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    owned: set[int] = set()
    for inner in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer]):
        adam = getattr(inner, "optimizer", None)
        if adam is None:
            continue
        for group in adam.param_groups:
            for param in group["params"]:
                owned.add(param.untyped_storage().data_ptr())
                owned.update(t.untyped_storage().data_ptr() for t in adam.state[param].values() if torch.is_tensor(t))
    for model_param in actor.module.parameters():
        owned.add(model_param.untyped_storage().data_ptr())
    stack = [optimizer_state]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend(node)
        elif isinstance(node, ShardedTensor) and torch.is_tensor(node.data) and node.data.numel() \
                and node.data.untyped_storage().data_ptr() not in owned:
            node.data.zero_()


def optimizer_record(distributed: bool) -> dict[str, Any]:
    """The manifest's ``optimizer`` entry: which optimizer saved the checkpoint, and how its state is laid out."""
    if distributed:
        return {"distributed": True, "sharding_type": OPTIMIZER_METADATA["distrib_optim_sharding_type"]}
    return {"distributed": False}


def _saved_with_distributed_optimizer(step_dir: Path, manifest: dict[str, Any]) -> bool | None:
    """Whether ``step_dir`` holds a distributed optimizer's state; ``None`` when it cannot tell.

    The manifest's ``optimizer`` entry, or for a checkpoint saved before the manifest recorded it,
    megatron's ``weights/common.pt`` (a few KB, read with ``weights_only=True``): the distributed
    optimizer stores its ``param_state_sharding_type`` there, the regular one its param groups.
    """
    recorded = manifest.get("optimizer")
    if isinstance(recorded, dict) and isinstance(recorded.get("distributed"), bool):
        return recorded["distributed"]
    try:
        common = torch.load(step_dir / WEIGHTS_DIR / "common.pt", map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, UnpicklingError):
        return None
    optimizer = common.get("optimizer") if isinstance(common, dict) else None
    if not isinstance(optimizer, dict):
        return None  # model weights only (winnow convert hf-to-megatron)
    return "param_state_sharding_type" in optimizer


def _describe_layout(layout: dict[str, Any]) -> str:
    return f"TP={layout['tensor_parallel']}, PP={layout['pipeline_parallel']}, DP={layout['data_parallel']}"


def _optimizer_name(distributed: bool) -> str:
    return "the distributed optimizer" if distributed else "the regular optimizer"


def conversion_commands(step_dir: Path, *, tensor_parallel: int, pipeline_parallel: int) -> tuple[str, Path]:
    """The ``winnow convert`` commands that rewrite the weights of ``step_dir`` for another TP/PP layout.

    The round trip through Hugging Face (in fp32) re-verifies the logits under the new layout (the
    logit gate on ``tensor_parallel`` × ``pipeline_parallel`` ranks). Its outputs go beside the run's
    checkpoint directory; the result holds model weights only, a new run's ``policy``. Returns the
    commands and that result's directory.
    """
    checkpoints = step_dir.parent
    hf_dir = checkpoints.with_name(f"{checkpoints.name}-{step_dir.name}-hf")
    new_dir = checkpoints.with_name(f"{checkpoints.name}-tp{tensor_parallel}-pp{pipeline_parallel}")
    return (f"winnow convert megatron-to-hf --ckpt {step_dir} --out {hf_dir} --dtype fp32 && winnow convert "
            f"hf-to-megatron --hf {hf_dir} --out {new_dir} --tp {tensor_parallel} --pp {pipeline_parallel}"), new_dir


def check_resume_layout(step_dir: Path, *, tensor_parallel: int, pipeline_parallel: int, data_parallel: int,
                        distributed_optimizer: bool) -> None:
    """Raise ``CheckpointError`` unless this layout and optimizer can resume from ``step_dir``; reads no tensor.

    What loads: the regular optimizer's state under any TP/PP/DP layout (megatron keys it by
    parameter), the distributed optimizer's under any DP size at the TP/PP layout that saved it
    (its buckets are cut by TP/PP; ``tests/checkpoint/test_reshard.py`` checks DP 2 → 1 and 4 bit
    for bit). What is refused, each with its remedy in the one-line message: a change of optimizer
    kind (the ``trainer.distributed_optimizer`` value that loads it; its default flips with DP),
    and another TP/PP layout for a distributed optimizer's checkpoint (resume at the saved TP/PP,
    or the ``winnow convert`` commands that rewrite the weights for the new layout; the optimizer
    state, schedule and run state are then not carried). A checkpoint whose manifest records no
    layout is left to megatron. Cheap: the manifest (and, for a checkpoint saved before the
    manifest recorded its optimizer, megatron's few-KB ``common.pt``), no collective, the same
    verdict on every rank.
    """
    manifest = json.loads((step_dir / MANIFEST_FILE).read_text())
    saved = manifest.get("layout")
    if not isinstance(saved, dict) or not {"tensor_parallel", "pipeline_parallel", "data_parallel"} <= saved.keys():
        return
    current = {"tensor_parallel": tensor_parallel, "pipeline_parallel": pipeline_parallel,
               "data_parallel": data_parallel}
    saved_distributed = _saved_with_distributed_optimizer(step_dir, manifest)
    same_model_split = all(saved[key] == current[key] for key in ("tensor_parallel", "pipeline_parallel"))
    saved_with = "" if saved_distributed is None else f" with {_optimizer_name(saved_distributed)}"
    problem = (f"cannot resume from {step_dir}: it was saved at {_describe_layout(saved)}{saved_with}, this run is at "
               f"{_describe_layout(current)} with {_optimizer_name(distributed_optimizer)}")
    # megatron keys the regular optimizer's state by parameter and the distributed optimizer's by bucket.
    kind_hint = ("one optimizer's state does not load into the other (trainer.distributed_optimizer is on by default "
                 "when DP > 1)")
    if saved_distributed is False:
        if distributed_optimizer:  # the regular optimizer's state then reshards to this TP/PP too
            raise CheckpointError(f"{problem}; {kind_hint}: set trainer.distributed_optimizer=false to resume")
        return
    if same_model_split:
        if saved_distributed and not distributed_optimizer:
            raise CheckpointError(f"{problem}; {kind_hint}: set trainer.distributed_optimizer=true to resume")
        return
    if saved_distributed is None and not distributed_optimizer:
        return  # nothing says the checkpoint holds a distributed optimizer's state: megatron reshards the rest
    commands, new_dir = conversion_commands(step_dir, tensor_parallel=tensor_parallel,
                                            pipeline_parallel=pipeline_parallel)
    also = "" if distributed_optimizer else " with trainer.distributed_optimizer=true"
    raise CheckpointError(
        f"{problem}; the distributed optimizer's state (Adam moments, fp32 master weights) is stored in buckets of "
        f"its TP/PP layout, so only DP may change on resume: resume at TP={saved['tensor_parallel']}, "
        f"PP={saved['pipeline_parallel']} (any DP){also}, or convert the weights to the new layout with `{commands}` "
        f"and start a new run from them (policy={new_dir}, a new checkpoint.directory); the optimizer state, "
        f"learning-rate schedule and data position are not carried")


class CheckpointManager:
    """Saves and restores checkpoints under one directory; every rank calls every method."""

    def __init__(self, directory: str | Path, *, keep_last: int, rank: int = 0, world_size: int = 1) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be ≥ 1, got {keep_last}")
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.rank = rank
        self.world_size = world_size

    # ------------------------------------------------------------------ paths
    def step_path(self, step: int) -> Path:
        return self.directory / step_dir_name(step)

    def list_steps(self) -> list[int]:
        return list_steps(self.directory)

    def _failed_ranks(self, failure: BaseException | None) -> dict[str, list[int]]:
        """Every rank's failure, as ``{cause: ranks}``, the same on every rank; empty when none failed.

        A collective that takes the place of a barrier, so every rank calls it at the same point:
        a rank whose write failed used to raise alone while the others waited at the next barrier.
        """
        cause = None if failure is None else describe_failure(failure)
        causes = all_gather_objects(cause, world_size=self.world_size)  # short strings from our own ranks
        ranks_by_cause: dict[str, list[int]] = {}
        for rank, text in enumerate(causes):
            if text is not None:
                ranks_by_cause.setdefault(text, []).append(rank)
        return ranks_by_cause

    def _raise_failure(self, ranks_by_cause: dict[str, list[int]], *, action: str, final: Path,
                       tmp: Path | None, failure: BaseException | None) -> NoReturn:
        """Raise the ``CheckpointWriteError`` for a failed save; rank 0 first removes the partial ``tmp``."""
        if tmp is not None and self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # on a full disk, give the space back
        if self.world_size == 1:
            detail = ": " + next(iter(ranks_by_cause))
        else:  # DCP reports one writer's failure on every rank: each distinct cause once, with its ranks
            detail = " on " + "; ".join(f"rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))}: {text}"
                                        for text, ranks in ranks_by_cause.items())
        raise CheckpointWriteError(f"{action} checkpoint {final} failed{detail}; the previous checkpoint is intact") \
            from failure

    def _agree(self, failure: BaseException | None, *, action: str, final: Path, tmp: Path | None) -> None:
        if ranks_by_cause := self._failed_ranks(failure):
            self._raise_failure(ranks_by_cause, action=action, final=final, tmp=tmp, failure=failure)

    # ------------------------------------------------------------------ save
    def save(self, step: int, *, actor, state: dict[str, Any] | None = None,
             tensors: dict[str, torch.Tensor] | None = None, metadata: dict[str, Any] | None = None) -> Path:
        """Write checkpoint ``step`` atomically; returns its final path.

        A failed write raises ``CheckpointWriteError`` on every rank, naming the ranks that failed: the
        ranks agree after each phase (prepare, write, publish) where they used to meet at a barrier.
        """
        final = self.step_path(step)
        tmp = final.with_name(final.name + ".tmp")
        failure: BaseException | None = None
        if self.rank == 0:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
                if tmp.exists():
                    shutil.rmtree(tmp)  # a previous crash mid-save
                (tmp / WEIGHTS_DIR).mkdir(parents=True)
                (tmp / "ranks").mkdir()
            except OSError as error:
                failure = error
        self._agree(failure, action="writing", final=final, tmp=tmp)
        actor.prepare_optimizer_state()
        model_state = actor.module.sharded_state_dict()
        sharded_state = {"model": model_state,
                         "optimizer": actor.optimizer.sharded_state_dict(model_state, metadata=OPTIMIZER_METADATA)}
        if actor.distributed_optimizer:
            _zero_uninitialized_padding(sharded_state["optimizer"], actor)
        # megatron's writer processes die with this one: after a kill -9 none writes into step_N.tmp.
        megatron_checkpoint_writers_die_with_this_process()
        try:
            dist_checkpointing.save(sharded_state, str(tmp / WEIGHTS_DIR))
        except CheckpointException as error:
            failure = error  # DCP gathered its writers' failures and raised on every rank
        except _WRITE_FAILURES as error:
            # megatron writes common.pt and metadata.json on rank 0 alone, between DCP's collectives:
            # the other ranks wait for it inside megatron, where no agreement reaches them. They stop
            # when this process exits (torchrun then ends the job).
            self._raise_failure({describe_failure(error): [self.rank]}, action="writing", final=final,
                                tmp=tmp, failure=error)
        if failure is None:
            try:
                _write_json(
                    tmp / "ranks" / f"rank_{self.rank:05d}.json",
                    {"rng": capture_rng_state(), "schedule": actor.schedule.state_dict(),
                     "num_skipped_steps": actor.num_skipped_steps},
                )
                if self.rank == 0:
                    _write_json(tmp / "state.json", {"step": step, **(state or {})})
                    save_file({k: v.contiguous() for k, v in (tensors or {}).items()}, str(tmp / "tensors.safetensors"))
            except _WRITE_FAILURES as error:
                failure = error
        self._agree(failure, action="writing", final=final, tmp=tmp)
        if self.rank == 0:
            try:
                self._publish(tmp, final, step, {**actor.checkpoint_metadata(),
                                                 "optimizer": optimizer_record(actor.distributed_optimizer),
                                                 **(metadata or {})})
            except OSError as error:
                failure = error
        # A failed publish keeps the complete .tmp (nothing names it; the next save replaces it).
        self._agree(failure, action="finishing", final=final, tmp=None)
        return final

    def publish(self, tmp: Path, final: Path, step: int, metadata: dict[str, Any]) -> None:
        """Write the manifest of the finished ``tmp`` directory, rename it to ``final``, update ``latest``."""
        try:
            self._publish(tmp, final, step, metadata)
        except OSError as error:
            raise CheckpointWriteError(f"finishing checkpoint {final} failed: {error}; the previous checkpoint is "
                                       "intact") from error

    def _publish(self, tmp: Path, final: Path, step: int, metadata: dict[str, Any]) -> None:
        files = {}
        for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
            size = path.stat().st_size
            entry: dict[str, Any] = {"size": size}
            if size <= HASHED_FILE_LIMIT:
                entry["sha256"] = file_sha256(path)
            files[str(path.relative_to(tmp))] = entry
        _write_json(tmp / MANIFEST_FILE, {"step": step, "world_size": self.world_size,
                                                   "files": files, **metadata})
        if final.exists():
            shutil.rmtree(final)  # re-saving the same step (e.g. after a resume)
        tmp.rename(final)
        atomic_write_text(self.directory / LATEST_FILE, final.name + "\n")
        for old in self.list_steps()[: -self.keep_last]:
            shutil.rmtree(self.step_path(old), ignore_errors=True)

    # ------------------------------------------------------------------ load
    def verify(self, path: Path) -> None:
        """Raise CheckpointError unless every file of the manifest is present and intact."""
        verify_checkpoint(path)

    def newest_valid(self) -> Path | None:
        """The newest checkpoint that verifies; invalid newer ones are reported and skipped."""
        return newest_valid(self.directory)

    def load(self, path: Path, *, actor) -> LoadedCheckpoint:
        """Restore weights, optimizer, schedule and RNG into ``actor``; return the run state.

        A checkpoint saved under megatron's local layer spec (a CPU run) resumes a Transformer
        Engine actor: the module extra states it lacks (TE's norms) keep the actor's own
        (``load_sharded_weights``); any other missing tensor fails the load. A layout or optimizer
        that cannot load this checkpoint is refused first, from the manifest (``check_resume_layout``).
        """
        self.verify(path)
        context = actor.context
        check_resume_layout(path, tensor_parallel=context.tensor_parallel, pipeline_parallel=context.pipeline_parallel,
                            data_parallel=context.data_parallel, distributed_optimizer=actor.distributed_optimizer)
        actor.prepare_optimizer_state()
        model_state = actor.module.sharded_state_dict()
        loaded = load_sharded_weights(
            {"model": model_state, "optimizer": actor.optimizer.sharded_state_dict(
                model_state, is_loading=True, metadata=OPTIMIZER_METADATA)},
            path / WEIGHTS_DIR,
        )
        # No autograd while copying in: with the distributed optimizer and fp32 weights, the
        # optimizer's parameter shards are views of the model's leaf parameters.
        with torch.no_grad():
            actor.module.load_state_dict(loaded["model"])
            actor.optimizer.load_state_dict(loaded["optimizer"])
        actor.finish_optimizer_load()
        manifest = json.loads((path / MANIFEST_FILE).read_text())
        rank_file = path / "ranks" / f"rank_{self.rank:05d}.json"
        if manifest["world_size"] == self.world_size and rank_file.is_file():
            rank_state = json.loads(rank_file.read_text())
            restore_rng_state(rank_state["rng"])
        else:
            # Another layout: per-rank RNG streams do not map onto the new ranks.
            logger.warning("checkpoint %s was saved by %d ranks; RNG states not restored on %d ranks",
                           path, manifest["world_size"], self.world_size)
            rank_state = json.loads((path / "ranks" / "rank_00000.json").read_text())
        actor.schedule.load_state_dict(rank_state["schedule"])
        actor.num_skipped_steps = rank_state["num_skipped_steps"]
        state = json.loads((path / "state.json").read_text())
        tensors = load_file(str(path / "tensors.safetensors"))
        return LoadedCheckpoint(path=path, step=int(state.pop("step")), state=state, tensors=tensors)

