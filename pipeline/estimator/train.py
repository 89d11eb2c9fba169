"""Online trainer of the DEPO difficulty estimator, and its calibration report.

Paper: "Difficulty-Estimated Policy Optimization", §3.1.2 (L = L_DE + w_distill·L_distill
+ w_rank·L_rank, weights 0.5 and 3 from §4.1) and §3.2 (the estimator trains on every
step's rollouts; filtering starts after a warm-up). The losses are the pure functions of
``pipeline.algorithms.depo``; this module owns the optimizer and the state.

Choices the paper leaves open:

* AdamW (lr 2e-5, weight decay 0.01: the usual BERT fine-tuning values) with gradient
  clipping at norm 1;
* without the actor's question log-probs (offline training on a curation, which does not
  record them) the distillation term is left out of the loss rather than faked;
* ``calibration`` counts a prompt as observed zero-variance when every one of its observed
  samples got the same reward (pass rate exactly 0 or 1).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from pipeline.algorithms.depo import depo_estimator_loss, depo_filter, filter_precision_recall, perplexity_targets
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

    def __init__(self, model: DifficultyEstimator, *, lr: float = 2e-5, weight_decay: float = 0.01,
                 w_distill: float = 0.5, w_rank: float = 3.0, margin: float = 0.1,
                 max_grad_norm: float | None = 1.0) -> None:
        if not lr > 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        if w_distill < 0 or w_rank < 0 or margin < 0:
            raise ValueError(f"w_distill, w_rank and margin must be ≥ 0, got {w_distill}, {w_rank}, {margin}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0 or None, got {max_grad_norm}")
        self.model = model
        self.w_distill, self.w_rank, self.margin = w_distill, w_rank, margin
        self.max_grad_norm = max_grad_norm
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
        self.num_updates = 0

    def update(self, texts: Sequence[str], observed_pass_rates: torch.Tensor,
               actor_mean_logprobs: torch.Tensor | None = None) -> dict[str, float]:
        """One optimizer step on a batch of prompts whose rollouts were graded.

        ``observed_pass_rates`` ``(B,)``: avg@k of each prompt's rewards in [0, 1].
        ``actor_mean_logprobs`` ``(B,)``: the actor's mean token log-prob of each question;
        its exp is the normalised-perplexity target of L_distill (``perplexity_targets``).
        None leaves L_distill out. The ranking loss compares every pair in the batch, so
        batches should mix prompts of several difficulties.
        """
        if len(texts) != observed_pass_rates.numel() or observed_pass_rates.dim() != 1:
            raise ValueError(f"update: {len(texts)} texts but observed_pass_rates of shape "
                             f"{tuple(observed_pass_rates.shape)}")
        self.model.train()
        reward_logits, perplexity_logits = self.model.score(texts)  # (B,), (B,)
        rewards = observed_pass_rates.to(device=reward_logits.device, dtype=reward_logits.dtype)
        if actor_mean_logprobs is not None:
            if actor_mean_logprobs.shape != observed_pass_rates.shape:
                raise ValueError(f"actor_mean_logprobs {tuple(actor_mean_logprobs.shape)} must match "
                                 f"observed_pass_rates {tuple(observed_pass_rates.shape)}")
            mean_logprobs = actor_mean_logprobs.to(device=reward_logits.device, dtype=torch.float64)[:, None]
            targets, target_metrics = perplexity_targets(token_logprobs=mean_logprobs,
                                                         token_mask=torch.ones_like(mean_logprobs, dtype=torch.bool))
            distill_weight = self.w_distill
        else:
            # The head's own prediction as target with weight 0: an exact zero term and zero gradient.
            targets, target_metrics = torch.sigmoid(perplexity_logits.detach()), {}
            distill_weight = 0.0
        loss, loss_metrics = depo_estimator_loss(
            advantage_logits=reward_logits, perplexity_logits=perplexity_logits, mean_rewards=rewards,
            perplexity_targets=targets.to(reward_logits.dtype), distill_weight=distill_weight,
            rank_weight=self.w_rank, margin=self.margin,
        )
        if actor_mean_logprobs is None:
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
                         "w_distill": self.w_distill, "w_rank": self.w_rank, "margin": self.margin,
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
        self.w_distill, self.w_rank = float(meta["w_distill"]), float(meta["w_rank"])
        self.margin = float(meta["margin"])
        self.max_grad_norm = meta["max_grad_norm"]

    # ---------------------------------------------------------------- evaluation

    def calibration(self, texts: Sequence[str], pass_rates: np.ndarray | torch.Tensor, *, group_size: int,
                    threshold: float, batch_size: int = 64, num_bins: int = 10) -> dict[str, Any]:
        """How well predicted pass rates match observed ones on ``texts`` (normally held out).

        ``brier``: mean (p̂ − p)²; ``brier_constant``: the same for the best constant
        (the observed mean), so ``brier < brier_constant`` means the estimator beats
        predicting the average. ``spearman``: rank correlation of p̂ and p (average ranks
        for ties). The DEPO filter (``depo_filter`` with ``group_size`` and ``threshold``,
        warm-up over) is scored against the prompts observed to have zero variance
        (p ∈ {0, 1}) with ``filter_precision_recall``. ``bins``: reliability-diagram data.
        """
        observed = np.asarray(pass_rates, dtype=np.float64)
        if observed.ndim != 1 or observed.size != len(texts) or observed.size == 0:
            raise ValueError(f"calibration: {len(texts)} texts and pass rates of shape {observed.shape}")
        if not np.all(np.isfinite(observed)) or np.any((observed < 0) | (observed > 1)):
            raise ValueError("calibration: pass rates must be finite and lie in [0, 1]")
        predicted = self.model.predict_pass_rate(texts, batch_size=batch_size).double().numpy()  # (N,)
        keep_mask, filter_metrics = depo_filter(group_size=group_size, threshold=threshold, step=0, warmup_steps=0,
                                                pass_rate=torch.from_numpy(predicted))
        zero_variance_mask = torch.from_numpy((observed == 0.0) | (observed == 1.0))
        precision_recall = filter_precision_recall(filtered_mask=~keep_mask, zero_variance_mask=zero_variance_mask)
        return {
            "num_prompts": int(observed.size),
            "brier": float(np.mean((predicted - observed) ** 2)),
            "brier_constant": float(np.mean((observed - observed.mean()) ** 2)),
            "mae": float(np.mean(np.abs(predicted - observed))),
            "spearman": spearman_correlation(predicted, observed),
            "predicted_mean": float(predicted.mean()),
            "predicted_std": float(predicted.std()),
            "observed_mean": float(observed.mean()),
            "observed_zero_variance_fraction": float(zero_variance_mask.double().mean()),
            "filter_ratio": _as_float(filter_metrics["depo/filter_ratio"]),
            "filter_precision": precision_recall["depo/filter_precision"],
            "filter_recall": precision_recall["depo/filter_recall"],
            "group_size": group_size,
            "threshold": threshold,
            "bins": reliability_bins(predicted, observed, num_bins=num_bins),
        }
