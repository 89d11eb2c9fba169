"""The difficulty estimator as a model router (DEPO §5, Table 3).

Paper: "Difficulty-Estimated Policy Optimization", §5 "Difficulty Estimator as Online Model
Router": a query whose score is below the confidence threshold τ is sent to the
high-capacity model, every other query to the small one. We read the score as the
predicted pass rate p̂ = σ(Â) (Table 3's τ ∈ {0.3, 0.5, 0.7, 0.75} are probabilities),
so ``hard = p̂ < τ``; raising τ sends more queries to the large model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from pipeline.estimator.model import DifficultyEstimator
from pipeline.rollout.types import Completion, GenerationRequest, SamplingParams, check_requests

__all__ = ["RoutedEngine", "estimator_predictor", "route"]

Predictor = Callable[[Sequence[GenerationRequest]], torch.Tensor]


def route(predicted_pass_rates: torch.Tensor, threshold: float) -> tuple[torch.Tensor, dict[str, float]]:
    """``hard_mask (B,)``: p̂ < τ goes to the large model; metrics report the split."""
    if predicted_pass_rates.dim() != 1:
        raise ValueError(f"predicted_pass_rates must be 1-D (B,), got {tuple(predicted_pass_rates.shape)}")
    if not (0.0 <= threshold <= 1.0):
        raise ValueError(f"threshold must lie in [0, 1], got {threshold}")
    rates = predicted_pass_rates.detach()
    if not bool(torch.isfinite(rates).all()) or bool(((rates < 0) | (rates > 1)).any()):
        raise ValueError("predicted_pass_rates must be finite and lie in [0, 1]")
    hard_mask = rates < threshold  # (B,)
    num_prompts = hard_mask.numel()
    num_large = int(hard_mask.sum())
    metrics = {
        "router/threshold": float(threshold),
        "router/num_large": float(num_large),
        "router/num_small": float(num_prompts - num_large),
        "router/large_fraction": num_large / num_prompts if num_prompts else 0.0,
        "router/small_fraction": (num_prompts - num_large) / num_prompts if num_prompts else 0.0,
    }
    return hard_mask, metrics


def estimator_predictor(estimator: DifficultyEstimator, text_of: Callable[[GenerationRequest], str], *,
                        batch_size: int = 64) -> Predictor:
    """A ``RoutedEngine`` predictor: the estimator's p̂ of each request's question text.

    Requests carry token ids only; ``text_of`` gives the raw question (e.g. a lookup by
    ``prompt_id``), which is what the estimator was trained on.
    """
    def predict(requests: Sequence[GenerationRequest]) -> torch.Tensor:
        return estimator.predict_pass_rate([text_of(request) for request in requests], batch_size=batch_size)

    return predict


class RoutedEngine:
    """A ``RolloutEngine`` that sends hard requests to ``large_engine`` and the rest to ``small_engine``.

    Completions come back in request order, then ``sample_index``, as the protocol
    requires; each keeps the ``weight_version`` of the engine that produced it.
    ``last_metrics`` holds the split of the latest ``generate`` call.
    """

    def __init__(self, small_engine, large_engine, predictor: Predictor, threshold: float) -> None:
        if not (0.0 <= threshold <= 1.0):
            raise ValueError(f"threshold must lie in [0, 1], got {threshold}")
        self.small_engine = small_engine
        self.large_engine = large_engine
        self.predictor = predictor
        self.threshold = threshold
        self.last_metrics: dict[str, float] = {}

    @property
    def weight_version(self) -> int:
        # The oldest weights either engine may answer with: the conservative bound for staleness checks.
        return min(self.small_engine.weight_version, self.large_engine.weight_version)

    def generate(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> list[Completion]:
        check_requests(requests)
        if not requests:
            self.last_metrics = route(torch.zeros(0), self.threshold)[1]
            return []
        predicted = self.predictor(requests)
        if predicted.shape != (len(requests),):
            raise ValueError(f"predictor returned shape {tuple(predicted.shape)} for {len(requests)} requests")
        hard_mask, metrics = route(predicted, self.threshold)
        hard = hard_mask.tolist()
        by_engine: dict[bool, list[Completion]] = {}
        for is_hard, engine in ((False, self.small_engine), (True, self.large_engine)):
            subset = [request for request, flag in zip(requests, hard) if flag == is_hard]
            completions = engine.generate(subset, params) if subset else []
            expected = sum(request.num_samples for request in subset)
            if len(completions) != expected:
                raise RuntimeError(f"{'large' if is_hard else 'small'} engine returned {len(completions)} "
                                   f"completions for {expected} requested samples")
            by_engine[is_hard] = completions
        # Each engine's output is ordered by its own requests, so walking the original
        # order and taking the next num_samples from the right engine restores it.
        cursor = {False: 0, True: 0}
        merged: list[Completion] = []
        for request, is_hard in zip(requests, hard):
            start = cursor[is_hard]
            chunk = by_engine[is_hard][start : start + request.num_samples]
            assert all(c.prompt_id == request.prompt_id for c in chunk), request.prompt_id
            merged.extend(chunk)
            cursor[is_hard] = start + request.num_samples
        metrics["router/num_large_samples"] = float(len(by_engine[True]))
        metrics["router/num_small_samples"] = float(len(by_engine[False]))
        self.last_metrics = metrics
        return merged

    def close(self) -> None:
        try:
            self.small_engine.close()
        finally:
            self.large_engine.close()
