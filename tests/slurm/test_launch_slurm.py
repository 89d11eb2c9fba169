"""Campaigns launched through NeMo-Run's SlurmExecutor onto the real dev cluster.

A 2-rank CPU RL run under torchrun; a campaign whose second stage waits on the first;
a failing first stage whose dependent SLURM cancels (``--kill-on-invalid-dep``) and the
launcher reports; and SIGUSR1 mid-run: the RL stage checkpoints, exits 75, the job is
requeued and the second attempt resumes from ``latest`` to the last step.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import pytest

from pipeline.config import EvaluateConfig
from pipeline.launch.campaign import CampaignPlan, CampaignStatus, Resources, Stage
from pipeline.launch.nemo import LaunchOptions, launch_campaign
from recipes.campaigns import _tiny_rl
from recipes.cpu import grpo_cpu
from recipes.stages import bootstrap_cpu, evaluate_cpu
from tests.slurm.cluster import START_BUDGET_S, DevCluster

pytestmark = [
    pytest.mark.slow,
    # Known bug, under investigation: on a real (non-dry) run nemo-run 0.11.1 renders the
    # --output/--chdir paths of a LocalTunnel job with the experiment directory twice, so
    # the first job fails before its task starts (dependents are cancelled as designed).
    pytest.mark.xfail(reason="nemo-run real-submission job paths doubled with LocalTunnel", strict=False),
]


@pytest.fixture(autouse=True)
def _no_stdin(monkeypatch):
    # nemo-run's shell calls read stdin; under pytest it is captured.
    monkeypatch.setattr(sys, "stdin", open("/dev/null"))


def _rl_stage(tmp: Path, *, steps: int, ranks: int = 1, requeues: int = 0) -> Stage:
    cfg = _tiny_rl(grpo_cpu(steps=steps, group_size=4))
    cfg = dataclasses.replace(
        cfg, bootstrap=bootstrap_cpu(tiny=True, cache_dir=str(tmp / "cache")),
        eval_set="arith?difficulty=3&size=20",
        checkpoint=dataclasses.replace(cfg.checkpoint, directory=str(tmp / "rl" / "checkpoints"), every_steps=100),
        logging=dataclasses.replace(cfg.logging, output_dir=str(tmp / "rl")),
    )
    return Stage(name="rl", kind="rl", config=cfg, resources=Resources(ranks_per_node=ranks, requeues=requeues))


def _launch(plan, profile, **options):
    return launch_campaign(plan, options=LaunchOptions(executor="slurm", profile=profile, poll_s=1, **options),
                           out=print)


def _logs(plan) -> str:
    return "\n".join(f"--- {path}\n{path.read_text(errors='replace')[-3000:]}"
                     for path in sorted((plan.output_dir / "nemo_run").rglob("log-*.out")))


@pytest.mark.timeout(START_BUDGET_S + 400)
def test_two_rank_rl_runs_under_torchrun(launch_profile, tmp_path):
    plan = CampaignPlan(name="rl2", output_dir=tmp_path, stages=[_rl_stage(tmp_path, steps=2, ranks=2)])
    result = _launch(plan, launch_profile)
    assert result.ok, _logs(plan)
    rows = [json.loads(line) for line in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if "loss" in row] == [1, 2]
    assert (tmp_path / "rl" / "checkpoints" / "step_00000002").is_dir()
    script = next((tmp_path / "nemo_run").rglob("rl.sh")).read_text()
    assert "torch.distributed.run --standalone --nnodes 1 --nproc-per-node 2" in script
    assert CampaignStatus(tmp_path).read()["rl"]["job_id"] is not None


@pytest.mark.timeout(START_BUDGET_S + 300)
def test_campaign_with_a_dependency_then_a_failure_that_stops_its_dependent(launch_profile, tmp_path):
    boot = bootstrap_cpu(tiny=True, cache_dir=str(tmp_path / "cache"))
    from pipeline.stages.bootstrap import config_hash

    entry = tmp_path / "cache" / config_hash(boot)
    evaluate = dataclasses.replace(evaluate_cpu(tiny=True), policy=str(entry), output_dir=str(tmp_path / "eval"))
    plan = CampaignPlan(name="dep", output_dir=tmp_path, stages=[
        Stage(name="bootstrap", kind="bootstrap", config=boot),
        Stage(name="evaluate", kind="evaluate", config=evaluate, depends_on=("bootstrap",)),
    ])
    result = _launch(plan, launch_profile)
    assert result.ok, _logs(plan)
    assert json.loads((tmp_path / "eval" / "results.json").read_text())["benchmarks"]
    # Relaunching skips both stages and submits nothing.
    again = _launch(plan, launch_profile)
    assert again.skipped == ("bootstrap", "evaluate") and again.ok

    broken_dir = tmp_path / "broken"
    broken = CampaignPlan(name="broken", output_dir=broken_dir, stages=[
        Stage(name="bootstrap", kind="bootstrap",
              config=dataclasses.replace(boot, sources=[str(tmp_path / "missing.jsonl")])),
        Stage(name="evaluate", kind="evaluate", config=evaluate, depends_on=("bootstrap",)),
    ])
    result = _launch(broken, launch_profile)
    assert result.states == {"bootstrap": "failed", "evaluate": "pending"}, _logs(broken)
    assert result.blocked == ("evaluate",) and not result.ok
    assert "missing.jsonl" in _logs(broken)


@pytest.mark.timeout(START_BUDGET_S + 600)
def test_usr1_checkpoints_requeues_and_resumes(launch_profile, slurm_cluster: DevCluster, tmp_path):
    stage = _rl_stage(tmp_path, steps=8, requeues=2)
    plan = CampaignPlan(name="requeue", output_dir=tmp_path, stages=[stage])
    submitted = _launch(plan, launch_profile, wait=False)
    job_id = int(CampaignStatus(tmp_path).read()["rl"]["job_id"])
    assert submitted.states["rl"] in ("pending", "running")
    metrics = tmp_path / "rl" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and any('"loss"' in line for line in metrics.read_text().splitlines())):
        assert time.monotonic() < deadline, f"no RL step after 300 s\n{_logs(plan)}"
        time.sleep(0.5)
    # What --signal=USR1@N sends before the time limit, sent now: to every process of the job's steps.
    slurm_cluster.slurm("scancel", "--signal=USR1", str(job_id))
    record = slurm_cluster.wait_for_job(job_id, lambda r: r["JobState"] == "COMPLETED" and r["Restarts"] == "1",
                                        timeout_s=400, what="requeued once and completed")
    status = CampaignStatus(tmp_path).read()["rl"]
    assert (status["state"], status["attempts"], status["restarts"]) == ("done", 2, 1), (record, _logs(plan))
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines() if '"loss"' in line]
    assert steps[-1] == 8
    # The second attempt resumed after the checkpointed step instead of starting over.
    assert sorted(set(steps)) == list(range(1, 9)) and steps.count(1) == 1, steps
