"""The sharded, resumable sample-and-grade engine behind `winnow curate` and `winnow evaluate`.

Both stages sample n responses per prompt from one policy with the local engine, grade them
in the bounded pool and keep the counts, shard by shard:

* ``plan_shards`` cuts the prompts, in order, into shards of ``shard_size``. Each shard samples
  in one engine call under its own seed, which the stage derives from its seed and the
  shard's position only, so a shard's samples do not depend on which shards ran before it
  or in which process;
* ``run_shard`` reads a shard back when its file exists (its prompt ids must be the plan's),
  else samples, grades and writes it atomically in the stage's format. A restarted run skips
  the finished shards and ends with the bytes of an uninterrupted one;
* ``sampling_fingerprint`` lists what determines a shard's samples; each stage records it
  (curate: a hash in every shard, evaluate: its manifest) and refuses to mix in shards written
  under another;
* ``ShardSampler`` holds the policy's engine, built on first use (a finished run re-aggregates
  without one), and samples one shard.

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
  The ids reach the engine both as its EOS and in every ``SamplingParams.stop_token_ids``.

Samples are reproducible on one device type (CPU and GPU kernels differ in the last bits).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Generic, TypeVar

import numpy as np

from pipeline.configlib import ConfigError
from pipeline.data.records import Prompt
from pipeline.errors import UserError
from pipeline.eval.runner import ProblemResult, sample_and_grade
from pipeline.data.templates import prompt_token_ids
from pipeline.rollout.types import SamplingParams

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
        generation_config = getattr(policy.hf_model, "generation_config", None)
        if getattr(generation_config, "eos_token_id", None) is None:
            generation_config = policy.hf_model.config
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

    def params(self, seed: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                              seed=seed)


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
    """Samples and grades one shard at a time with a ``LoadedPolicy`` on the local engine.

    ``grading_pool``: returns the running ``GradingPool`` (a stage may start it on first use).
    """

    def __init__(
        self, policy, *, options: SamplingOptions, grading_pool: Callable[[], Any], max_batch_rows: int = 256,
        show_progress: bool = True,
    ) -> None:
        self.policy = policy
        self.options = options
        self._grading_pool = grading_pool
        self._max_batch_rows = max_batch_rows
        self._show_progress = show_progress
        self._engine = None

    @property
    def engine(self):
        if self._engine is None:
            from pipeline.rollout.local import LocalEngine

            from pipeline.models.tokenizer import pad_token_id

            self._engine = LocalEngine(
                self.policy.hf_model, eos_token_ids=stop_token_ids(self.policy),
                pad_token_id=pad_token_id(self.policy.tokenizer), max_batch_rows=self._max_batch_rows,
                show_progress=self._show_progress,
            )
        return self._engine

    def sample(self, shard: Shard) -> list[ProblemResult]:
        """``num_samples`` graded responses per prompt of ``shard``, sampled under ``shard.seed``."""
        params = replace(self.options.params(shard.seed), stop_token_ids=tuple(self.engine.eos_token_ids))
        return sample_and_grade(
            engine=self.engine, tokenizer=self.policy.tokenizer, prompts=shard.prompts,
            num_samples=self.options.num_samples, params=params, pool=self._grading_pool(),
            template=self.options.template,
        )


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
