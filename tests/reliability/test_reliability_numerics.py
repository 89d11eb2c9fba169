"""A non-finite loss or gradient in a real RL run: skipped, counted, kept out of checkpoints, and stopped.

``tests/trainer/test_actor.py`` shows one actor step skipping a NaN loss. Here the whole
``run_rl`` loop runs on the tiny bootstrap policy with the policy loss poisoned at chosen
optimizer steps (a test-only fault: ``PolicyLoss.__call__`` is replaced in the spawned
worker), checkpointing every step, with ``trainer.max_skipped_steps=1``:

* update 2 is non-finite: it is skipped (``skipped_step`` logged, the actor's counter is 1),
  and the step-2 checkpoint holds exactly the step-1 model and optimizer tensors;
* update 3 is non-finite too: two skipped steps exceed the limit of one, so the run stops
  with an error naming ``trainer.max_skipped_steps`` before step 3 is logged or checkpointed;
* the cause fixed, a relaunch resumes from step 2 with the skip counter restored and
  finishes with ordinary steps.

Two poisons: a NaN loss value, and a finite loss whose backward pass yields an infinite
gradient (the actor's gradient check, not its loss check, must catch that one).
Runtime: about 25 s per poison on an idle 2-core machine (plus the session's one bootstrap).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.distributed_utils import run_distributed
from tests.reliability.test_reliability_interruptions import TRAINING_SIGNAL, checkpoint_tensors
from tests.rl.test_rl_loop import _config

NUM_STEPS = 4  # from RL_OVERRIDES
POISONED_UPDATES = (2, 3)  # 1-based optimizer steps: the logged steps 2 and 3
# A small held-out set: its evaluation at steps 0 and N would dominate a run this short.
EXTRA_OVERRIDES = ["checkpoint.every_steps=1", "checkpoint.keep_last=10", "trainer.max_skipped_steps=1",
                   "eval_set=arith?difficulty=3&size=8"]


def tiny_rl_config(tmp: str, cache_dir: str, extra: list[str]):
    """The tiny RL config of ``tests/rl`` on the session's bootstrap cache, with a training signal; ``extra`` wins."""
    return _config(tmp, [f"bootstrap.cache_dir={cache_dir}", *TRAINING_SIGNAL, *extra])


class _InfiniteGradient(torch.autograd.Function):
    """Identity forward; the backward pass sends an infinite gradient into the model."""

    @staticmethod
    def forward(ctx, loss: torch.Tensor) -> torch.Tensor:  # noqa: ARG004
        return loss.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: ARG004
        return grad * float("inf")


POISONS = {
    "nan_loss": lambda loss: loss * float("nan"),
    "inf_gradient": _InfiniteGradient.apply,
}


def _poisoned_run_worker(rank, world_size, tmp, cache_dir, poison):
    import traceback

    from pipeline.metrics import read_metrics
    from pipeline.parallel.context import ParallelContext
    from pipeline.stages import rl as rl_stage
    from pipeline.trainer.actor import Actor
    from pipeline.trainer.losses import PolicyLoss

    cfg = tiny_rl_config(tmp, cache_dir, EXTRA_OVERRIDES)
    context = ParallelContext.initialize(tensor_parallel=1, pipeline_parallel=1, seed=cfg.seed)
    poisoned = set(POISONED_UPDATES)
    updates: list[tuple[int, bool]] = []  # per optimizer step: (skip counter before it, skipped)
    original_train_step, original_loss = Actor.train_step, PolicyLoss.__call__

    def train_step(actor, batch, loss, **kwargs):
        skipped_before = actor.num_skipped_steps
        result = original_train_step(actor, batch, loss, **kwargs)
        if isinstance(loss, PolicyLoss):  # not the bootstrap's steps, when its cache is cold
            updates.append((skipped_before, result.skipped))
        return result

    def poisoned_loss(loss_fn, **kwargs):
        loss, metrics = original_loss(loss_fn, **kwargs)
        if len(updates) + 1 in poisoned:  # the update in progress
            loss = POISONS[poison](loss)
        return loss, metrics

    Actor.train_step, PolicyLoss.__call__ = train_step, poisoned_loss
    try:
        rl_stage.run_rl(cfg, context=context)
        stop = None
    except Exception as error:  # noqa: BLE001 - the type is the loop's choice; the test reads the message
        stop = f"{type(error).__name__}: {error}"
        assert "max_skipped_steps" in stop, traceback.format_exc()  # not some other failure
    checkpoint_dir = Path(cfg.checkpoint.directory)
    at_stop = {"updates": list(updates), "checkpoints": sorted(p.name for p in checkpoint_dir.iterdir()),
               "latest": (checkpoint_dir / "latest").read_text().strip(),
               "logged_steps": [row["step"] for row in read_metrics(Path(cfg.logging.output_dir) / "metrics.jsonl")]}
    poisoned.clear()  # the cause is fixed; the relaunch picks up from the newest checkpoint
    rl_stage.run_rl(cfg, context=context)
    return {"stop": stop, "at_stop": at_stop, "relaunch_updates": updates[len(at_stop["updates"]):],
            "rows": read_metrics(Path(cfg.logging.output_dir) / "metrics.jsonl")}


def _rank_state(step_dir: Path) -> dict:
    return json.loads((step_dir / "ranks" / "rank_00000.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("poison", sorted(POISONS))
def test_non_finite_steps_are_skipped_counted_kept_out_of_checkpoints_and_stop_the_run(
        tmp_path, bootstrap_cache_dir, poison):
    outcome = run_distributed(_poisoned_run_worker, world_size=1, timeout_s=600,
                              args=(str(tmp_path), str(bootstrap_cache_dir), poison))[0]

    # The stop: a clear error after the second skipped step, before step 3 is logged or saved.
    at_stop = outcome["at_stop"]
    assert outcome["stop"] is not None and "trainer.max_skipped_steps" in outcome["stop"], outcome
    assert at_stop["updates"] == [(0, False), (0, True), (1, True)]
    assert at_stop["logged_steps"] == [0, 1, 2]
    assert at_stop["checkpoints"] == ["latest", "step_00000001", "step_00000002"]
    assert at_stop["latest"] == "step_00000002"

    # The skipped step is logged as such, with the value that caused it.
    rows = outcome["rows"]
    assert [row["step"] for row in rows] == list(range(NUM_STEPS + 1))  # resumed at 2: nothing lost or repeated
    assert [row["skipped_step"] for row in rows[1:]] == [False, True, False, False]
    assert rows[2]["grad_norm"] == "nan"  # the metrics writer keeps non-finite values as strings
    if poison == "nan_loss":
        assert rows[2]["loss"] == "nan"
    else:
        assert math.isfinite(rows[2]["loss"])  # only the gradient check could catch this one

    # The skipped step never reached a checkpoint: step 2 holds step 1's model and optimizer exactly.
    checkpoints = tmp_path / "ckpt"
    step_1, step_2 = (checkpoint_tensors(checkpoints / f"step_{s:08d}", tmp_path) for s in (1, 2))
    assert step_1.keys() == step_2.keys() and any(".weight" in name for name in step_1)
    for name, value in step_1.items():
        assert torch.equal(value, step_2[name]), name
        assert torch.isfinite(value).all(), name
    assert _rank_state(checkpoints / "step_00000001")["num_skipped_steps"] == 0
    assert _rank_state(checkpoints / "step_00000002")["num_skipped_steps"] == 1
    # The learning-rate schedule did not advance either.
    assert _rank_state(checkpoints / "step_00000002")["schedule"] == _rank_state(checkpoints / "step_00000001")["schedule"]

    # The relaunch restored the counter from the step-2 checkpoint and trained normally.
    assert outcome["relaunch_updates"] == [(1, False), (1, False)]
    step_3 = checkpoint_tensors(checkpoints / "step_00000003", tmp_path)
    assert any(not torch.equal(value, step_3[name]) for name, value in step_2.items())
    assert all(torch.isfinite(value).all() for value in step_3.values())
