"""Typed records between generation and the update: rollout groups → a ``TrainBatch``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pipeline.rollout.types import Completion
from pipeline.trainer.batch import TrainBatch


@dataclass(slots=True)
class RolloutBatch:
    """One step's samples: S completions of P prompts, in prompt-major order."""

    prompt_indices: torch.Tensor  # (P,) int64 dataset index of each prompt
    prompt_token_ids: list[list[int]]  # P prompts as the engine saw them
    group_ids: torch.Tensor  # (S,) int64 in 0..P-1: which prompt a sample answers
    completions: list[Completion]  # S
    texts: list[str]  # S decoded responses
    rewards: torch.Tensor  # (S,) float32

    @property
    def num_samples(self) -> int:
        return len(self.completions)

    def num_correct_per_prompt(self) -> torch.Tensor:
        """(P,) samples with reward > 0 per prompt."""
        counts = torch.zeros(len(self.prompt_token_ids), dtype=torch.int64)
        return counts.index_add_(0, self.group_ids, (self.rewards > 0).long())

    def num_samples_per_prompt(self) -> torch.Tensor:
        return torch.bincount(self.group_ids, minlength=len(self.prompt_token_ids))


def to_train_batch(
    prompt_token_ids: Sequence[Sequence[int]],
    completions: Sequence[Completion],
    group_ids: torch.Tensor,
    *,
    pad_id: int,
) -> tuple[TrainBatch, torch.Tensor]:
    """Right-padded ``prompt + response`` rows and the engine's log-probs aligned to them.

    Returns the batch (``response_mask`` on the sampled tokens) and a (S, T) tensor of
    the engine's log-probs at the same positions (0 elsewhere).
    """
    rows = [(list(prompt_token_ids[int(g)]), c.token_ids.tolist(), c.logprobs) for g, c in zip(group_ids, completions)]
    length = max(len(p) + len(r) for p, r, _ in rows)
    tokens = torch.full((len(rows), length), pad_id, dtype=torch.long)  # (S, T)
    response_mask = torch.zeros((len(rows), length), dtype=torch.bool)  # (S, T)
    engine_logprobs = torch.zeros((len(rows), length), dtype=torch.float32)  # (S, T)
    for i, (prompt_ids, response_ids, response_logprobs) in enumerate(rows):
        start, end = len(prompt_ids), len(prompt_ids) + len(response_ids)
        tokens[i, :end] = torch.tensor(prompt_ids + response_ids, dtype=torch.long)
        response_mask[i, start:end] = True
        engine_logprobs[i, start:end] = response_logprobs.float()
    return TrainBatch(tokens=tokens, response_mask=response_mask), engine_logprobs
