"""Signals and kill -9 against the real `winnow rl` process: stop cleanly, resume exactly.

``tests/rl/test_rl_loop.py`` proves in-process that a run stopped after N steps and
resumed equals an uninterrupted one. Here the interruptions are real and come from
outside, at times the loop does not choose:

* SIGTERM (what SLURM and Kubernetes send) and SIGUSR1 (SLURM's ``--signal`` warning
  before the time limit): the process must exit 0 within a bounded time, with a
  checkpoint at the last step it logged, and a relaunch must finish with the same
  metrics, weights and per-prompt statistics as an uninterrupted run.
* SIGKILL at a seeded random moment after the first or second step (mid-generation,
  mid-update, ...), and SIGKILL while a checkpoint is half written: a relaunch must
  recover from the newest valid checkpoint and finish identical to an uninterrupted
  run, with every prompt drawn exactly once. Nothing the killed process started (its
  grading pool's forkserver and workers, multiprocessing's resource tracker) may still
  run seconds later: found by a mark in their environment, however they were reparented.

Every launch is a fresh interpreter (~1 minute of imports and setup on a loaded
2-core machine), so launches are shared: one uninterrupted reference run per module,
one chain SIGTERM → relaunch → SIGUSR1 → relaunch, and SIGKILL → relaunch for each
kill moment.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from tests.rl.test_rl_loop import RL_OVERRIDES
from tests.stages.test_bootstrap import OVERRIDES as BOOTSTRAP_OVERRIDES

REPO = Path(__file__).resolve().parents[2]
NUM_STEPS = 6
PROMPTS_PER_STEP = 4  # from RL_OVERRIDES
# The tiny bootstrap policy solves no difficulty-3 problem: every group has zero reward variance,
# so without a format reward RL changes no weight and comparing final weights would prove nothing.
TRAINING_SIGNAL = ["reward.format_reward=0.1"]
# After the tiny-run overrides of tests/rl: more steps, so an interrupted run has steps
# left to resume, and a small held-out set: its evaluation at steps 0 and N dominates a tiny run.
EXTRA_OVERRIDES = [
    f"steps={NUM_STEPS}", f"optim.total_steps={NUM_STEPS}", "checkpoint.every_steps=2",
    "eval_set=arith?difficulty=3&size=40", *TRAINING_SIGNAL,
]
STARTUP_TIMEOUT_S = 300.0  # imports, bootstrap cache check, first evaluation on a loaded CI machine
STOP_TIMEOUT_S = 120.0  # a signal waits for the current step (generate, grade, update) and a checkpoint
RUN_TIMEOUT_S = 400.0
# Names a launch in its environment; the processes it starts inherit it, wherever they are reparented.
LAUNCH_MARK_ENV = "WINNOW_TEST_LAUNCH"
# A kill -9 takes every child with it at once (``pipeline.parallel.lifetime``); slack for a loaded machine.
ORPHAN_TIMEOUT_S = 5.0
# Kills 1.40 s after step 2 is logged: on a 2-core CPU, after the step-2 checkpoint, in a later step.
CRASH_SEED = 20260526


def _overrides(tmp: Path, cache_dir: Path, extra: Sequence[str] = ()) -> list[str]:
    """The run's overrides; ``extra`` comes last, so it wins."""
    return [
        *[f"bootstrap.{o}" for o in BOOTSTRAP_OVERRIDES], f"bootstrap.cache_dir={cache_dir}",
        *RL_OVERRIDES, *EXTRA_OVERRIDES,
        f"checkpoint.directory={tmp}/ckpt", f"logging.output_dir={tmp}/run", *extra,
    ]


def _launch(tmp: Path, cache_dir: Path, attempt: str, *, extra: Sequence[str] = ()) -> subprocess.Popen:
    return _launch_command(tmp, ["rl", *_overrides(tmp, cache_dir, extra)], attempt)


def _launch_command(tmp: Path, arguments: Sequence[str], attempt: str) -> subprocess.Popen:
    """``winnow <arguments>`` in a fresh interpreter, its output in ``tmp/<attempt>.log``."""
    tmp.mkdir(parents=True, exist_ok=True)
    env = _launch_env(tmp, attempt)
    with (tmp / f"{attempt}.log").open("w") as log:  # the child keeps its own copy of the descriptor
        return subprocess.Popen([sys.executable, "-m", "pipeline.cli", *arguments],
                                cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


def _launch_env(tmp: Path, attempt: str) -> dict[str, str]:
    """The launch's environment, marked: every process it starts inherits the mark (``_assert_nothing_left``)."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", LAUNCH_MARK_ENV: f"{tmp}/{attempt}"}


def _marked_processes(tmp: Path, attempt: str) -> list[int]:
    """Live processes (not zombies) whose environment carries the mark of ``attempt``'s launch."""
    mark = f"{LAUNCH_MARK_ENV}={tmp}/{attempt}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:  # exited meanwhile, or not ours to read
            continue
        if mark in environ.split(b"\0") and stat[stat.rindex(")") + 2] not in "ZX":
            found.append(int(entry))
    return found


def _assert_nothing_left(tmp: Path, attempt: str) -> None:
    """After ``attempt``'s launch ended (a kill -9 included): none of the processes it started still runs."""
    deadline = time.monotonic() + ORPHAN_TIMEOUT_S
    while (left := _marked_processes(tmp, attempt)) and time.monotonic() < deadline:
        time.sleep(0.05)
    names = {pid: _command_line(pid) for pid in left}
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"still running {ORPHAN_TIMEOUT_S:.0f} s after the kill -9: {names}"


def _command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")[:160]
    except OSError:
        return "(exited)"


def _rows(tmp: Path) -> list[dict]:
    path = tmp / "run" / "metrics.jsonl"
    if not path.exists():
        return []
    # The last line may be half-written while the run is alive (or after a kill -9).
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return rows


def _wait_for_step(process: subprocess.Popen, tmp: Path, step: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(row["step"] >= step for row in _rows(tmp)):
            return
        if process.poll() is not None:
            pytest.fail(f"run exited with {process.returncode} before step {step}:\n{_log_tail(tmp)}")
        time.sleep(0.05)
    process.kill()
    pytest.fail(f"no step {step} within {timeout_s} s:\n{_log_tail(tmp)}")


def _wait_for_exit(process: subprocess.Popen, tmp: Path, timeout_s: float) -> int:
    try:
        return process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        pytest.fail(f"run did not exit within {timeout_s} s:\n{_log_tail(tmp)}")


def _log_tail(tmp: Path) -> str:
    return "\n".join(p.read_text()[-3000:] for p in sorted(tmp.glob("*.log")))


def _run_to_completion(tmp: Path, cache_dir: Path, attempt: str, *, extra: Sequence[str] = ()) -> None:
    process = _launch(tmp, cache_dir, attempt, extra=extra)
    assert _wait_for_exit(process, tmp, RUN_TIMEOUT_S) == 0, _log_tail(tmp)


def _latest_checkpoint_step(tmp: Path) -> int:
    name = (tmp / "ckpt" / "latest").read_text().strip()
    assert (tmp / "ckpt" / name / "manifest.json").is_file()
    return int(name.removeprefix("step_"))


def _strip_times(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith("time/")} for row in rows]


def checkpoint_tensors(step_dir: Path, scratch: Path) -> dict[str, torch.Tensor]:
    """Model and optimizer tensors of one checkpoint, read from megatron's torch_dist files."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    converted = scratch / f"{step_dir.name}_weights.pt"
    dcp_to_torch_save(step_dir / "weights", converted)
    # Our own file, just written from our own checkpoint: tensors only.
    state = torch.load(converted, weights_only=True)
    return {name: value for name, value in state.items() if isinstance(value, torch.Tensor)}


def _final_weights(tmp: Path, num_steps: int) -> dict[str, torch.Tensor]:
    return checkpoint_tensors(tmp / "ckpt" / f"step_{num_steps:08d}", tmp)


def _assert_same_outcome(tmp: Path, reference: Path, *, num_steps: int = NUM_STEPS) -> None:
    """``tmp`` (an interrupted and resumed run) ended exactly as ``reference`` (an uninterrupted one)."""
    rows = _rows(tmp)
    assert [row["step"] for row in rows] == list(range(num_steps + 1))  # no step lost or logged twice
    assert _strip_times(rows) == _strip_times(_rows(reference))
    expected, actual = _final_weights(reference, num_steps), _final_weights(tmp, num_steps)
    assert expected.keys() == actual.keys() and expected
    for name, value in expected.items():
        assert torch.equal(value, actual[name]), name
    stats = pq.read_table(tmp / "run" / "stats.parquet")
    expected_stats = pq.read_table(reference / "run" / "stats.parquet")
    assert stats.schema.equals(expected_stats.schema, check_metadata=True)
    for name in stats.column_names:
        # Never-measured columns are NaN, and NaN != NaN: compare through numpy, NaN-aware.
        actual_column = stats.column(name).to_numpy()
        expected_column = expected_stats.column(name).to_numpy()
        assert np.array_equal(actual_column, expected_column, equal_nan=actual_column.dtype.kind == "f"), name
    num_seen = stats.column("num_seen").to_pylist()
    # The train split holds more than num_steps * PROMPTS_PER_STEP prompts: one epoch, so each
    # drawn prompt is seen exactly once; a replayed or skipped step would break the count.
    assert len(num_seen) > num_steps * PROMPTS_PER_STEP
    assert sum(num_seen) == num_steps * PROMPTS_PER_STEP and max(num_seen) == 1
    seen_steps = sorted(s for s in stats.column("last_seen_step").to_pylist() if s >= 0)
    assert seen_steps == sorted(list(range(num_steps)) * PROMPTS_PER_STEP)
    assert not list((tmp / "ckpt").glob("*.tmp"))


@pytest.fixture(scope="module")
def cache_dir(bootstrap_cache_dir) -> Path:
    return bootstrap_cache_dir


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache_dir) -> Path:
    tmp = tmp_path_factory.mktemp("uninterrupted")
    _run_to_completion(tmp, cache_dir, "uninterrupted")
    return tmp


def _signal_and_check_clean_stop(tmp: Path, cache_dir: Path, signum: signal.Signals, *, after_step: int) -> int:
    process = _launch(tmp, cache_dir, signum.name)
    _wait_for_step(process, tmp, after_step, STARTUP_TIMEOUT_S)
    process.send_signal(signum)
    sent_at = time.monotonic()
    assert _wait_for_exit(process, tmp, STOP_TIMEOUT_S) == 0, _log_tail(tmp)
    assert time.monotonic() - sent_at < STOP_TIMEOUT_S
    reached = _rows(tmp)[-1]["step"]
    assert after_step <= reached < NUM_STEPS, "the signal must stop the run before its end"
    assert _latest_checkpoint_step(tmp) == reached  # the stop checkpointed the step it reached
    assert (tmp / "run" / "stats.parquet").is_file()  # finish() ran: a clean exit, not an abort
    _assert_nothing_left(tmp, signum.name)
    return reached


@pytest.mark.slow
def test_sigterm_then_sigusr1_stop_cleanly_and_the_resumed_run_matches(tmp_path, cache_dir, reference):
    stopped_at = _signal_and_check_clean_stop(tmp_path, cache_dir, signal.SIGTERM, after_step=1)
    stopped_again_at = _signal_and_check_clean_stop(tmp_path, cache_dir, signal.SIGUSR1,
                                                    after_step=stopped_at + 1)
    assert stopped_again_at > stopped_at  # the relaunch resumed instead of starting over
    _run_to_completion(tmp_path, cache_dir, "final")
    _assert_same_outcome(tmp_path, reference)


def _kill_mid_checkpoint(process: subprocess.Popen, tmp: Path) -> None:
    """SIGKILL while the step-4 checkpoint is being written (step 2's is the valid fallback)."""
    _wait_for_step(process, tmp, 3, STARTUP_TIMEOUT_S)
    partial = tmp / "ckpt" / "step_00000004.tmp"
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while not partial.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"never saw {partial.name} while the run was alive:\n{_log_tail(tmp)}")
        time.sleep(0.001)
    process.send_signal(signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.parametrize("moment", ["seeded_random", "mid_checkpoint"])
def test_kill_9_then_relaunch_matches_an_uninterrupted_run(tmp_path, cache_dir, reference, moment):
    process = _launch(tmp_path, cache_dir, "killed")
    if moment == "seeded_random":
        rng = random.Random(CRASH_SEED)
        after_step, delay_s = rng.choice([1, 2]), rng.uniform(0.0, 3.0)
        _wait_for_step(process, tmp_path, after_step, STARTUP_TIMEOUT_S)
        assert len(_marked_processes(tmp_path, "killed")) > 1, "the mark must find the run's helper processes"
        time.sleep(delay_s)
        assert process.poll() is None, "the run ended before the kill; the delay is too long for this config"
        process.send_signal(signal.SIGKILL)
    else:
        _kill_mid_checkpoint(process, tmp_path)
    assert _wait_for_exit(process, tmp_path, STOP_TIMEOUT_S) == -signal.SIGKILL
    _assert_nothing_left(tmp_path, "killed")  # the grading pool's forkserver and workers died with the run
    assert _rows(tmp_path)[-1]["step"] < NUM_STEPS
    if moment == "mid_checkpoint":
        assert (tmp_path / "ckpt" / "step_00000004.tmp").is_dir(), "the kill landed after the save finished"
        assert _latest_checkpoint_step(tmp_path) == 2  # the half-written checkpoint was never published
    _run_to_completion(tmp_path, cache_dir, "relaunched")
    _assert_same_outcome(tmp_path, reference)
