"""kill -9 of `winnow rl` across epoch boundaries: no prompt skipped or seen twice in an epoch.

The training set here has 10 prompts and each step draws 4, so the 6 steps cross two
epoch boundaries, the first inside logged step 3 (draws 8-11). The run is SIGKILLed as
soon as step 3 is logged, before the step-4 checkpoint, so the relaunch resumes from
step 2 and draws the prompts of step 3 again. (Seeded random kill moments are in
``test_reliability_interruptions.py``.)

The draws of an uninterrupted run are known without running it: ``PromptStream`` is a pure
function of ``(seed, epoch)``, and each of its epochs is a permutation of the prompts
(checked first). The statistics store of the interrupted-and-resumed run must count exactly
those draws: every prompt's ``num_seen``, ``last_seen_step`` and ``num_samples`` equal the
stream's, so no draw was lost or counted twice across the kill, and each epoch trained on
every prompt once (with seed 0, step 3 draws prompt 6 at the end of the first epoch and
again at the start of the second: its samples count twice, its encounters once).

Runtime: two ``winnow rl`` launches, about 25 s each on an idle 2-core machine (over a
minute each under load).
"""

from __future__ import annotations

import signal

import pyarrow.parquet as pq
import pytest

from tests.reliability.test_reliability_interruptions import (
    NUM_STEPS,
    PROMPTS_PER_STEP,
    STARTUP_TIMEOUT_S,
    STOP_TIMEOUT_S,
    _latest_checkpoint_step,
    _launch,
    _overrides,
    _rows,
    _run_to_completion,
    _wait_for_exit,
    _wait_for_step,
)

NUM_PROMPTS = 10
GROUP_SIZE = 4  # from RL_OVERRIDES, with the default uniform budget
EXTRA_OVERRIDES = [f'data.train=["arith?difficulty=3&size={NUM_PROMPTS}"]', "eval_set=arith?difficulty=3&size=8"]


def expected_draws(*, seed: int) -> list[list[int]]:
    """The prompt indices each step draws in an uninterrupted run."""
    from pipeline.rl.stream import PromptStream

    stream = PromptStream(NUM_PROMPTS, seed=seed)
    return [stream.next(PROMPTS_PER_STEP)[0].tolist() for _ in range(NUM_STEPS)]


@pytest.mark.slow
def test_kill_9_and_resume_neither_skip_nor_repeat_a_prompt_within_an_epoch(tmp_path, bootstrap_cache_dir):
    from pipeline import configlib
    from pipeline.config import RLConfig

    cfg = configlib.load(RLConfig, overrides=_overrides(tmp_path, bootstrap_cache_dir, EXTRA_OVERRIDES))
    draws = expected_draws(seed=cfg.seed)
    flat = [index for step in draws for index in step]
    for epoch in range(len(flat) // NUM_PROMPTS):  # the stream itself: each full epoch is a permutation
        assert sorted(flat[epoch * NUM_PROMPTS : (epoch + 1) * NUM_PROMPTS]) == list(range(NUM_PROMPTS))
    # The premise: some step takes the end of one epoch and the start of the next.
    assert any((step * PROMPTS_PER_STEP) // NUM_PROMPTS != ((step + 1) * PROMPTS_PER_STEP - 1) // NUM_PROMPTS
               for step in range(NUM_STEPS))

    process = _launch(tmp_path, bootstrap_cache_dir, "killed", extra=EXTRA_OVERRIDES)
    _wait_for_step(process, tmp_path, 3, STARTUP_TIMEOUT_S)
    process.send_signal(signal.SIGKILL)
    assert _wait_for_exit(process, tmp_path, STOP_TIMEOUT_S) == -signal.SIGKILL
    # Step 3 (draws 8-11, across the first epoch boundary) was logged but not checkpointed:
    # the relaunch resumes from step 2 and must draw those prompts again, exactly once.
    assert _rows(tmp_path)[-1]["step"] >= 3 and _latest_checkpoint_step(tmp_path) == 2, "the kill came too late"
    _run_to_completion(tmp_path, bootstrap_cache_dir, "relaunched", extra=EXTRA_OVERRIDES)

    assert [row["step"] for row in _rows(tmp_path)] == list(range(NUM_STEPS + 1))
    stats = pq.read_table(tmp_path / "run" / "stats.parquet")
    assert stats.num_rows == NUM_PROMPTS
    # A step that straddles an epoch boundary may draw a prompt twice, once for each epoch: the
    # store counts that as one encounter (num_seen) but keeps every sample (num_samples).
    expected_seen = [sum(index in indices for indices in draws) for index in range(NUM_PROMPTS)]
    expected_last = [max(step for step, indices in enumerate(draws) if index in indices) for index in range(NUM_PROMPTS)]
    assert stats.column("num_seen").to_pylist() == expected_seen
    assert stats.column("last_seen_step").to_pylist() == expected_last
    assert stats.column("num_samples").to_pylist() == [GROUP_SIZE * flat.count(index) for index in range(NUM_PROMPTS)]

