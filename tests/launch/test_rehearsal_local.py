"""The other cluster campaigns rehearse on this machine (NeMo-Run's local executor: a process tree per stage).

Qwen2.5-Math-1.5B (TP=2 trainer, Qwen2 with tied embeddings) and Llama-3.1-8B-Instruct (TP=4,
Llama 3 RoPE scaling, 128K vocabulary, TP=2 SGLang servers rehearsed as TP-1 stand-ins), each
from its published config; the events are played by the SLURM rehearsal of the 7B campaign.
About 2.5-4 minutes and 135-200 CPU-seconds each on 2 cores: `make test-rehearsals`, not `make test`
(in its second pass the suite took 26.9-27.8 minutes on 2 cores; docs/testing.md).
"""

from __future__ import annotations

import re

import pytest

from pipeline.cli import main as winnow

pytestmark = [pytest.mark.slow, pytest.mark.rehearsal, pytest.mark.timeout(1800)]


@pytest.mark.parametrize("recipe", ["qwen25-math-1.5b", "llama31-8b"])
def test_the_campaign_rehearses_here(recipe, tmp_path):
    out = tmp_path / recipe
    code = winnow(["launch", "campaign", "--recipe", recipe, "--rehearse", "--rehearse-events", "off",
                   "--rehearsal-dir", str(out)])
    report = (out / "report.txt").read_text()
    print(report)
    assert code == 0, report
    rows = dict(re.findall(r"^(\S+)\s+(PASS|FAIL|not run)\s", report, flags=re.M))
    assert rows and set(rows.values()) == {"PASS"}, report
    assert {"convert", "curate", "rl-default", "rl-grpo", "evaluate-default", "export-grpo"} <= set(rows)
