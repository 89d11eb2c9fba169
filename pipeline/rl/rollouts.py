"""Typed records between generation and the update: rollout groups → a ``TrainBatch``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

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

    @property
    def num_prompts(self) -> int:
        return len(self.prompt_token_ids)

    def weight_versions(self) -> torch.Tensor:
        """(S,) int64 the weight version each sample was generated with."""
        return torch.tensor([c.weight_version for c in self.completions], dtype=torch.int64)

    def to_state(self, prefix: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """(JSON fields, tensors named ``<prefix>.*``): the batch exactly, for a checkpoint (``from_state``)."""
        completions = self.completions
        state = {"texts": list(self.texts), "prompt_ids": [c.prompt_id for c in completions],
                 "sample_indices": [c.sample_index for c in completions],
                 "finish_reasons": [c.finish_reason for c in completions],
                 "weight_versions": [c.weight_version for c in completions]}
        tensors = {
            "prompt_indices": self.prompt_indices, "group_ids": self.group_ids, "rewards": self.rewards,
            "prompt_lengths": torch.tensor([len(ids) for ids in self.prompt_token_ids], dtype=torch.int64),
            "prompt_tokens": torch.tensor([t for ids in self.prompt_token_ids for t in ids], dtype=torch.int64),
            "lengths": torch.tensor([c.num_tokens for c in completions], dtype=torch.int64),
            "token_ids": torch.cat([c.token_ids for c in completions]) if completions else torch.zeros(0, dtype=torch.int64),
            "logprobs": torch.cat([c.logprobs for c in completions]) if completions else torch.zeros(0),
        }
        # Copies: the batches of one step share tensors, and a checkpoint file stores each once.
        return state, {f"{prefix}.{name}": tensor.clone() for name, tensor in tensors.items()}

    @staticmethod
    def from_state(state: dict[str, Any], tensors: dict[str, torch.Tensor], prefix: str) -> RolloutBatch:
        t = {name: tensors[f"{prefix}.{name}"] for name in (
            "prompt_indices", "group_ids", "rewards", "prompt_lengths", "prompt_tokens", "lengths", "token_ids",
            "logprobs")}
        prompts = [ids.tolist() for ids in t["prompt_tokens"].split(t["prompt_lengths"].tolist())]
        sizes = t["lengths"].tolist()
        completions = [Completion(prompt_id=prompt_id, sample_index=int(index), token_ids=token_ids.clone(),
                                  logprobs=logprobs.clone(), finish_reason=reason, weight_version=int(version))
                       for prompt_id, index, reason, version, token_ids, logprobs in zip(
                           state["prompt_ids"], state["sample_indices"], state["finish_reasons"],
                           state["weight_versions"], t["token_ids"].split(sizes), t["logprobs"].split(sizes))]
        return RolloutBatch(t["prompt_indices"].clone(), prompts, t["group_ids"].clone(), completions,
                            list(state["texts"]), t["rewards"].clone())

    def reward_sum_per_prompt(self) -> torch.Tensor:
        """(P,) float64 Σ rewards of each prompt's samples."""
        return torch.zeros(self.num_prompts, dtype=torch.float64).index_add_(0, self.group_ids, self.rewards.double())

    def select_samples(self, keep_mask: torch.Tensor) -> RolloutBatch:
        """The samples where ``keep_mask`` ``(S,)`` is true; every prompt stays (its group may shrink)."""
        rows = keep_mask.nonzero().squeeze(1).tolist()
        return RolloutBatch(self.prompt_indices, self.prompt_token_ids, self.group_ids[rows],
                            [self.completions[i] for i in rows], [self.texts[i] for i in rows], self.rewards[rows])

    def select_prompts(self, positions: torch.Tensor) -> RolloutBatch:
        """The prompts at ``positions`` ``(P',)`` (in that order) with all their samples, renumbered."""
        new_group = torch.full((self.num_prompts,), -1, dtype=torch.long)
        new_group[positions] = torch.arange(positions.numel())
        kept = new_group[self.group_ids] >= 0  # (S,)
        rows = kept.nonzero().squeeze(1)
        order = rows[torch.argsort(new_group[self.group_ids[rows]], stable=True)].tolist()  # prompt-major
        return RolloutBatch(self.prompt_indices[positions], [self.prompt_token_ids[i] for i in positions.tolist()],
                            new_group[self.group_ids[order]], [self.completions[i] for i in order],
                            [self.texts[i] for i in order], self.rewards[order])

    @staticmethod
    def concat(parts: Sequence[RolloutBatch]) -> RolloutBatch:
        """Batches of different prompts side by side (prompt positions offset, order kept)."""
        offsets = torch.tensor([0, *[part.num_prompts for part in parts]]).cumsum(0)
        return RolloutBatch(
            torch.cat([part.prompt_indices for part in parts]),
            [ids for part in parts for ids in part.prompt_token_ids],
            torch.cat([part.group_ids + offsets[k] for k, part in enumerate(parts)]),
            [c for part in parts for c in part.completions],
            [t for part in parts for t in part.texts],
            torch.cat([part.rewards for part in parts]),
        )

    @staticmethod
    def merge_rounds(base: RolloutBatch, parts: Sequence[RolloutBatch],
                     positions: Sequence[torch.Tensor]) -> RolloutBatch:
        """Several rounds of samples for subsets of ``base``'s prompts as one prompt-major batch.

        ``parts[k]`` answers ``base``'s prompts at ``positions[k]``; ``base`` provides the
        prompt list (its own samples are not included).
        """
        group_ids = torch.cat([pos[part.group_ids] for part, pos in zip(parts, positions)])  # (S,)
        completions = [c for part in parts for c in part.completions]
        texts = [t for part in parts for t in part.texts]
        rewards = torch.cat([part.rewards for part in parts])
        order = torch.argsort(group_ids, stable=True).tolist()
        return RolloutBatch(base.prompt_indices, base.prompt_token_ids, group_ids[order],
                            [completions[i] for i in order], [texts[i] for i in order], rewards[order])


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
