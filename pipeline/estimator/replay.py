"""The DEPO estimator's replay buffer: every observed (prompt, avg@k, zero-variance label), newest kept.

Paper: "Difficulty-Estimated Policy Optimization", §3.2: the estimator learns online from the
actor's rollouts. One AdamW step per RL step on that step's ≤ B prompts moves a fresh encoder
too little to separate prompts (its predictions stayed within ±0.02 of the batch mean for 60
steps on the CPU pool); the paper's warm-up alone is 100 steps × 128 prompts = 12,800 labels.
Replaying every observation lets each RL step take several minibatches of mixed difficulty.

Entries are a ring of ``capacity`` rows in preallocated tensors; a full buffer overwrites its
oldest row, so labels older than ``capacity`` observations (the actor has moved on since) leave
first. Texts are not copied: a row holds the prompt's index into the run's prompt list.

Memory: 48 bytes per entry (six 8-byte columns), allocated up front: 4096 entries are 192 KiB.
At 7B on 8×H100 every rank keeps the same copy on the CPU (1.5 MiB over 8 ranks) and rank 0
writes it with the checkpoint's run tensors; nothing is on the GPU and there is no collective.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["BYTES_PER_ENTRY", "COLUMNS", "ReplayBuffer"]

COLUMNS: dict[str, torch.dtype] = {
    "prompt_index": torch.int64,  # index into the run's prompt texts
    "pass_rate": torch.float64,  # avg@k of the observed group
    "zero_variance_target": torch.float64,  # ``zero_variance_targets`` label; NaN: unknown
    "question_logprob": torch.float64,  # the actor's mean question log-prob (L_distill); NaN: unknown
    "predicted_zero_variance_logit": torch.float64,  # Ẑ before the rollout (calibration); NaN: not scored
    "step": torch.int64,  # the RL step that observed it
}
BYTES_PER_ENTRY = sum(torch.empty(0, dtype=dtype).element_size() for dtype in COLUMNS.values())


class ReplayBuffer:
    """A ring buffer of observations with an exact ``state_dict`` round trip."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be ≥ 1, got {capacity}")
        self.capacity = capacity
        self.columns = {name: torch.zeros(capacity, dtype=dtype) for name, dtype in COLUMNS.items()}
        self.size = 0  # rows filled
        self.cursor = 0  # the row the next entry goes to
        self.num_added = 0  # entries ever added

    def __len__(self) -> int:
        return self.size

    def add(self, **values: torch.Tensor) -> torch.Tensor:
        """Append ``N`` entries (one ``(N,)`` tensor per column, every column given); returns their rows ``(N,)``.

        More than ``capacity`` entries at once keep only the last ``capacity`` of them.
        """
        if set(values) != set(COLUMNS):
            raise ValueError(f"add: give exactly the columns {sorted(COLUMNS)}, got {sorted(values)}")
        lengths = {value.numel() for value in values.values()}
        if len(lengths) != 1 or any(value.dim() != 1 for value in values.values()):
            raise ValueError("add: every column must be 1-D of one length")
        count = lengths.pop()
        skip = max(count - self.capacity, 0)
        rows = (self.cursor + torch.arange(skip, count)) % self.capacity  # (N',)
        for name, value in values.items():
            self.columns[name][rows] = value[skip:].to(COLUMNS[name])
        self.cursor = (self.cursor + count) % self.capacity
        self.size = min(self.size + count, self.capacity)
        self.num_added += count
        return rows

    def newest(self, count: int) -> torch.Tensor:
        """The rows of the newest ``min(count, size)`` entries ``(K,)``, newest first."""
        count = min(count, self.size)
        return (self.cursor - 1 - torch.arange(count)) % self.capacity

    def get(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """The entries at ``rows`` ``(K,)``: one ``(K,)`` tensor per column."""
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= self.size):
            raise IndexError(f"rows must lie in [0, {self.size})")
        return {name: column[rows].clone() for name, column in self.columns.items()}

    def state_dict(self) -> dict[str, Any]:
        """``{"tensors": the filled rows of each column, "json": capacity, size, cursor, num_added}``."""
        return {"tensors": {name: column[: self.size].clone() for name, column in self.columns.items()},
                "json": {"capacity": self.capacity, "size": self.size, "cursor": self.cursor,
                         "num_added": self.num_added}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        meta = state["json"]
        if int(meta["capacity"]) != self.capacity:
            raise ValueError(f"the checkpoint's replay buffer holds {meta['capacity']} entries, this run's "
                             f"algorithm.depo.replay_size is {self.capacity}; resume with the same replay_size")
        size = int(meta["size"])
        for name, dtype in COLUMNS.items():
            saved = state["tensors"][name]
            if saved.shape != (size,):
                raise ValueError(f"replay column {name}: {tuple(saved.shape)} rows, expected ({size},)")
            self.columns[name].zero_()
            self.columns[name][:size] = saved.to(dtype)
        self.size, self.cursor, self.num_added = size, int(meta["cursor"]), int(meta["num_added"])
