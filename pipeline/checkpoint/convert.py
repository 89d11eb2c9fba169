"""Hugging Face ⇄ winnow (megatron) conversion: streaming state maps and whole checkpoints.

Two levels:

* ``hf_to_megatron_state`` / ``megatron_to_hf_state`` / ``copy_into_model``: driven by
  ``hf_map.PARAM_MAP``, they do no I/O and no communication: they take tensors (a mapping,
  or a callable that reads one tensor by name, e.g. ``HFCheckpointReader.get_tensor``) and
  yield ``(name, tensor)`` pairs one parameter at a time, so a caller can write, load or
  broadcast each tensor before the next is read. Rollout weight sync uses them too.
* ``megatron_to_hf`` / ``hf_to_megatron``: whole checkpoints on disk, each returning a
  ``ConversionSummary`` (``winnow convert``, ``pipeline.cli.convert``, is their command line).

  ``megatron_to_hf``: a winnow checkpoint (a run directory, resolved through ``latest``, or
  one ``step_*`` directory) → an HF folder that ``transformers`` and SGLang load. The
  weights are read with megatron ``dist_checkpointing`` into a TP=1/PP=1 model, whatever
  layout saved them (it reshards), then mapped and written by ``write_hf_checkpoint``.

  ``hf_to_megatron``: an HF folder → a run directory holding ``step_00000000/`` (model
  weights only: the optimizer starts fresh), a ``latest`` pointer and the tokenizer under
  ``tokenizer/``. ``artifact.load_weights`` loads it, or the model part of any training
  checkpoint, into a ``GPTModel`` of any TP/PP layout.

  Both pass the logit gate (``pipeline.checkpoint.gate``; on unless ``verify=False``)
  before anything appears under the output name. For a bf16/fp16 export both sides of the
  gate use the same rounded weights (the megatron weights are cast to the export dtype and
  back), so the gate checks the conversion rather than the precision loss; that loss is
  measured on the same batch and reported. Everything is written into a temporary sibling
  of the output and renamed into place (``pipeline.io.publish_directory``) only after the
  gate passed: on any failure nothing exists under the output name and an existing output
  (``overwrite``) is left intact. Every user-facing failure is a ``CheckpointError`` (a
  ``UserError``).

Guarantees of the state maps (tested): HF → megatron → HF is bit-exact for every tensor,
whole, TP sharded or PP split; every megatron parameter of the requested stage is produced
exactly once; converting back refuses a state with a missing or unexpected name, a
replicated parameter that differs between TP ranks, or a tied output-layer copy that
differs from the embedding.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence, Union

import torch
from tqdm import tqdm

from pipeline.checkpoint.artifact import (
    TOKENIZER_DIR,
    WEIGHTS_DIR,
    checkpoint_spec,
    find_tokenizer_dir,
    load_weights,
    read_manifest,
    resolve_checkpoint,
    tokenizer_candidates,
    tokenizer_files,
)
from pipeline.checkpoint.gate import (
    GATE_ATOL,
    GATE_BATCH,
    GATE_SEED,
    GATE_SEQ_LEN,
    build_unsplit_model,
    gate_input_ids,
    hf_logits,
    layout_logits,
    logit_diff,
    megatron_logits,
)
from pipeline.checkpoint.hf_io import (
    GENERATION_CONFIG_FILE,
    INDEX_FILE,
    SINGLE_FILE,
    CheckpointError,
    HFCheckpointReader,
    write_hf_checkpoint,
)
from pipeline.checkpoint.hf_map import (
    MegatronLayout,
    ModelDims,
    ResolvedParam,
    expected_hf_shapes,
    expected_megatron_shapes,
    hf_to_megatron_tensor,
    megatron_to_hf_tensors,
    merge_tp,
    resolve_params,
    split_tp,
)
from pipeline.errors import UserError
from pipeline.io import publish_directory
from pipeline.models.spec import ModelSpec
from pipeline.parallel.lifetime import megatron_checkpoint_writers_die_with_this_process
from pipeline.parallel.rendezvous import single_rank_megatron

# megatron-core and transformers take seconds to import: they are imported where used, so
# that registering `winnow convert` keeps `winnow --help` fast.

__all__ = [
    "EXPORT_DTYPES",
    "ConversionSummary",
    "TensorSource",
    "copy_into_model",
    "hf_to_megatron",
    "hf_to_megatron_state",
    "megatron_to_hf",
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


# ---------------------------------------------------------------- whole checkpoints on disk

INIT_STEP = 0
# --dtype names → torch dtype names.
EXPORT_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


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


def _say(message: str) -> None:
    # Progress notes on stderr, where the CLI's `error:` line also goes; stdout is the summary.
    print(message, file=sys.stderr, flush=True)


def _progress(items: Iterable[Any], *, total: int, desc: str) -> Iterable[Any]:
    # disable=None: a bar on a terminal, nothing in log files.
    return tqdm(items, total=total, desc=desc, unit="tensor", disable=None, file=sys.stderr)


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
    try:
        publish_directory(staged, out, overwrite=overwrite)
    except FileExistsError:
        raise CheckpointError(f"cannot write {out}: it appeared while writing") from None


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
    fp32 weights training saves). ``tokenizer``: a folder of tokenizer files to copy;
    default: the checkpoint's own (``artifact.tokenizer_candidates``), else none.
    """
    started = time.perf_counter()
    seconds: dict[str, float] = {}
    out = Path(out)
    if dtype != "auto" and dtype not in EXPORT_DTYPES:
        raise UserError(f"--dtype {dtype!r}: expected one of {['auto', *EXPORT_DTYPES]}")
    _check_output(out, source=Path(checkpoint), overwrite=overwrite, atol=atol)
    step_dir = resolve_checkpoint(checkpoint, step=step)
    manifest = read_manifest(step_dir)
    spec = checkpoint_spec(step_dir, manifest=manifest)
    tokenizer_dir = find_tokenizer_dir(tokenizer, candidates=tokenizer_candidates(step_dir))
    if tokenizer_dir is None:
        _say(f"note: no tokenizer found for {step_dir} (pass --tokenizer); exporting the weights only")
    if dtype == "auto":
        dtype_name = manifest.get("hf_dtype") if manifest.get("hf_dtype") in EXPORT_DTYPES.values() else "float32"
    else:
        dtype_name = EXPORT_DTYPES[dtype]
    export_dtype = getattr(torch, dtype_name)

    with single_rank_megatron(GATE_SEED, purpose="conversion"), _staging_sibling(out) as staging:
        model = build_unsplit_model(spec)
        load_weights(step_dir, model)
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
            input_ids = gate_input_ids(spec)
            expected = megatron_logits(model, input_ids)
            if export_dtype != torch.float32:
                with torch.no_grad():
                    for param in model.parameters():
                        param.copy_(param.to(export_dtype).float())
                rounded = megatron_logits(model, input_ids)
                rounding_diff = float((rounded - expected).abs().max())
                expected = rounded
            del model  # only its logits are needed from here on
            max_diff = logit_diff(expected, hf_logits(staged, input_ids), atol=atol, what=f"HF export of {step_dir}")
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
    files = tokenizer_files(hf_dir)
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

    from pipeline.checkpoint.manager import CheckpointManager
    from pipeline.models.layer_spec import select_layer_spec

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

    with single_rank_megatron(GATE_SEED, purpose="conversion"), _staging_sibling(out) as staging:
        run_dir = staging / out.name
        manager = CheckpointManager(run_dir, keep_last=1)
        step_dir = manager.step_path(INIT_STEP)
        step_tmp = step_dir.with_name(step_dir.name + ".tmp")
        (step_tmp / WEIGHTS_DIR).mkdir(parents=True)
        model = build_unsplit_model(spec)
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
        megatron_checkpoint_writers_die_with_this_process()  # its writers die with this process
        dist_checkpointing.save({"model": model.sharded_state_dict()}, str(step_tmp / WEIGHTS_DIR))
        del model
        tokenizer_dir = _copy_tokenizer(hf_dir, run_dir)
        if tokenizer_dir is None:
            _say(f"note: {hf_dir} holds no tokenizer files; megatron-to-hf will need --tokenizer")
        # CheckpointManager's own finishing step: the manifest (file sizes and hashes, which
        # verification checks), the rename and the latest pointer.
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
        num_files = sum(1 for path in (step_dir / WEIGHTS_DIR).iterdir() if path.is_file())
        seconds["write"] = time.perf_counter() - phase

        max_diff = None
        if verify:
            phase = time.perf_counter()
            _say(
                f"verifying: logits of the written checkpoint (megatron, TP={tensor_parallel}, "
                f"PP={pipeline_parallel}) vs {hf_dir} (transformers)"
            )
            input_ids = gate_input_ids(spec)
            expected = hf_logits(hf_dir, input_ids)
            if tensor_parallel == pipeline_parallel == 1:
                fresh = build_unsplit_model(spec)  # randomly initialized: only a real load passes
                load_weights(step_dir, fresh)
                actual = megatron_logits(fresh, input_ids)
                del fresh
            else:
                actual = layout_logits(
                    step_dir,
                    spec=spec,
                    input_ids=input_ids,
                    tensor_parallel=tensor_parallel,
                    pipeline_parallel=pipeline_parallel,
                    timeout_s=timeout_s,
                )
            max_diff = logit_diff(expected, actual, atol=atol, what=f"megatron checkpoint of {hf_dir}")
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
