"""Verifiable rewards: ``grade()`` that never raises, and a bounded ``GradingPool``.

Public API::

    from pipeline.rewards import Grade, GradingPool, Reason, grade

    grade(response, gold, format_reward=0.0, timeout_s=5.0) -> Grade   # in-process
    with GradingPool(num_workers, deadline_s=5.0, memory_limit_mb=1024) as pool:
        grades = pool.grade_batch([(response, gold), ...])            # list[Grade]

``Grade(score, reason, extracted)``; ``reason`` is a ``Reason`` (a ``str``):
correct, wrong, no_answer, parse_error, invalid_gold, timeout, memory, worker_error.
"""

from pipeline.rewards.extract import last_boxed
from pipeline.rewards.grader import Grade, GradeOptions, Reason, grade
from pipeline.rewards.pool import GradingPool

__all__ = ["Grade", "GradeOptions", "GradingPool", "Reason", "grade", "last_boxed"]
