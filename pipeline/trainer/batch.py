"""``TrainBatch``: what the actor's update consumes, and token-count micro-batching.

Every per-token tensor is aligned with ``tokens``: entry ``[b, t]`` concerns the
token at position ``t`` (its log-prob given ``tokens[b, :t]``, its advantage,
whether it is a response token). Position 0 is never a response token, so the
alignment loses nothing and padding never needs index arithmetic elsewhere.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass

import torch


@dataclass(kw_only=True)
class TrainBatch:
    tokens: torch.Tensor  # (B, T) int64, prompt + response, right-padded
    response_mask: torch.Tensor  # (B, T) bool: tokens the policy generated (and is trained on)
    advantages: torch.Tensor | None = None  # (B, T) float: per-token advantage × token weight
    old_logprobs: torch.Tensor | None = None  # (B, T) float: log π_old, for the ratio
    ref_logprobs: torch.Tensor | None = None  # (B, T) float: log π_ref, for the KL term
    token_mask: torch.Tensor | None = None  # (B, T) bool: tokens kept by token selection

    def __post_init__(self) -> None:
        if self.tokens.dim() != 2:
            raise ValueError(f"tokens must be (B, T), got {tuple(self.tokens.shape)}")
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None and value.shape != self.tokens.shape:
                raise ValueError(
                    f"{field.name} must have the shape of tokens {tuple(self.tokens.shape)}, got {tuple(value.shape)}"
                )
        if self.response_mask.dtype != torch.bool:
            raise ValueError("response_mask must be a bool tensor")
        if self.response_mask[:, 0].any():
            raise ValueError("position 0 cannot be a response token (it has no prefix)")

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def seq_lengths(self) -> torch.Tensor:
        """(B,) index of the last response token + 1 (or of the last non-pad token, via the mask)."""
        positions = torch.arange(self.tokens.shape[1], device=self.tokens.device)
        last = torch.where(self.response_mask, positions, torch.zeros_like(positions)).amax(dim=1)
        return last + 1

    def select(self, rows: torch.Tensor, *, length: int | None = None) -> TrainBatch:
        """The rows ``rows`` (indices), optionally cut to the first ``length`` positions."""
        cut = slice(None) if length is None else slice(0, length)
        values = {
            field.name: (getattr(self, field.name)[rows][:, cut] if getattr(self, field.name) is not None else None)
            for field in dataclasses.fields(self)
        }
        return TrainBatch(**values)

    def to(self, device: torch.device) -> TrainBatch:
        """Every tensor on ``device``; the batch itself when they are all there already.

        Not validated again (a move changes no shape or value): on a GPU the checks would
        cost a host synchronization per micro-batch.
        """
        if all(getattr(self, f.name) is None or getattr(self, f.name).device == device
               for f in dataclasses.fields(self)):
            return self
        moved = copy.copy(self)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            setattr(moved, f.name, None if value is None else value.to(device))
        return moved


def pad_to_token_multiple(batch: TrainBatch, *, multiple: int) -> TrainBatch:
    """Right-pad positions until rows × length is a multiple of ``multiple``; ``batch`` itself if it is.

    For FP8 GEMMs, which need the flattened token count divisible by 8 or 16. The fewest
    positions that do it are added; they are fully masked (token 0, masks False, zeros),
    and with causal attention no real position sees them, so the real positions' outputs
    do not change. ``multiple=1`` (FP8 off) never pads.
    """
    if multiple < 1:
        raise ValueError(f"multiple must be ≥ 1, got {multiple}")
    rows, length = batch.tokens.shape
    step = multiple // math.gcd(rows, multiple)  # rows × L is a multiple of `multiple` iff `step` divides L
    target = -(-length // step) * step
    if target == length:
        return batch
    extra = target - length

    def pad(tensor: torch.Tensor | None) -> torch.Tensor | None:
        if tensor is None:
            return None
        return torch.cat([tensor, tensor.new_zeros((rows, extra))], dim=1)

    return TrainBatch(**{f.name: pad(getattr(batch, f.name)) for f in dataclasses.fields(batch)})


def plan_micro_batches(
    seq_lengths: torch.Tensor, *, max_tokens: int, max_rows: int | None = None
) -> list[torch.Tensor]:
    """Group rows into micro-batches whose padded size (rows × longest row) ≤ ``max_tokens``.

    Rows are taken longest first so that rows of similar length share a
    micro-batch (ragged groups from adaptive sampling would otherwise all pad to
    the longest sequence). A single row longer than ``max_tokens`` still gets a
    micro-batch of its own. Returns index tensors covering every row once.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be ≥ 1, got {max_tokens}")
    order = torch.argsort(seq_lengths, descending=True, stable=True).tolist()
    lengths = seq_lengths.tolist()
    plans: list[list[int]] = []
    current: list[int] = []
    for row in order:
        longest = lengths[current[0]] if current else lengths[row]
        full = max_rows is not None and len(current) >= max_rows
        if current and (full or (len(current) + 1) * longest > max_tokens):
            plans.append(current)
            current = []
        current.append(row)
    if current:
        plans.append(current)
    return [torch.tensor(sorted(rows), dtype=torch.long) for rows in plans]


def balance_rows(lengths: torch.Tensor, num_shares: int) -> list[torch.Tensor]:
    """Row indices of ``num_shares`` shares of near-equal token count; ``lengths`` is ``(B,)``.

    Longest processing time first (Graham, "Bounds on Multiprocessing Timing Anomalies",
    SIAM J. Appl. Math. 17(2), 1969): rows sorted by length, longest first (ties: lower
    index), each onto the currently lightest share (ties: lower share), so the heaviest
    share is within 4/3 − 1/(3m) of the best possible split. Why not contiguous chunks: RL
    rows are ragged — one batch holds 20- and 3,000-token responses — and a data-parallel
    rank's update time is its token count, so the slowest rank sets the step time. Each
    share lists its rows in ascending order; together the shares hold every row once.
    Cost: O(B log B + B·m) on the host, m the number of shares (B ≈ 10³, m ≤ 10³ at 7B).
    """
    if num_shares < 1:
        raise ValueError(f"num_shares must be >= 1, got {num_shares}")
    lengths = lengths.detach().cpu().long()
    order = sorted(range(lengths.numel()), key=lambda row: (-int(lengths[row]), row))
    loads = [0] * num_shares
    shares: list[list[int]] = [[] for _ in range(num_shares)]
    for row in order:
        lightest = min(range(num_shares), key=lambda share: (loads[share], share))
        shares[lightest].append(row)
        loads[lightest] += int(lengths[row])
    return [torch.tensor(sorted(rows), dtype=torch.long) for rows in shares]


def without_targets(batch: TrainBatch) -> TrainBatch:
    """``batch`` with no token to train on (response and token masks all False): a rank's
    placeholder when a step has fewer rows than data-parallel ranks, so every rank still runs
    the same collectives while adding nothing to the loss, its denominators or the gradient."""
    return dataclasses.replace(batch, response_mask=torch.zeros_like(batch.response_mask),
                               token_mask=None if batch.token_mask is None else torch.zeros_like(batch.token_mask))
