"""Corrupted checkpoint, whole stage: the relaunch says what it skipped, resumes from the one before, ends exact.

``tests/checkpoint/test_manager.py::test_corrupted_newest_checkpoint_falls_back`` shows
``newest_valid()`` skipping a damaged checkpoint. Here a whole ``run_rl`` (the tiny config of
``tests/rl``: 4 steps, checkpoints at steps 2 and 4) finishes; that run is the uninterrupted
reference. A copy of it then has its step-4 checkpoint damaged (a truncated weights shard; a
deleted ``tensors.safetensors``) and is relaunched: the relaunch must log which checkpoint it
skipped and why, resume from step 2, and end with the reference's metrics (without ``time/*``),
model and optimizer tensors and statistics.

In process (one spawned rank, both relaunches after the one reference run): the fault is in
files, so a fresh interpreter per launch would only add its startup. Runtime: about 40 s on a
loaded 2-core machine (plus the session's one bootstrap).
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.checkpoint.test_manager import _largest_file
from tests.distributed_utils import run_distributed
from tests.reliability.test_reliability_interruptions import _assert_same_outcome, checkpoint_tensors
from tests.reliability.test_reliability_numerics import tiny_rl_config

NUM_STEPS = 4  # from RL_OVERRIDES, which checkpoint every 2 steps
# A small held-out set: its evaluation at steps 0 and N would dominate a run this short.
EXTRA_OVERRIDES = ["eval_set=arith?difficulty=3&size=8"]
NEWEST, FALLBACK = "step_00000004", "step_00000002"


def _truncate_a_weights_shard(step_dir: Path) -> str:
    victim = _largest_file(step_dir / "weights")
    os.truncate(victim, victim.stat().st_size // 2)
    return victim.name


def _delete_the_run_tensors(step_dir: Path) -> str:
    (step_dir / "tensors.safetensors").unlink()
    return "tensors.safetensors"


DAMAGES = {"truncated": _truncate_a_weights_shard, "deleted": _delete_the_run_tensors}


class _Messages(logging.Handler):
    """Collects what the run logs, as a user would read it."""

    def __init__(self) -> None:
        super().__init__(level=logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(f"{record.levelname}: {record.getMessage()}")


def _damaged_relaunch_worker(rank, world_size, tmp, cache_dir):
    from pipeline.parallel.context import ParallelContext
    from pipeline.stages import rl as rl_stage

    tmp = Path(tmp)
    reference_cfg = tiny_rl_config(str(tmp / "reference"), cache_dir, EXTRA_OVERRIDES)
    context = ParallelContext.initialize(tensor_parallel=1, pipeline_parallel=1, seed=reference_cfg.seed)
    rl_stage.run_rl(reference_cfg, context=context)
    logs = _Messages()
    logger = logging.getLogger("pipeline")
    logger.addHandler(logs)
    logger.setLevel(logging.INFO)
    outcomes = {}
    for damage, apply in DAMAGES.items():
        shutil.copytree(tmp / "reference", tmp / damage)  # checkpoints and metrics of the finished run
        victim = apply(tmp / damage / "ckpt" / NEWEST)
        logs.messages.clear()
        rl_stage.run_rl(tiny_rl_config(str(tmp / damage), cache_dir, EXTRA_OVERRIDES), context=context)
        outcomes[damage] = {"victim": victim, "log": list(logs.messages)}
    return outcomes


@pytest.mark.slow
def test_a_damaged_newest_checkpoint_is_reported_skipped_and_the_run_resumes_from_the_one_before(
        tmp_path, bootstrap_cache_dir):
    outcomes = run_distributed(_damaged_relaunch_worker, world_size=1, timeout_s=600,
                               args=(str(tmp_path), str(bootstrap_cache_dir)))[0]
    reference = tmp_path / "reference"
    assert sorted(p.name for p in (reference / "ckpt").glob("step_*")) == [FALLBACK, NEWEST]
    # Steps 3-4 changed the weights: a relaunch that resumed from step 2 without training them
    # again, or from the damaged step 4, could not end with the reference's tensors.
    fallback, newest = (checkpoint_tensors(reference / "ckpt" / name, tmp_path) for name in (FALLBACK, NEWEST))
    assert any(not torch.equal(value, newest[name]) for name, value in fallback.items())
    for damage, outcome in outcomes.items():
        log = "\n".join(outcome["log"])
        # Which checkpoint, which file and what is wrong with it: what a user needs to decide.
        skipped = [line for line in outcome["log"] if f"{NEWEST} is unusable" in line]
        assert len(skipped) == 1 and skipped[0].startswith("ERROR: "), log
        assert outcome["victim"] in skipped[0], log
        assert ("missing" if damage == "deleted" else "bytes, the manifest says") in skipped[0], log
        assert f"resumed from {tmp_path / damage / 'ckpt' / FALLBACK} at step 2" in log, log
        _assert_same_outcome(tmp_path / damage, reference, num_steps=NUM_STEPS)
