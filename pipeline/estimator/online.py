"""The DEPO estimator during RL: predict before rollout, learn from replay after it, calibrate.

Paper: "Difficulty-Estimated Policy Optimization", §3.2 (the estimator is "updated online with
the actor"; filtering starts after a warm-up) and Figure 2 (drop the prompts whose estimated
advantage is zero). What the paper leaves open and winnow chooses:

* **Replay.** Every observed prompt goes into a ``ReplayBuffer`` (prompt index, avg@k,
  zero-variance label, the actor's question log-prob, the pre-rollout Ẑ, step). Each RL step
  takes ``minibatches`` AdamW steps on ``minibatch_size`` prompts: the first minibatch holds
  the step's new observations (filled up with older ones), the others are drawn uniformly from
  the buffer, so one step sees minibatches × minibatch_size labels instead of its ≤ B prompts.
  Cost: one ``OnlineEstimator`` per run, on the rank that samples (``pipeline.rl.sampling.DepoFilter``
  states its memory and time at the staged H100 defaults); the buffer is 48 bytes per entry
  (192 KiB at 4096), on the CPU.
* **Warm start.** ``algorithm.depo.estimator_dir`` loads the estimator `winnow train-estimator`
  fitted offline on the curation's k samples per prompt; the online steps continue from it.
* **Calibration.** The filter drops on P(all G rewards equal) = σ(a·Ẑ + b), a Platt scaling
  (``fit_platt_scaling``) of the zero-variance head refitted after every step on the newest
  ``calibration_window`` *pre-rollout* predictions and their observed labels: out-of-sample
  pairs, the predictions the filter actually acts on. Until ``MIN_CALIBRATION_PAIRS`` such
  pairs exist the head's own probability is used (a = 1, b = 0).

Sampling of minibatches uses a generator seeded from (seed, step), the updates' dropout masks a
stream of their own seeded from (seed, step) too (``own_random_stream``: the process's default
generators are the actor's), and the buffer, the calibration and the trainer round-trip through
``state_dict``: a resumed run trains exactly as an uninterrupted one, wherever the estimator runs.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from pipeline.algorithms.depo import fit_platt_scaling, zero_variance_logit
from pipeline.estimator.model import DifficultyEstimator
from pipeline.estimator.replay import ReplayBuffer
from pipeline.estimator.train import EstimatorTrainer

__all__ = ["MIN_CALIBRATION_PAIRS", "OnlineEstimator", "Prediction", "own_random_stream", "stream_seed"]

# Platt's two parameters from fewer labelled predictions than this are noise: below it the
# head's own probability stands (it is BCE-trained, a proper scoring rule, so not arbitrary).
MIN_CALIBRATION_PAIRS = 16
_REPLAY_PREFIX = "replay."


def stream_seed(name: str, *parts: int) -> int:
    """A 63-bit seed for the random stream ``name`` at ``parts`` (e.g. seed, step): differently named
    streams never share a seed, unlike linear formulas of (seed, step)."""
    digest = hashlib.sha256(":".join([name, *map(str, parts)]).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@contextmanager
def own_random_stream(seed: int, device: torch.device) -> Iterator[None]:
    """Run the block on default generators seeded with ``seed`` and restore them after it.

    For the estimator's dropout: the process's default generators belong to the actor, and megatron
    needs the default CUDA generator equal on every tensor-parallel rank (dropout outside its
    tensor-parallel regions), so a model trained on one rank must not advance it. Only the CPU
    generator and, on a GPU, that device's are forked (``fork_rng`` would otherwise touch every
    visible GPU); no cost beyond copying their states (a few KiB).
    """
    on_gpu = device.type == "cuda"
    with torch.random.fork_rng(devices=[device] if on_gpu else [], device_type="cuda"):
        torch.random.default_generator.manual_seed(seed)
        if on_gpu:
            with torch.cuda.device(device):
                torch.cuda.manual_seed(seed)
        yield


@dataclass(frozen=True, slots=True)
class Prediction:
    """What the estimator says about ``C`` prompts before they are rolled out, each ``(C,)`` float64."""

    pass_rate: torch.Tensor  # p̂ = σ(Â)
    zero_variance_logit: torch.Tensor  # Ẑ = residual head + logit of the point estimate (``zero_variance_logit``)
    zero_variance_prob: torch.Tensor  # calibrated P(all G rewards equal) = σ(a·Ẑ + b)


class OnlineEstimator:
    """An ``EstimatorTrainer`` with a replay buffer and a Platt calibration, for one RL run."""

    def __init__(self, trainer: EstimatorTrainer, texts: Sequence[str], *, replay_size: int, minibatches: int,
                 minibatch_size: int, calibration_window: int, seed: int) -> None:
        if minibatches < 1 or minibatch_size < 2 or calibration_window < 1:
            raise ValueError(f"minibatches ≥ 1, minibatch_size ≥ 2 and calibration_window ≥ 1, got "
                             f"{minibatches}, {minibatch_size}, {calibration_window}")
        self.trainer = trainer
        self.texts = texts
        self.buffer = ReplayBuffer(replay_size)
        self.minibatches, self.minibatch_size = minibatches, minibatch_size
        self.calibration_window = calibration_window
        self.seed = seed
        self.calibration = (1.0, 0.0)  # (slope a, intercept b) of σ(a·Ẑ + b)

    @property
    def model(self) -> DifficultyEstimator:
        return self.trainer.model

    def predict(self, prompt_indices: torch.Tensor) -> Prediction:
        """Score prompts by dataset index (eval mode, no gradient): p̂, Ẑ and the calibrated P(zero variance)."""
        reward_logits, residuals = self.model.predict_heads([self.texts[i] for i in prompt_indices.tolist()])
        slope, intercept = self.calibration
        logits = zero_variance_logit(head_logits=residuals.double(), pass_rate_logits=reward_logits.double(),
                                     group_size=self.trainer.group_size)
        return Prediction(pass_rate=torch.sigmoid(reward_logits.double()), zero_variance_logit=logits,
                          zero_variance_prob=torch.sigmoid(slope * logits + intercept))

    def learn(self, *, step: int, prompt_indices: torch.Tensor, pass_rates: torch.Tensor,
              zero_variance_targets: torch.Tensor, question_logprobs: torch.Tensor,
              predicted_zero_variance_logits: torch.Tensor) -> dict[str, float]:
        """Add a step's observations ``(N,)`` to the buffer, train on replay, refit the calibration.

        NaN marks an unknown zero-variance label, question log-prob, or pre-rollout logit (a
        prompt the filter did not score, e.g. a DAPO top-up). Returns the minibatches' mean
        losses and the buffer and calibration state as metrics.
        """
        count = prompt_indices.numel()
        if count:
            self.buffer.add(prompt_index=prompt_indices, pass_rate=pass_rates,
                            zero_variance_target=zero_variance_targets, question_logprob=question_logprobs,
                            predicted_zero_variance_logit=predicted_zero_variance_logits,
                            step=torch.full((count,), step, dtype=torch.int64))
        metrics = self._train(step=step, num_new=count)
        metrics.update(self._refit_calibration())
        metrics["depo/replay_entries"] = float(len(self.buffer))
        return metrics

    def _train(self, *, step: int, num_new: int) -> dict[str, float]:
        size = len(self.buffer)
        if size < 2:  # the ranking loss needs pairs; one prompt teaches too little
            return {}
        # A stream of its own: the actor's sampling seeds are (seed, step) too, and must not be shared.
        generator = torch.Generator().manual_seed((self.seed * 1_000_003 + step) * 2 + 1)
        fresh = self.buffer.newest(min(num_new, self.minibatch_size))  # (K,)
        sums: dict[str, float] = {}
        counts: dict[str, int] = {}
        last: dict[str, float] = {}
        with own_random_stream(stream_seed("depo-estimator-dropout", self.seed, step), self.model.device):
            for index in range(self.minibatches):
                order = torch.randperm(size, generator=generator)
                if index == 0 and fresh.numel():
                    order = torch.cat([fresh, order[~torch.isin(order, fresh)]])
                rows = order[: self.minibatch_size]
                batch = self.buffer.get(rows)
                texts = [self.texts[i] for i in batch["prompt_index"].tolist()]
                last = self.trainer.update(texts, batch["pass_rate"].float(), batch["question_logprob"],
                                           batch["zero_variance_target"])
                for name, value in last.items():
                    if math.isfinite(value):
                        sums[name] = sums.get(name, 0.0) + value
                        counts[name] = counts.get(name, 0) + 1
        metrics = {name: sums[name] / counts[name] for name in sums}
        metrics["estimator/num_updates"] = last["estimator/num_updates"]
        return metrics

    def _refit_calibration(self) -> dict[str, float]:
        rows = self.buffer.newest(len(self.buffer))  # newest first
        batch = self.buffer.get(rows)
        usable = ~torch.isnan(batch["zero_variance_target"]) & ~torch.isnan(batch["predicted_zero_variance_logit"])
        chosen = usable.nonzero().squeeze(1)[: self.calibration_window]
        if chosen.numel() >= MIN_CALIBRATION_PAIRS:
            self.calibration = fit_platt_scaling(logits=batch["predicted_zero_variance_logit"][chosen],
                                                 targets=batch["zero_variance_target"][chosen])
        return {"depo/calibration_slope": self.calibration[0], "depo/calibration_intercept": self.calibration[1],
                "depo/calibration_pairs": float(chosen.numel())}

    # ---------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        """``{"tensors", "json"}``: the trainer's (model, AdamW), the buffer's rows, the calibration, token counts."""
        trainer, buffer = self.trainer.state_dict(), self.buffer.state_dict()
        tensors = {**trainer["tensors"], **{_REPLAY_PREFIX + name: t for name, t in buffer["tensors"].items()}}
        return {"tensors": tensors,
                "json": {**trainer["json"], "replay": buffer["json"], "calibration": list(self.calibration),
                         "num_encoded_tokens": dict(self.model.num_encoded_tokens)}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        meta = dict(state["json"])
        replay_meta, calibration = meta.pop("replay"), meta.pop("calibration")
        counts = meta.pop("num_encoded_tokens")
        replay_tensors = {name.removeprefix(_REPLAY_PREFIX): tensor for name, tensor in state["tensors"].items()
                          if name.startswith(_REPLAY_PREFIX)}
        trainer_tensors = {name: tensor for name, tensor in state["tensors"].items()
                           if not name.startswith(_REPLAY_PREFIX)}
        self.trainer.load_state_dict({"tensors": trainer_tensors, "json": meta})
        self.buffer.load_state_dict({"tensors": replay_tensors, "json": replay_meta})
        self.calibration = (float(calibration[0]), float(calibration[1]))
        self.model.num_encoded_tokens = {kind: int(n) for kind, n in counts.items()}
