"""GradingPool: per-item deadlines with SIGKILL, memory caps, replacement, clean shutdown.

Every stuck or hostile input here is real: math-verify really hangs on it.
"""

import contextlib
import math
import os
import signal
import threading
import time

import psutil
import pytest

from pipeline.rewards import Grade, GradingPool, Reason, grade

# Inputs that math-verify does not finish within seconds (without its own alarm).
STUCK = [
    "\\boxed{9^{9^{9^9}}}",
    # https://github.com/huggingface/Math-Verify/issues/65
    "\\boxed{\\dfrac{5^{\\left(5^{\\left(5^{\\left(5^5\\right)}\\right)} - 4\\right)} - 5}{16}}",
    "\\boxed{(10^8)!}",
]
# Items that need math-verify (the fast path cannot decide them), with their verdicts.
SYMBOLIC = [
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", Reason.CORRECT),
    ("\\boxed{\\{1,2\\}}", "\\{2,1\\}", Reason.CORRECT),
    ("the final answer is 42", "42", Reason.CORRECT),
    ("\\boxed{(x+1)^2}", "x^2+2x+1", Reason.CORRECT),
    ("\\boxed{\\sqrt{2}}", "2", Reason.WRONG),
    ("\\boxed{[0,1]}", "(0,1]", Reason.WRONG),
    ("nothing to see", "2", Reason.NO_ANSWER),  # no box: math-verify extraction
]
# Items the fast path decides in the parent.
PLAIN = [
    ("\\boxed{\\frac{1}{2}}", "0.5", Reason.CORRECT),
    ("\\boxed{12}", "1.2", Reason.WRONG),
    ("\\boxed{x=2}", "2", Reason.CORRECT),
]
# Grading slack on a loaded 2-core CI machine: respawns, pipes, sympy work.
SLACK_S = 3.0


@pytest.fixture(scope="module")
def pool():
    with GradingPool(2, deadline_s=2.0, memory_limit_mb=1024) as pool:
        yield pool


def _descendants_are_clean(within_s: float = 5.0):
    """No zombie among this process's descendants, once their parents had ``within_s`` to reap them.

    A killed worker is a zombie until the forkserver that started it reaps it, asynchronously: on
    a loaded machine that can be later than ``join`` returns here. One that stays is the bug.
    """
    deadline = time.monotonic() + within_s
    while True:
        zombies = []
        for child in psutil.Process().children(recursive=True):
            try:
                if child.status() == psutil.STATUS_ZOMBIE:
                    zombies.append(child.pid)
            except psutil.NoSuchProcess:
                pass  # reaped between the listing and the question
        if not zombies or time.monotonic() > deadline:
            return not zombies
        time.sleep(0.1)


def test_batch_matches_in_process_grading_in_order(pool):
    items = (SYMBOLIC + PLAIN) * 3
    before = pool.metrics
    results = pool.grade_batch([(response, gold) for response, gold, _ in items])
    assert [result.reason for result in results] == [reason for _, _, reason in items]
    assert results == [grade(response, gold) for response, gold, _ in items]
    after = pool.metrics
    # The plain items never left the parent process.
    assert after["num_fast_path"] - before["num_fast_path"] == len(PLAIN) * 3
    assert after["num_math_verify"] - before["num_math_verify"] == len(SYMBOLIC) * 3


def test_empty_batch(pool):
    assert pool.grade_batch([]) == []


def test_stuck_items_are_killed_at_the_deadline_and_the_rest_is_graded(pool):
    # Four adjacent stuck items land in one chunk; idle workers steal the ones not
    # started yet, so they cost ceil(4 / 2) deadlines, not four.
    stuck = [*STUCK, STUCK[0]]
    items = [(response, "5", Reason.TIMEOUT) for response in stuck] + SYMBOLIC + PLAIN
    before = pool.metrics
    start = time.monotonic()
    results = pool.grade_batch([(response, gold) for response, gold, _ in items])
    elapsed = time.monotonic() - start
    bound = math.ceil(len(stuck) / pool.num_workers) * pool.deadline_s + SLACK_S
    assert elapsed < bound, (elapsed, bound)
    assert [result.reason for result in results] == [reason for _, _, reason in items]
    assert results[0] == Grade(0.0, Reason.TIMEOUT, "9^{9^{9^9}}")
    after = pool.metrics
    assert after["num_stolen"] > before["num_stolen"]
    # Each kill was followed by a replacement, and the pool still works.
    assert after["num_worker_starts"] - before["num_worker_starts"] == len(stuck)
    assert len(pool.worker_pids) == pool.num_workers
    assert pool.grade_batch([("\\boxed{2\\sqrt{2}}", "\\sqrt{8}")])[0].reason is Reason.CORRECT
    assert _descendants_are_clean()


def test_one_stuck_item_does_not_cost_the_rest_of_its_chunk():
    # One worker, one chunk: the stuck item goes first and the seven behind it are
    # re-dispatched to the replacement after the kill.
    followers = (SYMBOLIC + PLAIN)[:7]
    with GradingPool(1, deadline_s=2.0, chunk_size=8, memory_limit_mb=None) as pool:
        start = time.monotonic()
        results = pool.grade_batch([(STUCK[0], "5")] + [(r, g) for r, g, _ in followers])
        elapsed = time.monotonic() - start
    assert elapsed < pool.deadline_s + SLACK_S
    assert results[0].reason is Reason.TIMEOUT
    assert [result.reason for result in results[1:]] == [reason for _, _, reason in followers]


def test_memory_bomb_hits_the_cap_and_the_worker_is_replaced():
    # 2^{2^{30}} maps ~0.7 GB and takes ~8 s uncapped; under a 128 MB cap the
    # allocation fails, math-verify swallows the MemoryError, and the peak RSS tells.
    items = [
        ("\\boxed{2^{2^{30}}}", "5"),
        ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}"),
        ("\\boxed{2^{1073741824}}", "2^{2^{30}}"),  # equal, but not gradable under the cap
        ("\\boxed{\\sqrt{9}}", "\\sqrt{3^2}"),  # math-verify (not the fast path) decides it
    ]
    with GradingPool(1, deadline_s=30.0, memory_limit_mb=128) as pool:
        start = time.monotonic()
        results = pool.grade_batch(items)
        elapsed = time.monotonic() - start
        metrics = pool.metrics
    assert [result.reason for result in results] == [
        Reason.MEMORY,
        Reason.CORRECT,
        Reason.MEMORY,
        Reason.CORRECT,
    ]
    assert results[0] == Grade(0.0, Reason.MEMORY, "2^{2^{30}}")
    assert metrics["worker_peak_rss_mb"] < 128
    assert metrics["num_worker_starts"] == 3  # each memory item retired its worker
    assert elapsed < 15.0


def test_memory_cap_below_the_worker_baseline_is_refused_at_construction():
    with pytest.raises(ValueError, match="memory_limit_mb=8 is too small"):
        GradingPool(1, memory_limit_mb=8)


def _kill_busy_worker_soon(pool, signum):
    def killer():
        time.sleep(0.5)
        for pid in pool.worker_pids:
            os.kill(pid, signum)

    thread = threading.Thread(target=killer)
    thread.start()
    return thread


@pytest.mark.parametrize(
    ("signum", "reason"), [(signal.SIGKILL, Reason.MEMORY), (signal.SIGTERM, Reason.WORKER_ERROR)]
)
def test_a_worker_killed_from_outside_fails_only_its_current_item(signum, reason):
    # A SIGKILL the pool did not send is what the kernel OOM killer does.
    with GradingPool(1, deadline_s=30.0, chunk_size=4, memory_limit_mb=None) as pool:
        killer = _kill_busy_worker_soon(pool, signum)
        start = time.monotonic()
        results = pool.grade_batch([(STUCK[0], "5"), ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}")])
        killer.join()
        assert time.monotonic() - start < 10.0
        assert results == [
            Grade(0.0, reason, "9^{9^{9^9}}"),
            Grade(1.0, Reason.CORRECT, "2\\sqrt{2}"),
        ]
        assert pool.grade_batch([("\\boxed{3}", "\\sqrt{9}")])[0].reason is Reason.CORRECT


def test_model_output_is_never_executed_in_workers(pool, tmp_path):
    marker = tmp_path / "pwned"
    responses = [
        f"__import__('os').system('touch {marker}')",
        f'\\boxed{{__import__("os").system("touch {marker}")}}',
        f"final answer is 1+__import__('os').system('touch {marker}')",
    ]
    results = pool.grade_batch([(response, "5") for response in responses])
    assert all(result.score == 0.0 and not result.is_correct for result in results)
    assert not marker.exists()


def test_adversarial_batch_returns_within_the_deadline_arithmetic(pool):
    adversarial = [
        "x" * 1_000_000 + "\\boxed{5}",
        "{" * 1_000_000,
        "\\boxed{1\x00}",
        "\x00" * 100_000,
        "\\boxed{" * 1000,
        "\\boxed{" + "(" * 3000 + "1" + ")" * 3000 + "}",
        STUCK[2],
    ]
    start = time.monotonic()
    results = pool.grade_batch([(response, "5") for response in adversarial])
    elapsed = time.monotonic() - start
    assert elapsed < math.ceil(1 / pool.num_workers) * pool.deadline_s + SLACK_S
    assert results[0].reason is Reason.CORRECT
    assert results[-1].reason is Reason.TIMEOUT
    assert all(result.extracted is None or len(result.extracted) <= 8192 for result in results)


def test_spawn_start_method_works():
    with GradingPool(1, deadline_s=30.0, start_method="spawn") as pool:
        assert pool.grade_batch([("\\boxed{2\\sqrt{2}}", "\\sqrt{8}")])[0].reason is Reason.CORRECT


def test_close_joins_workers_and_leaves_no_zombies():
    pool = GradingPool(2, deadline_s=5.0)
    pids = pool.worker_pids
    assert len(pids) == 2
    pool.close()
    pool.close()  # idempotent
    assert not any(psutil.pid_exists(pid) for pid in pids)  # joined: reaped, not zombies
    assert _descendants_are_clean()
    with pytest.raises(RuntimeError, match="closed"):
        pool.grade_batch([("\\boxed{1}", "1")])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_workers": 0}, "num_workers"),
        ({"deadline_s": 0.0}, "deadline_s"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"start_method": "fork"}, "start_method"),
        ({"format_reward": float("inf")}, "format_reward"),
    ],
)
def test_invalid_configuration_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GradingPool(**{"num_workers": 1, **kwargs})


def _refuse_to_start():
    raise OSError(24, "Too many open files")


def test_idle_worker_death_is_noticed_and_items_fail_when_no_worker_can_start(monkeypatch):
    with GradingPool(1, deadline_s=30.0) as pool:
        (pid,) = pool.worker_pids
        os.kill(pid, signal.SIGKILL)  # dies between batches
        with contextlib.suppress(psutil.NoSuchProcess):
            psutil.Process(pid).wait(timeout=5)
        monkeypatch.setattr(pool, "_start_worker", _refuse_to_start)
        start = time.monotonic()
        results = pool.grade_batch([("\\boxed{2\\sqrt{2}}", "\\sqrt{8}"), ("\\boxed{1/2}", "0.5")])
        assert time.monotonic() - start < 5.0
        assert results == [
            Grade(0.0, Reason.WORKER_ERROR, "2\\sqrt{2}"),
            Grade(1.0, Reason.CORRECT, "1/2"),  # the fast path needs no worker
        ]
