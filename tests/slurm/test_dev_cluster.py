"""Real jobs on the dev cluster: multi-task srun, dependencies, signals and requeue.

No accounting storage is configured (no slurmdbd), so ``sacct`` has nothing to
read; a job's outcome is read from ``scontrol show job``, which keeps finished
jobs for MinJobAge = 600 s. Every wait is bounded by the job-level deadline of
``wait_for_job`` and, as a backstop, by pytest-timeout (which also covers the
session fixture's start-up, counted against the first test that uses it).
"""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

import pytest

from pipeline.launch.slurm_profiles import load_profile, parse_slurm_time
from tests.slurm.cluster import (
    START_BUDGET_S,
    STOP_BUDGET_S,
    DevCluster,
    free_port_pair,
    listening_addresses,
    new_state_dir,
    skip_reason,
)

# serial: one dev cluster for the session, started by the first test that asks for it, and
# timings (signal leads, requeue waits) that a second worker competing for the cores would skew.
pytestmark = [pytest.mark.slow, pytest.mark.serial]

FINAL_STATES = {
    "BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "TIMEOUT",
}


def finished(record: dict[str, str]) -> bool:
    return record["JobState"] in FINAL_STATES


def budget(seconds: float) -> pytest.MarkDecorator:
    """pytest-timeout for a test that may be the one paying for the cluster's start."""
    return pytest.mark.timeout(START_BUDGET_S + seconds)


@budget(60)
def test_daemons_listen_on_loopback_only(slurm_cluster: DevCluster) -> None:
    # slurmctld on the chosen port, slurmd on the next one (dev-cluster.sh --port).
    assert listening_addresses(slurm_cluster.port) == {"127.0.0.1"}
    assert listening_addresses(slurm_cluster.port + 1) == {"127.0.0.1"}


@budget(60)
def test_dev_profile_describes_the_running_cluster(slurm_cluster: DevCluster) -> None:
    profile = load_profile("dev")
    fields = slurm_cluster.slurm("sinfo", "-h", "-o", "%R %c %D %L").split()
    partition, cpus_per_node, num_nodes, default_time = fields
    assert partition == profile.partition
    assert int(num_nodes) == profile.nodes
    assert int(cpus_per_node) >= profile.cpus_per_node
    assert parse_slurm_time(default_time, field="DefaultTime") == profile.time_limit_s


@budget(60)
def test_two_task_srun_runs_both_ranks(slurm_cluster: DevCluster, tmp_path: Path) -> None:
    script = """#!/bin/bash
#SBATCH --job-name=winnow-ranks --ntasks=2 --time=2 --output=slurm-%j.out
srun --ntasks=2 bash -c 'echo "procid=$SLURM_PROCID ntasks=$SLURM_NTASKS pid=$$"' > ranks.txt
"""
    job_id = slurm_cluster.sbatch(script, cwd=tmp_path)
    record = slurm_cluster.wait_for_job(job_id, finished, timeout_s=45, what="finished")
    output = (tmp_path / f"slurm-{job_id}.out").read_text()
    assert (record["JobState"], record["ExitCode"]) == ("COMPLETED", "0:0"), f"{record}\n{output}"
    lines = sorted((tmp_path / "ranks.txt").read_text().splitlines())
    assert [line.rsplit(" pid=", 1)[0] for line in lines] == ["procid=0 ntasks=2", "procid=1 ntasks=2"]
    pids = {line.rsplit(" pid=", 1)[1] for line in lines}
    assert len(pids) == 2, f"both ranks ran in one process: {lines}"


@budget(60)
def test_afterok_dependency_waits_for_successful_parent(slurm_cluster: DevCluster, tmp_path: Path) -> None:
    # The parent writes its file only after 2 s: a child started early (dependency
    # ignored; a second CPU is free) would not see it.
    parent = slurm_cluster.sbatch("#!/bin/bash\nsleep 2\ntouch parent-done\n", cwd=tmp_path, args=("--time=1",))
    child = slurm_cluster.sbatch(
        "#!/bin/bash\ntest -e parent-done && touch child-saw-parent\n",
        cwd=tmp_path,
        args=("--time=1", f"--dependency=afterok:{parent}"),
    )
    child_record = slurm_cluster.wait_for_job(child, finished, timeout_s=45, what="finished")
    assert slurm_cluster.job(parent)["JobState"] == "COMPLETED"
    assert child_record["JobState"] == "COMPLETED", child_record
    assert (tmp_path / "child-saw-parent").exists()


@budget(90)
def test_afterok_dependency_on_failed_parent_never_runs(slurm_cluster: DevCluster, tmp_path: Path) -> None:
    parent = slurm_cluster.sbatch("#!/bin/bash\nexit 3\n", cwd=tmp_path, args=("--time=1",))
    child = slurm_cluster.sbatch(
        "#!/bin/bash\ntouch child-ran\n", cwd=tmp_path, args=("--time=1", f"--dependency=afterok:{parent}")
    )
    try:
        parent_record = slurm_cluster.wait_for_job(parent, finished, timeout_s=30, what="finished")
        assert (parent_record["JobState"], parent_record["ExitCode"]) == ("FAILED", "3:0"), parent_record
        # dev-cluster.sh leaves SchedulerParameters without kill_invalid_depend, like
        # most clusters: the child stays PENDING with this reason until cancelled.
        child_record = slurm_cluster.wait_for_job(
            child,
            lambda record: record["Reason"] == "DependencyNeverSatisfied",
            timeout_s=45,
            what="marked DependencyNeverSatisfied",
        )
        assert child_record["JobState"] == "PENDING", child_record
        assert child_record["Dependency"] == f"afterok:{parent}(failed)", child_record
    finally:
        slurm_cluster.cancel(child)
    child_record = slurm_cluster.wait_for_job(child, finished, timeout_s=30, what="cancelled")
    assert child_record["JobState"] == "CANCELLED", child_record
    assert not (tmp_path / "child-ran").exists()


REQUEUE_ON_SIGNAL = """#!/bin/bash
#SBATCH --job-name=winnow-requeue --time=1 --signal=B:USR1@50 --requeue --open-mode=append --output=slurm-%j.out
restart=${SLURM_RESTART_COUNT:-0}
echo "start restart=$restart" >> marker.txt
if (( restart >= 1 )); then
    echo "finished restart=$restart" >> marker.txt
    exit 0
fi
on_usr1() {
    echo "usr1 restart=$restart" >> marker.txt
    scontrol requeue "$SLURM_JOB_ID"
    exit 0
}
trap on_usr1 USR1
# bash runs a trap only between commands; `wait` on a background sleep returns
# as soon as USR1 arrives.
sleep 120 &
wait
echo "no USR1 before the time limit" >> marker.txt
exit 1
"""


@budget(150)
def test_signal_before_time_limit_then_self_requeue(slurm_cluster: DevCluster, tmp_path: Path) -> None:
    # slurmctld checks time limits every 30 s (PERIODIC_TIMEOUT), so USR1 arrives
    # 0-30 s after the start; the requeued job may start again after
    # cred_expire (10 s) plus a scheduling pass (sched_interval = 5 s).
    job_id = slurm_cluster.sbatch(REQUEUE_ON_SIGNAL, cwd=tmp_path)
    try:
        record = slurm_cluster.wait_for_job(job_id, finished, timeout_s=120, what="finished")
    finally:
        slurm_cluster.cancel(job_id)
    marker = (tmp_path / "marker.txt").read_text().splitlines()
    output = (tmp_path / f"slurm-{job_id}.out").read_text()
    assert marker == ["start restart=0", "usr1 restart=0", "start restart=1", "finished restart=1"], output
    assert (record["JobState"], record["Restarts"], record["ExitCode"]) == ("COMPLETED", "1", "0:0"), record


@budget(90)
def test_requeue_exit_code_requeues_automatically(slurm_cluster: DevCluster, tmp_path: Path) -> None:
    # RequeueExit=75 in dev-cluster.sh's slurm.conf; any other non-zero exit fails the job.
    script = """#!/bin/bash
#SBATCH --job-name=winnow-requeue-exit --time=1 --output=slurm-%j.out
restart=${SLURM_RESTART_COUNT:-0}
echo "run restart=$restart" >> marker.txt
(( restart >= 1 )) || exit 75
"""
    job_id = slurm_cluster.sbatch(script, cwd=tmp_path)
    try:
        record = slurm_cluster.wait_for_job(job_id, finished, timeout_s=60, what="finished")
    finally:
        slurm_cluster.cancel(job_id)
    assert (tmp_path / "marker.txt").read_text().splitlines() == ["run restart=0", "run restart=1"]
    assert (record["JobState"], record["Restarts"], record["ExitCode"]) == ("COMPLETED", "1", "0:0"), record


@pytest.mark.timeout(START_BUDGET_S + 2 * STOP_BUDGET_S + 60)
def test_start_status_stop_lifecycle() -> None:
    """A second, private cluster: start is idempotent, stop kills the daemons and is safe twice."""
    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)
    cluster = DevCluster(state_dir=new_state_dir(), port=free_port_pair())
    try:
        first = cluster.start()
        assert first.returncode == 0, first.stderr
        pids = cluster.daemon_pids()
        assert None not in pids.values(), pids

        again = cluster.start()
        assert again.returncode == 0, again.stderr
        assert again.stdout == f"export SLURM_CONF={cluster.slurm_conf}\n"
        assert cluster.daemon_pids() == pids, "a second start restarted running daemons"
        assert "starting" not in again.stderr

        status = cluster.script("status", timeout_s=30)
        assert status.returncode == 0, status.stdout + status.stderr
        assert " idle " in status.stdout and "dev*" in status.stdout, status.stdout

        stopped = cluster.script("stop", timeout_s=STOP_BUDGET_S)
        assert stopped.returncode == 0, stopped.stderr
        assert cluster.daemon_pids() == {"munged": None, "slurmctld": None, "slurmd": None}
        for pid in pids.values():
            assert not Path(f"/proc/{pid}").exists(), f"pid {pid} survived stop"

        stopped_again = cluster.script("stop", timeout_s=STOP_BUDGET_S)
        assert stopped_again.returncode == 0, stopped_again.stderr
        assert "nothing to stop" in stopped_again.stderr

        down = cluster.script("status", timeout_s=30)
        assert down.returncode == 1
        assert "is down" in down.stdout
    finally:
        cluster.script("stop", timeout_s=STOP_BUDGET_S)
        shutil.rmtree(cluster.state_dir, ignore_errors=True)


@pytest.mark.timeout(START_BUDGET_S + STOP_BUDGET_S + 60)
def test_start_fails_fast_and_clearly_when_port_is_taken() -> None:
    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)
    cluster = DevCluster(state_dir=new_state_dir(), port=free_port_pair())
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", cluster.port))
        squatter.listen()
        try:
            failed = cluster.start()
            assert failed.returncode == 1
            assert failed.stdout == "", "no export line for a cluster that did not start"
            assert f"error: port {cluster.port} on 127.0.0.1 is taken" in failed.stderr, failed.stderr
            assert cluster.start_s < 30, "the taken port should be found before any wait"
            assert cluster.daemon_pids()["slurmctld"] is None
        finally:
            cluster.script("stop", timeout_s=STOP_BUDGET_S)
            shutil.rmtree(cluster.state_dir, ignore_errors=True)
