"""Typed records and the ``RolloutEngine`` and ``WeightSink`` protocols: what the trainer asks for and gets back.

The trainer never cares where rollouts come from. It hands an engine a list of
``GenerationRequest`` (one prompt's token ids and how many samples it wants) and
one ``SamplingParams``, and receives one ``Completion`` per requested sample.

Contract every engine keeps (tested for both ``LocalEngine`` and ``SGLangEngine``):

* exactly ``Σ request.num_samples`` completions, ordered by request, then by
  ``sample_index``; each ``(prompt_id, sample_index)`` appears exactly once;
* ``Completion.token_ids`` are the generated tokens only (no prompt, no padding);
  a completion that finished on a stop token or stop string *includes* the token
  that completed the stop, as SGLang's ``output_ids`` do, so the trainer scores it;
* ``Completion.logprobs[i]`` is ``log π_T(token_ids[i] | prefix)`` where ``π_T`` is
  ``softmax(logits / temperature)`` over the *full* vocabulary — before top-p
  truncation. This is what the trainer recomputes (``logprobs_from_logits`` with the
  same temperature), and it is what SGLang 0.5.23 returns as
  ``meta_info.output_token_logprobs``: ``Sampler.forward`` divides the logits by the
  temperature, takes ``softmax`` and returns ``log(probs)`` of that tensor, while
  top-p renormalizes a separate copy used only to draw the token
  (``sglang/srt/layers/sampler.py``, standard path, ``SGLANG_RETURN_ORIGINAL_LOGPROB``
  unset). With ``temperature == 0`` (greedy) both engines report the log-probs of
  the unscaled distribution (``temperature`` 1), as SGLang does;
* ``weight_version`` is the version of the weights that produced the completion.

A ``WeightSink`` is where a weight sync delivers the actor's weights when they leave the
trainer's processes (``pipeline.rollout.weight_sync``): a folder every receiver reads, or a
stream of buckets. Each rollout backend with servers implements it (the SGLang one:
``pipeline.rollout.sglang.weights``); the in-process engine needs none.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Protocol, Sequence, runtime_checkable

import torch

__all__ = [
    "FINISH_REASONS",
    "Completion",
    "FinishReason",
    "GenerationRequest",
    "RolloutEngine",
    "RolloutError",
    "SamplingParams",
    "WeightSink",
    "check_requests",
]

FinishReason = Literal["stop", "length", "abort"]
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort")

# SGLang's sampling_seed is an i64 in its JSON schema.
_MAX_SEED = 2**63 - 1


class RolloutError(RuntimeError):
    """Generation could not complete: every server is gone, or a sample failed too often."""


@dataclass(kw_only=True, slots=True, frozen=True)
class SamplingParams:
    """How to sample, shared by every prompt of one ``generate`` call.

    ``temperature == 0`` is greedy decoding. ``top_p`` keeps the smallest set of most
    likely tokens whose preceding mass is ≤ ``top_p`` (SGLang's rule); 1 disables it.
    Generation of a sample stops at the first of: a token in ``stop_token_ids``, the
    model's EOS tokens (unless ``ignore_eos``), a completed ``stop_strings`` match in
    the decoded output (needs a tokenizer in the local engine), or
    ``max_new_tokens``. A stop wins over the length cap on the same token.
    ``seed`` makes sampling reproducible: the same requests, parameters and seed give
    the same completions (see each engine for what else must stay fixed).
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int):
            raise ValueError(f"max_new_tokens must be an int, got {self.max_new_tokens!r}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be finite and >= 0 (0 = greedy), got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        # Lists are accepted for convenience and frozen so the params stay hashable.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop_strings", tuple(self.stop_strings))
        for token_id in self.stop_token_ids:
            if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
                raise ValueError(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")
        for stop in self.stop_strings:
            if not isinstance(stop, str) or not stop:
                raise ValueError(f"stop_strings must be non-empty strings, got {self.stop_strings!r}")
        if self.seed is not None:
            if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not (0 <= self.seed <= _MAX_SEED):
                raise ValueError(f"seed must be None or an int in [0, 2**63), got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One prompt and the number of samples wanted from it (0 is allowed: no completions)."""

    prompt_id: str
    prompt_token_ids: tuple[int, ...]  # (P,)
    num_samples: int

    def __post_init__(self) -> None:
        ids = self.prompt_token_ids
        ids = tuple(ids.tolist() if isinstance(ids, torch.Tensor) or hasattr(ids, "dtype") else ids)
        # map/set iterate in C: cheap even for thousands of long prompts.
        if ids and set(map(type, ids)) != {int}:
            raise ValueError(f"prompt {self.prompt_id!r}: prompt_token_ids must be ints (or an int tensor/array)")
        object.__setattr__(self, "prompt_token_ids", ids)
        if not isinstance(self.prompt_id, str) or not self.prompt_id:
            raise ValueError(f"prompt_id must be a non-empty string, got {self.prompt_id!r}")
        if not self.prompt_token_ids:
            raise ValueError(f"prompt {self.prompt_id!r}: prompt_token_ids is empty")
        if min(self.prompt_token_ids) < 0:
            raise ValueError(f"prompt {self.prompt_id!r}: negative token id in prompt_token_ids")
        if isinstance(self.num_samples, bool) or not isinstance(self.num_samples, int) or self.num_samples < 0:
            raise ValueError(f"prompt {self.prompt_id!r}: num_samples must be an int >= 0, got {self.num_samples!r}")


@dataclass(frozen=True, slots=True, eq=False)
class Completion:
    """One sampled continuation of one prompt."""

    prompt_id: str
    sample_index: int  # in [0, num_samples) of its request
    token_ids: torch.Tensor  # (T,) int64, generated tokens only
    logprobs: torch.Tensor  # (T,) float32, log π_T(token) under the temperature-scaled full distribution
    finish_reason: FinishReason
    weight_version: int

    def __post_init__(self) -> None:
        assert self.token_ids.dim() == 1 and self.token_ids.shape == self.logprobs.shape, (
            self.token_ids.shape,
            self.logprobs.shape,
        )
        assert self.finish_reason in FINISH_REASONS, self.finish_reason

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.numel())


@runtime_checkable
class RolloutEngine(Protocol):
    """Anything that turns prompts into completions; see the module docstring for the contract.

    Weight synchronisation is not part of it: the in-process ``LocalEngine`` takes a copy of the
    weights itself, servers take them through a ``WeightSink``.
    """

    @property
    def weight_version(self) -> int: ...

    def generate(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> list[Completion]: ...

    def close(self) -> None: ...


@runtime_checkable
class WeightSink(Protocol):
    """Receivers of the actor's weights: a folder to load, or a streamed update, bucket by bucket.

    A streamed update is ``begin_update``, one ``send_bucket`` per bucket of the export
    (``pipeline.rollout.weight_export``), then ``end_update`` once, also after a failure. A
    failed delivery raises ``RolloutError``; the receivers keep their version until an update
    completes. Versions only grow: an update to a version not above the current one is a
    ``ValueError``.
    """

    def load_from_disk(self, folder: str, *, version: int) -> None:
        """Every receiver loads the Hugging Face folder ``folder`` (readable by all of them) as ``version``."""
        ...

    def begin_update(self, *, version: int) -> None:
        """Ready every receiver for the buckets of ``version``."""
        ...

    def send_bucket(self, bucket: Sequence[tuple[str, torch.Tensor]], *, version: int) -> None:
        """Deliver one bucket of HF-named full tensors to every receiver of the open update."""
        ...

    def end_update(self, *, version: int, completed: bool) -> None:
        """Close the update; if ``completed``, every receiver serves ``version`` from now on."""
        ...

    def close(self) -> None:
        """Release what the sink holds on the trainer's side (a broadcast group)."""
        ...


def check_requests(requests: Sequence[GenerationRequest]) -> int:
    """Validate a batch of requests (unique prompt ids) and return the total number of samples."""
    seen: set[str] = set()
    for request in requests:
        if not isinstance(request, GenerationRequest):
            raise ValueError(f"expected GenerationRequest, got {type(request).__name__}")
        if request.prompt_id in seen:
            raise ValueError(
                f"prompt_id {request.prompt_id!r} appears twice in one batch; "
                "(prompt_id, sample_index) identifies a sample, so ids must be unique"
            )
        seen.add(request.prompt_id)
    return sum(request.num_samples for request in requests)
