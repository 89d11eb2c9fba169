"""Grading under an adversarial corpus: every item gets a Grade in bounded time and memory.

``tests/rewards/test_pool.py`` already proves, one fault at a time: stuck sympy items
are killed at the deadline (``9^{9^{9^9}}``, ``(10^8)!``), the ``2^{2^{30}}`` memory bomb
hits the worker cap, a ``__import__('os').system`` response is not executed, megabyte
and NUL inputs return. This file throws the whole corpus at one pool, on the response
*and* on the gold side, plus what those tests lack (code-shaped strings with
``eval``/``exec``/``lambda``, 5,000-level nesting, unbalanced braces, control
characters inside boxes), and checks the pool as a whole: the batch time obeys the
deadline arithmetic of ``pipeline/rewards/pool.py``, the parent's RSS stays bounded,
nothing is executed, and the same pool then grades a normal item correctly.
"""

from __future__ import annotations

import math
import os
import time

import psutil
import pytest

from pipeline.rewards import Grade, GradingPool, Reason

MARKER = "/tmp/PWNED_winnow"
DEEP = 5_000


def _corpus() -> list[tuple[str, str]]:
    """(id, text) pairs; each text is graded as a response against "5" and as a gold answer."""
    code = [
        f"__import__('os').system('touch {MARKER}')",
        f"\\boxed{{__import__('os').system('touch {MARKER}')}}",
        f"\\boxed{{eval(\"__import__('os').system('touch {MARKER}')\")}}",
        f"\\boxed{{exec(\"open('{MARKER}', 'w')\")}}",
        f"The answer is \\boxed{{(lambda: __import__('os').system('touch {MARKER}'))()}}",
        "\\boxed{lambda x: x**x**x**x}",
        f"\\boxed{{().__class__.__base__.__subclasses__()}} and open('{MARKER}','w')",
        f"\\boxed{{5}} ; import os; os.system('touch {MARKER}')",
        "\\boxed{__builtins__['eval']('5')}",
        "\\boxed{compile('1', '', 'eval')}",
    ]
    huge = [
        "\\boxed{9^{9^{9^9}}}",
        "\\boxed{(10^8)!}",
        "\\boxed{2^{2^{30}}}",
        "\\boxed{10^{10^{10^{10}}}}",
        "\\boxed{\\dfrac{5^{\\left(5^{\\left(5^{\\left(5^5\\right)}\\right)} - 4\\right)} - 5}{16}}",
    ]
    nesting = [
        "\\boxed{" + "{" * DEEP + "5" + "}" * DEEP + "}",
        "\\boxed{" + "(" * DEEP + "5" + ")" * DEEP + "}",
        "\\boxed{" + "\\frac{1}{" * DEEP + "5" + "}" * DEEP + "}",
        "\\boxed{" + "\\sqrt{" * DEEP + "5" + "}" * DEEP + "}",
        "\\boxed{" + "[" * DEEP + "5" + "]" * DEEP + "}",
    ]
    malformed = [
        "\\boxed{5",
        "\\boxed{5}}}}}}",
        "}}}}\\boxed{5}{{{{",
        "\\boxed{\\left( 5 \\right.}",
        "\\boxed{\\frac{1}{}",
        "\\boxed{\\begin{matrix} 1 & 2 \\end{pmatrix}}",
        "\\boxed{}",
        "\\boxed{\\\\\\\\}",
    ]
    bytes_ = [
        "\\boxed{5\x00}",
        "\\boxed{\x01\x02\x03\x1b[31m5\x1b[0m}",
        "\\boxed{5}\x00" * 10_000,
        "".join(chr(c) for c in range(32)) * 1000,
        "\\boxed{\ud800}",  # a lone surrogate: not encodable as UTF-8
        "\\boxed{\u202e5\u202c}",  # right-to-left override
        "\\boxed{５}",  # a fullwidth digit
    ]
    large = [
        "x" * 1_000_000,
        "\\boxed{" + "9" * 1_000_000 + "}",
        "\\boxed{" + "1+" * 500_000 + "1}",
        ("\\boxed{5}" * 120_000)[:1_000_000],
    ]
    groups = {"code": code, "huge": huge, "nesting": nesting, "malformed": malformed, "bytes": bytes_,
              "large": large}
    return [(f"{name}{i}", text) for name, texts in groups.items() for i, text in enumerate(texts)]


CORPUS = _corpus()
NUM_WORKERS = 2
DEADLINE_S = 2.0
# Respawns through the forkserver, pipes and the parent's fast path over ~10 MB of text,
# on a loaded 2-core CI machine.
SLACK_S = 10.0
# The parent holds the corpus (~10 MB of str, up to 4 bytes a character) and the Grades.
PARENT_RSS_GROWTH_LIMIT_MB = 200


@pytest.fixture(scope="module")
def pool():
    with GradingPool(NUM_WORKERS, deadline_s=DEADLINE_S, memory_limit_mb=1024) as pool:
        yield pool


def _marker_exists() -> bool:
    return os.path.exists(MARKER)


@pytest.mark.slow
@pytest.mark.parametrize("side", ["response", "gold"])
def test_adversarial_corpus_is_graded_within_the_deadline_arithmetic(pool, side):
    assert not _marker_exists(), f"{MARKER} exists before the test; remove it"
    pairs = [(text, "5") if side == "response" else ("\\boxed{5}", text) for _, text in CORPUS]
    parent = psutil.Process()
    rss_before_mb = parent.memory_info().rss / 2**20
    timeouts_before = pool.metrics["num_timeouts"]
    start = time.monotonic()
    results = pool.grade_batch(pairs)
    elapsed = time.monotonic() - start
    rss_after_mb = parent.memory_info().rss / 2**20

    assert len(results) == len(CORPUS)
    assert all(isinstance(result, Grade) for result in results)
    assert all(result.score in (0.0, 1.0) for result in results)
    num_timeouts = pool.metrics["num_timeouts"] - timeouts_before
    # pool.py: a batch costs about ceil(num_stuck / num_workers) deadlines plus normal work.
    assert elapsed < math.ceil(num_timeouts / NUM_WORKERS) * DEADLINE_S + SLACK_S, (elapsed, num_timeouts)
    assert rss_after_mb - rss_before_mb < PARENT_RSS_GROWTH_LIMIT_MB
    assert not _marker_exists()
    by_id = dict(zip((name for name, _ in CORPUS), results))
    if side == "response":
        # Code is never an answer (code7's box holds a plain 5 and its trailing code is inert);
        # the stuck towers are cut off, not graded as wrong or right.
        assert [i for i in range(10) if by_id[f"code{i}"].is_correct] == [7]
        assert by_id["huge0"].reason in (Reason.TIMEOUT, Reason.MEMORY)
        assert by_id["huge2"].reason in (Reason.TIMEOUT, Reason.MEMORY)
        assert by_id["malformed1"].reason is Reason.CORRECT  # extra closing braces after the box
        assert by_id["large0"].reason is Reason.NO_ANSWER
    else:
        assert [i for i in range(10) if by_id[f"code{i}"].is_correct] == [7]
        assert by_id["large0"].reason is Reason.INVALID_GOLD

    # The pool survived: every worker slot is alive and grades a normal symbolic item.
    after = pool.grade_batch([("\\boxed{2\\sqrt{2}}", "\\sqrt{8}"), ("\\boxed{\\frac{1}{2}}", "0.5")])
    assert [grade.reason for grade in after] == [Reason.CORRECT, Reason.CORRECT]
    assert len(pool.worker_pids) == NUM_WORKERS
    assert all(psutil.pid_exists(pid) for pid in pool.worker_pids)
