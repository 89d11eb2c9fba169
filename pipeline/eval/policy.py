"""Load a policy to evaluate: a Hugging Face folder or a winnow (megatron) checkpoint.

``load_policy(path)`` accepts

* a Hugging Face model folder (``config.json`` plus weights): loaded with
  ``AutoModelForCausalLM.from_pretrained(path, local_files_only=True,
  trust_remote_code=False)``; its tokenizer is the folder's own unless one is given;
* a winnow checkpoint: a run's checkpoint directory (resolved through ``latest``), one
  ``step_*`` directory, or a bootstrap cache entry (``<cache>/<hash>/`` holding
  ``checkpoints/`` and ``tokenizer/``). The manifest's ``model_spec`` describes the
  model; a TP=1/PP=1 ``GPTModel`` with megatron's local layer spec is built under a
  one-rank megatron layout (``single_rank_megatron``: a gloo group unless the process
  has its own), only its weights are read
  (``dist_checkpointing.load({"model": ...})`` reshards from whatever TP/PP layout
  saved them; optimizer, schedule and RNG states are ignored), and they are mapped to
  Hugging Face names by ``pipeline.checkpoint.convert.megatron_to_hf_state`` — the
  same map rollout weight sync and ``winnow convert`` use — into
  ``pipeline.rollout.weight_sync.build_hf_model(spec)``.

``weights=False`` reads everything but the weights (``hf_model`` is ``None``): the
tokenizer, the config or ``ModelSpec`` and the generation config, which is all a stage
needs when SGLang servers generate (``pipeline.eval.sharded.policy_engine``).

The tokenizer of a winnow checkpoint is, in order: the ``tokenizer`` argument; the
``tokenizer`` path recorded in the manifest (relative to the step directory, as
bootstrap writes it); ``tokenizer/`` in the step directory, in the run directory, or
next to the run directory (a bootstrap cache entry): ``pipeline.checkpoint.artifact``'s
lookup, shared with ``winnow convert`` and the RL stage. Without one, ``PolicyError``
says where it looked.
"""

from __future__ import annotations

import json
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from pipeline.checkpoint.artifact import (
    checkpoint_spec,
    find_tokenizer_dir,
    is_hf_folder,
    load_weights,
    resolve_checkpoint,
    tokenizer_candidates,
)
from pipeline.errors import UserError

__all__ = ["DTYPES", "LoadedPolicy", "PolicyError", "load_policy"]

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class PolicyError(UserError):
    """The policy path is neither a Hugging Face folder nor a winnow checkpoint, or lacks a tokenizer."""


@dataclass(frozen=True, slots=True)
class LoadedPolicy:
    """An HF causal LM ready for ``LocalEngine``, its tokenizer, and where it came from.

    ``spec_or_config`` is the checkpoint's ``ModelSpec`` (winnow checkpoints) or the
    model's ``transformers`` config (HF folders). ``source`` is ``"hf:<folder>"`` or
    ``"megatron:<step directory>"``: the exact weights evaluated. ``tokenizer_dir``: the
    folder the tokenizer was loaded from (its ``generation_config.json``, when it has one,
    names the model's stop tokens). ``hf_model`` is ``None`` when loaded with ``weights=False``;
    ``generation_config`` is then the folder's own (HF folders), which a loaded model carries itself.
    """

    hf_model: torch.nn.Module | None
    tokenizer: Any
    spec_or_config: Any
    source: str
    tokenizer_dir: Path | None = None
    generation_config: Any = None

    @property
    def kind(self) -> Literal["hf", "megatron"]:
        return "hf" if self.source.startswith("hf:") else "megatron"

    @property
    def max_position_embeddings(self) -> int | None:
        """Longest prompt + response the model takes (``None``: unbounded)."""
        value = getattr(self.spec_or_config, "max_position_embeddings", None)
        return int(value) if value is not None else None


def _load_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)


def _tokenizer_dir(explicit: str | Path | None, *, candidates: list[Path]) -> Path:
    """``artifact.find_tokenizer_dir``, with a ``PolicyError`` saying where it looked when none is found."""
    try:
        folder = find_tokenizer_dir(explicit, candidates=candidates)
    except UserError as error:
        raise PolicyError(str(error)) from error
    if folder is None:
        looked = ", ".join(str(c) for c in candidates) or "nowhere"
        raise PolicyError(f"no tokenizer found (looked in {looked}); pass one with --tokenizer DIR (policy.tokenizer)")
    return folder


def load_policy(
    path: str | Path,
    *,
    tokenizer: str | Path | None = None,
    dtype: str = "float32",
    device: str | torch.device = "cpu",
    context=None,
    weights: bool = True,
) -> LoadedPolicy:
    """Load the policy at ``path`` (see the module docstring) in ``dtype`` on ``device``
    (``weights=False``: everything but the weights).

    ``context``: an existing one-rank ``ParallelContext`` to build a winnow checkpoint's
    model under. Without one, ``pipeline.parallel.rendezvous.single_rank_megatron`` provides
    the layout: the process's own one-rank megatron, else a one-rank gloo group brought up
    for the load and torn down afterwards; a process on more than one rank is refused
    (megatron cannot be initialized twice).
    """
    if dtype not in DTYPES:
        raise PolicyError(f"dtype: expected one of {sorted(DTYPES)}, got {dtype!r}")
    directory = Path(path)
    if not directory.is_dir():
        raise PolicyError(f"policy {directory} does not exist or is not a directory")
    if is_hf_folder(directory):
        policy = _load_hf_folder(directory, tokenizer=tokenizer, dtype=DTYPES[dtype], weights=weights)
    else:
        policy = _load_winnow_checkpoint(directory, tokenizer=tokenizer, dtype=DTYPES[dtype], context=context,
                                         weights=weights)
    if policy.hf_model is not None:
        policy.hf_model.to(device)
    return policy


def _load_hf_folder(folder: Path, *, tokenizer: str | Path | None, dtype: torch.dtype, weights: bool) -> LoadedPolicy:
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    tokenizer_dir = _tokenizer_dir(tokenizer, candidates=[folder])
    if not weights:
        config = AutoConfig.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
        # Read as plain JSON data (from_pretrained would route any unknown keyword into the config).
        generation_file = folder / "generation_config.json"
        if generation_file.is_file():
            generation_config = GenerationConfig.from_dict(json.loads(generation_file.read_text()))
        else:  # transformers derives one from the config, as a load does
            generation_config = GenerationConfig.from_model_config(config)
        return LoadedPolicy(None, _load_tokenizer(tokenizer_dir), config, f"hf:{folder.resolve()}", tokenizer_dir,
                            generation_config)
    model = AutoModelForCausalLM.from_pretrained(
        str(folder), local_files_only=True, trust_remote_code=False, dtype=dtype
    ).eval()
    return LoadedPolicy(model, _load_tokenizer(tokenizer_dir), model.config, f"hf:{folder.resolve()}", tokenizer_dir)


def _checkpoint_run_dir(directory: Path) -> Path:
    """A bootstrap cache entry keeps its checkpoints one level down."""
    nested = directory / "checkpoints"
    if nested.is_dir() and not (directory / "manifest.json").is_file() and not (directory / "latest").is_file():
        return nested
    return directory


def _load_winnow_checkpoint(
    directory: Path, *, tokenizer: str | Path | None, dtype: torch.dtype, context, weights: bool
) -> LoadedPolicy:
    try:
        step_dir = resolve_checkpoint(_checkpoint_run_dir(directory))
    except UserError as error:
        raise PolicyError(
            f"policy {directory}: not a Hugging Face folder (no config.json with weights) and not a usable "
            f"winnow checkpoint: {error}"
        ) from error
    try:
        spec = checkpoint_spec(step_dir)
    except UserError as error:
        raise PolicyError(str(error)) from error
    tokenizer_dir = _tokenizer_dir(tokenizer, candidates=tokenizer_candidates(step_dir))
    model = _megatron_weights_as_hf(step_dir, spec=spec, context=context).to(dtype) if weights else None
    return LoadedPolicy(model, _load_tokenizer(tokenizer_dir), spec, f"megatron:{step_dir.resolve()}", tokenizer_dir)


def _megatron_weights_as_hf(step_dir: Path, *, spec, context) -> torch.nn.Module:
    from pipeline.checkpoint.convert import copy_into_model, megatron_to_hf_state
    from pipeline.checkpoint.hf_map import MegatronLayout
    from pipeline.models.factory import build_gpt_model
    from pipeline.models.layer_spec import select_layer_spec
    from pipeline.parallel.rendezvous import single_rank_megatron
    from pipeline.rollout.weight_sync import build_hf_model

    purpose = "loading a policy for evaluation"
    if context is not None and (context.world_size, context.tensor_parallel, context.pipeline_parallel) != (1, 1, 1):
        raise PolicyError(
            f"{purpose} needs a one-rank context, got world size {context.world_size} "
            f"(TP={context.tensor_parallel}, PP={context.pipeline_parallel})"
        )
    # Only the weights are read, so a group of its own is gloo: the model is built on the CPU.
    layout = nullcontext(context) if context is not None else single_rank_megatron(0, purpose=purpose, backend="gloo")
    with layout as layout_context:
        # The local spec everywhere: its checkpoint keys equal Transformer Engine's, and
        # the converted HF model runs on any machine.
        module = build_gpt_model(spec, parallel_context=layout_context,
                                 layer_spec=select_layer_spec(spec, prefer_te=False))
        load_weights(step_dir, module)
        state = {
            name: tensor.detach() for name, tensor in module.state_dict().items() if not name.endswith("_extra_state")
        }
        hf_model = build_hf_model(spec)
        copy_into_model(hf_model, megatron_to_hf_state([[state]], spec=spec, layout=MegatronLayout.build(spec)))
        del module, state
    return hf_model.eval()
