"""Golden tests of the rendered sbatch and task scripts for the H100 presets (nemo-run dryrun),
the local task scripts, executor bounds, and how SLURM job states reconcile with status.json."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from pipeline.configlib import ConfigError
from pipeline.launch.campaign import CampaignStatus
from pipeline.launch.nemo import (
    EXPERIMENTS_DIR,
    TORCHRUN_SIGNALS,
    ExecutorOverrides,
    LaunchOptions,
    apply_executor_overrides,
    follow_slurm_jobs,
    launch_campaign,
    requeue_trap,
    stage_script,
)
from pipeline.launch.slurm_profiles import TunnelProfile, load_profile
from recipes.campaigns import cpu_campaign, llama31_8b, qwen25_math_1p5b, qwen25_math_7b


@pytest.fixture(autouse=True)
def _no_stdin(monkeypatch):
    # nemo-run's shell calls read stdin; under pytest it is captured.
    import sys

    monkeypatch.setattr(sys, "stdin", open("/dev/null"))


def _h100(tmp_path: Path):
    profile = load_profile("h100-example")
    return dataclasses.replace(profile, tunnel=TunnelProfile(kind="local", job_dir=str(tmp_path / "jobs")))


def _dryrun(plan, profile, tmp_path) -> dict[str, tuple[str, str]]:
    exp_dir = launch_campaign(plan, options=LaunchOptions(executor="slurm", profile=profile, dryrun=True,
                                                          experiments_dir=tmp_path / "exp"), out=lambda _: None)
    return {stage.name: ((exp_dir / f"{stage.name}_sbatch.sh").read_text(),
                         (exp_dir / stage.name / "scripts" / f"{stage.name}.sh").read_text())
            for stage in plan.stages if (exp_dir / f"{stage.name}_sbatch.sh").exists()}


def _flags(sbatch: str) -> dict[str, str]:
    return dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(\S+))?$", sbatch, flags=re.M))


PRESETS = [  # recipe, trainer nodes, rollout nodes, servers per node, server TP
    (qwen25_math_7b, 2, 1, 8, 1),
    (qwen25_math_1p5b, 1, 1, 8, 1),
    (llama31_8b, 2, 2, 4, 2),
]


@pytest.mark.parametrize("recipe, trainer_nodes, rollout_nodes, servers_per_node, server_tp", PRESETS)
def test_h100_rl_jobs(tmp_path, recipe, trainer_nodes, rollout_nodes, servers_per_node, server_tp):
    root = tmp_path / "campaign"
    plan = recipe(output_dir=root, model_dir="/models/m")
    scripts = _dryrun(plan, _h100(tmp_path), tmp_path)
    sbatch, task = scripts["rl-default"]
    flags = _flags(sbatch)
    assert flags["nodes"] == str(trainer_nodes + rollout_nodes)
    assert flags["ntasks-per-node"] == "1"  # one node role per node; it starts the node's 8 ranks
    assert flags["gpus-per-node"] == "8"
    assert (flags["account"], flags["partition"], flags["time"]) == ("llm_rl", "batch", "04:00:00")
    assert flags["signal"] == "USR1@300" and "requeue" in flags and flags["kill-on-invalid-dep"] == "yes"
    # nemo-run's own retry loop is off; the trap requeues transient exits, up to the stage's 50
    assert "export TORCHX_MAX_RETRIES=0" in sbatch
    assert requeue_trap(50) in sbatch and "trap winnow_job_exit EXIT" in sbatch
    # pyxis: image, the profile's mounts, its extra flags
    srun = next(line for line in sbatch.splitlines() if line.startswith("srun --output"))
    assert "--container-image /lustre/images/winnow-sglang.sqsh" in srun
    assert re.search(r"--container-mounts /lustre:/lustre,/models:/models:ro,\S+:/nemo_run", srun)
    assert "--container-writable --no-container-mount-home" in srun and "--kill-on-bad-exit=1" in srun
    assert 'export WINNOW_NODES="${nodes[*]}"' in sbatch and "export HF_HUB_OFFLINE=1" in sbatch
    # rollout nodes come after the trainer nodes and serve; the trainer nodes run torchrun
    assert f'if [ "${{SLURM_NODEID:-0}}" -ge {trainer_nodes} ]; then' in task
    assert f"python -m pipeline.cli.task serve --campaign-dir {root} --stage rl-default" in task
    torchrun = task.split("python -m torch.distributed.run ", 1)[1].split(" -m pipeline.cli.task worker")[0]
    expected = (f'--nnodes {trainer_nodes} --node-rank "${{SLURM_NODEID:-0}}" --master-addr "$WINNOW_HEAD_NODE" '
                f"--master-port 29500 --nproc-per-node 8 --signals-to-handle {TORCHRUN_SIGNALS}")
    if trainer_nodes == 1:
        expected = f"--standalone --nnodes 1 --nproc-per-node 8 --signals-to-handle {TORCHRUN_SIGNALS}"
    # torchrun gives its ranks the whole SIGUSR1 lead to checkpoint before it kills them.
    assert torchrun == expected + " --shutdown-timeout 300"
    assert "cd /lustre/winnow" in task
    rollout = plan.stage("rl-default").resources.rollout
    assert (rollout.nodes, rollout.servers_per_node, rollout.tensor_parallel) == (
        rollout_nodes, servers_per_node, server_tp)


def test_h100_single_gpu_stages_and_dependencies(tmp_path):
    plan = qwen25_math_7b(output_dir=tmp_path / "campaign")
    scripts = _dryrun(plan, _h100(tmp_path), tmp_path)
    estimator_flags = _flags(scripts["train-estimator"][0])
    assert (estimator_flags["nodes"], estimator_flags["gpus-per-node"]) == ("1", "1")
    assert "gpus-per-node" not in _flags(scripts["export-default"][0])


@pytest.mark.parametrize("stage_name", ["curate", "evaluate-default"])
def test_h100_curation_and_evaluation_run_on_the_server_nodes(tmp_path, stage_name):
    root = tmp_path / "campaign"
    plan = qwen25_math_7b(output_dir=root, model_dir="/models/m")
    sbatch, script = _dryrun(plan, _h100(tmp_path), tmp_path)[stage_name]
    flags = _flags(sbatch)
    # one head node runs the stage, the next one runs 8 SGLang servers, in one job
    assert (flags["nodes"], flags["gpus-per-node"], flags["ntasks-per-node"]) == ("2", "8", "1")
    assert "signal" not in flags  # only rl checkpoints on SIGUSR1; it would kill the others
    assert "requeue" in flags  # a requeued job resumes from the finished shards
    assert script.splitlines()[-5:] == [
        "# nodes 1..1 of the job serve rollouts (SGLang)",
        'if [ "${SLURM_NODEID:-0}" -ge 1 ]; then',
        f"  exec python -m pipeline.cli.task serve --campaign-dir {root} --stage {stage_name}",
        "fi",
        f"exec python -m pipeline.cli.task node --campaign-dir {root} --stage {stage_name}",
    ]
    rollout = plan.stage(stage_name).resources.rollout
    assert (rollout.nodes, rollout.servers_per_node, rollout.model_path) == (1, 8, "/models/m")


def test_slurm_dependencies_are_afterok_on_pending_parents(tmp_path, monkeypatch):
    import nemo_run as run

    added = {}
    original = run.Experiment.add

    def spy(self, task, *args, name, dependencies=None, **kwargs):
        added[name] = [self.jobs[[job.id for job in self.jobs].index(dep)].id for dep in dependencies or []]
        return original(self, task, *args, name=name, dependencies=dependencies, **kwargs)

    monkeypatch.setattr(run.Experiment, "add", spy)
    plan = qwen25_math_7b(output_dir=tmp_path / "campaign")
    CampaignStatus(plan.output_dir).update("curate", "done")  # done before: no dependency on it
    _dryrun(plan, _h100(tmp_path), tmp_path)
    assert "curate" not in added
    assert added["train-estimator"] == [] and added["rl-default"] == ["convert"]  # trains from the converted policy
    assert added["evaluate-default"] == ["rl-default"] and added["export-grpo"] == ["rl-grpo"]


def test_executor_overrides(tmp_path):
    plan = apply_executor_overrides(qwen25_math_7b(output_dir=tmp_path),
                                    ExecutorOverrides(nodes=4, time="08:00:00"))
    assert plan.stage("rl-default").resources.nodes == 4
    assert plan.stage("curate").resources.nodes == 1  # one-rank stages keep one node
    assert plan.stage("curate").resources.time_limit == "08:00:00"


def test_profile_bounds_are_enforced(tmp_path):
    profile = dataclasses.replace(_h100(tmp_path), nodes=2)
    with pytest.raises(ConfigError, match="3 nodes; the cluster profile allows 2 per job"):
        _dryrun(qwen25_math_7b(output_dir=tmp_path / "c"), profile, tmp_path)
    profile = dataclasses.replace(_h100(tmp_path), signal_s=4 * 3600)
    with pytest.raises(ConfigError, match="signal_s"):
        _dryrun(qwen25_math_7b(output_dir=tmp_path / "c"), profile, tmp_path)


def test_dev_cluster_job_paths_name_the_experiment_folder_once(tmp_path):
    # Without a container nemo-run rewrites every "/nemo_run" of the scripts into the job
    # folder; a job whose --output or --chdir names a missing folder dies before its task.
    profile = load_profile("dev")
    plan = cpu_campaign(output_dir=tmp_path / "campaign", tiny=True)
    exp_dir = launch_campaign(plan, options=LaunchOptions(executor="slurm", profile=profile, dryrun=True),
                              out=lambda _: None)
    assert exp_dir.parent.parent == tmp_path / "campaign" / EXPERIMENTS_DIR / "experiments"
    sbatch = (exp_dir / "rl-grpo_sbatch.sh").read_text()
    job_dir = exp_dir / "rl-grpo"
    assert _flags(sbatch)["output"] == f"{job_dir}/sbatch_winnow-cpu-tiny-rl-grpo_%j.out"
    srun = next(line for line in sbatch.splitlines() if line.startswith("srun --output"))
    assert srun.startswith(f"srun --output {job_dir}/log-winnow-cpu-tiny-rl-grpo_%j_")
    assert f"--chdir {job_dir}/code " in srun and srun.endswith(f"bash {job_dir}/scripts/rl-grpo.sh")
    task = (job_dir / "scripts" / "rl-grpo.sh").read_text()
    assert f"--campaign-dir {tmp_path / 'campaign'} --stage rl-grpo" in task


def test_paths_that_nemo_run_would_rewrite_are_refused(tmp_path):
    profile = load_profile("dev")
    plan = cpu_campaign(output_dir=tmp_path / "nemo_run" / "campaign", tiny=True)
    with pytest.raises(ConfigError, match="campaign output_dir .* contains '/nemo_run'"):
        launch_campaign(plan, options=LaunchOptions(executor="slurm", profile=profile, dryrun=True),
                        out=lambda _: None)
    with pytest.raises(ConfigError, match="workdir .* contains '/nemo_run'"):
        launch_campaign(cpu_campaign(output_dir=tmp_path / "c", tiny=True), out=lambda _: None, options=LaunchOptions(
            executor="slurm", profile=dataclasses.replace(profile, workdir="/src/nemo_runs/winnow"), dryrun=True))


def test_local_scripts(tmp_path):
    plan = cpu_campaign(output_dir=tmp_path, tiny=True)
    single = stage_script(plan, plan.stage("curate"), python="/venv/python", workdir="/repo")
    assert single.splitlines()[-1] == f"exec /venv/python -m pipeline.cli.task node --campaign-dir {tmp_path} --stage curate"
    two = dataclasses.replace(plan.stage("rl-grpo"), resources=dataclasses.replace(
        plan.stage("rl-grpo").resources, ranks_per_node=2))
    text = stage_script(plan, two, python="/venv/python", workdir="/repo")
    assert (f"-- \\\n  /venv/python -m torch.distributed.run --standalone --nnodes 1 --nproc-per-node 2 "
            f"--signals-to-handle {TORCHRUN_SIGNALS} -m pipeline.cli.task worker") in text


def test_following_slurm_jobs_reconciles_status(tmp_path):
    plan = cpu_campaign(output_dir=tmp_path, tiny=True)
    status = CampaignStatus(tmp_path)
    status.initialize(plan)
    status.update("bootstrap", "done")  # the task recorded its end
    status.update("curate", "running")  # the task was killed before it could
    ids = {"bootstrap": 1, "curate": 2, "train-estimator": 3}
    polls = iter([{1: ("RUNNING", "None"), 2: ("RUNNING", "None"), 3: ("PENDING", "Dependency")},
                  {1: ("COMPLETED", "None"), 2: ("TIMEOUT", "TimeLimit"),
                   3: ("CANCELLED", "DependencyNeverSatisfied")}])
    current = {}

    def job_state(job_id):
        if job_id == 1:
            current.update(next(polls))
        return current[job_id]

    result = follow_slurm_jobs(plan, ids, skipped=(), poll_s=0, out=lambda _: None, job_state=job_state)
    assert result.states == {"bootstrap": "done", "curate": "failed", "train-estimator": "pending"}
    assert result.blocked == ("train-estimator",)
    assert "TIMEOUT" in status.read()["curate"]["error"]
