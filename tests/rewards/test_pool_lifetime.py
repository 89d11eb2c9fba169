"""kill -9 of a grading pool's owner mid-batch: its workers, busy on stuck items, and its forkserver are gone.

An idle worker exits by itself at its pipe's end of file; a worker stuck in a sympy call
never reads the pipe again, and it keeps its forkserver alive (each forkserver child holds
the forkserver's liveness pipe). Measured without the death signals: both stuck workers and
the forkserver still ran 30 s after the kill.
"""

from __future__ import annotations

import pytest

from tests.parallel.test_lifetime import (  # noqa: F401 - no_leftover_parents: an autouse fixture
    alive,
    descendants,
    kill_9,
    no_leftover_parents,
    start_parent,
    wait_for,
    wait_until_gone,
)
from tests.rewards.test_pool import STUCK

POOL_PARENT = """
    import sys
    from pipeline.rewards import GradingPool

    if __name__ == "__main__":
        pool = GradingPool(2, deadline_s=600.0, start_method=sys.argv[1])
        print(" ".join(map(str, pool.worker_pids)), flush=True)
        pool.grade_batch([(response, "5") for response in {stuck!r}])
"""


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_workers_stuck_mid_item_die_with_the_pools_owner(tmp_path, start_method):
    parent = start_parent(tmp_path, POOL_PARENT.format(stuck=STUCK[:2]), start_method)
    workers = [int(pid) for pid in parent.stdout.readline().split()]
    assert len(workers) == 2, parent.stdout.read()
    # Busy: each worker's CPU time grows (it has taken its stuck item) before the kill.
    busy_at = {pid: _cpu_ticks(pid) for pid in workers}
    wait_for(lambda: all(_cpu_ticks(pid) > busy_at[pid] + 20 for pid in workers), parent, "stuck grading")
    helpers = descendants(parent.pid)  # the workers, the forkserver, multiprocessing's resource tracker
    assert set(workers) <= set(helpers)
    kill_9(parent)
    assert wait_until_gone(helpers) == []
    assert not any(alive(pid) for pid in workers)


def _cpu_ticks(pid: int) -> int:
    """User plus system CPU time of ``pid`` in clock ticks (``/proc/<pid>/stat`` fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])
