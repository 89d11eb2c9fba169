"""Read and write Hugging Face checkpoint folders of Llama-family models, tensor by tensor.

Reading (``HFCheckpointReader.open``) validates the whole folder before any tensor is
converted, from the safetensors headers only: ``config.json`` names a supported
architecture and parses into a ``ModelSpec``; every file the index names exists and
is a well-formed safetensors file; every tensor the model needs is present, with the
shape the config implies; nothing else is present. Tensor data is then read one
tensor at a time with ``safetensors.safe_open``, so only the file holding the
requested tensor is open.

Writing (``write_hf_checkpoint``) streams ``(name, tensor)`` pairs into shards of at
most ``max_shard_bytes`` (a larger single tensor gets a shard of its own, as
``transformers`` does), then writes the index, ``config.json``,
``generation_config.json`` and the tokenizer files. Everything goes into a temporary
sibling directory published at the end (``pipeline.io.publish_directory``: every file
synced, then one rename), after the tensor set was checked against the config: on any
failure nothing exists under the final name. The result
loads with ``transformers`` ``from_pretrained(path, local_files_only=True)`` without
``trust_remote_code``.

Every error is a ``CheckpointError`` (a ``UserError``) naming the file and tensor.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from pipeline.checkpoint.artifact import TOKENIZER_FILES, tokenizer_files
from pipeline.checkpoint.hf_map import expected_hf_shapes
from pipeline.errors import CheckpointError
from pipeline.io import publish_directory, rename_in_staging
from pipeline.models.families import FAMILIES
from pipeline.models.spec import ModelSpec

__all__ = [
    "CONFIG_FILE",
    "DEFAULT_MAX_SHARD_BYTES",
    "GENERATION_CONFIG_FILE",
    "INDEX_FILE",
    "SINGLE_FILE",
    "SUPPORTED_ARCHITECTURES",
    "TOKENIZER_FILES",
    "CheckpointError",
    "HFCheckpointReader",
    "TensorInfo",
    "write_hf_checkpoint",
]

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3  # transformers' save_pretrained default ("5GB")

# model_type → the one architecture class a folder of that family may name (pipeline.models.families).
SUPPORTED_ARCHITECTURES: dict[str, str] = {name: family.architecture for name, family in FAMILIES.items()}

_GENERATION_TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """Where a tensor lives and what its header says."""

    file: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype code, e.g. "BF16"


def _optional_tensor_names(spec: ModelSpec) -> frozenset[str]:
    """Tensors a valid checkpoint may carry that the model does not read."""
    names = {f"model.layers.{layer}.self_attn.rotary_emb.inv_freq" for layer in range(spec.num_layers)}
    if spec.tie_embeddings:
        # Some exporters store the tied head anyway; the reader checks it equals the embedding.
        names.add("lm_head.weight")
    return frozenset(names)


@contextmanager
def _open_safetensors(file: Path, *, tensor: str | None = None) -> Iterator[Any]:
    where = f"{file}" if tensor is None else f"tensor {tensor!r} in {file}"
    if not file.is_file():
        raise CheckpointError(f"missing shard: {file} does not exist (needed for {where})")
    try:
        with safe_open(str(file), framework="pt") as handle:
            yield handle
    except SafetensorError as error:
        raise CheckpointError(f"corrupt or truncated safetensors file: {where}: {error}") from error


class HFCheckpointReader:
    """A validated HF checkpoint folder whose tensors are read one at a time."""

    def __init__(self, *, path: Path, config: dict[str, Any], spec: ModelSpec, tensors: dict[str, TensorInfo]):
        self.path = path
        self.config = config
        self.spec = spec
        self._tensors = tensors

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> HFCheckpointReader:
        """Validate the folder at ``path`` (headers only) and return a reader for it."""
        folder = Path(path)
        if not folder.is_dir():
            raise CheckpointError(f"HF checkpoint folder {folder} does not exist")
        config = _read_config(folder / CONFIG_FILE)
        try:
            spec = ModelSpec.from_hf_config(config)
        except ValueError as error:
            raise CheckpointError(f"{folder / CONFIG_FILE}: {error}") from error
        tensors = _read_headers(folder)
        expected = expected_hf_shapes(spec)
        optional = _optional_tensor_names(spec)
        missing = [name for name in expected if name not in tensors]
        if missing:
            raise CheckpointError(
                f"missing tensor {missing[0]!r} in {folder} ({len(missing)} missing"
                f"{': ' + ', '.join(missing[:5]) if len(missing) > 1 else ''})"
            )
        for name, info in tensors.items():
            if name not in expected and name not in optional:
                raise CheckpointError(
                    f"unexpected tensor {name!r} in {info.file}: a {spec.family} model with this "
                    f"config.json has no such parameter"
                )
            expected_shape = expected.get(name)
            if name == "lm_head.weight" and expected_shape is None:
                expected_shape = expected["model.embed_tokens.weight"]
            if expected_shape is not None and info.shape != expected_shape:
                raise CheckpointError(
                    f"shape mismatch for tensor {name!r} in {info.file}: the file has {info.shape}, "
                    f"{folder / CONFIG_FILE} implies {expected_shape}"
                )
        reader = cls(path=folder, config=config, spec=spec, tensors=tensors)
        if spec.tie_embeddings and "lm_head.weight" in tensors:
            # Converting keeps only the embedding; a stored head that differs would be lost silently.
            if not torch.equal(reader.get_tensor("lm_head.weight"), reader.get_tensor("model.embed_tokens.weight")):
                raise CheckpointError(
                    f"tensor 'lm_head.weight' in {tensors['lm_head.weight'].file} differs from "
                    f"'model.embed_tokens.weight' although {folder / CONFIG_FILE} sets tie_word_embeddings"
                )
        return reader

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def names(self) -> list[str]:
        """All tensor names, grouped by file."""
        return sorted(self._tensors, key=lambda name: (self._tensors[name].file.name, name))

    def info(self, name: str) -> TensorInfo:
        if name not in self._tensors:
            raise CheckpointError(f"missing tensor {name!r} in {self.path}")
        return self._tensors[name]

    def get_tensor(self, name: str) -> torch.Tensor:
        """Read one tensor from its file."""
        info = self.info(name)
        with _open_safetensors(info.file, tensor=name) as handle:
            try:
                return handle.get_tensor(name)
            except SafetensorError as error:
                raise CheckpointError(f"cannot read tensor {name!r} from {info.file}: {error}") from error

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor, one file open at a time."""
        by_file: dict[Path, list[str]] = {}
        for name in self.names():
            by_file.setdefault(self._tensors[name].file, []).append(name)
        for file, names in by_file.items():
            with _open_safetensors(file) as handle:
                for name in names:
                    yield name, handle.get_tensor(name)


def _read_json_object(file: Path, *, what: str) -> dict[str, Any]:
    if not file.is_file():
        raise CheckpointError(f"missing {what}: {file} does not exist")
    try:
        loaded = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{file} is not valid JSON: {error}") from error
    if not isinstance(loaded, dict):
        raise CheckpointError(f"{file} does not hold a JSON object")
    return loaded


def _read_config(file: Path) -> dict[str, Any]:
    config = _read_json_object(file, what="config")
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(
            f"{file}: unsupported model_type {model_type!r}; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    architectures = config.get("architectures")
    expected_architecture = SUPPORTED_ARCHITECTURES[model_type]
    if architectures is not None and list(architectures) != [expected_architecture]:
        raise CheckpointError(
            f"{file}: unsupported architectures {architectures!r} for model_type {model_type!r}; "
            f"expected [{expected_architecture!r}]"
        )
    return config


def _read_headers(folder: Path) -> dict[str, TensorInfo]:
    index_file = folder / INDEX_FILE
    if index_file.exists():
        index = _read_json_object(index_file, what="index")
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index_file} has no 'weight_map' object")
        names_by_file: dict[str, list[str]] = {}
        for name, file_name in weight_map.items():
            if not isinstance(file_name, str) or Path(file_name).name != file_name:
                raise CheckpointError(f"{index_file}: tensor {name!r} maps to invalid file name {file_name!r}")
            names_by_file.setdefault(file_name, []).append(name)
        for file_name, names in names_by_file.items():
            if not (folder / file_name).is_file():
                raise CheckpointError(
                    f"missing shard: {index_file} maps {len(names)} tensors (first {names[0]!r}) to "
                    f"{folder / file_name}, which does not exist"
                )
    elif (folder / SINGLE_FILE).is_file():
        names_by_file = {SINGLE_FILE: []}
    else:
        present = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".safetensors"))
        raise CheckpointError(
            f"no safetensors weights in {folder}: expected {INDEX_FILE} or {SINGLE_FILE}"
            + (f" (found {present}; only safetensors is supported)" if present else "")
        )
    tensors: dict[str, TensorInfo] = {}
    for file_name, indexed_names in names_by_file.items():
        file = folder / file_name
        with _open_safetensors(file) as handle:
            keys = set(handle.keys())
            for name in indexed_names:
                if name not in keys:
                    raise CheckpointError(f"missing tensor {name!r}: {index_file} maps it to {file}, which lacks it")
            # With an index, tensors a shard holds but the index omits are invisible to
            # transformers too; only the indexed ones count.
            for name in indexed_names or sorted(keys):
                tensor_slice = handle.get_slice(name)
                tensors[name] = TensorInfo(
                    file=file, shape=tuple(tensor_slice.get_shape()), dtype=tensor_slice.get_dtype()
                )
    return tensors


def _shard_name(index: int, count: int) -> str:
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def _special_token_ids(tokenizer_dir: Path) -> dict[str, int]:
    """``bos/eos/pad_token_id`` of the tokenizer in ``tokenizer_dir`` (those it defines)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True, trust_remote_code=False)
    ids = {f"{name}_token_id": getattr(tokenizer, f"{name}_token_id") for name in ("bos", "eos", "pad")}
    return {key: value for key, value in ids.items() if isinstance(value, int)}


def generation_values_for(
    source_dir: Path | None, overrides: Mapping[str, Any] | None
) -> dict[str, Any]:
    """The generation config an export carries: ``source_dir``'s special tokens and generation config, then ``overrides``."""
    # The tokenizer's special tokens first: without eos_token_id in the generation config,
    # transformers' generate() never stops at the end of an answer.
    values: dict[str, Any] = _special_token_ids(source_dir) if source_dir is not None else {}
    if source_dir is not None and (source_dir / GENERATION_CONFIG_FILE).is_file():
        values.update(_read_json_object(source_dir / GENERATION_CONFIG_FILE, what="generation config"))
        values.pop("transformers_version", None)
    values.update(overrides or {})
    return values


def write_hf_checkpoint(
    path: str | os.PathLike[str],
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    spec: ModelSpec,
    generation_config: Mapping[str, Any] | None = None,
    tokenizer_dir: str | os.PathLike[str] | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> Path:
    """Write an HF checkpoint folder at ``path`` from streamed ``(hf_name, tensor)`` pairs.

    ``generation_config``: values for ``generation_config.json`` (``bos_token_id``,
    ``eos_token_id``, ``pad_token_id``, sampling defaults); they update the
    ``generation_config.json`` of ``tokenizer_dir`` when it has one. The token ids also go
    into ``config.json``. ``tokenizer_dir``: folder whose ``TOKENIZER_FILES`` are copied;
    it must hold at least one. Tensors are written with their own dtype; ``config.json``
    records the dtype of the embedding. Returns the final path.
    """
    final = Path(path)
    if max_shard_bytes < 1:
        raise CheckpointError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    if not final.parent.is_dir():
        raise CheckpointError(f"cannot write {final}: parent folder {final.parent} does not exist")
    if final.exists() and not overwrite:
        raise CheckpointError(f"cannot write {final}: it already exists (pass overwrite=True to replace it)")
    source = Path(tokenizer_dir) if tokenizer_dir is not None else None
    files: list[Path] = []
    if source is not None:
        files = tokenizer_files(source)
        if not files:
            raise CheckpointError(f"tokenizer folder {source} holds none of {list(TOKENIZER_FILES)}")
    generation_values = generation_values_for(source, generation_config)

    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        embedding_dtype = _write_shards(staging, tensors, spec=spec, max_shard_bytes=max_shard_bytes)
        write_hf_configs(staging, spec=spec, generation_values=generation_values, dtype=embedding_dtype)
        for file in files:
            shutil.copyfile(file, staging / file.name)
        try:
            publish_directory(staging, final, overwrite=overwrite)
        except FileExistsError:
            raise CheckpointError(f"cannot write {final}: it appeared while writing") from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return final


def _write_shards(
    staging: Path, tensors: Iterable[tuple[str, torch.Tensor]], *, spec: ModelSpec, max_shard_bytes: int
) -> torch.dtype:
    expected = expected_hf_shapes(spec)
    seen: set[str] = set()
    shard_files: list[Path] = []
    shard_of: dict[str, int] = {}
    pending: dict[str, torch.Tensor] = {}
    pending_bytes = 0
    total_bytes = 0
    embedding_dtype: torch.dtype | None = None

    def flush() -> None:
        nonlocal pending, pending_bytes
        file = staging / f"shard-{len(shard_files)}.safetensors"
        save_file(pending, str(file), metadata={"format": "pt"})
        shard_files.append(file)
        pending, pending_bytes = {}, 0

    for name, tensor in tensors:
        if name not in expected:
            raise CheckpointError(f"unexpected tensor {name!r} for a {spec.family} model with this spec")
        if name in seen:
            raise CheckpointError(f"tensor {name!r} given twice")
        if tuple(tensor.shape) != expected[name]:
            raise CheckpointError(
                f"shape mismatch for tensor {name!r}: got {tuple(tensor.shape)}, the spec implies {expected[name]}"
            )
        seen.add(name)
        if name == "model.embed_tokens.weight":
            embedding_dtype = tensor.dtype
        num_bytes = tensor.numel() * tensor.element_size()
        if pending and pending_bytes + num_bytes > max_shard_bytes:
            flush()
        # A private contiguous copy: safetensors refuses tensors sharing storage (TP shards
        # and the q/k/v views of one fused tensor do).
        pending[name] = tensor.detach().to("cpu", copy=True).contiguous()
        pending_bytes += num_bytes
        total_bytes += num_bytes
        shard_of[name] = len(shard_files)
    missing = [name for name in expected if name not in seen]
    if missing:
        raise CheckpointError(
            f"missing tensor {missing[0]!r}: the writer received {len(seen)} of {len(expected)} tensors"
        )
    if pending:
        flush()
    assert embedding_dtype is not None  # expected always contains the embedding

    if len(shard_files) == 1:
        rename_in_staging(shard_files[0], staging / SINGLE_FILE)
        return embedding_dtype
    final_names = [_shard_name(i + 1, len(shard_files)) for i in range(len(shard_files))]
    for file, final_name in zip(shard_files, final_names):
        rename_in_staging(file, staging / final_name)
    index = {
        "metadata": {"total_size": total_bytes},
        "weight_map": {name: final_names[shard_of[name]] for name in sorted(shard_of)},
    }
    (staging / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return embedding_dtype


def write_hf_configs(staging: Path, *, spec: ModelSpec, generation_values: dict[str, Any], dtype: torch.dtype) -> None:
    """``config.json`` and ``generation_config.json`` of an HF folder of ``spec`` whose weights are ``dtype``."""
    # transformers is imported here: it is slow to import and only the writer needs it.
    from transformers import GenerationConfig

    config = spec.to_hf_config()
    # torch_dtype is the transformers 4.x key; 5.x reads it as `dtype`.
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    for key in _GENERATION_TOKEN_KEYS:
        if generation_values.get(key) is not None:
            config[key] = generation_values[key]
    (staging / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    try:
        # Non-strict: released configs often carry flags transformers only warns about.
        generation = GenerationConfig.from_dict(dict(generation_values))
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"invalid generation config {generation_values}: {error}") from error
    generation.to_json_file(str(staging / GENERATION_CONFIG_FILE), use_diff=True)

