"""The node/worker/serve roles: status records, requeue exit code, rollout server discovery and lifetime."""

from __future__ import annotations

import dataclasses
import http.server
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import fiddle as fdl
import pytest

from pipeline.cli.task import main as task_main
from pipeline.config import Resources, RolloutServers
from pipeline.launch import task
from pipeline.launch.campaign import EXIT_REQUEUE, CampaignPlan, CampaignStatus, Stage
from recipes.campaigns import cpu_campaign, llama31_8b
from recipes.stages import rl_task, stage_task


def _saved_plan(tmp_path: Path) -> CampaignPlan:
    plan = cpu_campaign(output_dir=tmp_path, tiny=True)
    plan.save()
    return plan


def test_node_role_records_done(tmp_path, monkeypatch):
    _saved_plan(tmp_path)
    monkeypatch.setattr(task, "run_stage", lambda stage: "done")
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    assert task_main(["node", "--campaign-dir", str(tmp_path), "--stage", "curate"]) == 0
    record = CampaignStatus(tmp_path).read()["curate"]
    assert (record["state"], record["job_id"], record["attempts"]) == ("done", "41", 1)


def test_node_role_records_failure_and_reraises(tmp_path, monkeypatch):
    _saved_plan(tmp_path)

    def broken(stage):
        raise ValueError("no prompts")

    monkeypatch.setattr(task, "run_stage", broken)
    with pytest.raises(ValueError):
        task_main(["node", "--campaign-dir", str(tmp_path), "--stage", "curate"])
    assert CampaignStatus(tmp_path).read()["curate"]["error"] == "ValueError: no prompts"


def test_rl_stopped_before_its_last_step_exits_for_requeue(tmp_path, monkeypatch):
    _saved_plan(tmp_path)
    monkeypatch.setattr(task, "run_stage", lambda stage: "stopped")
    assert task_main(["node", "--campaign-dir", str(tmp_path), "--stage", "rl-grpo"]) == EXIT_REQUEUE
    assert CampaignStatus(tmp_path).state("rl-grpo") == "pending"


def test_node_role_runs_the_launcher_and_reports_its_failure(tmp_path):
    _saved_plan(tmp_path)
    code = task_main(["node", "--campaign-dir", str(tmp_path), "--stage", "curate", "--",
                      sys.executable, "-c", "raise SystemExit(3)"])
    assert code == 3
    assert CampaignStatus(tmp_path).read()["curate"]["error"] == "trainer exited with 3"


def test_rl_launcher_exit_is_judged_by_the_checkpoint(tmp_path):
    plan = _saved_plan(tmp_path)
    steps = plan.stage("rl-grpo").config.steps
    ckpt = Path(plan.stage("rl-grpo").config.checkpoint.directory)
    (ckpt / "step_00000001").mkdir(parents=True)
    args = ["node", "--campaign-dir", str(tmp_path), "--stage", "rl-grpo", "--", sys.executable, "-c", "pass"]
    assert task_main(args) == EXIT_REQUEUE  # ranks exited 0 one step short: a signal stopped them
    (ckpt / f"step_{steps:08d}").mkdir()
    assert task_main(args) == 0
    assert CampaignStatus(tmp_path).state("rl-grpo") == "done"


def test_rollout_urls_follow_the_trainer_nodes():
    stage = llama31_8b(output_dir="/x").stage("rl-default")
    hosts = ["t0", "t1", "r0", "r1"]
    assert task.rollout_urls(stage, hosts=hosts) == [
        f"http://{host}:{30000 + i}" for host in ("r0", "r1") for i in range(4)]
    with pytest.raises(RuntimeError, match="needs 2 trainer and 2 rollout nodes"):
        task.rollout_urls(stage, hosts=hosts[:3])
    commands = task.server_commands(stage, host="gpu-7", python="py")
    assert [c[c.index("--base-gpu-id") + 1] for c in commands] == ["0", "2", "4", "6"]
    assert all(c[c.index("--host") + 1] == "gpu-7" for c in commands)  # the node's name, never 0.0.0.0
    # The servers load the HF folder; the trainer's policy is its converted checkpoint.
    assert stage.resources.rollout.model_path == "/models/Llama-3.1-8B-Instruct" != stage.config.policy
    assert all(c[c.index("--tp-size") + 1] == "2" and c[c.index("--model-path") + 1] == "/models/Llama-3.1-8B-Instruct"
               and c[c.index("--tokenizer-path") + 1] == "/models/Llama-3.1-8B-Instruct" for c in commands)


def test_with_servers_switches_to_the_backend_the_servers_run(tmp_path):
    from pipeline.rollout.backends import rollout_backend

    def served(stage: Stage, program: str) -> Stage:
        stage = dataclasses.replace(stage, resources=dataclasses.replace(
            stage.resources, rollout=RolloutServers(nodes=1, server=program, model_path=str(tmp_path / "hf"))))
        return task.with_servers(stage, ["http://r0:30000"])

    stage = cpu_campaign(output_dir=tmp_path, tiny=True).stage("rl-grpo")
    assert task.with_servers(stage, []) is stage
    with pytest.raises(ValueError, match="no resources.rollout"):
        task.with_servers(stage, ["http://r0:30000"])
    for program in ("sglang", "standin"):  # the stand-in speaks SGLang's protocol: the same backend
        rollout = served(stage, program).config.rollout
        backend = rollout_backend(rollout.engine)
        assert backend.servers is not None and program in backend.servers.modules
        assert rollout.servers == ["http://r0:30000"] and rollout.engine != stage.config.rollout.engine
        assert rollout.weights_dir == str(tmp_path / "rl" / "grpo" / f"{backend.name}_weights")
    for name, output in (("curate", "curate"), ("evaluate-grpo", "eval/grpo")):
        rollout = served(cpu_campaign(output_dir=tmp_path, tiny=True).stage(name), "standin").config.rollout
        assert rollout_backend(rollout.engine).servers is not None and rollout.servers == ["http://r0:30000"]
        assert rollout.weights_dir == str(tmp_path / output / f"{rollout.engine}_weights")


def test_the_serve_role_supervises_with_the_leases_the_trainers_client_writes(tmp_path, monkeypatch):
    """A server loading weights fails its health probes like a hung one; the trainer's client leaves a lease
    in the weights folder of the stage's servers, and the serve role's supervisor must read that folder."""
    from pipeline.rollout.leases import load_leases_dir

    plan = cpu_campaign(output_dir=tmp_path, tiny=True)
    stage = plan.stage("rl-grpo")
    stage = dataclasses.replace(stage, resources=dataclasses.replace(
        stage.resources, rollout=RolloutServers(nodes=1, servers_per_node=2, server="standin",
                                                model_path=str(tmp_path / "hf"))))
    plan = dataclasses.replace(plan, stages=[stage if s.name == stage.name else s for s in plan.stages])
    plan.save()
    seen = {}
    monkeypatch.setattr(task, "serve", lambda commands, **kwargs: seen.update(kwargs) or 0)
    monkeypatch.setenv("SLURMD_NODENAME", "r0")
    assert task.run_role("serve", campaign_dir=str(tmp_path), stage_name="rl-grpo") == 0
    urls = ["http://r0:30000", "http://r0:30001"]
    assert seen["urls"] == urls
    assert seen["load_leases_dir"] == load_leases_dir(task.with_servers(stage, urls).config.rollout.weights_dir)
    assert seen["load_leases_dir"] == tmp_path / "rl" / "grpo" / "sglang_weights" / ".loading"


def test_wait_for_servers_sees_health(tmp_path):
    (tmp_path / "health").write_text("ok")
    handler = lambda *a: http.server.SimpleHTTPRequestHandler(*a, directory=str(tmp_path))  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        task.wait_for_servers([f"http://127.0.0.1:{server.server_port}"], timeout_s=10, poll_s=0.1)
        with pytest.raises(RuntimeError, match="not healthy after 0 s: http://127.0.0.1:9"):
            task.wait_for_servers(["http://127.0.0.1:9"], timeout_s=0.01, poll_s=0.1)
    finally:
        server.shutdown()


def test_serve_stops_on_this_attempts_marker_only(tmp_path):
    marker = tmp_path / "rl.done"
    marker.write_text("7:0\n")  # a previous attempt's marker
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    threading.Timer(1.0, lambda: marker.write_text("7:1\n")).start()
    assert task.serve([sleeper], done_marker=marker, token="7:1", poll_s=0.1) == 0
    assert task.serve([[sys.executable, "-c", "raise SystemExit(4)"]], done_marker=marker, token="8:0",
                      poll_s=0.1) == 4


def test_serve_ends_soon_after_the_marker_whatever_its_probe_interval(tmp_path):
    """The job of a stage with servers ends when the serve role sees the trainer's marker: not a probe interval later."""
    marker = tmp_path / "rl.done"
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    threading.Timer(0.5, lambda: marker.write_text("9:0\n")).start()
    started = time.monotonic()
    assert task.serve([sleeper], done_marker=marker, token="9:0", poll_s=30.0) == 0
    assert time.monotonic() - started < 0.5 + task.ROLE_POLL_S + 1.0


# The serve role in a process of its own, over two servers that record their process ids and sleep.
SERVE_SCRIPT = """
import sys
from pathlib import Path
from pipeline.launch.task import serve

started = sys.argv[1]
server = [sys.executable, "-c", "import os, sys, time; open(os.path.join(sys.argv[1], str(os.getpid())), 'w'); "
          "time.sleep(120)", started]
# min_servers=2: a server dying of the signal would end the role at once (no restart budget).
sys.exit(serve([server, server], done_marker=Path(sys.argv[2]), token="5:0", poll_s=0.05, min_servers=2))
"""


def _sigusr1_ignored(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status").read_text()
    state = next(line for line in status.splitlines() if line.startswith("State:"))
    assert "zombie" not in state, f"process {pid} died: {state}"
    mask = next(line for line in status.splitlines() if line.startswith("SigIgn:")).split()[1]
    return bool(int(mask, 16) >> (signal.SIGUSR1 - 1) & 1)


def test_serve_role_and_its_servers_outlive_sigusr1_and_end_on_the_marker(tmp_path):
    # SLURM's --signal=USR1@N (without B:) reaches every process of the job step: the serve role and
    # each server. Their default action would kill them, and srun would then end the trainer's tasks
    # before the checkpoint the signal asks for.
    started, marker = tmp_path / "started", tmp_path / "rl.done"
    started.mkdir()
    role = subprocess.Popen([sys.executable, "-c", SERVE_SCRIPT, str(started), str(marker)],
                            cwd=Path(__file__).resolve().parents[2])
    try:
        deadline = time.monotonic() + 60
        while len(list(started.iterdir())) < 2 and role.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        servers = sorted(int(path.name) for path in started.iterdir())
        assert len(servers) == 2, (servers, role.poll())
        for pid in (role.pid, *servers):
            os.kill(pid, signal.SIGUSR1)
        time.sleep(1.0)  # 20 supervision rounds
        assert role.poll() is None
        assert all(_sigusr1_ignored(pid) for pid in (role.pid, *servers))
        assert sorted(int(path.name) for path in started.iterdir()) == servers  # none restarted
        marker.write_text("5:0\n")
        assert role.wait(timeout=60) == 0
    finally:
        if role.poll() is None:
            role.kill()
            role.wait()
    for pid in servers:  # the role's close ended them
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()


def test_stage_tasks_build_back_to_the_typed_stage(tmp_path):
    plan = llama31_8b(output_dir=tmp_path)
    for stage in plan.stages:
        built = fdl.build(stage_task(stage))
        assert built.keywords["stage"] == stage
    rl = dataclasses.replace(plan.stage("rl-grpo").config, steps=3)
    built = fdl.build(rl_task(rl, resources=Resources(nodes=2, ranks_per_node=8)))
    assert built.keywords["stage"] == Stage(name="rl", kind="rl", config=rl,
                                            resources=Resources(nodes=2, ranks_per_node=8))
    assert isinstance(plan.stage("rl-grpo").resources.rollout, RolloutServers)


def test_every_run_of_a_local_stage_script_is_an_attempt_of_its_own(tmp_path, monkeypatch):
    """A relaunched local stage's servers must not read the previous attempt's done marker as theirs."""
    import subprocess

    from pipeline.launch import task
    from pipeline.launch.nemo import stage_script
    from recipes.campaigns import qwen25_math_7b

    plan = qwen25_math_7b(output_dir=tmp_path)
    script = stage_script(plan, plan.stage("rl-default"), python=sys.executable, workdir=tmp_path)
    setup = "\n".join(line for line in script.splitlines() if line.startswith("export WINNOW_ATTEMPT"))
    env = {key: value for key, value in os.environ.items() if not key.startswith("SLURM_")}
    tokens = {subprocess.run(["bash", "-c", setup + '\necho "$WINNOW_ATTEMPT"'], env=env, capture_output=True,
                             text=True, check=True).stdout.strip() for _ in range(2)}
    assert len(tokens) == 2 and all(token.startswith("local-") for token in tokens)
    slurm = {**env, "SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": "3"}
    assert subprocess.run(["bash", "-c", setup + '\necho "$WINNOW_ATTEMPT"'], env=slurm, capture_output=True,
                          text=True, check=True).stdout.strip() == "42:3"  # every node of one attempt alike
    monkeypatch.setenv(task.ATTEMPT_ENV, "local-99:0")
    assert task._attempt_token() == "local-99:0"
