"""Which exits requeue a SLURM job (the table, and the bash the sbatch script runs), the
collective-timeout rule, and the SIGUSR1 lead derived from the checkpoint-write estimate."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from pipeline.cli.task import main as task_main
from pipeline.config import (
    DEFAULT_COLLECTIVE_TIMEOUT_MIN,
    WEIGHT_SYNC_ALLOWANCE_S,
    ParallelConfig,
    Resources,
    RLConfig,
    RolloutConfig,
    collective_timeout_minutes,
)
from pipeline.configlib import ConfigError, load
from pipeline.errors import EXIT_USER_ERROR
from pipeline.launch import task
from pipeline.launch.campaign import EXIT_REQUEUE, EXIT_STOPPED_FOR_GOOD, CampaignStatus, Stage, job_exit
from pipeline.launch.nemo import requeue_trap, signal_lead_s
from pipeline.launch.plan import Assumptions, Layout, ModelDims, TrainerSettings, checkpoint_write_plan
from pipeline.launch.slurm_profiles import load_profile
from pipeline.rollout.sglang.client import SGLangClientConfig
from recipes.campaigns import cpu_campaign

# ---------------------------------------------------------------- the exit-code table

# (stage exit, restarts so far, requeues allowed) → (requeued, job exit)
TABLE = [
    ((0, 0, 2), (False, 0)),  # done
    ((EXIT_USER_ERROR, 0, 2), (False, EXIT_USER_ERROR)),  # bad config/data/checkpoint: the same again
    ((EXIT_REQUEUE, 0, 2), (True, EXIT_REQUEUE)),  # checkpointed on SIGUSR1: resume
    ((EXIT_REQUEUE, 2, 2), (False, EXIT_STOPPED_FOR_GOOD)),  # budget spent: never 75 (RequeueExit=75 clusters)
    ((137, 1, 2), (True, 137)),  # a task killed by SIGKILL (srun: 128 + 9)
    ((1, 0, 2), (True, 1)),  # torchrun when a rank died, or an exception
    ((1, 0, 0), (False, 1)),  # no budget
]


@pytest.mark.parametrize("given, expected", TABLE)
def test_job_exit_table(given, expected):
    code, restarts, requeues = given
    assert job_exit(code, restarts=restarts, requeues=requeues) == expected


def _run_trap(tmp_path: Path, *, code: int, restarts: int, requeues: int, signalled: bool = False,
              scontrol_fails: bool = False) -> tuple[int, bool]:
    """The trap in a bash that ends like nemo-run's sbatch script: ``exit <srun's status>``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    calls = tmp_path / "scontrol.calls"
    calls.unlink(missing_ok=True)
    fake = bin_dir / "scontrol"
    fake.write_text(f'#!/bin/sh\necho "$@" >> {calls}\nexit {1 if scontrol_fails else 0}\n')
    fake.chmod(0o755)
    # set -e as nemo-run's template has it when the script exits.
    script = f"set -e\n{requeue_trap(requeues)}\n" + ("kill -TERM $$\n" if signalled else "") + f"exit {code}\n"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "77",
           "SLURM_RESTART_COUNT": str(restarts)}
    result = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=30)
    called = calls.exists()
    if called:
        assert calls.read_text() == "requeue 77\n"
    return result.returncode, called and not scontrol_fails


@pytest.mark.parametrize("code", [0, 1, EXIT_USER_ERROR, EXIT_REQUEUE, 137, 143])
@pytest.mark.parametrize("restarts, requeues", [(0, 0), (0, 2), (1, 2), (2, 2)])
def test_the_sbatch_trap_applies_the_table(tmp_path, code, restarts, requeues):
    requeue, job_code = job_exit(code, restarts=restarts, requeues=requeues)
    assert _run_trap(tmp_path, code=code, restarts=restarts, requeues=requeues) == (job_code, requeue)


def test_the_trap_never_requeues_a_job_slurm_ends(tmp_path):
    # scancel and the hard time limit TERM the batch shell; scontrol requeue would revive a cancelled job.
    assert _run_trap(tmp_path, code=143, restarts=0, requeues=2, signalled=True) == (143, False)
    # A failed scontrol requeue (a job that is not requeueable) ends the job like a spent budget.
    assert _run_trap(tmp_path, code=EXIT_REQUEUE, restarts=0, requeues=2, scontrol_fails=True) == (
        EXIT_STOPPED_FOR_GOOD, False)


# ---------------------------------------------------------------- user errors through the node role


def test_a_user_error_exits_2_with_one_line(tmp_path, monkeypatch, capsys):
    cpu_campaign(output_dir=tmp_path, tiny=True).save()

    def missing(stage):
        raise FileNotFoundError(f"data.train: {tmp_path}/missing.jsonl does not exist")

    monkeypatch.setattr(task, "run_stage", missing)
    assert task_main(["node", "--campaign-dir", str(tmp_path), "--stage", "curate"]) == EXIT_USER_ERROR
    assert capsys.readouterr().err == f"error: data.train: {tmp_path}/missing.jsonl does not exist\n"
    assert CampaignStatus(tmp_path).read()["curate"]["state"] == "failed"


def _failing_ranks(*failures: tuple[int, int, bool, str]) -> str:
    """A torchrun stand-in: writes each (rank, time_ns, user_error, line) record, then exits 1 like torchrun."""
    records = [(rank, json.dumps({"time_ns": t, "user_error": user, "line": line})) for rank, t, user, line in failures]
    return ("import os, pathlib; d = os.environ['WINNOW_RANK_EXIT_DIR']; "
            f"[pathlib.Path(d, f'rank_{{r:05d}}').write_text(text) for r, text in {records!r}]; raise SystemExit(1)")


def test_a_ranks_user_error_reaches_the_node_as_2(tmp_path):
    """torchrun exits 1 whatever its ranks exit with; the rank's record in the exit folder restores the 2."""
    plan = cpu_campaign(output_dir=tmp_path, tiny=True)
    plan = dataclasses.replace(plan, stages=[dataclasses.replace(plan.stage("rl-grpo"), depends_on=(),
                                                                 resources=Resources(requeues=3))])
    plan.save()
    args = ["node", "--campaign-dir", str(tmp_path), "--stage", "rl-grpo", "--", sys.executable, "-c"]
    rank = _failing_ranks((1, 10, True, "rank 1: CheckpointError: no step_* in /ckpt"))
    assert task_main([*args, rank]) == EXIT_USER_ERROR
    record = CampaignStatus(tmp_path).read()["rl-grpo"]
    assert (record["state"], record["error"]) == ("failed", "rank 1: CheckpointError: no step_* in /ckpt")
    # Without a rank's record, a failure is transient: the node keeps torchrun's status and says so.
    assert task_main([*args, "raise SystemExit(1)"]) == 1
    assert CampaignStatus(tmp_path).read()["rl-grpo"]["error"] == "trainer exited with 1; requeued"


def test_the_node_reports_the_rank_that_failed_first(tmp_path):
    """Rank 0 crashes; rank 1 then loses its peer and raises a CheckpointError (a user error) a moment later.

    The status names rank 0's crash, and the job is a crash (torchrun's 1, requeued), not a user
    error: reporting rank 1's later "connection closed" error would send the user after a
    checkpoint that is fine, and would not requeue a transient crash.
    """
    plan = cpu_campaign(output_dir=tmp_path, tiny=True)
    plan = dataclasses.replace(plan, stages=[dataclasses.replace(plan.stage("rl-grpo"), depends_on=(),
                                                                 resources=Resources(requeues=3))])
    plan.save()
    args = ["node", "--campaign-dir", str(tmp_path), "--stage", "rl-grpo", "--", sys.executable, "-c"]
    ranks = _failing_ranks((1, 2_000, True, "rank 1: CheckpointError: Connection closed by peer"),
                           (0, 1_000, False, "rank 0: AssertionError: step 1 has a zero gradient"))
    assert task_main([*args, ranks]) == 1
    assert CampaignStatus(tmp_path).read()["rl-grpo"]["error"] == (
        "trainer exited with 1: rank 0: AssertionError: step 1 has a zero gradient; requeued")
    # The same two failures the other way round: the user error came first and decides.
    ranks = _failing_ranks((1, 1_000, True, "rank 1: CheckpointError: no step_* in /ckpt"),
                           (0, 2_000, False, "rank 0: RuntimeError: Connection closed by peer"))
    assert task_main([*args, ranks]) == EXIT_USER_ERROR
    assert CampaignStatus(tmp_path).read()["rl-grpo"]["error"] == "rank 1: CheckpointError: no step_* in /ckpt"


@pytest.mark.parametrize("error, user_error", [(ConfigError("data.train: not a file"), True),
                                                (AssertionError("step 1 has a zero gradient\ntraceback"), False)])
def test_a_worker_records_its_failure_for_the_node(tmp_path, monkeypatch, error, user_error):
    stage = cpu_campaign(output_dir=tmp_path, tiny=True).stage("curate")

    def bad(stage, context=None):
        raise error

    monkeypatch.setattr(task, "run_stage", bad)
    monkeypatch.setenv(task.RANK_EXIT_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(type(error)):
        task.run_worker(stage)
    record = task.RankFailure.read(tmp_path / "rank_00003")
    assert record.user_error is user_error
    assert record.line == f"rank 3: {type(error).__name__}: {str(error).splitlines()[0]}"


# ---------------------------------------------------------------- the collective timeout


def _sglang(**changes) -> RolloutConfig:
    return RolloutConfig(engine="sglang", servers=["http://r0:30000"], weights_dir="/shared/w", **changes)


def test_collective_timeout_covers_the_rollout_wait_plus_a_sync():
    from pipeline.rollout.sglang.weights import COLLECTIVE_TIMEOUT_MARGIN_S, MAX_GROUP_REFORMS, collective_timeout_s

    # A sync whose group fails re-forms it up to MAX_GROUP_REFORMS times; each try of a bucket waits at most
    # one update call and the group's collective timeout, and the other ranks wait for all of it.
    admin_s = SGLangClientConfig().admin_timeout_s
    assert WEIGHT_SYNC_ALLOWANCE_S == (1 + MAX_GROUP_REFORMS) * (admin_s + collective_timeout_s(admin_s))
    assert COLLECTIVE_TIMEOUT_MARGIN_S > 0 and WEIGHT_SYNC_ALLOWANCE_S == 5580
    # The local engine has no timeout to derive from.
    assert collective_timeout_minutes(parallel=ParallelConfig(), rollout=RolloutConfig()) == 30
    # Defaults: 3600 s × 4 attempts + 5580 s = 333 min, strictly exceeded.
    assert collective_timeout_minutes(parallel=ParallelConfig(), rollout=_sglang()) == 334
    # A batch limit replaces the per-request bound.
    assert collective_timeout_minutes(parallel=ParallelConfig(), rollout=_sglang(batch_timeout_s=1800)) == 124
    assert collective_timeout_minutes(parallel=ParallelConfig(), rollout=_sglang(request_timeout_s=60, max_attempts=2)) == 96
    # Short limits keep the floor.
    assert collective_timeout_minutes(parallel=ParallelConfig(), rollout=RolloutConfig()) == DEFAULT_COLLECTIVE_TIMEOUT_MIN
    for rollout in (_sglang(), _sglang(batch_timeout_s=1800), _sglang(request_timeout_s=600, max_attempts=1)):
        minutes = collective_timeout_minutes(parallel=ParallelConfig(), rollout=rollout)
        wait_s = rollout.batch_timeout_s or rollout.request_timeout_s * rollout.max_attempts
        assert minutes * 60 > wait_s + WEIGHT_SYNC_ALLOWANCE_S
    # An explicit timeout at least the rollout's wait is kept; with the local engine any is.
    assert collective_timeout_minutes(parallel=ParallelConfig(collective_timeout_min=5), rollout=RolloutConfig()) == 5
    assert collective_timeout_minutes(parallel=ParallelConfig(collective_timeout_min=400), rollout=_sglang()) == 400


def test_a_collective_timeout_shorter_than_the_rollout_is_refused_at_load():
    overrides = ["rollout.engine=sglang", "rollout.servers=[http://r0:30000]", "rollout.weights_dir=/w",
                 "parallel.collective_timeout_min=60"]
    with pytest.raises(ConfigError, match=r"parallel.collective_timeout_min: 60 min; .*rollout.request_timeout_s "
                                          r"× rollout.max_attempts.* at least 334 min"):
        load(RLConfig, overrides=overrides)
    cfg = load(RLConfig, overrides=[*overrides[:-1], "parallel.collective_timeout_min=120",
                                    "rollout.batch_timeout_s=1200"])  # 1200 + 5580 s < 120 min
    assert collective_timeout_minutes(parallel=cfg.parallel, rollout=cfg.rollout) == 120


def test_rl_workers_get_the_derived_timeout(monkeypatch):
    seen = {}

    def initialize_process_context(**kwargs):
        seen.update(kwargs)
        return "context"

    # A stand-in for the module stage_context imports: megatron itself is not needed to see the wiring.
    monkeypatch.setitem(sys.modules, "pipeline.parallel.rendezvous",
                        types.SimpleNamespace(initialize_process_context=initialize_process_context))
    cfg = dataclasses.replace(RLConfig(), rollout=_sglang(batch_timeout_s=1800))
    assert task.stage_context(Stage(name="rl", kind="rl", config=cfg)) == "context"
    assert seen["timeout_minutes"] == 124
    assert task.stage_context(cpu_campaign(output_dir="/x", tiny=True).stage("curate")) is None


# ---------------------------------------------------------------- the SIGUSR1 lead


QWEN25_7B = ModelDims(name="Qwen2.5-7B", vocab_size=152064, hidden_size=3584, ffn_hidden_size=18944, num_layers=28,
                      num_attention_heads=28, num_kv_heads=4, head_dim=128, max_position_embeddings=32768,
                      qkv_bias=True)


def test_checkpoint_write_estimate_is_weights_plus_optimizer_at_the_stated_bandwidth():
    params = QWEN25_7B.num_parameters()
    write = checkpoint_write_plan(QWEN25_7B, layout=Layout(data_parallel=8), trainer=TrainerSettings())
    # The first DP rank writes the bf16 weights and 1/8 of the fp32 master + Adam moments.
    assert write.bytes_per_rank == pytest.approx(params * (2 + 12 / 8), rel=1e-6)
    assert write.total_bytes == params * 14
    assert write.seconds == pytest.approx(write.bytes_per_rank / 1e9 * 2 + 60)
    assert 110 < write.seconds < 116 and write.signal_s == 114
    # Half the bandwidth: the transfer part doubles. TP = 2 halves what a rank writes.
    slow = checkpoint_write_plan(QWEN25_7B, layout=Layout(data_parallel=8), trainer=TrainerSettings(),
                                 assumptions=Assumptions(checkpoint_write_gbps=0.5))
    assert slow.seconds - 60 == pytest.approx(2 * (write.seconds - 60))
    split = checkpoint_write_plan(QWEN25_7B, layout=Layout(tensor_parallel=2, data_parallel=4),
                                  trainer=TrainerSettings())
    assert split.bytes_per_rank < 0.6 * checkpoint_write_plan(
        QWEN25_7B, layout=Layout(data_parallel=4), trainer=TrainerSettings()).bytes_per_rank
    # Without the distributed optimizer the first DP rank writes all of the optimizer state.
    whole = checkpoint_write_plan(QWEN25_7B, layout=Layout(data_parallel=8),
                                  trainer=TrainerSettings(distributed_optimizer=False))
    assert whole.bytes_per_rank == params * 14


def _qwen_folder(tmp_path: Path, **changes) -> Path:
    folder = tmp_path / "Qwen2.5-7B"
    folder.mkdir()
    config = {"model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
              "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
              "max_position_embeddings": 32768, **changes}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_signal_lead_is_the_checkpoint_write_with_the_profile_floor(tmp_path):
    profile = dataclasses.replace(load_profile("h100-example"), signal_s=120)
    policy = _qwen_folder(tmp_path)
    base = RLConfig()
    cfg = dataclasses.replace(base, policy=str(policy), trainer=dataclasses.replace(base.trainer, precision="bf16"))
    eight = Resources(nodes=1, ranks_per_node=8, gpus_per_node=8)
    # 7B on 8 ranks, bf16 with the distributed optimizer: 114 s, under the profile's 120 s floor.
    assert signal_lead_s(Stage(name="rl", kind="rl", config=cfg, resources=eight), profile=profile) == 120
    # One rank writes all of it (fp32: 4 + 8 bytes per parameter, no master copy): 2 × 91.4 s + 60 s.
    fp32 = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, precision="fp32"))
    one = Stage(name="rl", kind="rl", config=fp32, resources=Resources(gpus_per_node=1))
    expected = checkpoint_write_plan(QWEN25_7B, layout=Layout(), trainer=TrainerSettings(
        precision="fp32", distributed_optimizer=False)).signal_s
    assert expected == 243 and signal_lead_s(one, profile=profile) == expected
    assert signal_lead_s(one, profile=dataclasses.replace(profile, signal_s=600)) == 600
    # A policy the campaign has not produced yet (the bootstrap's): the floor.
    unknown = Stage(name="rl", kind="rl", config=RLConfig(), resources=Resources(gpus_per_node=1))
    assert signal_lead_s(unknown, profile=profile) == profile.signal_s


def test_under_slurm_the_stages_helpers_ignore_usr1(monkeypatch):
    """SLURM's SIGUSR1 reaches every process of the step; helpers started by the stage must survive it."""
    probe = [sys.executable, "-c", "import signal; print(signal.getsignal(signal.SIGUSR1).name)"]
    monkeypatch.setenv("SLURM_JOB_ID", "5")
    with task._helpers_ignore_usr1():
        assert subprocess.run(probe, capture_output=True, text=True, check=True).stdout == "SIG_IGN\n"
    assert subprocess.run(probe, capture_output=True, text=True, check=True).stdout == "SIG_DFL\n"
    monkeypatch.delenv("SLURM_JOB_ID")
    with task._helpers_ignore_usr1():
        assert subprocess.run(probe, capture_output=True, text=True, check=True).stdout == "SIG_DFL\n"
