"""kill -9 of a process that started children: every child is gone within seconds.

A parent script (a fresh interpreter, so the test can SIGKILL it) starts children the way
winnow does; the test kills it and reads ``/proc`` until every child has exited. Without
``pipeline.parallel.lifetime`` each case below leaves its children running: a spawned rank
finishes its work (torch's own SIGINT death signal runs its ``finally`` blocks, and is never
armed when the parent dies while the rank imports torch), a launcher's torchrun runs on.
The grading pool's case is in ``tests/rewards/test_pool_lifetime.py``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pipeline.parallel.lifetime import POLL_S

REPO = Path(__file__).resolve().parents[2]
GONE_WITHIN_S = 10.0  # generous on a loaded 2-core machine; the kernel's death signal takes milliseconds
STARTUP_TIMEOUT_S = 120.0

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def alive(pid: int) -> bool:
    """Process ``pid`` exists and has not exited (a zombie nobody has reaped yet counts as exited)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except (FileNotFoundError, ProcessLookupError):
        return ""


def children(pid: int) -> list[int]:
    """The direct children of ``pid``, from every thread's ``children`` list."""
    found: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            found += [int(child) for child in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
    except (FileNotFoundError, ProcessLookupError):
        pass
    return found


def descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        found += kids
        todo += kids
    return found


def wait_until_gone(pids: list[int], timeout_s: float = GONE_WITHIN_S) -> list[int]:
    """Polls until every pid has exited; returns the survivors at the deadline, SIGKILLed so none leak."""
    deadline = time.monotonic() + timeout_s
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    survivors = [pid for pid in pids if alive(pid)]
    for pid in survivors:
        os.kill(pid, signal.SIGKILL)
    return survivors


_PARENTS: list[subprocess.Popen] = []


def start_parent(tmp: Path, source: str, *args: str) -> subprocess.Popen:
    """Runs ``source`` as a script in a fresh interpreter (spawned children re-import it)."""
    script = tmp / "parent.py"
    script.write_text(textwrap.dedent(source))
    parent = subprocess.Popen([sys.executable, str(script), *args], cwd=REPO,
                              env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _PARENTS.append(parent)
    return parent


@pytest.fixture(autouse=True)
def no_leftover_parents():
    """A test that fails before its kill leaves its parent (and children) waiting: end them."""
    yield
    while _PARENTS:
        parent = _PARENTS.pop()
        if parent.poll() is None:
            wait_until_gone([*descendants(parent.pid), parent.pid], timeout_s=0)
            parent.wait()
        parent.stdout.close()


def kill_9(parent: subprocess.Popen) -> None:
    parent.send_signal(signal.SIGKILL)
    assert parent.wait(timeout=30) == -signal.SIGKILL


def wait_for(condition, parent: subprocess.Popen, what: str):
    """Polls ``condition()`` until it is truthy; fails with the parent's output if the parent dies first."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not (found := condition()):
        if parent.poll() is not None or time.monotonic() > deadline:
            parent.kill()
            pytest.fail(f"{what} never happened:\n{parent.stdout.read()}")
        time.sleep(0.01)
    return found


RANKS_PARENT = """
    import os, sys, time
    from pathlib import Path

    from pipeline.parallel.launch import run_ranks

    def rank_main(rank, result_dir, marks):
        (Path(marks) / f"started_{rank}").write_text(str(os.getpid()))
        try:
            time.sleep(120)  # a long collective, a benchmark, a conversion
        finally:
            # What a rank unwinding after its parent's death could do: write into a shared folder.
            (Path(marks) / f"late_{rank}").write_text("written after the parent died")

    if __name__ == "__main__":
        with run_ranks(rank_main, args=(sys.argv[1],), num_ranks=2, timeout_s=600, description="sleep"):
            pass
"""


def test_spawned_ranks_die_with_their_parent_and_write_nothing_after(tmp_path):
    marks = tmp_path / "marks"
    marks.mkdir()
    parent = start_parent(tmp_path, RANKS_PARENT, str(marks))
    started = wait_for(lambda: len(found := sorted(marks.glob("started_*"))) == 2 and found, parent, "two ranks")
    ranks = [int(path.read_text()) for path in started]
    kill_9(parent)
    assert wait_until_gone(ranks) == []  # exited: whatever a rank's cleanup wrote is there now
    assert not list(marks.glob("late_*")), "a rank ran its cleanup after its parent died"


def test_ranks_spawned_just_before_their_parent_dies_never_run(tmp_path):
    """The window before a rank arms its death signal: the parent dies while the rank imports torch."""
    marks = tmp_path / "marks"
    marks.mkdir()
    parent = start_parent(tmp_path, RANKS_PARENT, str(marks))
    ranks = wait_for(lambda: len(found := [pid for pid in children(parent.pid) if "spawn_main" in cmdline(pid)]) == 2
                     and found, parent, "two spawned ranks")
    kill_9(parent)
    assert wait_until_gone(ranks) == []
    assert not list(marks.glob("started_*")), "a rank started its work after its parent had died"


ARMED_CHILD = """
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1]])
    print(child.pid, flush=True)
    time.sleep(120)
"""
ARM_THEN_SLEEP = """
import sys, time
from pipeline.parallel import lifetime
{setup}
print(lifetime.exit_with_parent(parent_pid={parent_pid}), flush=True)
time.sleep(120)
"""
NO_PRCTL = "lifetime._load_prctl = lambda: None  # as on a system without prctl"


@pytest.mark.parametrize(("setup", "mechanism"), [("", "prctl"), (NO_PRCTL, "poll")], ids=["prctl", "poll"])
def test_an_armed_child_dies_with_its_parent(tmp_path, setup, mechanism):
    parent = start_parent(tmp_path, ARMED_CHILD, ARM_THEN_SLEEP.format(setup=setup, parent_pid=None))
    child = int(parent.stdout.readline())
    assert parent.stdout.readline().strip() == mechanism  # armed
    kill_9(parent)
    assert wait_until_gone([child], timeout_s=max(GONE_WITHIN_S, 4 * POLL_S)) == []


@pytest.mark.parametrize("setup", ["", NO_PRCTL], ids=["prctl", "poll"])
def test_a_child_whose_parent_is_already_gone_dies_when_it_arms(setup):
    # Parent pid 1 stands for "the parent I was started by": it is not our parent any more.
    result = subprocess.run([sys.executable, "-c", ARM_THEN_SLEEP.format(setup=setup, parent_pid=1)], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout) == (-signal.SIGKILL, "")


LAUNCHER_PARENT = """
    import sys
    from pipeline.launch import task

    # The node role running a launcher (torchrun in a job; here a stand-in that sleeps).
    task._run_ranks([sys.executable, "-c", "import time; print('launched', flush=True); time.sleep(120)"],
                    signals=task._Signals())
"""


def test_a_node_roles_launcher_dies_with_it(tmp_path):
    parent = start_parent(tmp_path, LAUNCHER_PARENT)
    assert parent.stdout.readline().strip() == "launched"
    launchers = children(parent.pid)
    assert len(launchers) == 1
    kill_9(parent)
    assert wait_until_gone(launchers) == []


TORCHRUN_STAND_IN = """
    import subprocess, sys, time
    # Stands in for torchrun: starts one rank of the ``worker`` role, whose stage sleeps.
    rank = subprocess.Popen([sys.executable, "-c", sys.argv[1]])
    print(rank.pid, flush=True)
    time.sleep(120)
"""
WORKER_ROLE = """
import time, types
from pipeline.launch import task

stage = types.SimpleNamespace(kind="rl")  # a kind that writes megatron checkpoints: its writers are armed too
task.CampaignPlan = types.SimpleNamespace(load=lambda campaign_dir: types.SimpleNamespace(stage=lambda name: stage))
task.run_worker = lambda stage: print("training", flush=True) or time.sleep(120)
task.run_role("worker", campaign_dir="unused", stage_name="rl")
"""


def test_a_worker_role_rank_dies_with_its_torchrun(tmp_path):
    parent = start_parent(tmp_path, TORCHRUN_STAND_IN, WORKER_ROLE)
    rank = int(parent.stdout.readline())
    wait_for(lambda: parent.stdout.readline().strip() == "training", parent, "the stage")  # after megatron's warnings
    kill_9(parent)
    assert wait_until_gone([rank]) == []


MEGATRON_SAVER = """
    import multiprocessing, sys
    from functools import partial

    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from pipeline.parallel import lifetime

    if __name__ == "__main__":
        lifetime.megatron_checkpoint_writers_die_with_this_process()
        lifetime.megatron_checkpoint_writers_die_with_this_process()  # idempotent
        queue = filesystem_async._get_write_results_queue()  # megatron's manager, as at the first save
        # One writer, as megatron forks it per write bucket; it blocks opening a FIFO no one reads,
        # as a writer blocks on a slow shared filesystem.
        fork = multiprocessing.get_context("fork")
        writer = fork.Process(target=partial(filesystem_async.FileSystemWriterAsync.write_preloaded_data, []),
                              kwargs=dict(local_proc_idx=0, write_bucket=(sys.argv[1], "key", ([], [])),
                                          results_queue=fork.Queue(), count_queue=fork.JoinableQueue(),
                                          use_fsync=False))
        writer.start()
        print("helpers", queue._manager._process.pid, writer.pid, flush=True)
        writer.join()
"""


def test_megatrons_checkpoint_helpers_die_with_the_saving_process(tmp_path):
    fifo = tmp_path / "bucket_0.distcp"
    os.mkfifo(fifo)
    parent = start_parent(tmp_path, MEGATRON_SAVER, str(fifo))
    line = wait_for(lambda: (text := parent.stdout.readline()).startswith("helpers") and text, parent,
                    "megatron's manager and a writer")  # after megatron's import warnings
    helpers = [int(pid) for pid in line.split()[1:]]
    assert len(helpers) == 2 and all(alive(pid) for pid in helpers), line
    kill_9(parent)
    assert wait_until_gone(helpers) == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the death signal with prctl")
def test_a_torchrun_rank_arms_its_death_signal_and_a_process_from_a_shell_does_not():
    probe = ("import ctypes, signal; from pipeline.parallel.rendezvous import exit_with_torchrun; "
             "armed = exit_with_torchrun(); libc = ctypes.CDLL(None, use_errno=True); value = ctypes.c_int(0); "
             "libc.prctl(2, ctypes.byref(value), 0, 0, 0); print(armed, value.value)")  # 2: PR_GET_PDEATHSIG
    environment = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_RUN_ID"} | {"PYTHONPATH": str(REPO)}
    outputs = [subprocess.run([sys.executable, "-c", probe], env=env, cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.split()
               for env in (environment, {**environment, "TORCHELASTIC_RUN_ID": "job-1"})]
    assert outputs == [["False", "0"], ["True", str(int(signal.SIGKILL))]]


def test_another_megatron_without_the_wrapped_functions_still_saves(monkeypatch, caplog):
    """A megatron-core that renamed what the helper wraps: a warning, never a failed checkpoint."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from pipeline.parallel import lifetime

    monkeypatch.delattr(filesystem_async, "_get_write_results_queue")
    monkeypatch.setattr(lifetime, "_MEGATRON_UNWRAPPED_WARNED", False)
    with caplog.at_level("WARNING", logger="pipeline.parallel.lifetime"):
        lifetime.megatron_checkpoint_writers_die_with_this_process()
        lifetime.megatron_checkpoint_writers_die_with_this_process()
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
    assert "may outlive a kill -9" in caplog.records[0].message
