"""The training prompt stream: seeded epochs, an exact position, nothing skipped or repeated.

Each epoch is a permutation of all prompts drawn from a generator seeded by
``(seed, epoch)``, so the order depends only on the seed and the position can be
saved as two integers. A step that needs more prompts than the epoch has left takes
the rest of this epoch and continues into the next one.
"""

from __future__ import annotations

import torch


class PromptStream:
    def __init__(self, num_prompts: int, *, seed: int) -> None:
        if num_prompts < 1:
            raise ValueError("the prompt stream needs at least one prompt")
        self.num_prompts = num_prompts
        self.seed = seed
        self.epoch = 0
        self.offset = 0

    def _order(self, epoch: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_prompts, generator=generator)

    def next(self, count: int) -> tuple[torch.Tensor, bool]:
        """The next ``count`` prompt indices, and whether an epoch ended on the way."""
        taken: list[torch.Tensor] = []
        epoch_ended = False
        while count > 0:
            order = self._order(self.epoch)
            chunk = order[self.offset : self.offset + count]
            taken.append(chunk)
            count -= len(chunk)
            self.offset += len(chunk)
            if self.offset == self.num_prompts:
                self.epoch, self.offset, epoch_ended = self.epoch + 1, 0, True
        return torch.cat(taken), epoch_ended

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset, "num_prompts": self.num_prompts, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["num_prompts"] != self.num_prompts or state["seed"] != self.seed:
            raise ValueError(
                f"prompt stream: the checkpoint was written for {state['num_prompts']} prompts with seed "
                f"{state['seed']}, this run has {self.num_prompts} with seed {self.seed}"
            )
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
