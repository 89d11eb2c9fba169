"""The other cluster campaigns rehearse on this machine (NeMo-Run's local executor: a process tree per stage).

Qwen2.5-Math-1.5B (TP=2 trainer, Qwen2 with tied embeddings) and Llama-3.1-8B-Instruct (TP=4,
Llama 3 RoPE scaling, 128K vocabulary, TP=2 SGLang servers rehearsed as TP-1 stand-ins), each
from its published config; the events are played by the SLURM rehearsal of the 7B campaign.
Alone on 2 cores, the 1.5B one takes about 200 s and 190 CPU-seconds (its whole process tree).

In `make test` they run in the second pass, both at once from one test on one worker, as process
trees at a lower CPU priority (``REHEARSAL_NICENESS``): the SLURM rehearsal beside them is that
pass's longest queue and often waits on the dev cluster's scheduling and its signal events, so
the two campaigns take the cores it leaves idle instead of stretching it (docs/testing.md).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# CFS gives a process of niceness 10 about a tenth of a contended core's share of one at 0.
REHEARSAL_NICENESS = 10

pytestmark = [pytest.mark.slow, pytest.mark.rehearsal, pytest.mark.timeout(1800)]


def _lower_priority() -> None:
    os.nice(REHEARSAL_NICENESS)


RECIPES = ("qwen25-math-1.5b", "llama31-8b")


def test_the_campaigns_rehearse_here(tmp_path):
    # Both at once, from one test: however xdist hands out the pass's tests, the two campaigns share
    # the cores the pass leaves idle from its start, rather than one waiting behind the other.
    launches = {}
    for recipe in RECIPES:
        log = (tmp_path / f"{recipe}.log").open("w")
        launches[recipe] = (subprocess.Popen(
            [sys.executable, "-m", "pipeline.cli", "launch", "campaign", "--recipe", recipe, "--rehearse",
             "--rehearse-events", "off", "--rehearsal-dir", str(tmp_path / recipe)],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
            preexec_fn=_lower_priority), log)
    codes = {}
    try:
        for recipe, (process, _) in launches.items():
            codes[recipe] = process.wait(timeout=1700)
    finally:
        for process, log in launches.values():
            if process.poll() is None:
                process.kill()
            log.close()
    for recipe in RECIPES:
        report_file = tmp_path / recipe / "report.txt"
        report = (report_file.read_text() if report_file.is_file()
                  else (tmp_path / f"{recipe}.log").read_text()[-8000:])
        print(report)
        assert codes[recipe] == 0, f"{recipe}: exit {codes[recipe]}\n{report}"
        rows = dict(re.findall(r"^(\S+)\s+(PASS|FAIL|not run)\s", report, flags=re.M))
        assert rows and set(rows.values()) == {"PASS"}, report
        assert {"convert", "curate", "rl-default", "rl-grpo", "evaluate-default", "export-grpo"} <= set(rows), report
