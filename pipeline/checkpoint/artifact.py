"""What a winnow checkpoint on disk is, and how every reader finds and checks one.

A run directory holds ``step_<8 digits>/`` checkpoints and ``latest``, a one-line file
naming the newest. One step directory (``CheckpointManager`` writes it, ``winnow
convert hf-to-megatron`` too)::

    weights/               megatron dist_checkpointing: the model (+ optimizer from training)
    ranks/, state.json,    training only: per-rank and run state (``CheckpointManager.load``)
    tensors.safetensors
    tokenizer/             optional; also looked for in the run directory and beside it
    manifest.json          written last: every file with its size (and sha256 up to
                           ``HASHED_FILE_LIMIT``), the step, ``model_spec``, layout, ...

Everything that reads a checkpoint goes through here: ``resolve_checkpoint`` (a run or
step directory → one verified step directory), ``checkpoint_spec``, the tokenizer lookup
(``tokenizer_candidates`` / ``find_tokenizer_dir``) and ``load_weights`` (model weights
only, into a ``GPTModel`` of any TP/PP layout). ``is_hf_folder`` tells a Hugging Face
model folder from a winnow checkpoint. megatron is imported only by ``load_weights``, so
this module is cheap to import (``winnow --help``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Iterable
from pathlib import Path
from pickle import UnpicklingError
from typing import Any

import torch

from pipeline.errors import CheckpointError, UserError
from pipeline.models.spec import ModelSpec

__all__ = [
    "EXTRA_STATE_SUFFIX",
    "HASHED_FILE_LIMIT",
    "LATEST_FILE",
    "MANIFEST_FILE",
    "TOKENIZER_DIR",
    "TOKENIZER_FILES",
    "WEIGHTS_DIR",
    "checkpoint_spec",
    "describe_failure",
    "file_sha256",
    "find_tokenizer_dir",
    "is_hf_folder",
    "keep_own_missing_extra_states",
    "list_steps",
    "load_sharded_weights",
    "load_weights",
    "newest_valid",
    "read_manifest",
    "resolve_checkpoint",
    "step_dir_name",
    "tokenizer_candidates",
    "tokenizer_files",
    "verify_checkpoint",
]

logger = logging.getLogger(__name__)

MANIFEST_FILE = "manifest.json"
LATEST_FILE = "latest"
WEIGHTS_DIR = "weights"
TOKENIZER_DIR = "tokenizer"
EXTRA_STATE_SUFFIX = "._extra_state"  # how state-dict and checkpoint keys name ``Module.get_extra_state``
HASHED_FILE_LIMIT = 64 * 2**20  # files above this are checked by size only (hashing TBs costs minutes)

# Everything a transformers fast or slow tokenizer of the supported families may need.
TOKENIZER_FILES: tuple[str, ...] = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)

_STEP_DIR = re.compile(r"^step_(\d{8})$")
_HF_WEIGHT_FILES = (
    "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json"
)


# ---------------------------------------------------------------- layout and verification


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def list_steps(directory: str | os.PathLike[str]) -> list[int]:
    """The steps of the ``step_*`` directories in ``directory``, ascending (verified or not)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(int(m.group(1)) for p in directory.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir())


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify_checkpoint(step_dir: Path) -> None:
    """Raise ``CheckpointError`` unless every file of the manifest is present and intact."""
    manifest_path = step_dir / MANIFEST_FILE
    try:
        manifest = json.loads(manifest_path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{manifest_path} is missing: the checkpoint was never completed") from None
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{manifest_path} is corrupt: {error}") from None
    for name, entry in manifest["files"].items():
        file = step_dir / name
        if not file.is_file():
            raise CheckpointError(f"{file} is missing")
        if file.stat().st_size != entry["size"]:
            raise CheckpointError(f"{file} has {file.stat().st_size} bytes, the manifest says {entry['size']}")
        if "sha256" in entry and file_sha256(file) != entry["sha256"]:
            raise CheckpointError(f"{file} does not match its sha256 in the manifest")


def newest_valid(directory: str | os.PathLike[str]) -> Path | None:
    """The newest checkpoint in ``directory`` that verifies; invalid newer ones are reported and skipped."""
    directory = Path(directory)
    for step in reversed(list_steps(directory)):
        path = directory / step_dir_name(step)
        try:
            verify_checkpoint(path)
            return path
        except CheckpointError as error:
            logger.error("checkpoint %s is unusable (%s); falling back to an older one", path, error)
    return None


def resolve_checkpoint(path: str | os.PathLike[str], *, step: int | None = None) -> Path:
    """The verified ``step_*`` directory that ``path`` designates.

    ``path`` is one ``step_*`` directory (or any directory holding ``manifest.json``) or
    a run directory: there ``step`` picks ``step_<step>``, else the ``latest`` pointer,
    else (no pointer) the newest checkpoint that verifies. A designated checkpoint that
    fails verification is an error, never silently replaced by an older one.
    """
    directory = Path(path)
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint {directory} does not exist or is not a directory")
    is_step_dir = _STEP_DIR.match(directory.name) is not None or (directory / MANIFEST_FILE).is_file()
    if is_step_dir:
        if step is not None:
            raise CheckpointError(f"--step {step}: {directory} is already one checkpoint; pass its run directory")
        chosen = directory
    elif step is not None:
        chosen = directory / step_dir_name(step)
        if not chosen.is_dir():
            raise CheckpointError(f"{chosen} does not exist; steps in {directory}: {list_steps(directory)}")
    elif (directory / LATEST_FILE).is_file():
        name = (directory / LATEST_FILE).read_text().strip()
        chosen = directory / name
        if _STEP_DIR.match(name) is None or not chosen.is_dir():
            raise CheckpointError(
                f"{directory / LATEST_FILE} points to {name!r}, which is not a checkpoint in {directory}"
            )
    else:
        steps = list_steps(directory)
        if not steps:
            raise CheckpointError(
                f"{directory} is not a winnow checkpoint: no {MANIFEST_FILE}, no 'latest' pointer "
                f"and no step_* directories"
            )
        newest = newest_valid(directory)
        if newest is None:
            raise CheckpointError(f"none of the checkpoints {steps} in {directory} verifies (see the log)")
        return newest
    try:
        verify_checkpoint(chosen)
    except UserError as error:
        raise CheckpointError(f"checkpoint {chosen} is unusable: {error}") from error
    except (KeyError, TypeError, AttributeError) as error:
        raise CheckpointError(f"{chosen / MANIFEST_FILE} is malformed: {error!r}") from error
    return chosen


# ---------------------------------------------------------------- manifest


def read_manifest(step_dir: Path) -> dict[str, Any]:
    """The manifest of a verified step directory (``resolve_checkpoint``); it must record a ``model_spec``."""
    manifest = json.loads((step_dir / MANIFEST_FILE).read_text())  # resolve_checkpoint parsed it already
    if not isinstance(manifest, dict) or not isinstance(manifest.get("model_spec"), dict):
        raise CheckpointError(
            f"{step_dir / MANIFEST_FILE} records no model_spec: the checkpoint predates model metadata "
            f"and cannot be rebuilt without the run's config"
        )
    return manifest


def checkpoint_spec(step_dir: Path, *, manifest: dict[str, Any] | None = None) -> ModelSpec:
    """The ``ModelSpec`` a verified step directory records (``manifest``: its ``read_manifest``, if read)."""
    if manifest is None:
        manifest = read_manifest(step_dir)
    try:
        return ModelSpec(**manifest["model_spec"])
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"{step_dir / MANIFEST_FILE}: invalid model_spec: {error}") from error


# ---------------------------------------------------------------- Hugging Face folders and tokenizers


def is_hf_folder(path: Path) -> bool:
    """A Hugging Face model folder: ``config.json`` beside safetensors or pytorch weights."""
    return (path / "config.json").is_file() and any((path / name).is_file() for name in _HF_WEIGHT_FILES)


def tokenizer_files(folder: Path) -> list[Path]:
    """The ``TOKENIZER_FILES`` that ``folder`` holds; empty when none or no folder."""
    return [folder / name for name in TOKENIZER_FILES if (folder / name).is_file()]


def tokenizer_candidates(step_dir: Path) -> list[Path]:
    """Where a checkpoint's tokenizer may live, in order: the manifest's ``tokenizer`` pointer
    (relative to the step; the bootstrap stage records one), ``<step>/tokenizer/``,
    ``<run>/tokenizer/`` (where hf-to-megatron puts it), then the run's parent's (a
    bootstrap cache entry)."""
    candidates = []
    manifest_path = step_dir / MANIFEST_FILE
    if manifest_path.is_file():
        pointer = json.loads(manifest_path.read_text()).get("tokenizer")
        if isinstance(pointer, str):
            candidates.append((step_dir / pointer).resolve())
    run_dir = step_dir.parent
    return [*candidates, step_dir / TOKENIZER_DIR, run_dir / TOKENIZER_DIR, run_dir.parent / TOKENIZER_DIR]


def find_tokenizer_dir(explicit: str | os.PathLike[str] | None, *, candidates: Iterable[Path]) -> Path | None:
    """``explicit`` if given, else the first of ``candidates`` holding tokenizer files; ``None`` if none does.

    ``candidates``: ``tokenizer_candidates(step_dir)`` for a winnow checkpoint, ``[folder]``
    for a Hugging Face folder. An ``explicit`` folder without tokenizer files is an error,
    never silently replaced by a candidate. Callers decide whether no tokenizer is an error.
    """
    if explicit is not None:
        folder = Path(explicit)
        if not tokenizer_files(folder):
            raise CheckpointError(
                f"tokenizer {folder}: not a folder holding tokenizer files ({', '.join(TOKENIZER_FILES[:2])}, ...)"
            )
        return folder
    return next((folder for folder in candidates if tokenizer_files(folder)), None)


# ---------------------------------------------------------------- weights


def load_weights(path: str | os.PathLike[str], module: torch.nn.Module) -> Path:
    """Load only the model weights of a winnow checkpoint into ``module``; return its step directory.

    ``path``: a run directory or a ``step_*`` directory, resolved and verified by
    ``resolve_checkpoint``; from training (weights + optimizer) or from ``winnow convert
    hf-to-megatron`` (weights only). ``module`` is this rank's ``GPTModel`` under any TP/PP
    layout (megatron reshards whatever layout saved it) and either layer spec (a TE model
    loads a local-spec checkpoint, ``load_sharded_weights``); every rank calls this. Used to
    start from another run's policy: the optimizer, schedule and RNG states are not
    touched, so they start fresh.
    """
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from torch.distributed.checkpoint import CheckpointException

    step_dir = resolve_checkpoint(path)
    weights = step_dir / WEIGHTS_DIR
    if not weights.is_dir():
        raise CheckpointError(f"{weights} does not exist: not a winnow checkpoint")
    try:
        loaded = load_sharded_weights({"model": module.sharded_state_dict()}, weights)
        module.load_state_dict(loaded["model"])
    except CheckpointError:
        raise
    except (CheckpointingException, CheckpointException, RuntimeError, ValueError, KeyError, OSError) as error:
        raise CheckpointError(
            f"cannot load the model weights from {weights} into the model its manifest describes: "
            f"{describe_failure(error)}"
        ) from error
    return step_dir


def load_sharded_weights(sharded_state: dict[str, Any], weights: Path) -> dict[str, Any]:
    """``dist_checkpointing.load``, refusing a checkpoint that pickles more than tensors and plain data.

    megatron reads ``common.pt`` with ``torch.load`` at torch's default, ``weights_only=True``: a file
    crafted to run code when unpickled fails with an ``UnpicklingError`` whose text suggests
    retrying with ``weights_only=False`` — the one thing not to do with a checkpoint from elsewhere.

    Module extra states the checkpoint lacks keep the module's own (``keep_own_missing_extra_states``):
    a Transformer Engine model loads what megatron's local layer spec wrote. Every other tensor or
    object the model asks for and the checkpoint lacks still fails the load.
    """
    from megatron.core import dist_checkpointing

    try:
        return dist_checkpointing.load(keep_own_missing_extra_states(sharded_state, weights), str(weights))
    except UnpicklingError as error:
        # torch's text goes on to suggest weights_only=False or allow-listing the global: not here.
        detail = str(error).split("WeightsUnpickler error:", 1)[-1].strip()
        reason = (detail.splitlines() or ["UnpicklingError"])[0].split(" Please", 1)[0]
        raise CheckpointError(
            f"{weights} holds pickled objects that are not tensors or plain data ({reason}); refused: "
            "unpickling a checkpoint from an untrusted source can run arbitrary code"
        ) from error


def keep_own_missing_extra_states(sharded_state: dict[str, Any], weights: Path) -> dict[str, Any]:
    """``sharded_state`` with each module extra state that ``weights`` lacks replaced by the module's own.

    Why: Transformer Engine's ``RMSNorm`` (megatron's ``TENorm``: the final norm, Qwen3's q/k
    norms) defines ``get_extra_state`` (its FP8 metadata), so megatron asks a TE model's checkpoint
    for ``decoder.final_layernorm._extra_state`` and the like as ``ShardedObject``s. megatron's local
    layer spec (``winnow convert hf-to-megatron``, CPU runs) builds torch norms, which have no extra
    state, so its checkpoints hold none of these, and torch's DCP would fail the whole load with
    "Missing key". Exactly those objects (key ending in ``._extra_state``, key absent from the
    checkpoint) become ``LocalNonpersistentObject``s of the module's current extra state: the load
    hands each back unchanged, so ``load_state_dict`` (strict) calls ``set_extra_state`` with the
    module's own state, the round trip a TE-written checkpoint takes too. Everything else is left
    as it is, so a missing weight still fails inside DCP, on every rank alike.

    Cost: each rank reads the checkpoint's DCP metadata file once more (every rank reads it again
    inside the load; megatron's strict load modes read it the same way), no collective. The
    decision depends only on an object's key, so all ranks holding that object agree.
    """
    from megatron.core.dist_checkpointing import LocalNonpersistentObject, ShardedObject
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_outplace
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    saved_keys = {entry.key for entry in load_sharded_metadata(str(weights)).values()}
    kept: list[str] = []

    def keep_own_if_missing(value: Any) -> Any:
        if isinstance(value, ShardedObject) and value.key.endswith(EXTRA_STATE_SUFFIX) \
                and value.key not in saved_keys:
            kept.append(value.key)
            return LocalNonpersistentObject(value.data)
        return value

    adjusted = dict_list_map_outplace(keep_own_if_missing, sharded_state)
    if kept:
        logger.info("%s holds no extra state for %d module(s) (a checkpoint of megatron's local layer spec); "
                    "they keep their own: %s", weights, len(set(kept)), ", ".join(sorted(set(kept))))
    return adjusted


def describe_failure(error: BaseException) -> str:
    """The first lines of a checkpoint read/write failure, unwrapping torch's per-rank ``CheckpointException``."""
    # torch's CheckpointException wraps each rank's error with its traceback
    # (`failures`: rank -> (exception, stack)); the first one names the tensor.
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        error = first[0] if isinstance(first, tuple) else first
    lines = [line for line in str(error).splitlines() if line.strip()]
    return " / ".join(lines[:3]) if lines else type(error).__name__
