"""The DEPO estimator's replay buffer and online loop (pipeline/estimator/replay.py, online.py)."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline.config import DEPO_RANK_MARGIN, DEPO_W_DISTILL, DEPO_W_RANK, DEPO_W_ZERO_VARIANCE
from pipeline.estimator.model import DifficultyEstimator
from pipeline.estimator.online import MIN_CALIBRATION_PAIRS, OnlineEstimator
from pipeline.estimator.replay import BYTES_PER_ENTRY, ReplayBuffer
from pipeline.estimator.train import EstimatorTrainer
from tests.estimator.digits import digits_texts, one_thread  # noqa: F401 (one_thread is a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


def _entries(start: int, count: int) -> dict[str, torch.Tensor]:
    values = torch.arange(start, start + count)
    return {"prompt_index": values, "pass_rate": values.double() / 100, "zero_variance_target": values.double() % 2,
            "question_logprob": -values.double(), "predicted_zero_variance_logit": values.double() / 10,
            "step": values // 4}


def test_replay_buffer_keeps_the_newest_entries_in_a_ring():
    assert BYTES_PER_ENTRY == 48  # six 8-byte columns: 4096 entries are 192 KiB
    buffer = ReplayBuffer(5)
    rows = buffer.add(**_entries(0, 3))
    assert rows.tolist() == [0, 1, 2] and len(buffer) == 3
    rows = buffer.add(**_entries(3, 4))  # 3, 4 fill the ring; 5, 6 overwrite the oldest (0, 1)
    assert rows.tolist() == [3, 4, 0, 1] and len(buffer) == 5 and buffer.num_added == 7
    assert buffer.get(buffer.newest(5))["prompt_index"].tolist() == [6, 5, 4, 3, 2]
    assert buffer.get(buffer.newest(2))["pass_rate"].tolist() == [0.06, 0.05]
    # More entries at once than the ring holds: the last five.
    buffer.add(**_entries(10, 8))
    assert sorted(buffer.get(torch.arange(5))["prompt_index"].tolist()) == [13, 14, 15, 16, 17]
    assert buffer.get(buffer.newest(1))["prompt_index"].tolist() == [17]
    with pytest.raises(ValueError, match="columns"):
        buffer.add(prompt_index=torch.tensor([1]))
    with pytest.raises(IndexError):
        ReplayBuffer(4).get(torch.tensor([0]))


def test_replay_buffer_state_round_trip_is_exact_and_checks_the_capacity():
    buffer = ReplayBuffer(4)
    buffer.add(**_entries(0, 6))
    restored = ReplayBuffer(4)
    restored.load_state_dict(buffer.state_dict())
    for name, column in buffer.columns.items():
        assert torch.equal(restored.columns[name], column), name
    assert (restored.size, restored.cursor, restored.num_added) == (4, 2, 6)
    restored.add(**_entries(50, 1))
    buffer.add(**_entries(50, 1))
    assert torch.equal(restored.get(restored.newest(4))["prompt_index"], buffer.get(buffer.newest(4))["prompt_index"])
    with pytest.raises(ValueError, match="replay_size"):
        ReplayBuffer(8).load_state_dict(buffer.state_dict())


def _online(texts: list[str], **kwargs) -> OnlineEstimator:
    torch.manual_seed(0)
    trainer = EstimatorTrainer(DifficultyEstimator.tiny(max_length=24), group_size=8, lr=1e-3, w_distill=DEPO_W_DISTILL,
                               w_rank=DEPO_W_RANK, margin=DEPO_RANK_MARGIN, w_zero_variance=DEPO_W_ZERO_VARIANCE)
    settings = {"replay_size": 64, "minibatches": 3, "minibatch_size": 8, "calibration_window": 40, "seed": 0}
    return OnlineEstimator(trainer, texts, **{**settings, **kwargs})


def _observe(online: OnlineEstimator, indices: torch.Tensor, step: int, *, logits=None, targets=None) -> dict:
    count = indices.numel()
    nan = torch.full((count,), math.nan, dtype=torch.float64)
    return online.learn(step=step, prompt_indices=indices, pass_rates=torch.full((count,), 0.5, dtype=torch.float64),
                        zero_variance_targets=nan if targets is None else targets, question_logprobs=nan,
                        predicted_zero_variance_logits=nan if logits is None else logits)


def test_each_step_trains_several_minibatches_and_the_first_holds_the_new_observations():
    texts, _ = digits_texts(40, seed=0)
    online = _online(texts)
    seen: list[list[str]] = []
    update = online.trainer.update
    online.trainer.update = lambda batch, *args: seen.append(list(batch)) or update(batch, *args)
    _observe(online, torch.arange(0, 20), step=0)
    new = torch.arange(20, 24)
    metrics = _observe(online, new, step=1)
    assert len(seen) == 6 and all(len(batch) == 8 for batch in seen)
    assert {texts[i] for i in new.tolist()} <= set(seen[3])  # step 1's first minibatch
    assert metrics["estimator/num_updates"] == 6.0 and metrics["depo/replay_entries"] == 24.0
    # The same seed and step draw the same minibatches: a resumed run replays what the uninterrupted one did.
    again, seen_again = _online(texts), []
    update_again = again.trainer.update
    again.trainer.update = lambda batch, *args: seen_again.append(list(batch)) or update_again(batch, *args)
    _observe(again, torch.arange(0, 20), step=0)
    _observe(again, new, step=1)
    assert seen_again == seen


def test_calibration_is_fitted_on_pre_rollout_predictions_once_there_are_enough():
    texts, _ = digits_texts(200, seed=0)
    online = _online(texts, replay_size=200, calibration_window=150)
    generator = torch.Generator().manual_seed(1)
    few = torch.arange(MIN_CALIBRATION_PAIRS - 1)
    _observe(online, few, step=0, logits=torch.zeros(few.numel(), dtype=torch.float64),
             targets=torch.ones(few.numel(), dtype=torch.float64))
    assert online.calibration == (1.0, 0.0)  # too few pairs: the head's own probability
    # Labels drawn from σ(2z − 1): Platt recovers roughly that slope and intercept.
    z = torch.randn(150, generator=generator, dtype=torch.float64)
    labels = (torch.rand(150, generator=generator, dtype=torch.float64) < torch.sigmoid(2 * z - 1)).double()
    metrics = _observe(online, torch.arange(50, 200), step=1, logits=z, targets=labels)
    slope, intercept = online.calibration
    assert metrics["depo/calibration_pairs"] == 150.0  # the window: the newest 150, not the 15 before them
    assert 1.2 < slope < 3.0 and -1.8 < intercept < -0.4, online.calibration
    prediction = online.predict(torch.arange(3))
    torch.testing.assert_close(prediction.zero_variance_prob,
                               torch.sigmoid(slope * prediction.zero_variance_logit + intercept))
