"""Rollout correction (TIS/MIS, token and sequence level): loop reference, hand cases, edge cases."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline.algorithms.rollout_correction import rollout_correction

VARIANTS = [(mode, level) for mode in ("truncate", "mask") for level in ("token", "sequence")]


def _reference(old, engine, mask, *, mode, level, upper, lower):
    """Plain Python loops over float64 lists, straight from the module docstring's equations."""
    weights, keep = [], []
    for o_row, e_row, m_row in zip(old, engine, mask):
        logs = [o - e for o, e, m in zip(o_row, e_row, m_row) if m]
        seq_ratio = math.exp(sum(logs) / len(logs)) if logs else 1.0
        w_row, k_row = [], []
        for o, e, m in zip(o_row, e_row, m_row):
            if not m:
                w_row.append(0.0)
                k_row.append(False)
                continue
            ratio = math.exp(o - e) if level == "token" else seq_ratio
            if mode == "truncate":
                w_row.append(min(ratio, upper))
                k_row.append(True)
            else:
                kept = lower <= ratio <= upper
                w_row.append(1.0 if kept else 0.0)
                k_row.append(kept)
        weights.append(w_row)
        keep.append(k_row)
    return weights, keep


@pytest.mark.parametrize(("mode", "level"), VARIANTS)
@pytest.mark.parametrize("seed", range(6))
def test_matches_the_loop_reference_in_float64(mode, level, seed):
    generator = torch.Generator().manual_seed(seed)
    old = -torch.rand(5, 7, generator=generator, dtype=torch.float64) * 3  # (B, T)
    engine = old + torch.randn(5, 7, generator=generator, dtype=torch.float64) * 0.8
    mask = torch.rand(5, 7, generator=generator) < 0.7
    mask[0] = False  # a sample with no response token
    (weights, keep), metrics = rollout_correction(old_logprobs=old, engine_logprobs=engine, response_mask=mask,
                                                  mode=mode, level=level, upper=1.5, lower=0.6)
    ref_weights, ref_keep = _reference(old.tolist(), engine.tolist(), mask.tolist(), mode=mode, level=level,
                                       upper=1.5, lower=0.6)
    assert weights.dtype == torch.float64
    torch.testing.assert_close(weights, torch.tensor(ref_weights, dtype=torch.float64), rtol=1e-12, atol=0)
    assert keep.tolist() == ref_keep
    assert 0.0 <= metrics["corrected_fraction"] <= 1.0


def test_hand_computed_token_and_sequence_cases():
    # Sample 0: log ratios (ln 3, 0) → token ratios (3, 1), sequence ratio √3 ≈ 1.732.
    # Sample 1: log ratios (−ln 4, masked) → token ratio 1/4, sequence ratio 1/4.
    old = torch.tensor([[math.log(3.0), 0.0], [-math.log(4.0), float("nan")]], dtype=torch.float64)
    engine = torch.zeros(2, 2, dtype=torch.float64)
    mask = torch.tensor([[True, True], [True, False]])
    common = dict(old_logprobs=old, engine_logprobs=engine, response_mask=mask)
    (w, keep), metrics = rollout_correction(**common, mode="truncate", level="token", upper=2.0)
    assert w.tolist() == [[2.0, 1.0], [0.25, 0.0]] and keep.tolist() == [[True, True], [True, False]]
    assert metrics["corrected_fraction"] == pytest.approx(1 / 3) and metrics["ratio_max"] == pytest.approx(3.0)
    (w, _), _ = rollout_correction(**common, mode="truncate", level="sequence", upper=2.0)
    torch.testing.assert_close(w, torch.tensor([[math.sqrt(3.0)] * 2, [0.25, 0.0]], dtype=torch.float64))
    (w, keep), metrics = rollout_correction(**common, mode="mask", level="token", upper=2.0, lower=0.5)
    assert keep.tolist() == [[False, True], [False, False]] and w.tolist() == [[0.0, 1.0], [0.0, 0.0]]
    assert metrics["corrected_fraction"] == pytest.approx(2 / 3)
    (w, keep), _ = rollout_correction(**common, mode="mask", level="sequence", upper=2.0, lower=0.5)
    assert keep.tolist() == [[True, True], [False, False]]


@pytest.mark.parametrize(("mode", "level"), VARIANTS)
def test_float_noise_zero_is_no_correction(mode, level):
    old = torch.full((2, 3), -1.0, dtype=torch.float64)
    engine = old - 1e-17  # the math says log ratio 0
    (w, keep), metrics = rollout_correction(old_logprobs=old, engine_logprobs=engine,
                                            response_mask=torch.ones(2, 3, dtype=torch.bool), mode=mode, level=level,
                                            upper=1.0, lower=1.0)
    assert torch.equal(w, torch.ones(2, 3, dtype=torch.float64)) and bool(keep.all())
    assert metrics["corrected_fraction"] == 0.0


def test_masked_positions_may_hold_anything_and_empty_batches_give_nan_metrics():
    old = torch.tensor([[0.0, float("nan"), float("-inf")]])
    engine = torch.tensor([[0.0, float("inf"), 3.0]])
    mask = torch.tensor([[True, False, False]])
    (w, keep), _ = rollout_correction(old_logprobs=old, engine_logprobs=engine, response_mask=mask,
                                      mode="truncate", level="sequence", upper=2.0)
    assert w.tolist() == [[1.0, 0.0, 0.0]] and keep.tolist() == [[True, False, False]]
    (w, keep), metrics = rollout_correction(old_logprobs=old, engine_logprobs=engine,
                                            response_mask=torch.zeros(1, 3, dtype=torch.bool), mode="mask",
                                            level="token", upper=2.0)
    assert not bool(keep.any()) and float(w.abs().sum()) == 0.0 and math.isnan(metrics["ratio_mean"])


def test_non_finite_inside_the_mask_and_bad_arguments_raise():
    ones = torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="engine_logprobs has a non-finite value"):
        rollout_correction(old_logprobs=torch.zeros(1, 2), engine_logprobs=torch.tensor([[0.0, float("nan")]]),
                           response_mask=ones, mode="truncate", level="token", upper=2.0)
    with pytest.raises(ValueError, match="upper must be >= 1"):
        rollout_correction(old_logprobs=torch.zeros(1, 2), engine_logprobs=torch.zeros(1, 2), response_mask=ones,
                           mode="truncate", level="token", upper=0.5)
    with pytest.raises(ValueError, match="lower must lie"):
        rollout_correction(old_logprobs=torch.zeros(1, 2), engine_logprobs=torch.zeros(1, 2), response_mask=ones,
                           mode="mask", level="token", upper=2.0, lower=1.5)
    with pytest.raises(ValueError, match="shape mismatch"):
        rollout_correction(old_logprobs=torch.zeros(1, 2), engine_logprobs=torch.zeros(1, 3), response_mask=ones,
                           mode="mask", level="token", upper=2.0)


def test_no_gradient_flows_and_extreme_ratios_stay_finite():
    old = torch.tensor([[80.0, 0.0]], requires_grad=True)
    (w, _), metrics = rollout_correction(old_logprobs=old, engine_logprobs=torch.zeros(1, 2),
                                         response_mask=torch.ones(1, 2, dtype=torch.bool), mode="truncate",
                                         level="token", upper=2.0)
    assert not w.requires_grad and w.tolist() == [[2.0, 1.0]] and math.isfinite(metrics["ratio_max"])
