"""A benchmark spec that cannot be satisfied ends `winnow evaluate` with one ``error:`` line, exit 2.

``arith`` at difficulty 1 holds 162 problems, about 8 of them in the 5% test split: asking
for 40 used to end in a ``ValueError`` traceback from ``pipeline/data/synthetic.py``, as did a
difficulty above 5, which the spec parser lets through to the generator. Both are the user's
spec, so they are ``DataError``s (a ``UserError``), which the CLI prints as one line.

In process (``pipeline.cli.main``): the error comes before any generation, so a subprocess
would only add its startup. Runtime: about 5 s with the policy fixture.
"""

from __future__ import annotations

import re

import pytest

from pipeline import cli
from tests.stages.test_evaluate import hf_policy  # noqa: F401 - a fixture


@pytest.mark.parametrize(("spec", "message"), [
    ("arith?difficulty=1&size=40",
     r"arith at difficulty 1 has only about (\d+) distinct problems in split 'test', not 40 .*ask for size <= \1"),
    ("arith?difficulty=9&size=4", r"arith: difficulty must be an integer in 1\.\.5, got 9"),
])
def test_an_unsatisfiable_synthetic_benchmark_is_one_error_line(
        tmp_path, capsys, hf_policy, spec, message):  # noqa: F811
    code = cli.main(["evaluate", str(hf_policy), f"output_dir={tmp_path}", f'eval.benchmarks=["{spec}"]',
                     "progress=false", "eval.max_new_tokens=8"])
    err = capsys.readouterr().err
    assert code == cli.EXIT_USER_ERROR, err
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: ") and re.search(message, last), err
