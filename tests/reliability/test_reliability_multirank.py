"""Crash anywhere, two ranks: kill -9 a two-rank RL job (torchrun, data parallel 2 on gloo) and relaunch it.

Every rank writes its shard of each checkpoint and the manifest is published last, so a job
killed between checkpoints resumes from the last complete one on both ranks; the resumed job
must end with the uninterrupted job's weights, metrics
and statistics.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from tests.reliability.test_reliability_interruptions import (
    REPO,
    RUN_TIMEOUT_S,
    STARTUP_TIMEOUT_S,
    STOP_TIMEOUT_S,
    _assert_nothing_left,
    _assert_same_outcome,
    _launch_command,
    _launch_env,
    _log_tail,
    _marked_processes,
    _overrides,
    _rows,
    _wait_for_step,
)
from tests.stages.test_bootstrap import OVERRIDES as BOOTSTRAP_OVERRIDES

# Data parallel 2: the tiny policy's 59-token vocabulary is not divisible by TP=2 (the RL
# stage does not pad a bootstrap vocabulary yet).
TWO_RANKS: list[str] = []
CRASH_SEED = 20261122


def _launch_two_ranks(tmp: Path, cache_dir: Path, attempt: str) -> subprocess.Popen:
    """``torchrun --nproc-per-node 2 -m pipeline.cli rl ...`` in its own process group."""
    tmp.mkdir(parents=True, exist_ok=True)
    env = _launch_env(tmp, attempt)
    arguments: Sequence[str] = ["rl", *_overrides(tmp, cache_dir, TWO_RANKS)]
    with (tmp / f"{attempt}.log").open("w") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
             "-m", "pipeline.cli", *arguments],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _kill_the_job(tmp: Path, attempt: str) -> None:
    """SIGKILL every process of the launch: torchrun, its ranks (each in a session of its own), their helpers."""
    for pid in _marked_processes(tmp, attempt):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _wait(process: subprocess.Popen, tmp: Path, attempt: str, timeout_s: float) -> int:
    try:
        return process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_the_job(tmp, attempt)
        process.wait()
        pytest.fail(f"job did not exit within {timeout_s} s:\n{_log_tail(tmp)}")


@pytest.fixture(scope="module")
def cache_dir(bootstrap_cache_dir) -> Path:
    return bootstrap_cache_dir


@pytest.mark.slow
@pytest.mark.distributed
def test_kill_9_of_a_two_rank_job_then_relaunch_matches_an_uninterrupted_job(tmp_path, cache_dir):
    # The base policy is trained by one process (shared with the other reliability tests);
    # both ranks of the two-rank jobs load it.
    bootstrap = _launch_command(tmp_path / "bootstrap", ["bootstrap", *BOOTSTRAP_OVERRIDES, f"cache_dir={cache_dir}"],
                                "bootstrap")
    assert bootstrap.wait(timeout=RUN_TIMEOUT_S) == 0, _log_tail(tmp_path / "bootstrap")
    reference = tmp_path / "reference"
    assert _wait(_launch_two_ranks(reference, cache_dir, "straight"), reference, "straight", RUN_TIMEOUT_S) == 0, \
        _log_tail(reference)

    killed = tmp_path / "killed"
    process = _launch_two_ranks(killed, cache_dir, "killed")
    rng = random.Random(CRASH_SEED)
    after_step, delay_s = rng.choice([2, 3]), rng.uniform(0.0, 2.0)
    _wait_for_step(process, killed, after_step, STARTUP_TIMEOUT_S)
    time.sleep(delay_s)
    assert process.poll() is None, "the job ended before the kill; the delay is too long for this config"
    # torchrun and both ranks at once, as a node failure would. torchrun starts each rank in a
    # session of its own, so its process group holds only torchrun: the ranks are found by the mark.
    _kill_the_job(killed, "killed")
    _wait(process, killed, "killed", STOP_TIMEOUT_S)
    _assert_nothing_left(killed, "killed")
    assert _rows(killed)[-1]["step"] < 6

    assert _wait(_launch_two_ranks(killed, cache_dir, "relaunched"), killed, "relaunched", RUN_TIMEOUT_S) == 0, \
        _log_tail(killed)
    _assert_same_outcome(killed, reference)
