"""run_ranks: results come back per rank, a failing rank is named with its traceback, a hang times out."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from pipeline.parallel.launch import RankFailure, run_ranks


def _write_square(rank: int, result_dir: str, base: int) -> None:
    (Path(result_dir) / f"rank{rank}.txt").write_text(str((base + rank) ** 2))


def _fail_on_rank_one(rank: int, result_dir: str) -> None:
    if rank == 1:
        raise ValueError("shard 1 is missing")


def _hang(rank: int, result_dir: str) -> None:
    time.sleep(60)


def test_every_rank_runs_with_its_rank_and_the_shared_result_dir():
    with run_ranks(_write_square, args=(3,), num_ranks=2, timeout_s=60, description="squares") as result_dir:
        assert [(result_dir / f"rank{rank}.txt").read_text() for rank in range(2)] == ["9", "16"]
    assert not result_dir.exists()  # the temporary folder lives only inside the block


def test_a_failing_rank_is_named_with_its_error_and_traceback():
    with pytest.raises(RankFailure) as caught:
        with run_ranks(_fail_on_rank_one, args=(), num_ranks=2, timeout_s=60, description="layout check"):
            pytest.fail("the block must not run when a rank failed")
    failure = caught.value
    assert failure.rank_name == "rank00001"
    assert str(failure) == "layout check failed on rank00001: ValueError: shard 1 is missing"
    assert "Traceback" in failure.detail and "_fail_on_rank_one" in failure.detail


def test_a_hung_rank_times_out_and_is_terminated():
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"hang did not finish within 2 s \(hung collective\?\)"):
        with run_ranks(_hang, args=(), num_ranks=1, timeout_s=2, description="hang"):
            pytest.fail("the block must not run when a rank hung")
    assert time.monotonic() - started < 30  # not the worker's 60 s: it was terminated
