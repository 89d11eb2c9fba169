"""Golden tests of the rendered sbatch and task scripts for the H100 presets (nemo-run dryrun),
the local task scripts, executor bounds, and how SLURM job states reconcile with status.json."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from pipeline.config import Resources, TrainEstimatorConfig
from pipeline.configlib import ConfigError
from pipeline.launch.campaign import CampaignStatus
from pipeline.launch.campaign import Stage
from pipeline.launch.nemo import (
    CONVERSION_BASE_BYTES,
    EXPERIMENTS_DIR,
    TORCHRUN_SIGNALS,
    ExecutorOverrides,
    LaunchOptions,
    apply_executor_overrides,
    conversion_memory_bytes,
    follow_slurm_jobs,
    job_resources,
    launch_campaign,
    requeue_trap,
    stage_script,
)
from pipeline.launch.slurm_profiles import TunnelProfile, load_profile
from recipes.campaigns import cpu_campaign, h100_rl, llama31_8b, qwen25_math_1p5b, qwen25_math_7b


@pytest.fixture(autouse=True)
def _no_stdin(monkeypatch):
    # nemo-run's shell calls read stdin; under pytest it is captured.
    import sys

    monkeypatch.setattr(sys, "stdin", open("/dev/null"))


def _h100(tmp_path: Path):
    profile = load_profile("h100-example")
    return dataclasses.replace(profile, tunnel=TunnelProfile(kind="local", job_dir=str(tmp_path / "jobs")))


def _dryrun(plan, profile, tmp_path, out=lambda _: None) -> dict[str, tuple[str, str]]:
    exp_dir = launch_campaign(plan, options=LaunchOptions(executor="slurm", profile=profile, dryrun=True,
                                                          experiments_dir=tmp_path / "exp"), out=out)
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


def _qwen7b_with_depo(output_dir: Path):
    """The 7B preset with DEPO as the chosen method: its campaign trains the estimator (one GPU)."""
    rl = h100_rl(model_dir="/models/Qwen2.5-Math-7B", tensor_parallel=4, max_new_tokens=3072,
                 micro_batch_tokens=8192)
    return qwen25_math_7b(output_dir=output_dir, rl=dataclasses.replace(
        rl, algorithm=dataclasses.replace(rl.algorithm, prompt_filter="depo")))


def test_h100_single_gpu_stages_and_dependencies(tmp_path):
    plan = _qwen7b_with_depo(tmp_path / "campaign")
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


# Qwen2.5-Math-7B's config.json, as published (the keys the planner sizes it by, and its dtype).
QWEN25_MATH_7B_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
    "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "max_position_embeddings": 4096,
    "vocab_size": 152064, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}
QWEN25_MATH_7B_PARAMETERS = 7_615_616_512


def _model_dir(tmp_path: Path, config: dict = QWEN25_MATH_7B_CONFIG) -> Path:
    import json

    folder = tmp_path / "Qwen2.5-Math-7B"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_gpu_jobs_take_the_whole_node_on_an_exclusive_profile(tmp_path):
    # A node's 8 ranks plus a grading pool, or 8 SGLang servers: never one CPU at the default memory.
    plan = qwen25_math_7b(output_dir=tmp_path / "campaign", model_dir=str(_model_dir(tmp_path)))
    scripts = _dryrun(plan, _h100(tmp_path), tmp_path)
    gpu_stages = [stage.name for stage in plan.stages if stage.resources.gpus_per_node > 0]
    assert {"rl-default", "rl-grpo", "curate", "evaluate-default"} <= set(gpu_stages)
    for name in gpu_stages:
        sbatch = scripts[name][0]
        flags = _flags(sbatch)
        assert (flags["cpus-per-task"], flags["mem"], flags["ntasks-per-node"]) == ("112", "0", "1"), name
        assert "exclusive" in flags, name
        # srun >= 22.05 does not inherit --cpus-per-task: the script hands it to the step, before srun runs it.
        assert "\nexport SRUN_CPUS_PER_TASK=112\n" in sbatch, name
        assert sbatch.index("export SRUN_CPUS_PER_TASK=112") < sbatch.index("srun --output"), name


def test_gpu_jobs_that_share_nodes_ask_for_their_gpus_share(tmp_path):
    profile = dataclasses.replace(_h100(tmp_path), exclusive=False, mem_per_node="2000G")
    plan = qwen25_math_7b(output_dir=tmp_path / "campaign", model_dir=str(_model_dir(tmp_path)))
    flags = _flags(_dryrun(plan, profile, tmp_path)["rl-default"][0])
    assert (flags["cpus-per-task"], flags["mem"]) == ("112", "2000G") and "exclusive" not in flags
    one_gpu = Stage(name="one", kind="train-estimator", config=TrainEstimatorConfig(),
                    resources=Resources(gpus_per_node=1))
    shape = job_resources(one_gpu, plan=plan, profile=profile)
    assert (shape.cpus_per_task, shape.mem, shape.exclusive) == (14, "250G", False)
    half = dataclasses.replace(one_gpu, resources=Resources(gpus_per_node=4))
    assert job_resources(half, plan=plan, profile=profile).mem == "1000G"
    # The same one-GPU job on whole nodes takes the node.
    whole = job_resources(one_gpu, plan=plan, profile=_h100(tmp_path))
    assert (whole.cpus_per_task, whole.mem, whole.exclusive) == (112, "0", True)


def test_conversion_memory_formula():
    # N x (8 + 2w) + 2 GiB: two fp32 copies, the HF weights at their dtype, transients bounded by them.
    assert conversion_memory_bytes(QWEN25_MATH_7B_PARAMETERS, weight_bytes=2) == (
        QWEN25_MATH_7B_PARAMETERS * 12 + CONVERSION_BASE_BYTES)
    assert conversion_memory_bytes(1000, weight_bytes=4) == 16_000 + (2 << 30)
    for bad in ({"num_parameters": 0, "weight_bytes": 2}, {"num_parameters": 10, "weight_bytes": 3}):
        with pytest.raises(ValueError):
            conversion_memory_bytes(**bad)


def test_convert_and_export_ask_for_the_memory_the_model_needs(tmp_path):
    from pipeline.launch.plan import load_model_dims

    model_dir = _model_dir(tmp_path)
    assert load_model_dims(model_dir).num_parameters() == QWEN25_MATH_7B_PARAMETERS
    plan = qwen25_math_7b(output_dir=tmp_path / "campaign", model_dir=str(model_dir))
    notes = []
    scripts = _dryrun(plan, _h100(tmp_path), tmp_path, out=notes.append)
    # 7.62e9 x 12 B + 2 GiB = 87.1 GiB, rounded up to whole GiB. export-<v>'s checkpoint does not
    # exist yet: its size comes from the folder its rl stage's servers load, in bf16 (the preset's dtype).
    for name in ("convert", "export-default", "export-grpo"):
        sbatch = scripts[name][0]
        flags = _flags(sbatch)
        assert (flags["cpus-per-task"], flags["mem"]) == ("8", "88G"), name
        assert "exclusive" not in flags and "gpus-per-node" not in flags, name
        assert "\nexport SRUN_CPUS_PER_TASK=8\n" in sbatch, name
    assert "7.62 B parameters at 2 B each" in scripts["convert"][0]
    assert not [note for note in notes if "memory" in note]
    # An fp32 folder: 16 B per parameter.
    fp32 = {**QWEN25_MATH_7B_CONFIG, "torch_dtype": "float32"}
    plan32 = qwen25_math_7b(output_dir=tmp_path / "c32", model_dir=str(_model_dir(tmp_path / "f32", fp32)))
    expected_gib = -(-(QWEN25_MATH_7B_PARAMETERS * 16 + (2 << 30)) // (1 << 30))
    assert job_resources(plan32.stage("convert"), plan=plan32, profile=_h100(tmp_path)).mem == f"{expected_gib}G"
    # The preset exports bf16 whatever the folder's dtype.
    assert job_resources(plan32.stage("export-default"), plan=plan32, profile=_h100(tmp_path)).mem == "88G"


def test_export_of_an_existing_checkpoint_reads_its_manifest(tmp_path):
    import json

    from pipeline.models.spec import ModelSpec

    plan = qwen25_math_7b(output_dir=tmp_path / "campaign", model_dir="/nonexistent/model")
    export = plan.stage("export-default")
    checkpoints = Path(export.config.checkpoint)
    (checkpoints / "step_00000020").mkdir(parents=True)
    (checkpoints / "latest").write_text("step_00000020\n")
    spec = ModelSpec(family="qwen2", vocab_size=152064, hidden_size=3584, ffn_hidden_size=18944, num_layers=28,
                     num_attention_heads=28, num_query_groups=4, max_position_embeddings=4096, qkv_bias=True)
    (checkpoints / "step_00000020" / "manifest.json").write_text(json.dumps(
        {"model_spec": dataclasses.asdict(spec), "hf_dtype": "bfloat16"}))
    auto = dataclasses.replace(export, config=dataclasses.replace(export.config, dtype="auto"))
    shape = job_resources(auto, plan=plan, profile=_h100(tmp_path))
    assert shape.mem == "88G" and f"checkpoint {checkpoints}" in shape.basis  # auto: the recorded bf16
    fp32 = dataclasses.replace(export, config=dataclasses.replace(export.config, dtype="fp32"))
    fp32_gib = -(-(QWEN25_MATH_7B_PARAMETERS * 16 + (2 << 30)) // (1 << 30))
    assert job_resources(fp32, plan=plan, profile=_h100(tmp_path)).mem == f"{fp32_gib}G"


def test_a_conversion_of_an_unknown_model_takes_a_nodes_memory(tmp_path):
    # /models/m does not exist on this machine: nothing says how big the model is.
    plan = qwen25_math_7b(output_dir=tmp_path / "campaign", model_dir="/models/m")
    notes = []
    scripts = _dryrun(plan, _h100(tmp_path), tmp_path, out=notes.append)
    for name in ("convert", "export-default"):
        flags = _flags(scripts[name][0])
        assert (flags["cpus-per-task"], flags["mem"]) == ("8", "0"), name
        assert any(note.startswith(f"{name}: the model's size cannot be read") for note in notes), notes
    sized = dataclasses.replace(_h100(tmp_path), exclusive=False, mem_per_node="1500G")
    assert job_resources(plan.stage("convert"), plan=plan, profile=sized).mem == "1500G"


def test_a_conversion_bigger_than_a_node_asks_for_all_of_it(tmp_path):
    plan = qwen25_math_7b(output_dir=tmp_path / "campaign", model_dir=str(_model_dir(tmp_path)))
    small = dataclasses.replace(_h100(tmp_path), exclusive=False, mem_per_node="64G", cpus_per_node=4)
    shape = job_resources(plan.stage("convert"), plan=plan, profile=small)
    assert (shape.cpus_per_task, shape.mem) == (4, "64G")
    assert "needs about 88G of memory, more than the profile's mem_per_node 64G" in shape.note


def test_cpu_jobs_ask_for_a_cpu_per_rank(tmp_path):
    profile = dataclasses.replace(load_profile("dev"), cpus_per_node=2)  # a 2-CPU node: 2 ranks take all of it
    plan = cpu_campaign(output_dir=tmp_path / "campaign", tiny=True)
    two = dataclasses.replace(plan.stage("rl-grpo"), resources=dataclasses.replace(
        plan.stage("rl-grpo").resources, ranks_per_node=2))
    plan = dataclasses.replace(plan, stages=[two if stage.name == "rl-grpo" else stage for stage in plan.stages])
    scripts = _dryrun(plan, profile, tmp_path)
    one, both = _flags(scripts["curate"][0]), _flags(scripts["rl-grpo"][0])
    assert one["cpus-per-task"] == "1" and "mem" not in one  # part of a "0" node: the cluster's default
    assert "export SRUN_CPUS_PER_TASK=1\n" in scripts["curate"][0]
    assert (both["cpus-per-task"], both["mem"]) == ("2", "0")  # every CPU: all of the node
    assert "export SRUN_CPUS_PER_TASK=2\n" in scripts["rl-grpo"][0]
    # The export's model is the bootstrap's (its checkpoint does not exist yet): tiny, 2 GiB and change,
    # on the dev node's 2 CPUs.
    export = _flags(scripts["export-grpo"][0])
    assert (export["cpus-per-task"], export["mem"]) == ("2", "3G")
    assert "stage bootstrap's model config" in scripts["export-grpo"][0]
    # On a node with a stated size, a CPU job gets its CPUs' share.
    sized = dataclasses.replace(profile, mem_per_node="8G")
    assert job_resources(plan.stage("curate"), plan=plan, profile=sized).mem == "4G"
    # A CPU job on a GPU node may not have more ranks than the node has CPUs.
    six = dataclasses.replace(two, resources=dataclasses.replace(two.resources, ranks_per_node=6), depends_on=())
    with pytest.raises(ConfigError, match="ranks_per_node: 6 CPU ranks; the profile's nodes have 4 CPUs"):
        _dryrun(dataclasses.replace(plan, stages=[six]), dataclasses.replace(_h100(tmp_path), cpus_per_node=4),
                tmp_path)


def test_slurm_dependencies_are_afterok_on_pending_parents(tmp_path, monkeypatch):
    import nemo_run as run

    added = {}
    original = run.Experiment.add

    def spy(self, task, *args, name, dependencies=None, **kwargs):
        added[name] = [self.jobs[[job.id for job in self.jobs].index(dep)].id for dep in dependencies or []]
        return original(self, task, *args, name=name, dependencies=dependencies, **kwargs)

    monkeypatch.setattr(run.Experiment, "add", spy)
    plan = _qwen7b_with_depo(tmp_path / "campaign")
    CampaignStatus(plan.output_dir).update("curate", "done")  # done before: no dependency on it
    _dryrun(plan, _h100(tmp_path), tmp_path)
    assert "curate" not in added
    assert added["train-estimator"] == []
    # both train from the converted policy; the DEPO variant also reads the estimator
    assert added["rl-default"] == ["convert", "train-estimator"] and added["rl-grpo"] == ["convert"]
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
