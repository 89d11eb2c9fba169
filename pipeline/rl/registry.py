"""The one shape of every RL method the loop can name, and the registries that hold them.

A *method* is whatever fills one slot of the loop: an advantage, a sample selector, a
token weighting, a policy loss, a sampling temperature, a prompt filter, a rollout budget
or a sampler. Each registry entry is a factory ``entry(cfg, setting) -> Method``, built
once from its own section of ``AlgorithmConfig`` and the run's ``MethodSetting``, and
every method answers the same four calls:

``__call__(**inputs)``     the step's decision (its inputs depend on the slot; the
                           docstring of each registry in ``methods.py``/``sampling.py``
                           states them);
``update(end) -> metrics`` the end-of-step hook: every method sees the step's outcome
                           (``StepEnd``) once, after the update, and advances whatever
                           schedule or estimate it keeps;
``state_dict()`` / ``load_state_dict(state)``  what a checkpoint must hold for an exact
                           resume (JSON-serialisable; ``{}`` for a stateless method).

The pure arithmetic stays in ``pipeline.algorithms``: methods bind options and keep state,
nothing else. The loop never tests a method's name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from pipeline.registry import Registry as NamedTable

if TYPE_CHECKING:
    from pipeline.config import AlgorithmConfig
    from pipeline.rl.rollouts import RolloutBatch
    from pipeline.stats.store import PromptStatsStore

Metrics = dict[str, float]


def float_metrics(metrics: dict[str, Any]) -> Metrics:
    """A method's metrics as plain floats (tensors and numpy scalars are not JSON-logged as-is)."""
    return {name: float(value) for name, value in metrics.items()}


def on_one_rank(payload: Any) -> Any:
    """``MethodSetting.broadcast_from_sampling_rank`` of a one-rank run: the payload is already everywhere."""
    return payload


@dataclass(slots=True)
class MethodSetting:
    """What a method may know about the run beyond its own config section."""

    total_steps: int
    group_size: int
    temperature: float  # the configured sampling temperature (τ₀)
    vocab_size: int = 0
    max_new_tokens: int = 0
    texts: list[str] = field(default_factory=list)  # every training prompt's problem text, by dataset index
    stats: PromptStatsStore | None = None
    seed: int = 0
    # Where a method that keeps a model of its own (DEPO's estimator) runs it: only on the rank that
    # samples (global rank 0, which drives the engine), on ``sampling_device``; every other rank
    # receives its decisions through ``broadcast_from_sampling_rank``, a collective that every rank
    # calls at the same point (the run's ``broadcast_from_rank0``; the identity at one rank). Parallelism
    # enters the methods here only: they never import torch.distributed.
    is_sampling_rank: bool = True
    sampling_device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    broadcast_from_sampling_rank: Callable[[Any], Any] = on_one_rank
    # Objects several methods share (D³S's N_s/K schedule drives both sample and token
    # selection): built once per run by ``shared`` and checkpointed once under their name.
    shared_components: dict[str, Any] = field(default_factory=dict)

    def shared(self, name: str, build: Callable[[], Any]) -> Any:
        if name not in self.shared_components:
            self.shared_components[name] = build()
        return self.shared_components[name]


@dataclass(slots=True)
class StepEnd:
    """The outcome of one step, handed to every method's ``update``."""

    step: int  # the step that just finished (0-based)
    mean_entropy: float  # of the policy on the trained samples
    epoch_ended: bool  # the prompt stream completed a pass over the data during this step
    pool: RolloutBatch  # every graded sample of the step
    selected: Any  # the filter's ``SelectedPrompts``
    question_logprobs: torch.Tensor | None  # (P,) when a method asked for them (``needs_question_logprobs``)


class Method:
    """Base of every registry entry: stateless and update-free unless a subclass says otherwise."""

    needs_token_stats = False  # needs the actor's log-probs and entropies before the update
    needs_question_logprobs = False  # needs the actor's mean log-prob of each prompt's question in ``StepEnd``

    def update(self, end: StepEnd) -> Metrics:  # noqa: ARG002 - the default method keeps nothing
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: ARG002
        return None


Factory = Callable[["AlgorithmConfig", MethodSetting], Method]


class Registry(NamedTable[Factory]):
    """A named table of method factories (``pipeline.registry.Registry``); an unknown name fails with the
    allowed ones listed."""

    def build(self, name: str, cfg: AlgorithmConfig, setting: MethodSetting) -> Method:
        return self.get(name)(cfg, setting)
