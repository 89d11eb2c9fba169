"""On the real dev cluster: a user error ends the job without a requeue; a killed task is requeued.

Both jobs are rl stages launched the way ``winnow launch`` does (NeMo-Run's sbatch script with
winnow's requeue trap, ``requeues=2``). The first points at a checkpoint that does not exist
and runs two ranks under torchrun, so the rank's exit 2 must survive torchrun's rewrap to 1.
The second is SIGKILLed after its first periodic checkpoint, so srun reports 137 with no
checkpoint of its own; the trap requeues it, and the second attempt resumes from the latest
checkpoint to the last step. The other way a job is requeued, SIGUSR1 before the time limit
(checkpoint, exit 75), is played by the SLURM rehearsal of the H100 campaign
(``test_rehearsal_slurm.py``) on an rl stage with its rollout servers.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from pathlib import Path

import pytest

from pipeline.config import Resources
from pipeline.launch.campaign import CampaignPlan, CampaignStatus, Stage
from pipeline.launch.nemo import LaunchOptions, launch_campaign
from tests.slurm.cluster import START_BUDGET_S, DevCluster
from tests.slurm.test_launch_slurm import _logs, _tiny_rl_config, _trained_steps

# serial: one dev cluster for the session, started by the first test that asks for it, and
# timings (signal leads, requeue waits) that a second worker competing for the cores would skew.
pytestmark = [pytest.mark.slow, pytest.mark.serial]

FINAL_STATES = {"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY",
                "PREEMPTED", "TIMEOUT"}


def _submit(stage: Stage, *, tmp_path: Path, profile) -> int:
    plan = CampaignPlan(name="requeue", output_dir=tmp_path, stages=[stage])
    launch_campaign(plan, options=LaunchOptions(executor="slurm", profile=profile, wait=False))
    return int(CampaignStatus(tmp_path).read()[stage.name]["job_id"])


def _node_pids(campaign_dir: Path) -> list[int]:
    """The node role of this campaign's job (found by its command line, which names the campaign folder)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            words = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue  # ended meanwhile
        if b"pipeline.cli.task" in words and b"node" in words and str(campaign_dir).encode() in words:
            pids.append(int(entry.name))
    return pids


def _rows_up_to(metrics: Path, step: int) -> list[str]:
    """The metrics lines of steps 0..``step`` as written (a line cut by a kill is skipped)."""
    rows = []
    for line in metrics.read_text().splitlines():
        try:
            row_step = json.loads(line)["step"]
        except json.JSONDecodeError:
            continue
        if row_step <= step:
            rows.append(line)
    return rows


@pytest.mark.timeout(START_BUDGET_S + 300)
def test_a_user_error_through_torchrun_exits_2_and_is_not_requeued(launch_profile, slurm_cluster: DevCluster,
                                                                    tmp_path):
    missing = tmp_path / "no-such-checkpoint"
    cfg = dataclasses.replace(_tiny_rl_config(tmp_path, steps=2, cache=tmp_path / "cache"), policy=str(missing))
    stage = Stage(name="rl", kind="rl", config=cfg, resources=Resources(ranks_per_node=2, requeues=2))
    job_id = _submit(stage, tmp_path=tmp_path, profile=launch_profile)
    record = slurm_cluster.wait_for_job(job_id, lambda r: r["JobState"] in FINAL_STATES, timeout_s=240,
                                        what="finished")
    # A requeue happens before the job ends (the trap runs in it), so a final FAILED with no restart is final.
    assert (record["JobState"], record["ExitCode"], record["Restarts"]) == ("FAILED", "2:0", "0"), (
        record, _logs(tmp_path))
    status = CampaignStatus(tmp_path).read()["rl"]
    assert status["state"] == "failed" and status["attempts"] == 1, status
    # The rank's own error, carried past torchrun (which exits 1 for any failed rank): the stage's
    # input check refuses the missing policy before any work starts.
    assert status["error"].startswith("rank ") and "PreflightError" in status["error"], status
    assert str(missing) in status["error"]


def _latest_step(checkpoints: Path) -> int | None:
    try:
        return int((checkpoints / "latest").read_text().strip().removeprefix("step_"))
    except (FileNotFoundError, ValueError):
        return None  # none yet, or read while being replaced


@pytest.mark.timeout(START_BUDGET_S + 600)
def test_a_killed_task_is_requeued_and_the_job_resumes_from_its_checkpoint(launch_profile, slurm_cluster: DevCluster,
                                                                           bootstrap_cache_dir, tmp_path):
    # SIGUSR1's path (checkpoint, exit 75, requeue, resume with equal rows) is played by the SLURM
    # rehearsal of the H100 campaign (test_rehearsal_slurm.py), on an rl stage with its servers.
    # Enough steps that the kill lands mid-run: a tiny step takes tens of milliseconds on an
    # idle machine, and several could finish between a poll and the signal.
    num_steps, every = 30, 2
    cfg = _tiny_rl_config(tmp_path, steps=num_steps, cache=bootstrap_cache_dir)
    cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, every_steps=every))
    job_id = _submit(Stage(name="rl", kind="rl", config=cfg, resources=Resources(requeues=2)), tmp_path=tmp_path,
                     profile=launch_profile)
    checkpoints, metrics = Path(cfg.checkpoint.directory), tmp_path / "rl" / "metrics.jsonl"

    # Attempt 1: killed after its first periodic checkpoint.
    deadline = time.monotonic() + 400
    while not _latest_step(checkpoints):
        assert time.monotonic() < deadline, f"no checkpoint in 400 s\n{_logs(tmp_path)}"
        time.sleep(0.05)
    pids = _node_pids(tmp_path)
    assert len(pids) == 1, (pids, _logs(tmp_path))
    os.kill(pids[0], signal.SIGKILL)  # what an OOM killer or a dying rank does: no checkpoint, no exit code
    resume_step = _latest_step(checkpoints)
    # The rows up to the checkpoint, as attempt 1 wrote them (time/* wall times included).
    first_rows = _rows_up_to(metrics, resume_step)

    # Attempt 2: resumed from the periodic checkpoint to the last step.
    record = slurm_cluster.wait_for_job(job_id, lambda r: r["JobState"] == "COMPLETED", timeout_s=400,
                                        what="completed")
    assert record["Restarts"] == "1", (record, _logs(tmp_path))
    status = CampaignStatus(tmp_path).read()["rl"]
    assert (status["state"], status["attempts"], status["restarts"]) == ("done", 2, 1), (status, _logs(tmp_path))
    assert 0 < resume_step < num_steps and resume_step % every == 0, resume_step
    # Resumed, not restarted: the rows up to the checkpoint are the first attempt's bytes (a rerun
    # from step 1 would rewrite them with new wall times); the rest were logged once, to the last step.
    assert len(first_rows) >= resume_step + 1  # the step-0 evaluation and a row per step
    assert _rows_up_to(metrics, resume_step) == first_rows
    assert _trained_steps(tmp_path / "rl") == list(range(1, num_steps + 1))
    assert (checkpoints / f"step_{num_steps:08d}").is_dir()
