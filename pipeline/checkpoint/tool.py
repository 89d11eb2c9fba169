"""``winnow convert``: Hugging Face ⇄ winnow (megatron) checkpoints, behind a logit gate.

Two directions, each a CLI command (``add_*_arguments`` / ``run_*``) over a library
function that returns a ``ConversionSummary``:

* ``megatron_to_hf``: a winnow checkpoint (a run directory, resolved through
  ``latest``, or one ``step_*`` directory) → an HF folder that ``transformers`` and
  SGLang load. The weights are read with megatron ``dist_checkpointing`` into a
  TP=1/PP=1 model, whatever layout saved them (it reshards), then mapped with
  ``hf_map.PARAM_MAP`` and written by ``write_hf_checkpoint``.
* ``hf_to_megatron``: an HF folder → a run directory holding ``step_00000000/``
  (model weights only: the optimizer starts fresh), a ``latest`` pointer and the
  tokenizer under ``tokenizer/``. ``load_model_weights`` loads it, or the model part of
  any training checkpoint, into a ``GPTModel`` of any TP/PP layout.

The verification gate (on unless ``verify=False``): the output is loaded back the way
its consumer will load it (``transformers.AutoModelForCausalLM`` without
``trust_remote_code``; megatron ``dist_checkpointing`` under the recorded TP/PP layout)
and its logits on a fixed seeded batch (``GATE_BATCH`` rows of ``GATE_SEQ_LEN``
tokens, no padding, explicit causal mask on the megatron side) are compared with the
source model's in fp32. A maximum absolute difference above ``atol`` (``GATE_ATOL``
= 1e-4) fails the conversion. For a bf16/fp16 export both sides use the same rounded
weights (the megatron weights are cast to the export dtype and back), so the gate
checks the conversion rather than the precision loss; that loss is measured on the
same batch and reported. Everything is written into a temporary sibling of the output
and renamed into place only after the gate passed: on any failure nothing exists under
the output name and an existing output (``overwrite``) is left intact.

Every user-facing failure is a ``CheckpointError`` (a ``UserError``): the CLI prints one
``error:`` line and exits 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import torch
from tqdm import tqdm

from pipeline.checkpoint.convert import copy_into_model, hf_to_megatron_state, megatron_to_hf_state
from pipeline.checkpoint.hf_io import (
    GENERATION_CONFIG_FILE,
    INDEX_FILE,
    SINGLE_FILE,
    TOKENIZER_FILES,
    CheckpointError,
    HFCheckpointReader,
    move_into_place,
    write_hf_checkpoint,
)
from pipeline.checkpoint.hf_map import MegatronLayout, expected_hf_shapes, expected_megatron_shapes
from pipeline.errors import UserError
from pipeline.models.spec import ModelSpec
from pipeline.parallel.launch import RankFailure, free_port, run_ranks

# megatron-core and transformers take seconds to import: they are imported where used, so
# that registering these commands keeps `winnow --help` fast.

__all__ = [
    "GATE_ATOL",
    "GATE_BATCH",
    "GATE_SEQ_LEN",
    "ConversionSummary",
    "add_hf_to_megatron_arguments",
    "add_megatron_to_hf_arguments",
    "build_parser",
    "hf_to_megatron",
    "load_model_weights",
    "main",
    "megatron_to_hf",
    "parse_size",
    "resolve_checkpoint",
    "run_hf_to_megatron",
    "run_megatron_to_hf",
]

GATE_ATOL = 1e-4
GATE_BATCH, GATE_SEQ_LEN, GATE_SEED = 2, 64, 1234
TOKENIZER_DIR = "tokenizer"
MANIFEST_FILE = "manifest.json"
INIT_STEP = 0

_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
_STEP_DIR = re.compile(r"^step_(\d{8})$")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {
    "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}


@dataclass(slots=True, kw_only=True)
class ConversionSummary:
    """What a conversion wrote and how the gate went."""

    direction: str
    source: Path
    output: Path
    num_tensors: int
    num_bytes: int
    num_files: int
    dtype: str
    layout: tuple[int, int] = (1, 1)  # (tensor_parallel, pipeline_parallel)
    tokenizer: Path | None = None
    atol: float = GATE_ATOL
    max_logit_diff: float | None = None  # None: the gate was skipped
    rounding_logit_diff: float | None = None  # bf16/fp16 export vs the fp32 weights
    seconds: dict[str, float] = field(default_factory=dict)

    def format(self) -> str:
        lines = [
            f"{self.direction}: {self.source} -> {self.output}",
            f"  wrote {self.num_tensors} tensors, {_format_bytes(self.num_bytes)} ({self.dtype}) "
            f"in {self.num_files} file{'s' if self.num_files != 1 else ''}",
            f"  tokenizer: {self.tokenizer if self.tokenizer is not None else 'none'}",
        ]
        if self.max_logit_diff is None:
            lines.append("  verification: skipped (--no-verify)")
        else:
            tp, pp = self.layout
            lines.append(
                f"  verification: passed, max |logit diff| {self.max_logit_diff:.3g} <= {self.atol:g} "
                f"on {GATE_BATCH}x{GATE_SEQ_LEN} tokens (megatron TP={tp}, PP={pp})"
            )
        if self.rounding_logit_diff is not None:
            lines.append(
                f"  {self.dtype} rounding moved the logits by up to {self.rounding_logit_diff:.3g} "
                f"(vs the fp32 weights; not gated)"
            )
        phases = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.seconds.items())
        lines.append(f"  time: {phases}, total {sum(self.seconds.values()):.1f} s")
        return "\n".join(lines)


def _format_bytes(num_bytes: int) -> str:
    exponent = min(int(math.log(num_bytes, 1024)), 4) if num_bytes >= 1024 else 0
    return f"{num_bytes / 1024**exponent:.1f} {('B', 'KiB', 'MiB', 'GiB', 'TiB')[exponent]}"


def parse_size(text: str) -> int:
    """``"5GB"`` → bytes, with transformers' convention: KB/MB/GB are powers of 1000, KiB/MiB/GiB of 1024."""
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"invalid size {text!r}: expected e.g. 5GB, 500MB, 2GiB or a number of bytes")
    number, unit = match.groups()
    num_bytes = int(float(number) * _SIZE_UNITS[(unit or "B").upper()])
    if num_bytes < 1:
        raise ValueError(f"invalid size {text!r}: must be at least one byte")
    return num_bytes


# ---------------------------------------------------------------- checkpoints


def resolve_checkpoint(path: str | os.PathLike[str], *, step: int | None = None) -> Path:
    """The verified ``step_*`` directory that ``path`` designates.

    ``path`` is one ``step_*`` directory (or any directory holding ``manifest.json``) or
    a run directory: there ``step`` picks ``step_<step>``, else the ``latest`` pointer,
    else (no pointer) the newest checkpoint that verifies. A designated checkpoint that
    fails verification is an error, never silently replaced by an older one.
    """
    from pipeline.trainer.checkpoint import CheckpointManager

    directory = Path(path)
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint {directory} does not exist or is not a directory")
    is_step_dir = _STEP_DIR.match(directory.name) is not None or (directory / MANIFEST_FILE).is_file()
    manager = CheckpointManager(directory.parent if is_step_dir else directory, keep_last=1)
    if is_step_dir:
        if step is not None:
            raise CheckpointError(f"--step {step}: {directory} is already one checkpoint; pass its run directory")
        chosen = directory
    elif step is not None:
        chosen = manager.step_path(step)
        if not chosen.is_dir():
            raise CheckpointError(f"{chosen} does not exist; steps in {directory}: {manager.list_steps()}")
    elif (directory / "latest").is_file():
        name = (directory / "latest").read_text().strip()
        chosen = directory / name
        if _STEP_DIR.match(name) is None or not chosen.is_dir():
            raise CheckpointError(
                f"{directory / 'latest'} points to {name!r}, which is not a checkpoint in {directory}"
            )
    else:
        steps = manager.list_steps()
        if not steps:
            raise CheckpointError(
                f"{directory} is not a winnow checkpoint: no {MANIFEST_FILE}, no 'latest' pointer "
                f"and no step_* directories"
            )
        newest = manager.newest_valid()
        if newest is None:
            raise CheckpointError(f"none of the checkpoints {steps} in {directory} verifies (see the log)")
        return newest
    try:
        manager.verify(chosen)
    except UserError as error:
        raise CheckpointError(f"checkpoint {chosen} is unusable: {error}") from error
    except (KeyError, TypeError, AttributeError) as error:
        raise CheckpointError(f"{chosen / MANIFEST_FILE} is malformed: {error!r}") from error
    return chosen


def _read_manifest(step_dir: Path) -> dict[str, Any]:
    manifest = json.loads((step_dir / MANIFEST_FILE).read_text())  # resolve_checkpoint parsed it already
    if not isinstance(manifest, dict) or not isinstance(manifest.get("model_spec"), dict):
        raise CheckpointError(
            f"{step_dir / MANIFEST_FILE} records no model_spec: the checkpoint predates model metadata "
            f"and cannot be converted without the run's config"
        )
    return manifest


def _spec_from_manifest(manifest: dict[str, Any], *, step_dir: Path) -> ModelSpec:
    try:
        return ModelSpec(**manifest["model_spec"])
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"{step_dir / MANIFEST_FILE}: invalid model_spec: {error}") from error


def checkpoint_spec(step_dir: Path) -> ModelSpec:
    """The ``ModelSpec`` a verified step directory (``resolve_checkpoint``) records."""
    return _spec_from_manifest(_read_manifest(step_dir), step_dir=step_dir)


def _load_step_weights(step_dir: Path, module: torch.nn.Module) -> None:
    # Imported here: the trainer's checkpoint module loads megatron, which `--help` should not.
    from pipeline.trainer.checkpoint import load_model_weights as load_step_weights

    load_step_weights(step_dir, module)


def load_model_weights(path: str | os.PathLike[str], module: torch.nn.Module) -> Path:
    """Load only the model weights of a winnow checkpoint into ``module``; return the step directory.

    ``path``: a run directory or a ``step_*`` directory (see ``resolve_checkpoint``), from
    training (weights + optimizer) or from ``hf-to-megatron`` (weights only). ``module``
    is this rank's ``GPTModel`` under any TP/PP layout; every rank calls this. The
    optimizer, schedule and RNG states are not touched: a run starting from converted
    weights starts them fresh.
    """
    step_dir = resolve_checkpoint(path)
    _load_step_weights(step_dir, module)
    return step_dir


# ---------------------------------------------------------------- megatron in this process


@contextmanager
def _single_rank_megatron() -> Iterator[None]:
    """A one-rank megatron layout for this process: reused if the process already has one."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from pipeline.parallel.context import ParallelContext

    # The one check outside pipeline/parallel: a host process (a test session, a driver
    # that already trains) may own the process group, and megatron cannot be initialized twice.
    if parallel_state.model_parallel_is_initialized():
        sizes = (
            dist.get_world_size(),
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
        )
        if sizes != (1, 1, 1):
            raise UserError(
                f"conversion needs a one-rank process; this one already runs megatron on {sizes[0]} ranks "
                f"(TP={sizes[1]}, PP={sizes[2]})"
            )
        yield
        return
    if dist.is_initialized() and dist.get_world_size() != 1:
        raise UserError(
            f"conversion needs a one-rank process; this one is part of a {dist.get_world_size()}-rank group"
        )
    context = ParallelContext.initialize(
        tensor_parallel=1,
        pipeline_parallel=1,
        seed=GATE_SEED,
        rank=0,
        world_size=1,
        local_rank=0,
        master_addr="127.0.0.1",
        master_port=free_port(),
    )
    try:
        yield
    finally:
        context.destroy()


def _build_model(spec: ModelSpec, *, parallel_context: Any = None) -> torch.nn.Module:
    """megatron's local layer spec everywhere: its checkpoint keys equal TE's (``sharded_state_dict_keys_map``)."""
    from pipeline.models.factory import build_gpt_model
    from pipeline.models.layer_spec import select_layer_spec

    return build_gpt_model(
        spec, parallel_context=parallel_context, layer_spec=select_layer_spec(spec, prefer_te=False)
    ).eval()


# ---------------------------------------------------------------- the gate


def _gate_input_ids(spec: ModelSpec) -> torch.Tensor:
    seq_len = min(GATE_SEQ_LEN, spec.max_position_embeddings)
    generator = torch.Generator().manual_seed(GATE_SEED)
    return torch.randint(0, spec.vocab_size, (GATE_BATCH, seq_len), generator=generator)  # (B, T)


def _megatron_inputs(input_ids: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, ...]:
    batch, seq_len = input_ids.shape
    position_ids = torch.arange(seq_len).expand(batch, seq_len)  # (B, T)
    # megatron's convention, True = masked. Explicit: without one megatron builds it on "cuda".
    causal_mask = torch.ones(1, 1, seq_len, seq_len, dtype=torch.bool).triu_(1)  # (1, 1, T, T)
    return input_ids.to(device), position_ids.to(device), causal_mask.to(device)


def _megatron_logits(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """(B, T, V) fp32 logits of an unsplit (TP=1, PP=1) model."""
    device = next(model.parameters()).device
    with torch.no_grad():
        return model(*_megatron_inputs(input_ids, device)).float().cpu()


def _hf_logits(folder: Path, input_ids: torch.Tensor) -> torch.Tensor:
    """(B, T, V) fp32 logits of the HF folder, loaded as its users will load it."""
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(
            folder, local_files_only=True, trust_remote_code=False, dtype=torch.float32, attn_implementation="eager"
        )
    except (OSError, ValueError, KeyError, RuntimeError) as error:
        raise CheckpointError(f"transformers cannot load {folder}: {_first_lines(str(error))}") from error
    with torch.no_grad():
        return model.eval()(input_ids).logits.float()


def _logit_diff(expected: torch.Tensor, actual: torch.Tensor, *, atol: float, what: str) -> float:
    """Max |expected - actual|; raises when above ``atol`` or not finite."""
    if expected.shape != actual.shape:
        raise CheckpointError(
            f"verification failed: {what}: logits of shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
        )
    if not torch.isfinite(expected).all():
        raise CheckpointError(f"verification failed: {what}: the source model's logits are not finite")
    diff = (expected - actual).abs()  # (B, T, V)
    worst = float(diff.max()) if torch.isfinite(diff).all() else float("inf")
    if not worst <= atol:
        b, t, v = (int(i) for i in torch.unravel_index(diff.nan_to_num(float("inf")).argmax(), diff.shape))
        raise CheckpointError(
            f"verification failed: {what}: max |logit diff| {worst:.4g} > tolerance {atol:g} "
            f"(row {b}, position {t}, token {v}); nothing was written"
        )
    return worst


# ---------------------------------------------------------------- output handling


def _check_output(out: Path, *, source: Path, overwrite: bool, atol: float) -> None:
    if not (math.isfinite(atol) and atol > 0):
        raise UserError(f"--atol: expected a positive tolerance, got {atol}")
    if not out.parent.is_dir():
        raise CheckpointError(f"cannot write {out}: parent folder {out.parent} does not exist")
    out_path, source_path = out.resolve(), source.resolve()
    if out_path == source_path or out_path in source_path.parents or source_path in out_path.parents:
        raise CheckpointError(f"cannot write {out}: it overlaps the input {source}; choose another --out")
    if out.exists() and not overwrite:
        raise CheckpointError(f"cannot write {out}: it already exists (pass --overwrite to replace it)")


@contextmanager
def _staging_sibling(out: Path) -> Iterator[Path]:
    """A temporary folder next to ``out`` (same filesystem, so renames are atomic), always removed."""
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.convert-", dir=out.parent))
    try:
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _publish(staged: Path, out: Path, *, overwrite: bool) -> None:
    # mkdtemp creates folders readable by their owner only; a published model is read by
    # serving jobs and colleagues, so it gets the permissions a plain mkdir would give.
    umask = os.umask(0)
    os.umask(umask)
    staged.chmod(0o777 & ~umask)
    move_into_place(staged, out, overwrite=overwrite)


def _tokenizer_files(folder: Path) -> list[Path]:
    return [folder / name for name in TOKENIZER_FILES if (folder / name).is_file()]


def tokenizer_candidates(step_dir: Path) -> list[Path]:
    """Where a checkpoint's tokenizer may live, in order: the manifest's ``tokenizer`` pointer
    (relative to the step; the bootstrap stage records one), ``<step>/tokenizer/``,
    ``<run>/tokenizer/`` (where hf-to-megatron puts it), then the run's parent's."""
    candidates = []
    manifest_path = step_dir / "manifest.json"
    if manifest_path.is_file():
        pointer = json.loads(manifest_path.read_text()).get("tokenizer")
        if isinstance(pointer, str):
            candidates.append((step_dir / pointer).resolve())
    run_dir = step_dir.parent
    return [*candidates, step_dir / TOKENIZER_DIR, run_dir / TOKENIZER_DIR, run_dir.parent / TOKENIZER_DIR]


def _find_tokenizer(explicit: str | os.PathLike[str] | None, *, step_dir: Path) -> Path | None:
    """``--tokenizer``, else the first of ``tokenizer_candidates(step_dir)`` holding tokenizer files."""
    if explicit is not None:
        folder = Path(explicit)
        if not folder.is_dir() or not _tokenizer_files(folder):
            raise CheckpointError(f"--tokenizer {folder}: not a folder holding tokenizer files")
        return folder
    for folder in tokenizer_candidates(step_dir):
        if folder.is_dir() and _tokenizer_files(folder):
            return folder
    return None


def _first_lines(text: str, num_lines: int = 3) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return " | ".join(lines[:num_lines]) + (" ..." if len(lines) > num_lines else "")


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _progress(items: Iterable[Any], *, total: int, desc: str) -> Iterable[Any]:
    # disable=None: a bar on a terminal, nothing in log files.
    return tqdm(items, total=total, desc=desc, unit="tensor", disable=None, file=sys.stderr)


# ---------------------------------------------------------------- megatron → HF


def _export_tensors(
    named_tensors: Iterable[tuple[str, torch.Tensor]], *, dtype: torch.dtype, counts: dict[str, int]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Cast to the export dtype, refusing non-finite values (a diverged run, an fp16 overflow)."""
    for name, tensor in named_tensors:
        cast = tensor.detach().to(dtype)
        if not torch.isfinite(cast).all():
            source_finite = bool(torch.isfinite(tensor).all())
            raise CheckpointError(
                f"tensor {name!r} has non-finite values "
                + ("in the checkpoint" if not source_finite else f"after casting to {dtype} (out of range)")
            )
        counts["tensors"] += 1
        counts["bytes"] += cast.numel() * cast.element_size()
        yield name, cast


def megatron_to_hf(
    *,
    checkpoint: str | os.PathLike[str],
    out: str | os.PathLike[str],
    tokenizer: str | os.PathLike[str] | None = None,
    step: int | None = None,
    dtype: str = "auto",
    max_shard_bytes: int = 5 * 10**9,
    verify: bool = True,
    atol: float = GATE_ATOL,
    overwrite: bool = False,
) -> ConversionSummary:
    """Export a winnow checkpoint as an HF folder at ``out``; see the module docstring.

    ``dtype``: ``"fp32"``, ``"bf16"``, ``"fp16"`` or ``"auto"`` (the dtype of the HF model
    the run came from when ``hf-to-megatron`` recorded one, else fp32, lossless for the
    fp32 weights training saves).
    """
    started = time.perf_counter()
    seconds: dict[str, float] = {}
    out = Path(out)
    if dtype != "auto" and dtype not in _DTYPES:
        raise UserError(f"--dtype {dtype!r}: expected one of {['auto', *_DTYPES]}")
    _check_output(out, source=Path(checkpoint), overwrite=overwrite, atol=atol)
    step_dir = resolve_checkpoint(checkpoint, step=step)
    manifest = _read_manifest(step_dir)
    spec = _spec_from_manifest(manifest, step_dir=step_dir)
    tokenizer_dir = _find_tokenizer(tokenizer, step_dir=step_dir)
    if tokenizer_dir is None:
        _say(f"note: no tokenizer found for {step_dir} (pass --tokenizer); exporting the weights only")
    if dtype == "auto":
        dtype_name = manifest.get("hf_dtype") if manifest.get("hf_dtype") in _DTYPES.values() else "float32"
    else:
        dtype_name = _DTYPES[dtype]
    export_dtype = getattr(torch, dtype_name)

    with _single_rank_megatron(), _staging_sibling(out) as staging:
        model = _build_model(spec)
        _load_step_weights(step_dir, model)
        seconds["load"] = time.perf_counter() - started

        phase = time.perf_counter()
        counts = {"tensors": 0, "bytes": 0}
        hf_tensors = megatron_to_hf_state([[model.state_dict()]], spec=spec, layout=MegatronLayout.build(spec))
        staged = write_hf_checkpoint(
            staging / out.name,
            _progress(
                _export_tensors(hf_tensors, dtype=export_dtype, counts=counts),
                total=len(expected_hf_shapes(spec)),
                desc="megatron -> HF",
            ),
            spec=spec,
            tokenizer_dir=tokenizer_dir,
            max_shard_bytes=max_shard_bytes,
        )
        index = staged / INDEX_FILE
        num_files = len(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else 1
        assert index.is_file() or (staged / SINGLE_FILE).is_file()
        seconds["convert+write"] = time.perf_counter() - phase

        max_diff = rounding_diff = None
        if verify:
            phase = time.perf_counter()
            _say("verifying: logits of the written folder (transformers) vs the megatron checkpoint")
            input_ids = _gate_input_ids(spec)
            expected = _megatron_logits(model, input_ids)
            if export_dtype != torch.float32:
                with torch.no_grad():
                    for param in model.parameters():
                        param.copy_(param.to(export_dtype).float())
                rounded = _megatron_logits(model, input_ids)
                rounding_diff = float((rounded - expected).abs().max())
                expected = rounded
            del model  # only its logits are needed from here on
            max_diff = _logit_diff(
                expected, _hf_logits(staged, input_ids), atol=atol, what=f"HF export of {step_dir}"
            )
            seconds["verify"] = time.perf_counter() - phase
        _publish(staged, out, overwrite=overwrite)

    return ConversionSummary(
        direction="megatron-to-hf",
        source=step_dir,
        output=out,
        num_tensors=counts["tensors"],
        num_bytes=counts["bytes"],
        num_files=num_files,
        dtype=dtype_name,
        tokenizer=tokenizer_dir,
        atol=atol,
        max_logit_diff=max_diff,
        rounding_logit_diff=rounding_diff,
        seconds=seconds,
    )


# ---------------------------------------------------------------- HF → megatron


def _check_layout(spec: ModelSpec, *, tensor_parallel: int, pipeline_parallel: int) -> None:
    """Reject a layout the trainer could not build, before any weight is read."""
    from pipeline.models.factory import build_transformer_config
    from pipeline.models.layer_spec import select_layer_spec

    where = f"--tp {tensor_parallel} --pp {pipeline_parallel}"
    if spec.vocab_size % tensor_parallel:
        raise UserError(f"{where}: vocab_size {spec.vocab_size} is not divisible by the tensor-parallel size")
    try:
        MegatronLayout.build(spec, tp_size=tensor_parallel, pp_size=pipeline_parallel)
        _, choice = select_layer_spec(spec, prefer_te=False)
        build_transformer_config(
            spec, choice=choice, tensor_parallel=tensor_parallel, pipeline_parallel=pipeline_parallel
        )
    except ValueError as error:
        raise UserError(f"{where}: {error}") from error


def _copy_tokenizer(hf_dir: Path, run_dir: Path) -> Path | None:
    files = _tokenizer_files(hf_dir)
    if not files:
        return None
    target = run_dir / TOKENIZER_DIR
    target.mkdir()
    if (hf_dir / GENERATION_CONFIG_FILE).is_file():
        files.append(hf_dir / GENERATION_CONFIG_FILE)  # sampling defaults and eos ids travel with it
    for file in files:
        shutil.copyfile(file, target / file.name)
    return target


def hf_to_megatron(
    *,
    hf: str | os.PathLike[str],
    out: str | os.PathLike[str],
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    verify: bool = True,
    atol: float = GATE_ATOL,
    overwrite: bool = False,
    timeout_s: float = 1800.0,
) -> ConversionSummary:
    """Convert the HF folder ``hf`` into a winnow run directory at ``out``; see the module docstring.

    The checkpoint format is layout-independent; ``tensor_parallel``/``pipeline_parallel``
    are recorded as the intended layout and, with ``verify``, checked by loading the
    written checkpoint on that many gloo ranks (spawned processes) and comparing the
    last stage's logits with the HF model's. ``timeout_s`` bounds that check.
    """
    from megatron.core import dist_checkpointing

    from pipeline.models.layer_spec import select_layer_spec
    from pipeline.trainer.checkpoint import CheckpointManager

    started = time.perf_counter()
    seconds: dict[str, float] = {}
    out = Path(out)
    hf_dir = Path(hf)
    _check_output(out, source=hf_dir, overwrite=overwrite, atol=atol)
    reader = HFCheckpointReader.open(hf_dir)
    spec = reader.spec
    _check_layout(spec, tensor_parallel=tensor_parallel, pipeline_parallel=pipeline_parallel)
    layout = MegatronLayout.build(spec)
    _, choice = select_layer_spec(spec, prefer_te=False)
    embedding_dtype = reader.info("model.embed_tokens.weight").dtype

    with _single_rank_megatron(), _staging_sibling(out) as staging:
        run_dir = staging / out.name
        manager = CheckpointManager(run_dir, keep_last=1)
        step_dir = manager.step_path(INIT_STEP)
        step_tmp = step_dir.with_name(step_dir.name + ".tmp")
        (step_tmp / "weights").mkdir(parents=True)
        model = _build_model(spec)
        try:
            copy_into_model(
                model,
                _progress(
                    hf_to_megatron_state(reader.get_tensor, spec=spec, layout=layout),
                    total=len(expected_megatron_shapes(spec, layout=layout)),
                    desc="HF -> megatron",
                ),
            )
        except ValueError as error:
            raise CheckpointError(f"converting {hf_dir}: {error}") from error
        num_tensors = sum(1 for _ in model.parameters())
        num_bytes = sum(param.numel() * param.element_size() for param in model.parameters())
        seconds["read+convert"] = time.perf_counter() - started

        phase = time.perf_counter()
        dist_checkpointing.save({"model": model.sharded_state_dict()}, str(step_tmp / "weights"))
        del model
        tokenizer_dir = _copy_tokenizer(hf_dir, run_dir)
        if tokenizer_dir is None:
            _say(f"note: {hf_dir} holds no tokenizer files; megatron-to-hf will need --tokenizer")
        # CheckpointManager's own finishing step: the manifest (file sizes and hashes, which
        # CheckpointManager.verify and newest_valid check), the rename and the latest pointer.
        manager.publish(
            step_tmp,
            step_dir,
            INIT_STEP,
            {
                "model_spec": spec.to_dict(),
                "layer_spec": choice.to_dict(),
                "layout": {
                    "tensor_parallel": tensor_parallel,
                    "pipeline_parallel": pipeline_parallel,
                    "data_parallel": 1,
                },
                "source": "hf",
                "hf_source": str(hf_dir.resolve()),
                "hf_dtype": _SAFETENSORS_DTYPES.get(embedding_dtype, embedding_dtype),
                "model_only": True,
            },
        )
        num_files = sum(1 for path in (step_dir / "weights").iterdir() if path.is_file())
        seconds["write"] = time.perf_counter() - phase

        max_diff = None
        if verify:
            phase = time.perf_counter()
            _say(
                f"verifying: logits of the written checkpoint (megatron, TP={tensor_parallel}, "
                f"PP={pipeline_parallel}) vs {hf_dir} (transformers)"
            )
            input_ids = _gate_input_ids(spec)
            expected = _hf_logits(hf_dir, input_ids)
            if tensor_parallel == pipeline_parallel == 1:
                fresh = _build_model(spec)  # randomly initialized: only a real load passes
                _load_step_weights(step_dir, fresh)
                actual = _megatron_logits(fresh, input_ids)
                del fresh
            else:
                actual = _layout_logits(
                    step_dir,
                    spec=spec,
                    input_ids=input_ids,
                    tensor_parallel=tensor_parallel,
                    pipeline_parallel=pipeline_parallel,
                    timeout_s=timeout_s,
                )
            max_diff = _logit_diff(expected, actual, atol=atol, what=f"megatron checkpoint of {hf_dir}")
            seconds["verify"] = time.perf_counter() - phase
        _publish(run_dir, out, overwrite=overwrite)

    return ConversionSummary(
        direction="hf-to-megatron",
        source=hf_dir,
        output=out,
        num_tensors=num_tensors,
        num_bytes=num_bytes,
        num_files=num_files,
        dtype="float32",
        layout=(tensor_parallel, pipeline_parallel),
        tokenizer=out / TOKENIZER_DIR if tokenizer_dir is not None else None,
        atol=atol,
        max_logit_diff=max_diff,
        seconds=seconds,
    )


# ---------------------------------------------------------------- layout check on spawned ranks


def _layout_worker(
    rank: int,
    result_dir: str,
    world_size: int,
    tensor_parallel: int,
    pipeline_parallel: int,
    port: int,
    step_dir: str,
    spec_fields: dict[str, Any],
    input_ids: torch.Tensor,
) -> None:
    """One rank of the layout check: build its shard, load the checkpoint, run the pipeline forward.

    Positional parameters, as ``run_ranks`` passes them: ``rank``, ``result_dir``, then its ``args``.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from pipeline.parallel.context import ParallelContext

    # Ranks share the machine's cores: more threads per rank only adds contention.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    context = ParallelContext.initialize(
        tensor_parallel=tensor_parallel,
        pipeline_parallel=pipeline_parallel,
        seed=GATE_SEED,
        rank=rank,
        world_size=world_size,
        local_rank=rank,
        master_addr="127.0.0.1",
        master_port=port,
    )
    try:
        model = _build_model(ModelSpec(**spec_fields), parallel_context=context)
        _load_step_weights(Path(step_dir), model)
        device = next(model.parameters()).device
        tokens, position_ids, causal_mask = _megatron_inputs(input_ids, device)
        collected: list[torch.Tensor] = []

        def forward_step(data_iterator: Iterator[torch.Tensor], stage_model: torch.nn.Module):
            output = stage_model(next(data_iterator), position_ids, causal_mask)

            def keep_logits(logits: torch.Tensor):
                collected.append(logits.float().cpu())  # (B, T, V / TP)
                return logits.sum() * 0.0, {}

            return output, keep_logits

        with torch.no_grad():
            get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iter([tokens]),
                model=[model],
                num_microbatches=1,
                seq_length=tokens.shape[1],
                micro_batch_size=tokens.shape[0],
                forward_only=True,
            )
        if context.is_pipeline_last:
            torch.save(collected[0], Path(result_dir) / f"logits_tp{context.tp_rank:04d}.pt")
    finally:
        context.destroy()


def _layout_logits(
    step_dir: Path,
    *,
    spec: ModelSpec,
    input_ids: torch.Tensor,
    tensor_parallel: int,
    pipeline_parallel: int,
    timeout_s: float,
) -> torch.Tensor:
    """(B, T, V) logits of ``step_dir`` loaded on tp x pp spawned gloo ranks (vocab shards concatenated)."""
    world_size = tensor_parallel * pipeline_parallel
    where = f"TP={tensor_parallel}, PP={pipeline_parallel}"
    try:
        with run_ranks(_layout_worker, args=(world_size, tensor_parallel, pipeline_parallel, free_port(),
                                             str(step_dir), spec.to_dict(), input_ids),
                       num_ranks=world_size, timeout_s=timeout_s, description=f"layout check under {where}") as result_dir:
            shards = sorted(result_dir.glob("logits_tp*.pt"))
            assert len(shards) == tensor_parallel, f"expected {tensor_parallel} logit shards, got {len(shards)}"
            return torch.cat([torch.load(path, weights_only=True) for path in shards], dim=-1)  # (B, T, V)
    except TimeoutError as error:
        raise CheckpointError(str(error)) from None
    except RankFailure as failure:
        _say(failure.detail)  # the failing rank's traceback, for a bug report
        raise CheckpointError(
            f"loading the checkpoint under {where} failed on {failure.rank_name}: {_first_lines(failure.detail, 1)}"
        ) from None


# ---------------------------------------------------------------- command line


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _add_gate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-verify", action="store_true",
                        help="skip the logit verification gate (not recommended)")
    parser.add_argument("--atol", type=float, default=GATE_ATOL,
                        help=f"gate tolerance: max |logit diff| in fp32 (default {GATE_ATOL:g})")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing --out (only after the new output passed the gate)")


def add_megatron_to_hf_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ckpt", required=True, metavar="DIR",
                        help="a run's checkpoint directory (uses 'latest') or one step_* directory")
    parser.add_argument("--out", required=True, metavar="DIR", help="the HF folder to create")
    parser.add_argument("--tokenizer", metavar="DIR",
                        help="tokenizer files to copy (default: a tokenizer/ folder in the step or run directory)")
    parser.add_argument("--step", type=int, metavar="N", help="export step_N of the run directory instead of 'latest'")
    parser.add_argument("--dtype", choices=["auto", *_DTYPES], default="auto",
                        help="weights dtype (default auto: the source HF model's dtype if recorded, else fp32)")
    parser.add_argument("--max-shard-size", type=_size, default="5GB", metavar="SIZE",
                        help="largest safetensors shard, e.g. 5GB, 500MB, 2GiB (default 5GB)")
    _add_gate_arguments(parser)


def run_megatron_to_hf(args: argparse.Namespace) -> int:
    summary = megatron_to_hf(
        checkpoint=args.ckpt,
        out=args.out,
        tokenizer=args.tokenizer,
        step=args.step,
        dtype=args.dtype,
        max_shard_bytes=args.max_shard_size,
        verify=not args.no_verify,
        atol=args.atol,
        overwrite=args.overwrite,
    )
    print(summary.format())
    return 0


def add_hf_to_megatron_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hf", required=True, metavar="DIR", help="a Hugging Face model folder (safetensors)")
    parser.add_argument("--out", required=True, metavar="DIR", help="the run directory to create")
    parser.add_argument("--tp", type=_positive_int, default=1, metavar="N",
                        help="tensor-parallel size the RL run will use (recorded and verified)")
    parser.add_argument("--pp", type=_positive_int, default=1, metavar="M",
                        help="pipeline-parallel size the RL run will use (recorded and verified)")
    _add_gate_arguments(parser)


def run_hf_to_megatron(args: argparse.Namespace) -> int:
    summary = hf_to_megatron(
        hf=args.hf,
        out=args.out,
        tensor_parallel=args.tp,
        pipeline_parallel=args.pp,
        verify=not args.no_verify,
        atol=args.atol,
        overwrite=args.overwrite,
    )
    print(summary.format())
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The standalone converter's parser (``tools/convert_checkpoint.py``); ``winnow convert`` has the same."""
    parser = argparse.ArgumentParser(
        prog="convert_checkpoint.py",
        description="Convert checkpoints between Hugging Face and winnow's megatron format, verified by logits.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, help_text, add_arguments, run in (
        ("hf-to-megatron", "HF folder -> winnow run directory (step_00000000, weights only)",
         add_hf_to_megatron_arguments, run_hf_to_megatron),
        ("megatron-to-hf", "winnow checkpoint -> HF folder that transformers and SGLang load",
         add_megatron_to_hf_arguments, run_megatron_to_hf),
    ):
        command = commands.add_parser(name, help=help_text, description=help_text)
        add_arguments(command)
        command.set_defaults(handler=run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one conversion; a ``UserError`` prints ``error: ...`` and returns 2, as ``winnow`` does."""
    from pipeline.cli import EXIT_USER_ERROR

    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except (UserError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USER_ERROR
