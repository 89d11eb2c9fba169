"""Run a test function on N gloo ranks (spawned processes) and collect what each returns.

    results = run_distributed(worker, world_size=2, args=(...))

``worker(rank, world_size, *args)`` runs in a fresh process with torchrun's
environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT`` on a port reserved until the ranks are done) set; it initializes the process group itself
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
import time
from pathlib import Path
from typing import Any, Callable

import torch

from pipeline.parallel.launch import RankFailure, run_ranks
from pipeline.parallel.rendezvous import reserved_port

__all__ = ["RankFailed", "reserved_port", "run_distributed"]


class RankFailed(AssertionError):
    """A spawned rank raised, died or hung; the message holds its traceback."""


def _entry(
    local_rank: int,
    result_dir: str,
    worker: Callable[..., Any],
    world_size: int,
    port: int,
    args: tuple[Any, ...],
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
    result = worker(local_rank, world_size, *args)
    with (Path(result_dir) / f"rank{local_rank}.pkl").open("wb") as f:
        pickle.dump(result, f)


def run_distributed(
    worker: Callable[..., Any],
    *,
    world_size: int,
    args: tuple[Any, ...] = (),
    timeout_s: float = 120.0,
) -> list[Any]:
    """Run ``worker(rank, world_size, *args)`` on ``world_size`` spawned ranks; return their results."""
    try:
        with reserved_port() as port, run_ranks(_entry, args=(worker, world_size, port, args, time.time() + timeout_s),
                                                num_ranks=world_size, timeout_s=timeout_s,
                                                description=f"{world_size} rank(s)") as result_dir:
            results = []
            for rank in range(world_size):
                with (result_dir / f"rank{rank}.pkl").open("rb") as f:
                    results.append(pickle.load(f))
            return results
    except TimeoutError as error:
        raise RankFailed(str(error)) from None
    except RankFailure as failure:
        raise RankFailed(f"{failure}\n{failure.detail}") from None


@contextlib.contextmanager
def one_rank_context(*, seed: int = 0):
    """A one-rank gloo ``ParallelContext`` (an in-process store), torn down on exit (module fixtures)."""
    from pipeline.parallel.context import ParallelContext

    ctx = ParallelContext.initialize(tensor_parallel=1, pipeline_parallel=1, seed=seed, rank=0, world_size=1,
                                     backend="gloo")
    try:
        yield ctx
    finally:
        ctx.destroy()
