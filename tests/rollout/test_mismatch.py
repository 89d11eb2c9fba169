"""logprob_mismatch and tis_weights: loop references, hand cases, edge cases, properties."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.rollout.mismatch import logprob_mismatch, tis_weights


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
    with pytest.raises(ValueError, match="trainer_old_logprobs has a non-finite"):
        tis_weights(trainer.flip(0) * float("nan"), trainer, mask=torch.tensor([True, True]), cap=2.0)


def test_shape_mismatch_raises() -> None:
    with pytest.raises(ValueError, match="shape"):
        logprob_mismatch(torch.zeros(2, 3), torch.zeros(2, 4), mask=torch.ones(2, 3))
    with pytest.raises(ValueError, match="shape"):
        tis_weights(torch.zeros(2, 3), torch.zeros(2, 3), mask=torch.ones(3, 2), cap=2.0)


def test_tis_hand_case() -> None:
    # old − engine = [0.5, −0.5, 0.0, (masked)] → ratios [1.6487, 0.6065, 1.0]
    # cap 1.5 → weights [1.5, 0.60653066, 1.0, 0]; capped 1 of 3; mean 3.10653066 / 3
    old = torch.tensor([-1.0, -1.0, -3.0, -0.2])
    engine = torch.tensor([-1.5, -0.5, -3.0, -5.0])
    mask = torch.tensor([True, True, True, False])
    weights, metrics = tis_weights(old, engine, mask=mask, cap=1.5)
    torch.testing.assert_close(weights, torch.tensor([1.5, 0.60653066, 1.0, 0.0]))
    assert metrics["frac_capped"].item() == pytest.approx(1 / 3)
    assert metrics["mean_weight"].item() == pytest.approx(3.10653066 / 3, rel=1e-6)
    assert metrics["num_tokens"] == 3.0


def test_tis_has_no_gradient_and_rejects_cap_below_one() -> None:
    old = torch.tensor([-1.0, -2.0], requires_grad=True)
    engine = torch.tensor([-1.2, -1.9], requires_grad=True)
    weights, _ = tis_weights(old, engine, mask=torch.ones(2), cap=2.0)
    assert not weights.requires_grad
    with pytest.raises(ValueError, match="cap"):
        tis_weights(old, engine, mask=torch.ones(2), cap=0.5)


def test_tis_fully_masked() -> None:
    weights, metrics = tis_weights(torch.zeros(3), torch.zeros(3), mask=torch.zeros(3), cap=2.0)
    assert torch.equal(weights, torch.zeros(3)) and metrics["num_tokens"] == 0.0
    assert math.isnan(metrics["mean_weight"].item())


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    cap=st.floats(1.0, 10.0),
    noise=st.floats(0.0, 3.0),
)
def test_property_tis_weights_are_the_capped_ratio(seed: int, cap: float, noise: float) -> None:
    generator = torch.Generator().manual_seed(seed)
    engine = -torch.rand(4, 16, generator=generator, dtype=torch.float64) * 6
    old = engine + torch.randn(4, 16, generator=generator, dtype=torch.float64) * noise
    mask = torch.rand(4, 16, generator=generator) > 0.2
    weights, metrics = tis_weights(old, engine, mask=mask, cap=cap)
    ratio = (old - engine).exp()
    assert (weights[mask] <= cap).all() and (weights[mask] > 0).all() and (weights[~mask] == 0).all()
    below = mask & (ratio <= cap)
    torch.testing.assert_close(weights[below], ratio[below])
    assert (weights[mask & (ratio > cap)] == cap).all()
    # Identical policies: no mismatch, unit weights.
    same, _ = tis_weights(engine, engine, mask=mask, cap=cap)
    assert (same[mask] == 1).all()
    delta, mismatch = logprob_mismatch(engine, engine, mask=mask)
    assert (delta == 0).all() and mismatch["max_abs_diff"].item() == 0 and mismatch["ratio_std"].item() == 0
