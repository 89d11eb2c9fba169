"""Spawned gloo ranks inside one command: a layout check of the converter, the TP/PP benchmark.

``run_ranks`` starts ``num_ranks`` fresh interpreters (spawn, not fork: no torch
threads, megatron state or CUDA context inherited), waits for them with a deadline,
and turns a failure into one exception that names the rank and carries its
traceback. Each rank gets ``(rank, result_dir, *args)``; it writes what it returns
into ``result_dir`` (a temporary folder that lives until ``run_ranks``' block ends).
A rank dies with the process that started it (``lifetime.exit_with_parent``): a kill -9 of
the caller leaves no rank running, and none writes into ``result_dir`` after the caller is
gone. torch's own death signal for spawned ranks is SIGINT, which a rank inside a C call
does not act on and which runs its ``except``/``finally`` blocks, and it is set with no
check for a parent that died while the rank was still importing torch.
The caller's entry point must guard its main code with ``if __name__ == "__main__":``
— spawned ranks re-import it. Ranks that form a process group get their port from
``reserved_port``, held around the whole ``run_ranks`` block: rank 0 binds it seconds after the
spawn, and a port that was merely free when picked may be gone by then.
"""

from __future__ import annotations

import os
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from pipeline.parallel.lifetime import exit_with_parent
from pipeline.parallel.rendezvous import reserved_port

__all__ = ["RankFailure", "reserved_port", "run_ranks"]


class RankFailure(RuntimeError):
    """A spawned rank raised or died; ``rank_name`` is e.g. ``rank00001``, ``detail`` its traceback."""

    def __init__(self, message: str, *, rank_name: str, detail: str) -> None:
        super().__init__(message)
        self.rank_name = rank_name
        self.detail = detail


def _error_path(result_dir: str, rank: int) -> Path:
    return Path(result_dir) / f"rank{rank:05d}.err"


def _guarded_rank(rank: int, worker: Callable[..., None], result_dir: str, parent_pid: int, *args: Any) -> None:
    """One spawned rank: die with ``parent_pid``, run ``worker``, leave its error where the parent reads it."""
    exit_with_parent(parent_pid=parent_pid)
    try:
        worker(rank, result_dir, *args)
    except BaseException as error:
        # First line: the error itself (callers quote it); then the traceback.
        _error_path(result_dir, rank).write_text(f"{type(error).__name__}: {error}\n{traceback.format_exc()}")
        raise


@contextmanager
def run_ranks(worker: Callable[..., None], *, args: tuple[Any, ...], num_ranks: int, timeout_s: float,
              description: str) -> Iterator[Path]:
    """Run ``worker(rank, result_dir, *args)`` on ``num_ranks`` spawned ranks; yield ``result_dir``.

    ``worker`` and ``args`` must be picklable (a module-level function, plain data).
    Raises ``TimeoutError`` past ``timeout_s`` (a hung collective) and ``RankFailure``
    when a rank raises or dies; every rank still alive is terminated either way.
    """
    with tempfile.TemporaryDirectory(prefix="winnow-ranks-") as result_dir:
        processes = mp.start_processes(_guarded_rank, args=(worker, result_dir, os.getpid(), *args), nprocs=num_ranks,
                                       join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        try:
            while not processes.join(timeout=0.5):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{description} did not finish within {timeout_s:.0f} s (hung collective?)")
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as error:
            failures = sorted(Path(result_dir).glob("rank*.err"))
            rank_name = failures[0].stem if failures else "a rank"
            detail = failures[0].read_text() if failures else str(error)
            raise RankFailure(f"{description} failed on {rank_name}: {detail.splitlines()[0] if detail else error}",
                              rank_name=rank_name, detail=detail) from None
        finally:
            for process in processes.processes:
                if process.is_alive():
                    process.terminate()
            for process in processes.processes:
                process.join(timeout=5)
        yield Path(result_dir)
