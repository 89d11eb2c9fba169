"""logprob_mismatch: loop reference, hand case, edge cases (the correction: tests/algorithms/test_rollout_correction.py)."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline.rollout.mismatch import logprob_mismatch


def _mismatch_reference(engine, trainer, mask, threshold):
    """Straight from the definitions, float64, one token at a time."""
    deltas = [t - e for e, t, m in zip(engine, trainer, mask) if m]
    n = len(deltas)
    ratios = [math.exp(d) for d in deltas]
    mean_ratio = sum(ratios) / n
    return {
        "mean_abs_diff": sum(abs(d) for d in deltas) / n,
        "max_abs_diff": max(abs(d) for d in deltas),
        "ratio_std": math.sqrt(sum((r - mean_ratio) ** 2 for r in ratios) / n),
        "frac_above_threshold": sum(abs(d) > threshold for d in deltas) / n,
    }


def test_mismatch_matches_loop_reference() -> None:
    generator = torch.Generator().manual_seed(0)
    engine = -torch.rand(6, 40, generator=generator, dtype=torch.float64) * 5
    trainer = engine + torch.randn(6, 40, generator=generator, dtype=torch.float64) * 0.2
    mask = torch.rand(6, 40, generator=generator) > 0.3
    delta, metrics = logprob_mismatch(engine, trainer, mask=mask, threshold=0.15)
    reference = _mismatch_reference(
        engine.flatten().tolist(), trainer.flatten().tolist(), mask.flatten().tolist(), 0.15
    )
    for key, value in reference.items():
        assert metrics[key].item() == pytest.approx(value, rel=1e-12, abs=1e-12), key
    assert metrics["num_tokens"] == mask.sum().item()
    torch.testing.assert_close(delta, torch.where(mask, trainer - engine, 0.0))


def test_mismatch_hand_case() -> None:
    # Δ = trainer − engine = [−0.1, 0.0, (masked)]; mean|Δ| = 0.05, max = 0.1
    # exp Δ = [0.904837418, 1.0] → population std = (1 − 0.904837418) / 2 = 0.047581291
    # |Δ| > 0.05 for one of two tokens → 0.5
    engine = torch.tensor([[-1.0, -2.0, -0.5]])
    trainer = torch.tensor([[-1.1, -2.0, -0.3]])
    mask = torch.tensor([[1, 1, 0]])
    _, metrics = logprob_mismatch(engine, trainer, mask=mask, threshold=0.05)
    assert metrics["mean_abs_diff"].item() == pytest.approx(0.05, abs=1e-7)
    assert metrics["max_abs_diff"].item() == pytest.approx(0.1, abs=1e-7)
    assert metrics["ratio_std"].item() == pytest.approx(0.047581291, abs=1e-7)
    assert metrics["frac_above_threshold"].item() == 0.5
    assert metrics["num_tokens"] == 2.0


def test_mismatch_fully_masked_is_nan_with_zero_tokens() -> None:
    engine = torch.full((2, 3), float("nan"))  # masked-out values are never read
    delta, metrics = logprob_mismatch(engine, torch.zeros(2, 3), mask=torch.zeros(2, 3, dtype=torch.bool))
    assert metrics["num_tokens"] == 0.0
    statistics = ("mean_abs_diff", "max_abs_diff", "ratio_std", "frac_above_threshold")
    assert all(math.isnan(metrics[k].item()) for k in statistics)
    assert torch.equal(delta, torch.zeros(2, 3))


def test_non_finite_inside_mask_raises_outside_is_ignored() -> None:
    engine = torch.tensor([-1.0, -float("inf")])
    trainer = torch.tensor([-1.0, -2.0])
    _, metrics = logprob_mismatch(engine, trainer, mask=torch.tensor([True, False]))
    assert metrics["max_abs_diff"].item() == 0.0
    with pytest.raises(ValueError, match="engine_logprobs has a non-finite"):
        logprob_mismatch(engine, trainer, mask=torch.tensor([True, True]))


def test_shape_mismatch_raises() -> None:
    with pytest.raises(ValueError, match="shape"):
        logprob_mismatch(torch.zeros(2, 3), torch.zeros(2, 4), mask=torch.ones(2, 3))
