"""``Sampling.state``/``load_state`` carry the sampler's state: a stateful sampler resumes exactly."""

from __future__ import annotations

import json
from typing import Any

import torch

from pipeline.config import AlgorithmConfig
from pipeline.rl.registry import Method, MethodSetting
from pipeline.rl.sampling import NoFilter, Sampled, Sampling, UniformBudget
from tests.rl.test_rl_sampling import FakeEngine


class RotatingSampler(Method):
    """Spends each step's budget on a rotating slice of the prompts and keeps a running count: its
    decisions depend on every earlier step, so a resume that lost its state would choose differently."""

    def __init__(self) -> None:
        self.offset = 0
        self.samples_drawn = 0

    def __call__(self, indices: torch.Tensor, budgets: torch.Tensor, *, generate, draw, seed: int) -> Sampled:
        half = max(indices.numel() // 2, 1)
        chosen = torch.roll(indices, -self.offset)[:half]
        rollouts = generate(chosen, budgets[:half] + self.samples_drawn % 3, 0)
        self.offset = (self.offset + 1) % indices.numel()
        self.samples_drawn += rollouts.num_samples
        return Sampled(pool=rollouts, train=rollouts, baseline=rollouts)

    def state_dict(self) -> dict[str, Any]:
        return {"offset": self.offset, "samples_drawn": self.samples_drawn}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.offset = int(state["offset"])
        self.samples_drawn = int(state["samples_drawn"])


def _sampling() -> Sampling:
    setting = MethodSetting(total_steps=10, group_size=2, temperature=1.0)
    return Sampling(prompt_filter=NoFilter(AlgorithmConfig(), setting),
                    budget=UniformBudget(AlgorithmConfig(), setting), sampler=RotatingSampler())


def _step(sampling: Sampling, engine: FakeEngine, step: int) -> list[int]:
    indices = torch.arange(5)
    budgets, _ = sampling.budget(indices)
    sampled = sampling.sampler(indices, budgets, generate=engine.generate, draw=lambda count: indices[:count],
                               seed=step)
    return sampled.pool.prompt_indices.tolist() + [sampled.pool.num_samples]


def test_a_stateful_sampler_resumes_exactly():
    outcomes = {i: [1, 0, i % 2] for i in range(5)}
    uninterrupted = _sampling()
    engine = FakeEngine(outcomes)
    expected = [_step(uninterrupted, engine, step) for step in range(4)]

    first = _sampling()
    before = [_step(first, FakeEngine(outcomes), step) for step in range(2)]
    state, tensors = first.state()
    resumed = _sampling()
    resumed.load_state(json.loads(json.dumps(state)), tensors)  # the checkpoint stores the state as JSON
    assert resumed.sampler.state_dict() == first.sampler.state_dict() != RotatingSampler().state_dict()
    engine = FakeEngine(outcomes)
    after = [_step(resumed, engine, step) for step in range(2, 4)]
    assert before + after == expected
