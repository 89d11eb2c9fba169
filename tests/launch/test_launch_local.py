"""`winnow launch campaign --executor local` end to end on the tiny CPU campaign, as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _launch(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", "launch", "campaign", *args], cwd=REPO,
                          capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=900, check=False)


CPU_TINY_STAGES = ["bootstrap", "curate", "train-estimator", "rl-default", "evaluate-default", "export-default",
                   "rl-grpo", "evaluate-grpo", "export-grpo", "rl-methods", "evaluate-methods", "export-methods"]


# Every stage kind runs through this launcher, end to end, in the in-process rehearsals of the cluster
# campaigns (tests/launch/test_rehearsal_local.py), and the CPU campaign's stages in process in
# tests/launch/test_demo.py; this test keeps what is the launcher's own: a relaunch runs the stages
# not done and skips the rest.
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_relaunch_runs_the_stages_not_done_and_skips_the_rest(tmp_path):
    from pipeline.launch.campaign import CampaignStatus

    status = CampaignStatus(tmp_path)
    for name in CPU_TINY_STAGES[1:]:
        status.update(name, "done")
    result = _launch("--recipe", "cpu-tiny", "--executor", "local", "--output-dir", str(tmp_path))
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert result.stdout.count("done before, skipped") == len(CPU_TINY_STAGES) - 1, result.stdout
    assert "bootstrap: running" in result.stdout and "bootstrap: done" in result.stdout, result.stdout
    stages = json.loads((tmp_path / "status.json").read_text())["stages"]
    assert set(stages) == set(CPU_TINY_STAGES)
    assert stages["bootstrap"]["state"] == "done" and stages["bootstrap"]["attempts"] == 1
    assert all(stages[name]["attempts"] == 0 for name in CPU_TINY_STAGES[1:])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_failing_stage_stops_its_dependents_and_the_launch_exits_non_zero(tmp_path):
    result = _launch("--recipe", "cpu-tiny", "--executor", "local", "--output-dir", str(tmp_path),
                     f'bootstrap.sources=["{tmp_path}/missing.jsonl"]')
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    stages = json.loads((tmp_path / "status.json").read_text())["stages"]
    assert stages["bootstrap"]["state"] == "failed"
    assert all(record["state"] == "pending" and record["attempts"] == 0
               for name, record in stages.items() if name != "bootstrap")
    assert "did not finish: failed bootstrap" in result.stderr
