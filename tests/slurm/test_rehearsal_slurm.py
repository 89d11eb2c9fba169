"""`winnow launch campaign --recipe qwen25-math-7b --rehearse --executor slurm`: the H100 campaign, whole, on the dev cluster.

Every stage runs as the SLURM job the cluster would get (sbatch/srun, the stage script, the
node and serve roles, torchrun with the recipe's TP=4, the update-group weight sync to CPU
stand-ins for SGLang), with the two events: SIGUSR1 to every task of the first rl job
(checkpoint, exit 75, requeue, resume; rows equal an uninterrupted control run) and a
SIGKILL of one stand-in during the second (restarted, re-synced before it serves again).
"""

from __future__ import annotations

import re

import pytest

from pipeline.cli import main as winnow

# serial: the session's one dev cluster; rehearsal: its own pass of `make test` (minutes of wall time).
pytestmark = [pytest.mark.slow, pytest.mark.serial, pytest.mark.rehearsal, pytest.mark.timeout(1800)]


def test_the_qwen25_math_7b_campaign_rehearses_on_slurm(launch_profile_file, slurm_cluster, tmp_path, capsys):
    out = tmp_path / "rehearsal"
    code = winnow(["launch", "campaign", "--recipe", "qwen25-math-7b", "--rehearse", "--executor", "slurm",
                   "--profile", str(launch_profile_file), "--rehearsal-dir", str(out)])
    report = (out / "report.txt").read_text()
    print(report)
    assert code == 0, report
    rows = dict(re.findall(r"^(\S+)\s+(PASS|FAIL|not run)\s", report, flags=re.M))
    assert set(rows) == {"convert", "curate", "train-estimator", "rl-default", "evaluate-default", "export-default",
                         "rl-grpo", "evaluate-grpo", "export-grpo", "rl-default-control"}, report
    assert set(rows.values()) == {"PASS"}, report
    assert "rl-default: stopped by SIGUSR1, resumed; its" in report and "scancel --signal=USR1" in report
    assert re.search(r"rl-grpo: the server on port \d+ was killed, restarted .* and re-synced", report), report
    # What the cluster is asked for: the job's CPUs, and srun told so too.
    scripts = "\n".join(path.read_text() for path in (out / "campaign").rglob("*_sbatch.sh"))
    assert "--cpus-per-task=4" in scripts and "export SRUN_CPUS_PER_TASK=4" in scripts
