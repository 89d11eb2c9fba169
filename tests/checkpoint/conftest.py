"""A one-rank megatron process group for the checkpoint tests."""

from __future__ import annotations

from typing import Any, Iterator

import pytest



@pytest.fixture(scope="module")
def megatron_single_rank() -> Iterator[Any]:
    """megatron parallel_state on a one-rank gloo group (CPU compatibility layer on)."""
    from pipeline.parallel.context import ParallelContext

    context = ParallelContext.initialize(
        tensor_parallel=1,
        pipeline_parallel=1,
        seed=1234,
        rank=0,
        world_size=1,
        local_rank=0,
        backend="gloo",
    )
    try:
        yield context
    finally:
        context.destroy()
