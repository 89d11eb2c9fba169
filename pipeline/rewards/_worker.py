"""The grading worker process: ``worker_main`` runs in each ``GradingPool`` process.

The forkserver preloads this module (through ``_forkserver``), so importing it must load
everything a worker needs (math-verify, sympy, the antlr LaTeX parser): new workers then
fork from a warm server in milliseconds instead of paying the ~0.5 s import after every SIGKILL.

Protocol over a duplex ``Connection`` (picklable primitives only, never sympy objects):

    parent -> worker  ("grade", [(item_id, answer, response_tail, gold, has_box), ...])
                      ("revoke", [item_id, ...])   # drop these if not started yet
                      ("stop",)
    worker -> parent  ("ready", baseline_mb)
                      ("init_error", message)
                      ("start", item_id)
                      ("result", item_id, score, reason, extracted, peak_rss_mb)
                      ("retire",)   # about to exit on purpose; not a crash
"""

from __future__ import annotations

import resource
import signal
import sys
from collections import deque
from multiprocessing.connection import Connection

import psutil

from pipeline.parallel.lifetime import exit_with_parent
from pipeline.rewards import grader
from pipeline.rewards.grader import GradeOptions, PendingGrade, Reason

__all__ = ["MEMORY_FLAG_FRACTION", "worker_main"]

# math-verify and sympy catch MemoryError with broad ``except Exception`` blocks, so an
# allocation refused by RLIMIT_AS usually surfaces as a plain "wrong". The peak RSS is
# what stays observable: an item that drove it above the worker's starting RSS by this
# fraction of its headroom (cap minus starting address space) is reported as
# ``memory``, and the worker retires so the next item starts from a fresh peak and an
# unfragmented heap.
MEMORY_FLAG_FRACTION = 0.5


# Answers that cover the common corners of the LaTeX grammar and of sympy. The antlr
# parser builds its prediction DFA lazily, so the first parse of each construct is
# 10-100x slower than later ones; parsing these once in the forkserver makes every
# replacement worker start close to steady-state speed.
_WARM_UP_PAIRS = (
    ("-3", "3"),
    ("2.5", "\\frac{5}{2}"),
    ("10\\%", "0.1"),
    ("30^\\circ", "\\frac{\\pi}{6}"),
    ("2\\sqrt{2}", "\\sqrt{8}"),
    ("\\sqrt[3]{2}", "2^{1/3}"),
    ("\\frac{\\sqrt{3}}{2}", "\\sin(\\pi/3)"),
    ("e^{2}", "\\exp(2)"),
    ("\\ln 2", "\\log(2)"),
    ("\\{1,2\\}", "\\{2,1\\}"),
    ("[0,1]", "(0,1]"),
    ("(-\\infty,1)\\cup(2,\\infty)", "x<1"),
    ("(y+1)^2", "y^2+2y+1"),  # simplify() and the polys machinery
    ("\\frac{x+1}{x-1}", "1+\\frac{2}{x-1}"),
    ("y=2x+1", "2x+1"),
    ("a=1,b=2", "b=2,a=1"),
    ("\\begin{pmatrix}1\\\\2\\end{pmatrix}", "\\begin{pmatrix}1\\\\2\\end{pmatrix}"),
    ("3+4i", "4i+3"),
    ("\\binom{5}{2}", "10"),
    ("0.7071", "\\frac{\\sqrt{2}}{2}"),  # numeric evalf
    ("\\left(\\frac{1}{2}\\right)^2", "\\frac14"),
    ("|x-1|", "|1-x|"),
    ("x=2", "\\text{(A)}"),
    ("12\\text{ cm}", "12"),
)
_WARM_UP_RESPONSES = (
    "The final answer is 12.",
    "So $x = 3/4$, hence the answer is $\\frac{3}{4}$.",
    "Answer: 2\\sqrt{2}",
)


def _warm_up() -> None:
    """Pay one-off costs (imports, antlr DFA construction, sympy caches) once in the
    forkserver rather than in every replacement worker. Never raises: an exception
    here would take the forkserver down with it."""
    options = GradeOptions()
    pending = [
        PendingGrade(answer=answer, response_tail="", gold=gold, has_box=True)
        for answer, gold in _WARM_UP_PAIRS
    ]
    pending += [
        PendingGrade(answer=None, response_tail=response, gold="1", has_box=False)
        for response in _WARM_UP_RESPONSES
    ]
    for item in pending:
        grader.grade_pending_guarded(item, options, timeout_s=None)


_warm_up()


def _peak_rss_mb() -> float:
    # ru_maxrss is in KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _set_memory_cap(memory_limit_mb: int | None) -> str | None:
    """Cap the address space; an error message when the cap cannot be honoured."""
    if memory_limit_mb is None:
        return None
    baseline_mb = psutil.Process().memory_info().vms / 2**20
    # Below ~1.5x the baseline the worker could not even parse a small answer.
    if memory_limit_mb < 1.5 * baseline_mb:
        return (
            f"memory_limit_mb={memory_limit_mb} is too small: a grading worker already "
            f"maps {baseline_mb:.0f} MB; use at least {int(1.5 * baseline_mb) + 1}"
        )
    limit = memory_limit_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    return None


def worker_main(conn: Connection, options: GradeOptions, memory_limit_mb: int | None) -> None:
    """Grade items from ``conn`` until told to stop or the parent goes away."""
    # Die with the parent (the forkserver, or the owner under spawn) even mid-item: nobody
    # is left to read the grade, and a stuck item would otherwise hold a core indefinitely.
    exit_with_parent(parent_pid=None)
    # Ctrl-C reaches the whole process group; the parent owns shutdown.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    error = _set_memory_cap(memory_limit_mb)
    if error is not None:
        conn.send(("init_error", error))
        return
    baseline = psutil.Process().memory_info()
    conn.send(("ready", baseline.vms / 2**20))
    flag_mb = None
    if memory_limit_mb is not None:
        headroom_mb = memory_limit_mb - baseline.vms / 2**20
        flag_mb = max(_peak_rss_mb(), baseline.rss / 2**20) + MEMORY_FLAG_FRACTION * headroom_mb
    todo: deque[tuple[int, str | None, str, str, bool]] = deque()
    while True:
        # Block for work when there is none; otherwise only drain what has arrived
        # (a revoke must be seen before the next item starts).
        while not todo or conn.poll():
            try:
                message = conn.recv()
            except EOFError:  # the parent exited or closed the pool
                return
            if message[0] == "stop":
                return
            if message[0] == "grade":
                todo.extend(message[1])
            else:
                assert message[0] == "revoke", message[0]
                revoked = set(message[1])
                todo = deque(item for item in todo if item[0] not in revoked)
        item_id, answer, response_tail, gold, has_box = todo.popleft()
        conn.send(("start", item_id))
        pending = PendingGrade(
            answer=answer, response_tail=response_tail, gold=gold, has_box=has_box
        )
        peak_before_mb = _peak_rss_mb()
        result = grader.grade_pending_guarded(pending, options, timeout_s=None)
        peak_mb = _peak_rss_mb()
        near_cap = flag_mb is not None and peak_mb >= flag_mb
        if near_cap and peak_mb > peak_before_mb and result.reason is not Reason.CORRECT:
            result = grader.failure(Reason.MEMORY, result.extracted)
        conn.send(("result", item_id, result.score, result.reason.value, result.extracted, peak_mb))
        if near_cap or result.reason is Reason.MEMORY:
            conn.send(("retire",))
            conn.close()
            sys.exit(0)
