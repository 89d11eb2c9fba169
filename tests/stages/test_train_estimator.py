"""`winnow train-estimator` end to end on a curation written with curate's own writers."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import numpy as np
import pytest

from pipeline import configlib
from pipeline.config import TrainEstimatorConfig
from pipeline.configlib import ConfigError
from pipeline.estimator.model import DifficultyEstimator
from pipeline.eval.sharded import Shard
from pipeline.stages.train_estimator import holdout_mask, load_training_set, run_train_estimator
from tests.estimator.digits import digits_texts, one_thread  # noqa: F401 (one_thread is a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


@dataclass
class _FakePrompt:
    id: str
    problem: str
    answer: str = "0"
    source: str = "synthetic"
    metadata: dict = field(default_factory=dict)


@dataclass
class _FakeResult:
    prompt: _FakePrompt
    num_samples: int
    num_correct: int

    @property
    def response_lengths(self) -> list[int]:
        return [10] * self.num_samples

    @property
    def num_generated_tokens(self) -> int:
        return sum(self.response_lengths)


def _write_curation(directory, *, num_prompts: int, k: int = 8) -> list[str]:
    """A finished curation in `winnow curate`'s layout, written with its own writers; returns sampled ids."""
    from pipeline.stages import curate
    from pipeline.stats import curation

    texts, rates = digits_texts(num_prompts, seed=5)
    prompts = [_FakePrompt(id=f"p{i:04d}", problem=text) for i, text in enumerate(texts)]
    num_correct = np.rint(rates * k).astype(np.int64)
    num_samples = np.full(num_prompts, k, dtype=np.int64)
    num_samples[::10] = 0  # dropped before sampling (e.g. too long): no shard row, no pass rate
    num_correct[::10] = 0
    sampled = np.flatnonzero(num_samples > 0)
    (directory / curation.SHARDS_DIR).mkdir(parents=True)
    for index, start in enumerate(range(0, sampled.size, 40)):
        rows = sampled[start : start + 40]
        shard = Shard(index=index, prompts=[prompts[i] for i in rows], seed=index,
                      path=directory / curation.SHARDS_DIR / f"shard_{index:05d}.parquet")
        results = [_FakeResult(prompt=prompts[i], num_samples=k, num_correct=int(num_correct[i])) for i in rows]
        # The policy's question log-prob: easier (higher pass rate) questions are more familiar.
        question_logprobs = -3.0 + 2.0 * rates[rows]
        curate._atomic_write_parquet(shard.path, curate._shard_table(results, shard=shard, fingerprint="fake",
                                                                      question_logprobs=question_logprobs))
    result = curation.CurationResult(
        output_dir=directory, prompt_ids=[p.id for p in prompts], specs=["fake"] * num_prompts,
        sources=["synthetic"] * num_prompts, num_samples=num_samples, num_correct=num_correct,
        pass_rates=curation.pass_rates(num_samples, num_correct), kept_mask=num_samples > 0,
        drop_reasons=["" if n else "too_long" for n in num_samples], samples_per_prompt=k,
        counts={"total": num_prompts, "kept": int(sampled.size), "too_long": num_prompts - int(sampled.size)},
    )
    curation.write_pass_rates(directory / curation.PASS_RATES_FILE, result, difficulty=curate._difficulty_names(result))
    curation.write_manifest(directory, {"config": {"num_samples": k}, "counts": result.counts})
    return [prompts[i].id for i in sampled]


def test_stage_end_to_end_on_a_fake_curation(tmp_path):
    sampled_ids = _write_curation(tmp_path / "curate", num_prompts=160)
    data = load_training_set(tmp_path / "curate")
    ids, texts, pass_rates = data.ids, data.texts, data.pass_rates
    assert ids == sampled_ids and data.samples_per_prompt == 8 and len(texts) == 144 and pass_rates.min() >= 0.0
    assert data.question_logprobs.shape == (144,) and data.question_logprobs.max() <= -1.0
    assert (data.num_samples == 8).all() and np.array_equal(data.num_correct, np.rint(pass_rates * 8))
    cfg = configlib.load(TrainEstimatorConfig, overrides=[
        f"curation_dir={tmp_path / 'curate'}", "encoder=tiny", "max_length=24", "epochs=3", "batch_size=16",
        "lr=0.003", "holdout_fraction=0.25", f"output_dir={tmp_path / 'out'}", "progress=false"])
    lines = []
    returned = run_train_estimator(cfg, out=lines.append)
    assert "held-out" in lines[-1] and "Spearman" in lines[-1]

    out = tmp_path / "out"
    report = json.loads((out / "calibration.json").read_text())
    assert returned["holdout"]["brier"] == report["holdout"]["brier"] and returned["history"] == report["history"]
    expected_holdout = int(holdout_mask(sampled_ids, fraction=0.25).sum())
    assert report["num_prompts"] == {"train": 144 - expected_holdout, "holdout": expected_holdout}
    assert report["holdout"]["spearman"] > 0.5, report["holdout"]
    assert report["holdout"]["group_size"] == 8  # null group_size: the curation's k
    # The zero-variance head is scored against the all-equal labels of the k = 8 samples, beside the point
    # estimate it corrects; the drop rule reports its operating point and precision.
    holdout = report["holdout"]
    assert holdout["num_zero_variance_labels"] == holdout["num_prompts"]
    assert holdout["zero_variance_brier"] < holdout["zero_variance_brier_constant"], holdout
    assert holdout["operating_point"] == {"filter_ratio": 0.5, "threshold": 0.5}
    assert "zero_variance_brier_point_estimate" in holdout and "zero-variance Brier" in lines[-1]
    assert len(report["history"]) == 3 and report["num_updates"] == 3 * math.ceil((144 - expected_holdout) / 16)
    assert (out / "calibration.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    loaded = DifficultyEstimator.load(out / "estimator")
    held_texts = [t for t, held in zip(texts, holdout_mask(ids, fraction=0.25)) if held]
    predicted = loaded.predict_pass_rate(held_texts).double().numpy()
    held_rates = pass_rates[holdout_mask(ids, fraction=0.25)]
    assert np.mean((predicted - held_rates) ** 2) == pytest.approx(report["holdout"]["brier"], rel=1e-5)
    assert "torch" in report["versions"]
    assert all(row["train_loss"] > 0 and "holdout_zero_variance_brier" in row for row in report["history"])
    # Tokens read, padding excluded: every train text once per epoch; the held-out texts at each
    # epoch's calibration and the final one, the train texts at the final one.
    held = holdout_mask(ids, fraction=0.25)
    lengths = loaded.tokenizer(texts, max_length=24)[1].sum(dim=1).numpy()  # (P,)
    train_tokens, held_tokens = int(lengths[~held].sum()), int(lengths[held].sum())
    assert report["num_encoded_tokens"] == {"train": 3 * train_tokens, "inference": 4 * held_tokens + train_tokens}

    # A rerun with the same config finds the finished outputs and does not retrain.
    weights = (out / "estimator" / "model.safetensors").stat().st_mtime_ns
    lines.clear()
    assert run_train_estimator(cfg, out=lines.append)["history"] == report["history"]
    assert any("already trained with this config" in line for line in lines)
    assert (out / "estimator" / "model.safetensors").stat().st_mtime_ns == weights

    with pytest.raises(ConfigError, match="curation_dir"):
        run_train_estimator(TrainEstimatorConfig(encoder="tiny", output_dir=str(tmp_path / "x")))


def test_zero_variance_labels_follow_the_rl_group_size(tmp_path):
    """group_size below the curation's k trains the head on the share of G-subsets that are all equal;
    above k the event cannot be observed, and the stage says so before training."""
    _write_curation(tmp_path / "curate", num_prompts=60)
    common = [f"curation_dir={tmp_path / 'curate'}", "encoder=tiny", "max_length=24", "epochs=1", "batch_size=16",
              "holdout_fraction=0.25", "progress=false"]
    cfg = configlib.load(TrainEstimatorConfig, overrides=[*common, "group_size=4", f"output_dir={tmp_path / 'g4'}"])
    report = run_train_estimator(cfg, out=lambda line: None)
    data = load_training_set(tmp_path / "curate")
    held = holdout_mask(data.ids, fraction=0.25)
    # Pass rate c/8 with c = 6: C(6,4)/C(8,4) = 15/70 of the 4-subsets are all correct.
    correct = data.num_correct[held]
    expected = np.array([(math.comb(int(c), 4) + math.comb(8 - int(c), 4)) / math.comb(8, 4) for c in correct])
    assert report["holdout"]["group_size"] == 4
    assert report["holdout"]["observed_zero_variance_fraction"] == pytest.approx(expected.mean(), rel=1e-12)
    too_large = configlib.load(TrainEstimatorConfig, overrides=[*common, "group_size=16",
                                                               f"output_dir={tmp_path / 'g16'}"])
    with pytest.raises(ConfigError, match="group_size: 16 exceeds the 8 samples"):
        run_train_estimator(too_large, out=lambda line: None)


def test_holdout_split_is_stable_and_near_the_fraction():
    ids = [f"id-{i}" for i in range(4000)]
    mask = holdout_mask(ids, fraction=0.1)
    assert 0.08 < mask.mean() < 0.12
    assert np.array_equal(holdout_mask(ids[::-1], fraction=0.1), mask[::-1])  # per id, not per position
    assert not (mask & ~holdout_mask(ids, fraction=0.2)).any()  # a larger fraction holds out a superset


def test_config_rejects_bad_values():
    with pytest.raises(ConfigError, match="holdout_fraction"):
        configlib.load(TrainEstimatorConfig, overrides=["holdout_fraction=1.0"])
    with pytest.raises(ConfigError, match="encoder"):
        configlib.load(TrainEstimatorConfig, overrides=["encoder=roberta"])
    with pytest.raises(ConfigError, match="max_length"):
        configlib.load(TrainEstimatorConfig, overrides=["max_length=1024"])
    with pytest.raises(ConfigError, match="filter_threshold"):
        configlib.load(TrainEstimatorConfig, overrides=["filter_threshold=1.0"])
    with pytest.raises(ConfigError, match="margin"):
        configlib.load(TrainEstimatorConfig, overrides=["margin=1.5"])
    assert configlib.load(TrainEstimatorConfig).w_rank == 3.0
