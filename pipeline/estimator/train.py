"""Trainer of the DEPO difficulty estimator, and its calibration report.

Paper: "Difficulty-Estimated Policy Optimization", §3.1.2 (L = L_DE + w_distill·L_distill
+ w_rank·L_rank, weights 0.5 and 3 from §4.1) and §3.2 (the estimator trains on every
step's rollouts; filtering starts after a warm-up). The losses are the pure functions of
``pipeline.algorithms.depo``; this module owns the optimizer and the state. The online
loop around it (replay buffer, minibatches, calibration) is ``pipeline.estimator.online``.

Choices the paper leaves open:

* AdamW (weight decay 0.01, the usual BERT fine-tuning value) with gradient clipping at
  norm 1;
* a missing actor question log-prob (NaN, or None for the whole batch: offline training on
  a curation that did not record them) leaves that prompt out of L_distill rather than
  faking a target; a missing zero-variance label (NaN) leaves it out of L_ZV;
* ``calibration`` scores the drop rule against each prompt's observed zero-variance label
  (``zero_variance_targets``: the share of G-subsets of its samples that are all equal).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from pipeline.algorithms.depo import (
    depo_drop_decision,
    depo_estimator_loss,
    filter_precision_recall,
    perplexity_targets,
    zero_variance_log_prob,
    zero_variance_logit,
)
from pipeline.estimator.model import DifficultyEstimator

__all__ = ["EstimatorTrainer", "average_ranks", "reliability_bins", "spearman_correlation"]

_MODEL_PREFIX = "model."
_OPTIMIZER_PREFIX = "optimizer."


def average_ranks(values: np.ndarray) -> np.ndarray:
    """1-based ranks of ``values`` ``(N,)``; tied values share the mean of their ranks."""
    _, inverse, counts = np.unique(values, return_inverse=True, return_counts=True)
    ends = np.cumsum(counts)  # last 1-based rank of each distinct value
    return ((ends - counts + 1 + ends) / 2.0)[inverse]


def spearman_correlation(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman's ρ: Pearson correlation of the average ranks; NaN when either side is constant or N < 2."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"spearman_correlation: x {x.shape} and y {y.shape} must be 1-D of one shape")
    if x.size < 2:
        return math.nan
    rank_x = average_ranks(x) - (x.size + 1) / 2.0
    rank_y = average_ranks(y) - (y.size + 1) / 2.0
    denominator = math.sqrt(float(rank_x @ rank_x) * float(rank_y @ rank_y))
    return float(rank_x @ rank_y) / denominator if denominator > 0 else math.nan


def reliability_bins(predicted: np.ndarray, observed: np.ndarray, *, num_bins: int = 10) -> dict[str, list]:
    """Reliability-diagram data: equal-width bins of predicted pass rate, mean predicted/observed per bin.

    Empty bins report NaN means and count 0 (JSON writes NaN as ``NaN``).
    """
    edges = np.linspace(0.0, 1.0, num_bins + 1)
    index = np.clip(np.digitize(predicted, edges[1:-1]), 0, num_bins - 1)  # (N,)
    counts = np.bincount(index, minlength=num_bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_predicted = np.bincount(index, weights=predicted, minlength=num_bins) / counts
        mean_observed = np.bincount(index, weights=observed, minlength=num_bins) / counts
    return {"edges": edges.tolist(), "count": counts.tolist(), "mean_predicted": mean_predicted.tolist(),
            "mean_observed": mean_observed.tolist()}


def _as_float(value: float | torch.Tensor) -> float:
    return float(value.detach()) if isinstance(value, torch.Tensor) else float(value)


class EstimatorTrainer:
    """AdamW on the DEPO loss; ``update`` per batch of observed prompts, exact ``state_dict`` round trip."""

    def __init__(self, model: DifficultyEstimator, *, group_size: int, lr: float, w_distill: float, w_rank: float,
                 margin: float, w_zero_variance: float, weight_decay: float = 0.01,
                 max_grad_norm: float | None = 1.0) -> None:
        """``group_size``: the G whose all-equal event the zero-variance head predicts (the RL run's)."""
        if group_size < 1:
            raise ValueError(f"group_size must be ≥ 1, got {group_size}")
        if not lr > 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        if w_distill < 0 or w_rank < 0 or w_zero_variance < 0:
            raise ValueError(f"w_distill, w_rank and w_zero_variance must be ≥ 0, got {w_distill}, {w_rank}, "
                             f"{w_zero_variance}")
        if not (0.0 <= margin <= 1.0):
            raise ValueError(f"margin must lie in [0, 1], got {margin}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0 or None, got {max_grad_norm}")
        self.model = model
        self.group_size = group_size
        self.w_distill, self.w_rank, self.margin = w_distill, w_rank, margin
        self.w_zero_variance = w_zero_variance
        self.max_grad_norm = max_grad_norm
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
        self.num_updates = 0

    def update(self, texts: Sequence[str], observed_pass_rates: torch.Tensor,
               actor_mean_logprobs: torch.Tensor | None = None,
               zero_variance_targets: torch.Tensor | None = None) -> dict[str, float]:
        """One optimizer step on a batch of prompts whose rollouts were graded.

        ``observed_pass_rates`` ``(B,)``: avg@k of each prompt's rewards in [0, 1].
        ``actor_mean_logprobs`` ``(B,)``: the actor's mean token log-prob of each question;
        its exp is the normalised-perplexity target of L_distill (``perplexity_targets``).
        NaN marks an unknown one; None leaves L_distill out. ``zero_variance_targets`` ``(B,)``:
        ``zero_variance_targets`` labels (NaN: unknown) for L_ZV; None leaves it out. The
        ranking loss compares every pair in the batch, so batches should mix prompts of
        several difficulties.
        """
        if len(texts) != observed_pass_rates.numel() or observed_pass_rates.dim() != 1:
            raise ValueError(f"update: {len(texts)} texts but observed_pass_rates of shape "
                             f"{tuple(observed_pass_rates.shape)}")
        for name, extra in (("actor_mean_logprobs", actor_mean_logprobs),
                            ("zero_variance_targets", zero_variance_targets)):
            if extra is not None and extra.shape != observed_pass_rates.shape:
                raise ValueError(f"{name} {tuple(extra.shape)} must match observed_pass_rates "
                                 f"{tuple(observed_pass_rates.shape)}")
        self.model.train()
        reward_logits, perplexity_logits, zero_variance_residuals = self.model.score(texts)  # (B,) each
        rewards = observed_pass_rates.to(device=reward_logits.device, dtype=reward_logits.dtype)
        known_logprob = (None if actor_mean_logprobs is None
                         else ~torch.isnan(actor_mean_logprobs.to(reward_logits.device)))  # (B,)
        target_metrics: dict[str, float] = {}
        with_distill = known_logprob is not None and bool(known_logprob.any())
        if with_distill:
            assert actor_mean_logprobs is not None
            mean_logprobs = actor_mean_logprobs.to(device=reward_logits.device, dtype=torch.float64)[known_logprob]
            targets, target_metrics = perplexity_targets(token_logprobs=mean_logprobs[:, None],
                                                         token_mask=torch.ones_like(mean_logprobs[:, None],
                                                                                    dtype=torch.bool))
            # L_distill is the mean over the known rows; scaled by their share so that each row
            # weighs w_distill/B, as in a batch where every row is known.
            distill_logits = perplexity_logits[known_logprob]
            distill_weight = self.w_distill * int(known_logprob.sum()) / len(texts)
        else:
            # The head's own prediction as target with weight 0: an exact zero term and zero gradient.
            distill_logits, targets, distill_weight = perplexity_logits, torch.sigmoid(perplexity_logits.detach()), 0.0
        with_zero_variance = zero_variance_targets is not None
        loss, loss_metrics = depo_estimator_loss(
            advantage_logits=reward_logits, perplexity_logits=distill_logits, mean_rewards=rewards,
            perplexity_targets=targets.to(reward_logits.dtype), distill_weight=distill_weight,
            rank_weight=self.w_rank, margin=self.margin,
            zero_variance_logits=zero_variance_logit(head_logits=zero_variance_residuals, pass_rate_logits=reward_logits,
                                                     group_size=self.group_size) if with_zero_variance else None,
            zero_variance_targets=(zero_variance_targets.to(device=reward_logits.device, dtype=torch.float64)
                                   if zero_variance_targets is not None else None),
            zero_variance_weight=self.w_zero_variance,
        )
        if not with_distill:
            loss_metrics.pop("depo/loss_distill")
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        max_norm = self.max_grad_norm if self.max_grad_norm is not None else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        self.optimizer.step()
        self.num_updates += 1
        metrics = {name: _as_float(value) for name, value in {**loss_metrics, **target_metrics}.items()}
        metrics["estimator/grad_norm"] = float(grad_norm)
        metrics["estimator/num_updates"] = float(self.num_updates)
        return metrics

    # ---------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        """``{"tensors": flat name → tensor (safetensors-ready), "json": plain data}``: model and AdamW state."""
        tensors = {_MODEL_PREFIX + name: tensor.detach().cpu().clone().contiguous()
                   for name, tensor in self.model.state_dict().items()}
        optimizer_state = self.optimizer.state_dict()
        scalars: dict[str, dict[str, Any]] = {}
        for index, entries in optimizer_state["state"].items():
            for key, value in entries.items():
                if isinstance(value, torch.Tensor):
                    tensors[f"{_OPTIMIZER_PREFIX}{index}.{key}"] = value.detach().cpu().clone().contiguous()
                else:
                    scalars.setdefault(str(index), {})[key] = value
        groups = [{key: list(value) if isinstance(value, tuple) else value for key, value in group.items()}
                  for group in optimizer_state["param_groups"]]
        return {"tensors": tensors,
                "json": {"num_updates": self.num_updates, "param_groups": groups, "scalar_state": scalars,
                         "group_size": self.group_size,
                         "w_distill": self.w_distill, "w_rank": self.w_rank, "margin": self.margin,
                         "w_zero_variance": self.w_zero_variance,
                         "max_grad_norm": self.max_grad_norm, "estimator": self.model.describe()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned (possibly after a safetensors/JSON round trip)."""
        tensors, meta = state["tensors"], state["json"]
        model_state = {name[len(_MODEL_PREFIX):]: tensor for name, tensor in tensors.items()
                       if name.startswith(_MODEL_PREFIX)}
        self.model.load_state_dict(model_state, strict=True)
        per_param: dict[int, dict[str, Any]] = {}
        for name, tensor in tensors.items():
            if name.startswith(_OPTIMIZER_PREFIX):
                index, key = name[len(_OPTIMIZER_PREFIX):].split(".", 1)
                per_param.setdefault(int(index), {})[key] = tensor
        for index, entries in meta["scalar_state"].items():
            per_param.setdefault(int(index), {}).update(entries)
        groups = [{key: tuple(value) if key == "betas" else value for key, value in group.items()}
                  for group in meta["param_groups"]]
        self.optimizer.load_state_dict({"state": per_param, "param_groups": groups})
        self.num_updates = int(meta["num_updates"])
        self.group_size = int(meta["group_size"])
        self.w_distill, self.w_rank = float(meta["w_distill"]), float(meta["w_rank"])
        self.margin = float(meta["margin"])
        self.w_zero_variance = float(meta["w_zero_variance"])
        self.max_grad_norm = meta["max_grad_norm"]

    # ---------------------------------------------------------------- evaluation

    def calibration(self, texts: Sequence[str], pass_rates: np.ndarray | torch.Tensor, *,
                    zero_variance_targets: np.ndarray | torch.Tensor, filter_ratio: float, threshold: float,
                    batch_size: int = 64, num_bins: int = 10) -> dict[str, Any]:
        """How well predicted pass rates and zero-variance probabilities match observed ones on ``texts``.

        ``texts`` are normally held out. Pass rate: ``brier`` is mean (p̂ − p)²,
        ``brier_constant`` the same for the best constant (the observed mean), so
        ``brier < brier_constant`` means the estimator beats predicting the average;
        ``spearman`` is the rank correlation of p̂ and p (average ranks for ties); ``bins`` is
        reliability-diagram data. Zero variance at the trainer's G, over prompts whose label is
        known (``zero_variance_targets``, NaN: unknown): ``zero_variance_brier`` of the head's
        P(all G equal), ``zero_variance_brier_point_estimate`` of p̂^G + (1 − p̂)^G (what the
        head corrects) and ``zero_variance_brier_constant``. The drop rule
        (``depo_drop_decision`` at ``filter_ratio`` and ``threshold`` on the head's raw
        probability: the online filter recalibrates it, ``pipeline.estimator.online``) is
        scored with ``filter_precision_recall``.
        """
        observed = np.asarray(pass_rates, dtype=np.float64)
        labels = np.asarray(zero_variance_targets, dtype=np.float64)
        if observed.ndim != 1 or observed.size != len(texts) or observed.size == 0 or labels.shape != observed.shape:
            raise ValueError(f"calibration: {len(texts)} texts, pass rates of shape {observed.shape} and "
                             f"zero-variance targets of shape {labels.shape}")
        if not np.all(np.isfinite(observed)) or np.any((observed < 0) | (observed > 1)):
            raise ValueError("calibration: pass rates must be finite and lie in [0, 1]")
        known = ~np.isnan(labels)
        if np.any((labels[known] < 0) | (labels[known] > 1)):
            raise ValueError("calibration: zero-variance targets must lie in [0, 1] (NaN: unknown)")
        reward_logits, zero_variance_residuals = self.model.predict_heads(texts, batch_size=batch_size)
        predicted = torch.sigmoid(reward_logits.double()).numpy()  # (N,)
        zero_variance_prob = torch.sigmoid(zero_variance_logit(head_logits=zero_variance_residuals.double(),
                                                               pass_rate_logits=reward_logits.double(),
                                                               group_size=self.group_size))  # (N,)
        point_estimate = zero_variance_log_prob(group_size=self.group_size,
                                                pass_rate_logits=reward_logits.double()).exp().numpy()  # (N,)
        drop_mask, decision_metrics = depo_drop_decision(zero_variance_prob=zero_variance_prob,
                                                         filter_ratio=filter_ratio, threshold=threshold)
        known_tensor = torch.from_numpy(known)
        precision_recall = filter_precision_recall(filtered_mask=drop_mask[known_tensor],
                                                   zero_variance_mask=torch.from_numpy(labels[known]))
        head = zero_variance_prob.numpy()
        return {
            "num_prompts": int(observed.size),
            "brier": float(np.mean((predicted - observed) ** 2)),
            "brier_constant": float(np.mean((observed - observed.mean()) ** 2)),
            "mae": float(np.mean(np.abs(predicted - observed))),
            "spearman": spearman_correlation(predicted, observed),
            "predicted_mean": float(predicted.mean()),
            "predicted_std": float(predicted.std()),
            "observed_mean": float(observed.mean()),
            "num_zero_variance_labels": int(known.sum()),
            "observed_zero_variance_fraction": float(labels[known].mean()) if known.any() else math.nan,
            "zero_variance_prob_mean": float(head.mean()),
            "zero_variance_brier": _brier(head[known], labels[known]),
            "zero_variance_brier_point_estimate": _brier(point_estimate[known], labels[known]),
            "zero_variance_brier_constant": _brier(np.full(int(known.sum()), labels[known].mean()), labels[known])
            if known.any() else math.nan,
            "filter_ratio": decision_metrics["depo/filter_ratio"],
            "filter_precision": precision_recall["depo/filter_precision"],
            "filter_recall": precision_recall["depo/filter_recall"],
            "group_size": self.group_size,
            "operating_point": {"filter_ratio": filter_ratio, "threshold": threshold},
            "bins": reliability_bins(predicted, observed, num_bins=num_bins),
        }


def _brier(predicted: np.ndarray, observed: np.ndarray) -> float:
    return float(np.mean((predicted - observed) ** 2)) if observed.size else math.nan
