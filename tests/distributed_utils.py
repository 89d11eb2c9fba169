"""Run a test function on N gloo ranks (spawned processes) and collect what each returns.

    results = run_distributed(worker, world_size=2, args=(...))

``worker(rank, world_size, *args)`` runs in a fresh process with torchrun's
environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT`` on a free port) set; it initializes the process group itself
(normally through ``ParallelContext.initialize``). Its return value must be
picklable; ``results[r]`` is rank ``r``'s. If any rank raises, the others are
terminated and the test fails with that rank's traceback. A run that exceeds
``timeout_s`` (a hung collective) fails naming the ranks still running.

``worker`` must be a module-level function (spawned processes import it by
name), and tensors in results should be detached CPU tensors.
"""

from __future__ import annotations

import contextlib

import faulthandler
import os
import pickle
import socket
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

__all__ = ["RankFailed", "find_free_port", "run_distributed"]


class RankFailed(AssertionError):
    """A spawned rank raised; the message holds its traceback."""


def find_free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(
    local_rank: int,
    worker: Callable[..., Any],
    world_size: int,
    port: int,
    args: tuple[Any, ...],
    result_dir: str,
    deadline: float,
) -> None:
    # A hung collective shows up as a stack dump of every rank on stderr shortly before
    # the parent gives up (deadline is wall-clock time: startup already used some).
    faulthandler.dump_traceback_later(max(deadline - time.time() - 3.0, 0.5), exit=False)
    os.environ.update(
        RANK=str(local_rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(local_rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    # Ranks share few cores: more threads per rank only adds contention.
    torch.set_num_threads(1)
    path = Path(result_dir) / f"rank{local_rank}.pkl"
    try:
        result = worker(local_rank, world_size, *args)
    except BaseException:
        path.with_suffix(".err").write_text(traceback.format_exc())
        raise
    with path.open("wb") as f:
        pickle.dump(result, f)


def run_distributed(
    worker: Callable[..., Any],
    *,
    world_size: int,
    args: tuple[Any, ...] = (),
    timeout_s: float = 120.0,
) -> list[Any]:
    """Run ``worker(rank, world_size, *args)`` on ``world_size`` spawned ranks; return their results."""
    port = find_free_port()
    with tempfile.TemporaryDirectory(prefix="winnow-dist-") as result_dir:
        context = mp.start_processes(
            _entry,
            args=(worker, world_size, port, args, result_dir, time.time() + timeout_s),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout_s
        try:
            while not context.join(timeout=0.5):
                if time.monotonic() > deadline:
                    alive = [rank for rank, process in enumerate(context.processes) if process.is_alive()]
                    raise RankFailed(f"ranks {alive} still running after {timeout_s:.0f} s (hung collective?)")
        except mp.ProcessRaisedException as error:
            failed = sorted(Path(result_dir).glob("rank*.err"))
            details = "\n".join(f"--- {path.stem} ---\n{path.read_text()}" for path in failed)
            raise RankFailed(details or str(error)) from None
        except mp.ProcessExitedException as error:
            raise RankFailed(f"rank {error.error_index} exited with code {error.exit_code}") from None
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.terminate()
            for process in context.processes:
                process.join(timeout=5)
        results = []
        for rank in range(world_size):
            with (Path(result_dir) / f"rank{rank}.pkl").open("rb") as f:
                results.append(pickle.load(f))
        return results


@contextlib.contextmanager
def one_rank_context(*, seed: int = 0):
    """A one-rank gloo ``ParallelContext`` on a free local port, torn down on exit (module fixtures)."""
    from pipeline.parallel.context import ParallelContext

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = ParallelContext.initialize(tensor_parallel=1, pipeline_parallel=1, seed=seed, rank=0, world_size=1,
                                     master_addr="127.0.0.1", master_port=port, backend="gloo")
    try:
        yield ctx
    finally:
        ctx.destroy()
