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


@pytest.mark.slow
@pytest.mark.timeout(1000)
def test_tiny_cpu_campaign_runs_then_skips(tmp_path):
    first = _launch("--recipe", "cpu-tiny", "--executor", "local", "--output-dir", str(tmp_path))
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-4000:]
    stages = json.loads((tmp_path / "status.json").read_text())["stages"]
    assert {name: record["state"] for name, record in stages.items()} == dict.fromkeys(
        ["bootstrap", "curate", "train-estimator", "rl-default", "evaluate-default", "export-default", "rl-grpo",
         "evaluate-grpo", "export-grpo", "rl-methods", "evaluate-methods", "export-methods"], "done")
    for variant in ("default", "grpo", "methods"):
        assert (tmp_path / "rl" / variant / "checkpoints" / "step_00000002").is_dir()
        assert json.loads((tmp_path / "eval" / variant / "results.json").read_text())["benchmarks"]
        assert (tmp_path / "export" / variant / "config.json").is_file()
    assert (tmp_path / "curate" / "kept.jsonl").stat().st_size > 0

    again = _launch("--recipe", "cpu-tiny", "--executor", "local", "--output-dir", str(tmp_path))
    assert again.returncode == 0 and again.stdout.count("done before, skipped") == 12, again.stdout


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
