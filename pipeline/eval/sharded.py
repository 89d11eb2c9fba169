"""The sharded, resumable sample-and-grade engine behind `winnow curate` and `winnow evaluate`.

Both stages sample n responses per prompt from one fixed policy, grade them in the bounded
pool and keep the counts, shard by shard, through the same ``RolloutEngine`` RL uses:

* ``policy_engine`` builds the scoring engine of the rollout backend a ``rollout`` config block
  names (``pipeline.rollout.backends``): the policy's HF model in this process, or servers
  that first load the policy being scored from a Hugging Face folder: the policy's own, or a
  winnow checkpoint's one export to HF under ``rollout.weights_dir`` (``served_weights``; a
  later run of the same checkpoint reuses the export, and a backend without servers never
  asks for it);
* ``plan_shards`` cuts the prompts, in order, into shards of ``shard_size``. Each shard samples
  in one engine call under its own seed (``curation_shard_seed``, ``evaluation_shard_seed``),
  which depends on the stage's seed and the shard's position only, so a shard's samples do not
  depend on which shards ran before it or in which process. The SGLang engine seeds every sample
  from ``(shard seed, prompt id, sample index)`` (``sglang.protocol.sample_seed``), so a sample is the
  same whichever server produced it and however often a failed server's work was retried;
  the local engine draws a shard's noise from one generator seeded with the shard seed;
* ``run_shard`` reads a shard back when its file exists (its prompt ids must be the plan's),
  else samples, grades and writes it atomically in the stage's format. A restarted run skips
  the finished shards and ends with the bytes of an uninterrupted one;
* ``sampling_fingerprint`` lists what determines a shard's samples; each stage records it
  (curate: ``fingerprint_digest`` in every shard, checked by ``check_shard_fingerprints``;
  evaluate: its manifest, compared by ``fingerprint_changes``) and refuses to mix in shards
  written under another;
* ``ShardSampler`` holds the engine, built on first use (a finished run re-aggregates without
  one, and never contacts a server), and samples one shard.

The two rules both stages follow:

* device (``resolve_device``): ``auto`` is CUDA when available, else the CPU; an explicit
  ``cuda`` or ``cuda:N`` without CUDA is a ``ConfigError`` naming ``device``; anything else
  is passed to torch as given;
* stop tokens (``stop_token_ids``): ``pipeline.models.tokenizer.stop_token_ids``, the rule RL
  uses too: the tokenizer's EOS plus the model's ``generation_config`` EOS ids (instruct models
  list several), read from a Hugging Face folder's model or from the ``generation_config.json``
  next to a winnow checkpoint's tokenizer (conversion copies it there). A winnow checkpoint's
  HF model is built from its ``ModelSpec`` and carries only ``transformers``' default ids
  (Llama's 2, whatever the tokenizer says), so its own generation config is not consulted.
  The ids reach the engine in every ``SamplingParams.stop_token_ids`` (and the local engine's EOS).

Which engine ran is not part of the fingerprint, as the device is not: it changes which random
draws a shard gets, not what it measures, so an evaluation may resume on the servers. Samples
are reproducible on one engine and device type (CPU and GPU kernels differ in the last bits;
SGLang's own sampling is bit-reproducible with ``--enable-deterministic-inference``).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import numpy as np

from pipeline.config import RolloutConfig
from pipeline.configlib import ConfigError
from pipeline.data.records import Prompt
from pipeline.data.templates import prompt_token_ids
from pipeline.errors import UserError
from pipeline.eval.runner import ProblemResult, sample_and_grade
from pipeline.rollout.backends import ScoredPolicy, rollout_backend
from pipeline.rollout.types import RolloutEngine, SamplingParams

Rows = TypeVar("Rows")


# ================================================================ the shared rules


def resolve_device(choice: str) -> str:
    """The device to load the policy on: ``auto`` → CUDA when available, else the CPU."""
    import torch

    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device: {choice!r} requested but CUDA is not available")
    return choice


def stop_token_ids(policy) -> list[int]:
    """Stop tokens of a ``LoadedPolicy`` (see the module docstring)."""
    from pipeline.models.tokenizer import stop_token_ids as model_stop_token_ids

    generation_config = None
    if policy.kind == "hf":
        model_config = policy.spec_or_config if policy.hf_model is None else policy.hf_model.config
        generation_config = (policy.generation_config if policy.hf_model is None
                             else getattr(policy.hf_model, "generation_config", None))
        if getattr(generation_config, "eos_token_id", None) is None:
            generation_config = model_config
    folders = [policy.tokenizer_dir] if policy.tokenizer_dir is not None else []
    return list(model_stop_token_ids(policy.tokenizer, folders=folders, generation_config=generation_config))


def fits_context(
    prompts: Sequence[Prompt], *, tokenizer, template: str, max_new_tokens: int, max_positions: int | None
) -> np.ndarray:
    """``(P,)`` bool: the rendered prompt plus ``max_new_tokens`` fits the model's context (the engine refuses more)."""
    if max_positions is None:
        return np.ones(len(prompts), dtype=bool)
    lengths = np.array([len(prompt_token_ids(tokenizer, p, template=template)) for p in prompts], dtype=np.int64)
    return lengths + max_new_tokens <= max_positions


@dataclass(frozen=True, slots=True)
class SamplingOptions:
    """How every shard samples: n responses per prompt, the distribution, the prompt template."""

    num_samples: int
    max_new_tokens: int
    temperature: float
    top_p: float
    template: str

    def params(self, seed: int, *, stop_token_ids: Sequence[int] = ()) -> SamplingParams:
        return SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                              seed=seed, stop_token_ids=tuple(stop_token_ids))


def sampling_fingerprint(
    options: SamplingOptions, *, policy_source: str, tokenizer: str | None, dtype: str, shard_size: int, seed: int,
    reward,
) -> dict[str, Any]:
    """What determines every shard's samples and grades: the exact weights (``LoadedPolicy.source``),
    tokenizer, dtype, sampling options, shard size, seed and the grading limits (``reward``: a
    ``RewardConfig``). The device and the engine's batch size are left out: they change which
    random draws a shard gets, not what it measures, so a run may resume on another machine."""
    return {
        "policy": policy_source,
        "tokenizer": tokenizer,
        "dtype": dtype,
        "template": options.template,
        "shard_size": shard_size,
        "num_samples": options.num_samples,
        "temperature": options.temperature,
        "top_p": options.top_p,
        "max_new_tokens": options.max_new_tokens,
        "seed": seed,
        "max_response_chars": reward.max_response_chars,
        "max_answer_chars": reward.max_answer_chars,
    }


def fingerprint_digest(fingerprint: dict[str, Any], prompts: Iterable[Prompt]) -> str:
    """A short hash of a fingerprint and the exact prompts it samples (id, problem, answer, in order)."""
    digest = hashlib.sha256()
    digest.update(json.dumps(fingerprint, sort_keys=True).encode())
    for prompt in prompts:
        digest.update(json.dumps([prompt.id, prompt.problem, prompt.answer]).encode() + b"\n")
    return digest.hexdigest()[:24]


def fingerprint_changes(old: dict[str, Any], new: dict[str, Any]) -> str:
    """``key: old → new`` for every key whose value differs ("" when none does)."""
    changed = sorted(key for key in set(new) | set(old) if old.get(key) != new.get(key))
    return ", ".join(f"{key}: {old.get(key)!r} → {new.get(key)!r}" for key in changed)


def check_shard_fingerprints(
    paths: Iterable[Path], *, fingerprint_of: Callable[[Path], Any], expected: Any, error: type[UserError],
    output_dir: Path, run_name: str,
) -> None:
    """Refuse shards another ``run_name`` (other policy, options or prompts) wrote into ``output_dir``."""
    for path in paths:
        found = fingerprint_of(path)
        if found != expected:
            raise error(
                f"{path} was written by another {run_name} (fingerprint {found}, this run {expected}): the policy, "
                "sampling or grading options, shard size or prompts differ. Use a new output_dir, or delete "
                f"{output_dir} to start over"
            )


# ================================================================ shard seeds
# Two hashes, one per stage: the shards of every existing curation and evaluation were sampled
# with their own, and a resume must draw the same seeds.


def curation_shard_seed(seed: int, shard_index: int) -> int:
    """The sampling seed of curation shard ``shard_index``: a hash of ``(seed, shard_index)`` in [0, 2^63)."""
    digest = hashlib.sha256(f"winnow.curate|{seed}|{shard_index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def evaluation_shard_seed(seed: int, benchmark: str, shard_index: int) -> int:
    """The sampling seed of shard ``shard_index`` of ``benchmark``: a hash in [0, 2^60)."""
    from pipeline.eval.report import derive_seed

    return derive_seed("shard", seed, benchmark, shard_index)


# ================================================================ engines

_EXPORT_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def served_weights(policy, *, weights_dir: str | None, dtype: str) -> Path:
    """The HF folder the SGLang servers load for ``policy``: a Hugging Face folder itself; a winnow
    checkpoint exported once (``convert.megatron_to_hf``, logit gate on) to
    ``<weights_dir>/policy-<hash of the step directory>-<dtype>``, reused when a complete export is
    there (the export publishes by renaming a staged folder, so a present one is complete).

    Size at 7B: one export of 15 GB in bf16 on the shared filesystem, written by this process.
    """
    from pipeline.checkpoint.artifact import is_hf_folder

    if policy.kind == "hf":
        return Path(policy.source.removeprefix("hf:"))
    if not weights_dir:
        raise ConfigError("rollout.weights_dir: SGLang servers load a winnow checkpoint from an HF export; "
                          "give a folder every server can read")
    step_dir = Path(policy.source.removeprefix("megatron:"))
    name = hashlib.sha256(str(step_dir).encode()).hexdigest()[:16]
    out = Path(weights_dir) / f"policy-{name}-{_EXPORT_DTYPES[dtype]}"
    if not is_hf_folder(out):
        from pipeline.checkpoint.convert import megatron_to_hf

        out.parent.mkdir(parents=True, exist_ok=True)
        megatron_to_hf(checkpoint=step_dir, out=out, tokenizer=policy.tokenizer_dir, dtype=_EXPORT_DTYPES[dtype])
    return out


def policy_engine(
    rollout: RolloutConfig, policy, *, dtype: str, max_batch_rows: int = 256, show_progress: bool = True
) -> RolloutEngine:
    """The scoring engine of the backend ``rollout.engine`` names, generating from ``policy``.

    Whether it needs the policy's weights in this process is the backend's
    ``scoring_loads_weights`` (else ``load_policy(weights=False)`` is enough); servers load
    ``served_weights(policy)`` exported in ``dtype``, and are left running on ``close``.
    """
    served = scored_policy(policy, served_folder=lambda: served_weights(policy, weights_dir=rollout.weights_dir,
                                                                         dtype=dtype))
    return rollout_backend(rollout.engine).scoring_engine(rollout, served, max_batch_rows=max_batch_rows,
                                                          show_progress=show_progress)


def scored_policy(policy, *, served_folder: Callable[[], Path] | None = None) -> ScoredPolicy:
    """What a scoring engine needs of a ``LoadedPolicy``: its model, stop tokens, pad token and served folder."""
    from pipeline.models.tokenizer import pad_token_id

    return ScoredPolicy(hf_model=policy.hf_model, eos_token_ids=tuple(stop_token_ids(policy)),
                        pad_token_id=pad_token_id(policy.tokenizer), served_folder=served_folder)


# ================================================================ shards


@dataclass(frozen=True, slots=True)
class Shard:
    """The unit of work saved and resumed: consecutive prompts, their sampling seed, their file."""

    index: int
    prompts: list[Prompt]
    seed: int
    path: Path


def plan_shards(
    prompts: Sequence[Prompt], *, shard_size: int, seed_of: Callable[[int], int], path_of: Callable[[int], Path]
) -> list[Shard]:
    """``prompts`` in order, cut into shards of ``shard_size``; shard ``i`` samples with ``seed_of(i)``
    and is saved at ``path_of(i)``."""
    return [
        Shard(index=index, prompts=list(prompts[start : start + shard_size]), seed=seed_of(index), path=path_of(index))
        for index, start in enumerate(range(0, len(prompts), shard_size))
    ]


class ShardSampler:
    """Samples and grades one shard at a time from a ``LoadedPolicy``.

    ``grading_pool``: returns the running ``GradingPool`` (a stage may start it on first use).
    ``build_engine``: returns the engine to generate with, called once, on the first shard
    that needs sampling (default: the scoring engine of a default ``rollout`` block's backend,
    the local engine over ``policy.hf_model``). ``close`` closes an engine it built.
    """

    def __init__(
        self, policy, *, options: SamplingOptions, grading_pool: Callable[[], Any],
        build_engine: Callable[[], RolloutEngine] | None = None, max_batch_rows: int = 256,
        show_progress: bool = True,
    ) -> None:
        self.policy = policy
        self.options = options
        self.stop_token_ids = tuple(stop_token_ids(policy))
        self._grading_pool = grading_pool
        default = RolloutConfig()
        self._build_engine = build_engine or (lambda: rollout_backend(default.engine).scoring_engine(
            default, scored_policy(policy), max_batch_rows=max_batch_rows, show_progress=show_progress))
        self._engine: RolloutEngine | None = None

    @property
    def engine(self) -> RolloutEngine:
        if self._engine is None:
            self._engine = self._build_engine()
        return self._engine

    def sample(self, shard: Shard) -> list[ProblemResult]:
        """``num_samples`` graded responses per prompt of ``shard``, sampled under ``shard.seed``."""
        return sample_and_grade(
            engine=self.engine, tokenizer=self.policy.tokenizer, prompts=shard.prompts,
            num_samples=self.options.num_samples, params=self.options.params(shard.seed,
                                                                             stop_token_ids=self.stop_token_ids),
            pool=self._grading_pool(), template=self.options.template,
        )

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine = None


@dataclass(frozen=True, slots=True)
class ShardOutcome(Generic[Rows]):
    rows: Rows  # the shard's records, in the stage's format
    reused: bool  # read back from disk rather than sampled
    seconds: float


def run_shard(
    shard: Shard,
    *,
    sampler: ShardSampler,
    read: Callable[[Path], tuple[Rows, list[str]]],
    write: Callable[[Shard, list[ProblemResult]], Rows],
    error: type[UserError],
    plan_name: str,
    on_failure: Callable[[BaseException], None] | None = None,
) -> ShardOutcome[Rows]:
    """Shard ``shard``: read back when its file exists, else sampled, graded and written.

    ``read(path)`` gives the stored rows and their prompt ids; ids other than the plan's raise
    ``error``. ``write(shard, results)`` builds the rows and writes them atomically.
    ``on_failure`` sees an exception of sampling or writing before it propagates.
    """
    started = time.perf_counter()
    if shard.path.is_file():
        rows, ids = read(shard.path)
        if ids != [prompt.id for prompt in shard.prompts]:
            raise error(f"{shard.path} holds other problems than shard {shard.index} of {plan_name}; "
                        "delete it to regenerate it")
        return ShardOutcome(rows, reused=True, seconds=time.perf_counter() - started)
    try:
        rows = write(shard, sampler.sample(shard))
    except BaseException as failure:
        if on_failure is not None:
            on_failure(failure)
        raise
    return ShardOutcome(rows, reused=False, seconds=time.perf_counter() - started)
