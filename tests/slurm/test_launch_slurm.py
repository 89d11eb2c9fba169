"""Stages and campaigns launched through NeMo-Run's SlurmExecutor onto the real dev cluster.

A 2-rank CPU RL run under torchrun (``winnow launch stage rl``); a failing first stage whose
dependents SLURM cancels (``--kill-on-invalid-dep``) while ``winnow launch campaign``
exits non-zero. A whole campaign DAG run in order through ``--dependency=afterok`` (two
branches at once) is the rehearsal's (``test_rehearsal_slurm.py``); a relaunch that skips
the stages done, ``tests/launch/test_launch_local.py``. SIGUSR1 mid-run (checkpoint, exit 75, requeue, resume) is in
``test_slurm_requeue.py``, in one job with a killed task.

Runtime on 2 cores: 12-62 s per test idle, up to 2 min loaded (each job imports torch and
megatron-core; the RL tests train a 40-step bootstrap policy first).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from pipeline import configlib
from pipeline.cli import main as winnow
from pipeline.config import RLConfig
from pipeline.launch.campaign import CampaignStatus
from pipeline.launch.nemo import EXPERIMENTS_DIR
from recipes.campaigns import _tiny_rl, cpu_tiny_campaign
from recipes.cpu import grpo_cpu
from recipes.stages import bootstrap_cpu
from tests.slurm.cluster import START_BUDGET_S

# serial: one dev cluster for the session, started by the first test that asks for it, and
# timings (signal leads, requeue waits) that a second worker competing for the cores would skew.
pytestmark = [pytest.mark.slow, pytest.mark.serial]


def _tiny_rl_config(tmp: Path, *, steps: int, cache: Path):
    """A tiny CPU rl run under ``tmp``; ``cache``: the bootstrap cache (the session's: trained once)."""
    cfg = _tiny_rl(grpo_cpu(steps=steps, group_size=4))
    return dataclasses.replace(
        cfg, bootstrap=bootstrap_cpu(tiny=True, cache_dir=str(cache)),
        eval_set="arith?difficulty=3&size=20",
        checkpoint=dataclasses.replace(cfg.checkpoint, directory=str(tmp / "rl" / "checkpoints"), every_steps=100),
        logging=dataclasses.replace(cfg.logging, output_dir=str(tmp / "rl")),
    )


def _logs(output_dir: Path) -> str:
    """The jobs' sbatch and task logs, for failure messages."""
    return "\n".join(f"--- {path}\n{path.read_text(errors='replace')[-3000:]}"
                     for path in sorted((output_dir / EXPERIMENTS_DIR).rglob("*.out")))


def _trained_steps(run_dir: Path) -> list[int]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row["step"] for row in rows if "loss" in row]


@pytest.mark.timeout(START_BUDGET_S + 600)
def test_two_rank_rl_stage_runs_under_torchrun(launch_profile_file, bootstrap_cache_dir, slurm_cluster, tmp_path):
    config = tmp_path / "rl.yaml"
    config.write_text(configlib.dump_yaml(_tiny_rl_config(tmp_path, steps=3, cache=bootstrap_cache_dir)))
    # Overrides on both sides of the options: the order users type them in.
    code = winnow(["launch", "stage", "rl", "seed=3", "--config", str(config), "--executor", "slurm",
                   "--profile", str(launch_profile_file), "--ranks-per-node", "2", "--output-dir",
                   str(tmp_path / "launch"), "steps=2", "optim.total_steps=2"])
    assert code == 0, _logs(tmp_path / "launch")
    assert _trained_steps(tmp_path / "rl") == [1, 2]
    resolved = configlib.load(RLConfig, yaml_path=str(tmp_path / "rl" / "config.yaml"))
    assert (resolved.seed, resolved.steps) == (3, 2)
    # Two ranks (data parallel 2) wrote the final checkpoint, each its own RNG state.
    final = tmp_path / "rl" / "checkpoints" / "step_00000002"
    assert sorted(path.name for path in (final / "ranks").iterdir()) == ["rank_00000.json", "rank_00001.json"]
    script = next((tmp_path / "launch" / EXPERIMENTS_DIR).rglob("rl.sh")).read_text()
    assert "torch.distributed.run --standalone --nnodes 1 --nproc-per-node 2" in script
    record = CampaignStatus(tmp_path / "launch").read()["rl"]
    assert record["state"] == "done" and int(record["job_id"]) > 0
    # A CPU per rank for the node's one task, handed on to srun's step (srun >= 22.05 does not inherit it).
    sbatch = next((tmp_path / "launch" / EXPERIMENTS_DIR).rglob("rl_sbatch.sh")).read_text()
    assert "#SBATCH --cpus-per-task=2\n" in sbatch and "\nexport SRUN_CPUS_PER_TASK=2\n" in sbatch
    job = slurm_cluster.job(int(record["job_id"]))
    assert (job["NumCPUs"], job["CPUs/Task"]) == ("2", "2"), job


def test_failed_stage_cancels_its_dependents_and_the_launcher_exits_nonzero(launch_profile_file, tmp_path, capsys):
    missing = tmp_path / "missing.jsonl"
    code = winnow(["launch", "campaign", "--recipe", "cpu-tiny", "--executor", "slurm", "--profile",
                   str(launch_profile_file), "--output-dir", str(tmp_path), f'bootstrap.sources=["{missing}"]'])
    assert code == 1, _logs(tmp_path)
    records = CampaignStatus(tmp_path).read()
    assert records["bootstrap"]["state"] == "failed"
    assert "missing.jsonl" in records["bootstrap"]["error"]
    dependents = [name for name in records if name != "bootstrap"]
    # Every other stage of the recipe's plan (curate, train-estimator, and rl, evaluate, export per variant).
    assert sorted(dependents) == sorted(stage.name for stage in cpu_tiny_campaign(output_dir=tmp_path).stages
                                        if stage.name != "bootstrap")
    # Cancelled by SLURM before they ran: never started, still pending for the next launch.
    assert {records[name]["state"] for name in dependents} == {"pending"}
    assert all(records[name]["attempts"] == 0 for name in dependents)
    assert "did not finish: failed bootstrap" in capsys.readouterr().err
