"""The other cluster campaigns rehearse on this machine (NeMo-Run's local executor: a process tree per stage).

Qwen2.5-Math-1.5B (TP=2 trainer, Qwen2 with tied embeddings) and Llama-3.1-8B-Instruct (TP=4,
Llama 3 RoPE scaling, 128K vocabulary, TP=2 SGLang servers rehearsed as TP-1 stand-ins), each
from its published config; the events are played by the SLURM rehearsal of the 7B campaign.
About 3-4 minutes and 190-280 CPU-seconds each on 2 cores, alone.

In `make test` they run in the second pass, each on a worker of its own, as a process tree at a
lower CPU priority (``REHEARSAL_NICENESS``): the SLURM rehearsal beside them is that pass's
longest queue and mostly waits on the dev cluster's scheduling and its signal events, so the two
campaigns take the cores it leaves idle instead of stretching it (docs/testing.md).
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


@pytest.mark.parametrize("recipe", [
    # One xdist group each: two workers, so the two campaigns share whatever cores the pass leaves.
    pytest.param("qwen25-math-1.5b", marks=pytest.mark.xdist_group("rehearsal-qwen25-math-1.5b")),
    pytest.param("llama31-8b", marks=pytest.mark.xdist_group("rehearsal-llama31-8b")),
])
def test_the_campaign_rehearses_here(recipe, tmp_path):
    out = tmp_path / recipe
    result = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "launch", "campaign", "--recipe", recipe, "--rehearse",
         "--rehearse-events", "off", "--rehearsal-dir", str(out)],
        cwd=REPO, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=1700, check=False,
        preexec_fn=_lower_priority)
    report_file = out / "report.txt"
    report = report_file.read_text() if report_file.is_file() else result.stdout[-4000:] + result.stderr[-4000:]
    print(report)
    assert result.returncode == 0, report + result.stderr[-4000:]
    rows = dict(re.findall(r"^(\S+)\s+(PASS|FAIL|not run)\s", report, flags=re.M))
    assert rows and set(rows.values()) == {"PASS"}, report
    assert {"convert", "curate", "rl-default", "rl-grpo", "evaluate-default", "export-grpo"} <= set(rows)
