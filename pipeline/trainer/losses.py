"""Token losses the actor optimizes: supervised cross-entropy and the registered policy losses.

Each loss exposes ``denominator(micro)`` (its local normalization count) and is
called with the global ``normalizer`` (that count summed over all micro-batches
and data-parallel ranks), so micro-batching never changes the loss.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pipeline.algorithms.losses import loss_denominator
from pipeline.trainer.batch import TrainBatch


class CrossEntropyLoss:
    """Mean negative log-likelihood of the response tokens (the bootstrap SFT step)."""

    def denominator(self, micro: TrainBatch) -> torch.Tensor:
        return micro.response_mask.sum(dtype=torch.float64)

    def __call__(self, *, logprobs: torch.Tensor, entropy: torch.Tensor | None, micro: TrainBatch,
                 normalizer: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        mask = micro.response_mask
        total = torch.where(mask, logprobs, torch.zeros((), dtype=logprobs.dtype)).sum()
        loss = -total / normalizer.clamp(min=1).to(logprobs.dtype)
        metrics: dict[str, Any] = {"num_tokens": mask.sum()}
        if entropy is not None:
            metrics["entropy"] = torch.where(mask, entropy, 0.0).sum() / mask.sum().clamp(min=1)
        return loss, metrics


class PolicyLoss:
    """A policy loss of ``pipeline.algorithms.losses`` (``grpo_loss``, ``gspo_loss``) with its options bound once."""

    def __init__(self, fn: Callable[..., tuple[torch.Tensor, dict[str, Any]]], *, aggregation: str = "token_mean",
                 **options: Any) -> None:
        self.fn = fn
        self.aggregation = aggregation
        self.options = options

    def denominator(self, micro: TrainBatch) -> torch.Tensor:
        return loss_denominator(micro.response_mask, aggregation=self.aggregation, token_mask=micro.token_mask,
                                max_response_length=self.options.get("max_response_length"))

    def __call__(self, *, logprobs: torch.Tensor, entropy: torch.Tensor | None, micro: TrainBatch,
                 normalizer: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        if micro.advantages is None:
            raise ValueError("a policy loss needs advantages in the TrainBatch")
        # No old_logprobs: one update per batch, so π_old is π_θ at this very forward pass.
        old_logprobs = micro.old_logprobs if micro.old_logprobs is not None else logprobs.detach()
        return self.fn(
            logprobs=logprobs,
            old_logprobs=old_logprobs,
            advantages=micro.advantages,
            response_mask=micro.response_mask,
            token_mask=micro.token_mask,
            ref_logprobs=micro.ref_logprobs,
            entropy=entropy,
            aggregation=self.aggregation,
            normalizer=normalizer,
            **self.options,
        )
