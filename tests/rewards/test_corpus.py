"""winnow's adversarial grading corpus (``grading_corpus.jsonl``): every case must grade as labelled.

Each line is one case: ``response``, ``gold``, optional ``problem``, ``expected``
(``correct``/``wrong``), the ``rule`` it exercises, optional ``reason`` (the exact
``Reason`` a rejected hack must carry) and its ``source``. Categories:

* ``equivalent``: MATH-500 reference answers as given and rewritten in equivalent forms
  (every answer type: integers, fractions, decimals, radicals, pi, degrees, intervals,
  tuples, matrices, complex numbers, bases, text and multiple choice), GSM8K answers
  and full reference solutions, the number forms of ``docs/grading.md``;
* ``wrong``: the same answers changed in value, near misses of the tolerance rule, of
  lists written as several boxes and of unboxed expressions;
* ``hack``: unevaluated arithmetic (boxed, unboxed, GSM8K calculator annotations),
  expressions and fractions copied from the question;
* ``math-verify``: the test inputs of huggingface/Math-Verify (``tests/test_all.py``,
  ``tests/test_numina_cases.py``, ``tests/test_open_thoughts.py``) with the verdict its
  tests expect, except where winnow decides otherwise on purpose: those cases keep
  math-verify's verdict in ``math_verify_expected`` and name winnow's rule (the last
  box is the answer, a comma is not a decimal point, unevaluated arithmetic, ...).

Graded in one batch through the pool, as the RL loop grades (3,140 cases, 763 of them
reach sympy; 5-15 s on the shared 2-core build machine, load ~2-7).
"""

from __future__ import annotations

import collections
import json
from pathlib import Path

import pytest

from pipeline.rewards import GradingPool

CORPUS = Path(__file__).with_name("grading_corpus.jsonl")
CATEGORIES = {"equivalent", "wrong", "hack", "math-verify"}


def _cases() -> list[dict]:
    with CORPUS.open(encoding="utf-8") as lines:
        return [json.loads(line) for line in lines]


@pytest.fixture(scope="module")
def graded() -> list[tuple[dict, object]]:
    cases = _cases()
    with GradingPool(2, deadline_s=5.0) as pool:
        grades = pool.grade_batch([(case["response"], case["gold"], case.get("problem")) for case in cases])
    return list(zip(cases, grades))


def test_every_case_is_labelled_with_its_rule_and_source():
    cases = _cases()
    assert len(cases) > 2500
    for case in cases:
        assert case["category"] in CATEGORIES and case["expected"] in ("correct", "wrong"), case
        assert case["rule"] and case["source"], case
        assert "reason" not in case or case["expected"] == "wrong", case
    counts = collections.Counter((case["category"], case["expected"]) for case in cases)
    assert counts[("equivalent", "correct")] and counts[("wrong", "wrong")] and counts[("hack", "wrong")]
    assert counts[("math-verify", "correct")] and counts[("math-verify", "wrong")]


def test_the_grader_agrees_with_every_label(graded):
    disagreements = [
        (case["rule"], case["response"][-120:], case["gold"], case["expected"], grade.reason.value)
        for case, grade in graded
        if grade.is_correct != (case["expected"] == "correct")
        or ("reason" in case and grade.reason.value != case["reason"])
    ]
    assert not disagreements, f"{len(disagreements)} of {len(graded)} disagree: {disagreements[:20]}"


def test_extracted_answers_are_verbatim_substrings_of_the_response(graded):
    for case, grade in graded:
        assert grade.extracted is None or grade.extracted in case["response"], (case, grade)
