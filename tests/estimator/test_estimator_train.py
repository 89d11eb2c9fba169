"""DEPO estimator trainer (§3.1.2) and calibration metrics; the stage: tests/stages/test_train_estimator.py."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.config import DEPO_RANK_MARGIN, DEPO_W_DISTILL, DEPO_W_RANK, DEPO_W_ZERO_VARIANCE
from pipeline.estimator.model import DifficultyEstimator
from pipeline.estimator.train import EstimatorTrainer, average_ranks, reliability_bins, spearman_correlation
from tests.estimator.digits import digits_texts, one_thread  # noqa: F401 (one_thread is a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


def _trainer(seed: int = 0, **kwargs) -> EstimatorTrainer:
    torch.manual_seed(seed)
    defaults = {"group_size": 8, "lr": 3e-3, "w_distill": DEPO_W_DISTILL, "w_rank": DEPO_W_RANK,
                "margin": DEPO_RANK_MARGIN, "w_zero_variance": DEPO_W_ZERO_VARIANCE}
    return EstimatorTrainer(DifficultyEstimator.tiny(max_length=24), **{**defaults, **kwargs})


def _labels(rates: np.ndarray) -> torch.Tensor:
    """Zero-variance labels of prompts observed with exactly G samples: 1 where all equal (rate 0 or 1)."""
    return torch.from_numpy(((rates == 0) | (rates == 1)).astype(np.float64))


# ================================================================ ranks and calibration


def test_average_ranks_and_spearman_with_ties_hand_case():
    # x = [10, 20, 20, 30]: ranks 1, (2+3)/2, (2+3)/2, 4.
    assert average_ranks(np.array([10.0, 20.0, 20.0, 30.0])).tolist() == [1.0, 2.5, 2.5, 4.0]
    # y = [1, 3, 2, 4] → ranks [1, 3, 2, 4]. Centred: x' = [−1.5, 0, 0, 1.5], y' = [−1.5, 0.5, −0.5, 1.5];
    # Σx'y' = 2.25 + 2.25 = 4.5, Σx'² = 4.5, Σy'² = 5 → ρ = 4.5 / √22.5 = 0.948683…
    rho = spearman_correlation(np.array([10.0, 20.0, 20.0, 30.0]), np.array([1.0, 3.0, 2.0, 4.0]))
    assert rho == pytest.approx(4.5 / math.sqrt(22.5), abs=1e-12)
    assert spearman_correlation(np.array([1.0, 2.0, 3.0]), np.array([9.0, 5.0, 1.0])) == pytest.approx(-1.0)
    assert math.isnan(spearman_correlation(np.array([1.0, 1.0]), np.array([0.0, 1.0])))
    assert math.isnan(spearman_correlation(np.array([1.0]), np.array([0.0])))


def test_spearman_matches_a_loop_reference():
    rng = np.random.default_rng(3)
    x, y = rng.integers(0, 5, 40).astype(float), rng.integers(0, 4, 40).astype(float)

    def loop_ranks(values):
        return np.array([np.sum(values < v) + (np.sum(values == v) + 1) / 2 for v in values])

    expected = np.corrcoef(loop_ranks(x), loop_ranks(y))[0, 1]
    assert spearman_correlation(x, y) == pytest.approx(expected, abs=1e-12)


def test_calibration_hand_case_with_a_constant_prediction():
    trainer = _trainer(group_size=4)
    with torch.no_grad():  # every prompt predicted p̂ = σ(ln 3) = 0.75; the zero-variance residual stays 0
        trainer.model.reward_head.weight.zero_()
        trainer.model.reward_head.bias.fill_(math.log(3.0))
    rates = np.array([0.0, 0.5, 1.0, 1.0])
    labels = np.array([1.0, 0.0, 1.0, 1.0])  # G = 4 samples each: all equal unless mixed

    def calibration(threshold: float, targets: np.ndarray = labels) -> dict:
        return trainer.calibration(list("abcd"), rates, zero_variance_targets=targets, filter_ratio=0.5,
                                   threshold=threshold)

    report = calibration(0.3)
    # Brier = (0.75² + 0.25² + 0.25² + 0.25²) / 4 = (0.5625 + 3·0.0625) / 4 = 0.1875.
    assert report["brier"] == pytest.approx(0.1875, abs=1e-6)
    # Best constant: mean 0.625 → ((0.625² + 0.125² + 2·0.375²) / 4) = 0.171875.
    assert report["brier_constant"] == pytest.approx(0.171875, abs=1e-12)
    assert math.isnan(report["spearman"])  # a constant prediction has no ranking
    # A zero residual is the point estimate 0.75⁴ + 0.25⁴ = 0.3203125: Brier (3·0.6796875² + 0.3203125²)/4;
    # the constant 0.75 scores (3·0.0625 + 0.5625)/4 = 0.1875.
    point = (3 * 0.6796875**2 + 0.3203125**2) / 4
    assert report["zero_variance_brier"] == pytest.approx(point, abs=1e-6)
    assert report["zero_variance_brier_point_estimate"] == pytest.approx(point, abs=1e-6)
    assert report["zero_variance_brier_constant"] == pytest.approx(0.1875, abs=1e-12)
    # All four are above 0.3; the cap ⌊0.5·4⌋ = 2 drops the first two (a tie keeps candidate order):
    # a (zero variance) and b (mixed) → precision 1/2, recall 1/3.
    assert report["filter_ratio"] == 0.5
    assert report["filter_precision"] == pytest.approx(0.5) and report["filter_recall"] == pytest.approx(1 / 3)
    assert report["observed_zero_variance_fraction"] == 0.75 and report["group_size"] == 4
    assert report["operating_point"] == {"filter_ratio": 0.5, "threshold": 0.3}
    strict = calibration(0.33)  # 0.3203125 is not above 0.33
    assert strict["filter_ratio"] == 0.0 and math.isnan(strict["filter_precision"]) and strict["filter_recall"] == 0.0
    # A residual of logit(0.6) − logit(0.3203125) lifts every P to 0.6: Brier (3·0.4² + 0.6²)/4 = 0.21.
    with torch.no_grad():
        trainer.model.zero_variance_head.bias.fill_(math.log(0.6 / 0.4) - math.log(0.3203125 / 0.6796875))
    assert calibration(0.5)["zero_variance_brier"] == pytest.approx(0.21, abs=1e-6)
    # Unknown labels (NaN) are left out of the zero-variance scores: (3·0.4²)/3 = 0.16.
    partial = calibration(0.5, np.array([1.0, math.nan, 1.0, 1.0]))
    assert partial["num_zero_variance_labels"] == 3 and partial["zero_variance_brier"] == pytest.approx(0.16, abs=1e-6)


def test_calibration_spearman_and_bins_use_the_predictions(monkeypatch):
    trainer = _trainer()
    predictions = torch.tensor([0.05, 0.3, 0.35, 0.95])
    monkeypatch.setattr(trainer.model, "predict_heads",
                        lambda texts, batch_size: (torch.logit(predictions), torch.zeros(4)))
    report = trainer.calibration(list("abcd"), np.array([0.0, 0.5, 0.25, 1.0]),
                                 zero_variance_targets=np.array([1.0, 0.0, 0.0, 1.0]), filter_ratio=0.5,
                                 threshold=0.9)
    # Predictions rank [1, 2, 3, 4], observed [1, 3, 2, 4] → ρ = 1 − 6·(0+1+1+0)/(4·15) = 0.8.
    assert report["spearman"] == pytest.approx(0.8)
    bins = report["bins"]
    assert bins["count"] == [1, 0, 0, 2, 0, 0, 0, 0, 0, 1]
    assert bins["mean_observed"][3] == pytest.approx(0.375) and bins["mean_predicted"][3] == pytest.approx(0.325)
    with pytest.raises(ValueError, match="lie in"):
        trainer.calibration(["a"], np.array([1.5]), zero_variance_targets=np.array([1.0]), filter_ratio=0.5,
                            threshold=0.5)
    with pytest.raises(ValueError, match="zero-variance targets"):
        trainer.calibration(["a"], np.array([0.5]), zero_variance_targets=np.array([1.0, 0.0]), filter_ratio=0.5,
                            threshold=0.5)


def test_reliability_bins_put_one_in_the_last_bin():
    bins = reliability_bins(np.array([0.0, 1.0, 0.55]), np.array([0.0, 1.0, 1.0]), num_bins=2)
    assert bins["count"] == [1, 2] and bins["mean_observed"] == [0.0, 1.0]


# ================================================================ updates


def test_tiny_estimator_learns_a_synthetic_difficulty():
    texts, rates = digits_texts(96, seed=0)
    holdout_texts, holdout_rates = digits_texts(48, seed=1)
    trainer = _trainer(seed=0)
    labels = _labels(rates)

    def calibration():
        return trainer.calibration(holdout_texts, holdout_rates, zero_variance_targets=_labels(holdout_rates),
                                   filter_ratio=0.5, threshold=0.5)

    before = calibration()
    order = torch.randperm(len(texts), generator=torch.Generator().manual_seed(0)).numpy()
    for _ in range(2):
        for start in range(0, len(texts), 16):
            batch = order[start : start + 16]
            metrics = trainer.update([texts[i] for i in batch], torch.tensor(rates[batch], dtype=torch.float32),
                                     zero_variance_targets=labels[batch])
    after = calibration()
    assert after["spearman"] > 0.5, after
    # Far better than the best constant prediction, and than the untrained model.
    assert after["brier"] < 0.5 * after["brier_constant"] and after["brier"] < 0.5 * before["brier"]
    assert after["zero_variance_brier"] < 0.8 * after["zero_variance_brier_constant"], after
    assert {"depo/loss", "depo/loss_de", "depo/loss_rank", "depo/loss_zero_variance",
            "estimator/grad_norm"} <= metrics.keys()
    assert "depo/loss_distill" not in metrics and trainer.num_updates == 12


def test_ranking_direction_higher_observed_reward_scores_higher():
    trainer = _trainer(seed=1, w_rank=3.0, margin=1.0)
    texts = ["hard question 987654321", "easy one"]
    start_logits = trainer.model.predict_logits(texts)
    for _ in range(25):
        metrics = trainer.update(texts, torch.tensor([0.2, 0.8]))
    logits = trainer.model.predict_logits(texts)
    assert logits[1] - logits[0] > 1.0 > float(start_logits[1] - start_logits[0])
    assert metrics["depo/rank_pairs"] == 1.0
    # Swapping which prompt is rewarded swaps the order back.
    for _ in range(40):
        trainer.update(texts, torch.tensor([0.8, 0.2]))
    logits = trainer.model.predict_logits(texts)
    assert logits[0] > logits[1]


def test_distillation_trains_the_perplexity_head_only_when_log_probs_are_given():
    trainer = _trainer(weight_decay=0.0)
    texts = ["a b c", "1 2 3 4", "x"]
    head_before = trainer.model.perplexity_head.weight.detach().clone()
    trainer.update(texts, torch.tensor([0.0, 0.5, 1.0]))
    # No target: zero gradient and no weight decay, so AdamW leaves the head exactly as it was.
    assert torch.equal(trainer.model.perplexity_head.weight, head_before)
    metrics = trainer.update(texts, torch.tensor([0.0, 0.5, 1.0]), torch.tensor([-0.1, -2.0, -5.0]))
    assert not torch.equal(trainer.model.perplexity_head.weight, head_before)
    # Target P = exp(mean log-prob): mean of exp([-0.1, -2, -5]).
    assert metrics["depo/ppl_target_mean"] == pytest.approx(float(np.exp([-0.1, -2.0, -5.0]).mean()), rel=1e-6)
    assert "depo/loss_distill" in metrics
    with pytest.raises(ValueError, match="non-finite"):
        trainer.update(texts, torch.tensor([0.0, 0.5, 1.0]), torch.tensor([-0.1, -math.inf, -5.0]))


def test_unknown_log_probs_and_labels_are_left_out_of_their_losses():
    trainer = _trainer(weight_decay=0.0)
    texts = ["a b c", "1 2 3 4", "x"]
    rates = torch.tensor([0.0, 0.5, 1.0])
    nan = math.nan
    # All unknown: the same as None (no L_distill, no L_ZV term, the heads' weights untouched).
    heads = {name: getattr(trainer.model, name).weight.detach().clone()
             for name in ("perplexity_head", "zero_variance_head")}
    metrics = trainer.update(texts, rates, torch.full((3,), nan), torch.full((3,), nan))
    assert "depo/loss_distill" not in metrics and metrics["depo/zero_variance_labels"] == 0.0
    for name, weight in heads.items():
        assert torch.equal(getattr(trainer.model, name).weight, weight), name
    # One known log-prob: its target alone, exp(−2).
    metrics = trainer.update(texts, rates, torch.tensor([nan, -2.0, nan]), torch.tensor([1.0, nan, 1.0]))
    assert metrics["depo/ppl_target_mean"] == pytest.approx(math.exp(-2.0), rel=1e-9)
    assert metrics["depo/zero_variance_labels"] == 2.0 and "depo/loss_distill" in metrics
    assert not torch.equal(trainer.model.zero_variance_head.weight, heads["zero_variance_head"])


def test_update_rejects_bad_batches():
    trainer = _trainer()
    with pytest.raises(ValueError, match="2 texts"):
        trainer.update(["a", "b"], torch.tensor([0.5]))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        trainer.update(["a", "b"], torch.tensor([0.5, 1.5]))
    with pytest.raises(ValueError, match="must match"):
        trainer.update(["a", "b"], torch.tensor([0.5, 0.5]), torch.tensor([-1.0]))
    with pytest.raises(ValueError, match="must match"):
        trainer.update(["a", "b"], torch.tensor([0.5, 0.5]), None, torch.tensor([1.0]))
    with pytest.raises(ValueError, match="lr"):
        EstimatorTrainer(trainer.model, group_size=8, lr=0.0, w_distill=0.5, w_rank=3.0, margin=0.5,
                         w_zero_variance=1.0)
    with pytest.raises(ValueError, match="margin"):
        EstimatorTrainer(trainer.model, group_size=8, lr=1e-3, w_distill=0.5, w_rank=3.0, margin=2.0,
                         w_zero_variance=1.0)


def test_state_dict_round_trip_through_safetensors_and_json_is_exact(tmp_path):
    texts, rates = digits_texts(16, seed=2)
    targets = torch.tensor(rates, dtype=torch.float32)
    labels = _labels(rates)
    original = _trainer(seed=0)
    for _ in range(3):
        original.update(texts, targets, zero_variance_targets=labels)
    state = original.state_dict()
    save_file(state["tensors"], str(tmp_path / "estimator.safetensors"))
    (tmp_path / "estimator.json").write_text(json.dumps(state["json"]))

    restored = _trainer(seed=123)  # other init: everything must come from the state
    restored.load_state_dict({"tensors": load_file(str(tmp_path / "estimator.safetensors")),
                              "json": json.loads((tmp_path / "estimator.json").read_text())})
    assert restored.num_updates == 3
    for name, tensor in original.model.state_dict().items():
        assert torch.equal(restored.model.state_dict()[name], tensor), name
    # The next update (same dropout draws) must give bit-identical weights: the AdamW moments came back too.
    torch.manual_seed(7)
    metrics_original = original.update(texts, targets, zero_variance_targets=labels)
    torch.manual_seed(7)
    metrics_restored = restored.update(texts, targets, zero_variance_targets=labels)
    assert metrics_original == metrics_restored
    for name, tensor in original.model.state_dict().items():
        assert torch.equal(restored.model.state_dict()[name], tensor), name


def test_the_zero_variance_head_learns_what_the_point_estimate_misses_on_a_mixed_class():
    """Text that cannot tell half always-solved prompts from half solved at 1/2 gives p̂ ≈ 0.75, whose
    point estimate 0.75⁸ + 0.25⁸ = 0.10 understates the class's zero-variance share ≈ 0.50 (Jensen)."""
    generator = torch.Generator().manual_seed(4)
    letters = "abcdefghij"
    texts, rates = [], []
    for index in range(64):
        suffix = "".join(letters[int(k)] for k in torch.randint(0, 10, (6,), generator=generator))
        mixed = index % 2 == 0  # "mix" prompts: half p = 1, half p = 0.5; "half" prompts: all p = 0.5
        texts.append(("mix " if mixed else "half ") + suffix)
        rates.append((1.0 if index % 4 == 0 else 0.5) if mixed else 0.5)
    rates_tensor = torch.tensor(rates, dtype=torch.float64)
    trainer = _trainer(seed=2, group_size=8)
    for epoch in range(12):
        rewards = (torch.rand(64, 8, generator=generator, dtype=torch.float64) < rates_tensor[:, None]).double()
        labels = (rewards.amax(dim=1) == rewards.amin(dim=1)).double()  # observed all-equal groups of 8
        for start in range(0, 64, 16):
            rows = slice(start, start + 16)
            trainer.update(texts[rows], rewards[rows].mean(dim=1).float(), zero_variance_targets=labels[rows])
    probe = ["mix zzzzzz", "half zzzzzz"]
    reward_logits, residuals = trainer.model.predict_heads(probe)
    from pipeline.algorithms.depo import zero_variance_log_prob, zero_variance_logit

    point = zero_variance_log_prob(group_size=8, pass_rate_logits=reward_logits.double()).exp()
    head = torch.sigmoid(zero_variance_logit(head_logits=residuals.double(), pass_rate_logits=reward_logits.double(),
                                             group_size=8))
    # The mixed class, truth ≈ 0.50: measured point estimate 0.21, head 0.70.
    assert float(point[0]) < 0.3 and 0.35 < float(head[0]) < 0.85, (point, head)
    assert float(head[1]) < 0.15  # the pure class at 1/2: truth 2/256
