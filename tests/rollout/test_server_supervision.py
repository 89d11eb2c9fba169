"""Supervised rollout servers: real fake-SGLang subprocesses under a ``Supervisor``, an ``SGLangEngine`` on them.

A server is killed with ``kill -9`` and another stopped with ``SIGSTOP`` while their requests
are in flight. The supervisor restarts each at its URL; the engine takes it back only after it
loaded the newest weights folder and reports the trainer's weight version, which the server's
own request log shows (the reload comes before any ``/generate`` of the new process). Every
step delivers each requested sample exactly once with the tokens of the current version, so
a lost, duplicated or stale sample fails. A server that keeps dying is retired and the run
goes on; below ``min_servers`` the run fails with one error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from pipeline.config import RolloutConfig
from pipeline.configlib import ConfigError
from pipeline.parallel.rendezvous import reserved_port
from pipeline.rollout.sglang import protocol as api
from pipeline.rollout.sglang.client import SGLangClientConfig, run_sync
from pipeline.rollout.sglang.generation import SGLangEngine
from pipeline.rollout.sglang.weights import SGLangWeights, UpdateGroupSettings
from pipeline.rollout.supervise import ServerCommand, Supervisor
from pipeline.rollout.types import Completion, GenerationRequest, RolloutError, SamplingParams
from tests.rollout.fake_sglang import REPO_ROOT, expected_sample, start_fake_servers

SEED = 77
PARAMS = SamplingParams(max_new_tokens=5, temperature=1.0, seed=SEED, stop_token_ids=(3, 500))


def _engine_config(**overrides: Any) -> SGLangClientConfig:
    settings: dict[str, Any] = dict(
        max_in_flight=6, max_samples_per_request=2, request_timeout_s=20.0, connect_timeout_s=2.0,
        max_consecutive_failures=2, backoff_initial_s=0.05, backoff_max_s=0.2, startup_timeout_s=30.0,
        # Probe limits well above a loaded machine's latency: a false hang would count a failure.
        health_poll_s=0.05, watchdog_interval_s=0.2, probe_timeout_s=2.0, admin_timeout_s=10.0,
        recovery_timeout_s=30.0, show_progress=False,
    )
    settings.update(overrides)
    return SGLangClientConfig(**settings)


class Fleet:
    """Fake servers on fixed ports under a supervisor running in a background thread."""

    def __init__(self, tmp_path: Path, flags: list[list[str]], *, max_restarts: int, probe_timeout_s: float = 2.0,
                 max_failed_probes: int = 3) -> None:
        # Held while the fleet runs: a killed server restarts on its port, which nothing may take meanwhile.
        self._ports = contextlib.ExitStack()
        ports = [self._ports.enter_context(reserved_port()) for _ in flags]
        self.urls = [f"http://127.0.0.1:{port}" for port in ports]
        self.logs = [tmp_path / f"server{i}.jsonl" for i in range(len(flags))]
        commands = [
            ServerCommand(command=(sys.executable, "-m", "tests.rollout.fake_sglang", "--port", str(port),
                                   "--port-file", str(tmp_path / f"server{i}.port"), "--log", str(log), *extra),
                          url=url)
            for i, (port, url, log, extra) in enumerate(zip(ports, self.urls, self.logs, flags))
        ]
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        # A probe may wait a while on a loaded machine; a stopped server still fails max_failed_probes within seconds.
        self.supervisor = Supervisor(commands, max_restarts=max_restarts, probe_timeout_s=probe_timeout_s,
                                     probe_interval_s=0.1, max_failed_probes=max_failed_probes, startup_timeout_s=30.0,
                                     env=env)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self.supervisor.run, kwargs={"until": self._stop.is_set}, daemon=True)

    def __enter__(self) -> Fleet:
        self.supervisor.start()
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self.supervisor.close()
        self._ports.close()

    def records(self, index: int) -> list[dict[str, Any]]:
        import json

        if not self.logs[index].exists():
            return []
        return [json.loads(line) for line in self.logs[index].read_text().splitlines() if line.strip()]

    def signal_when_busy(self, index: int, sig: int) -> threading.Thread:
        """Send ``sig`` to server ``index`` as soon as its current process has a ``/generate`` in flight."""
        pid = self.supervisor.pids[index]
        seen = sum(r["path"] == "/generate" and r["pid"] == pid for r in self.records(index))

        def wait_and_signal() -> None:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                if sum(r["path"] == "/generate" and r["pid"] == pid for r in self.records(index)) > seen:
                    os.kill(pid, sig)
                    return
                time.sleep(0.005)

        thread = threading.Thread(target=wait_and_signal, daemon=True)
        thread.start()
        return thread


def _requests(step: int, num_prompts: int = 14) -> list[GenerationRequest]:
    return [GenerationRequest(f"s{step}q{i}", [i + 2, 19, step], 1 + i % 4) for i in range(num_prompts)]


def _assert_exact_delivery(completions: list[Completion], requests: list[GenerationRequest], *, version: int) -> None:
    keys = [(r.prompt_id, s) for r in requests for s in range(r.num_samples)]
    assert [(c.prompt_id, c.sample_index) for c in completions] == keys  # none lost, none twice
    prompts = {r.prompt_id: list(r.prompt_token_ids) for r in requests}
    served = "default" if version == 0 else str(version)
    for c in completions:
        tokens, logprobs, finish = expected_sample(
            prompts[c.prompt_id], sampling_seed=api.sample_seed(SEED, c.prompt_id, c.sample_index),
            weight_version=served, max_new_tokens=PARAMS.max_new_tokens, stop_token_ids=list(PARAMS.stop_token_ids))
        assert c.token_ids.tolist() == tokens and c.finish_reason == finish and c.weight_version == version


def _recover(engine: SGLangEngine) -> None:
    """Wait until no server is down (each back, stale until the next update, or retired), as a batch waits for them."""
    pool = engine.pool

    async def run() -> None:
        async with pool.client() as client:
            await asyncio.gather(*(pool.recover(client, s) for s in pool.servers if s.state == "down"))

    run_sync(run())


def _resynced_before_serving(records: list[dict[str, Any]], pid: int, *, folder: str, version: int) -> bool:
    """The process ``pid`` loaded ``folder`` as ``version`` before any ``/generate`` it got."""
    mine = [r for r in records if r["pid"] == pid]
    paths = [r["path"] for r in mine]
    if "/update_weights_from_disk" not in paths:
        return False
    load = paths.index("/update_weights_from_disk")
    body = mine[load]["body"]
    return "/generate" not in paths[:load] and body["model_path"] == folder and body["weight_version"] == str(version)


@pytest.mark.timeout(120)
def test_killed_and_hung_servers_are_restarted_resynced_and_lose_no_sample(tmp_path):
    with Fleet(tmp_path, [["--delay-s", "0.15"]] * 3, max_restarts=2) as fleet:
        engine = SGLangEngine.attach(fleet.urls, config=_engine_config(max_server_failures=2))
        first_pids = list(fleet.supervisor.pids)
        completions = engine.generate(_requests(0), PARAMS)
        _assert_exact_delivery(completions, _requests(0), version=0)

        version = 0
        for step, (target, sig) in enumerate([(0, signal.SIGKILL), (1, signal.SIGSTOP)], start=1):
            version += 1
            folder = str(tmp_path / f"v{version}")
            SGLangWeights(engine.pool).load_from_disk(folder, version=version)
            fault = fleet.signal_when_busy(target, sig)
            completions = engine.generate(_requests(step), PARAMS)
            fault.join()
            _assert_exact_delivery(completions, _requests(step), version=version)
            _recover(engine)
            pid = fleet.supervisor.pids[target]
            assert pid != first_pids[target] and fleet.supervisor.restarts[target] == 1
            # The restarted process started at the launch weights ("default") and was brought to the
            # trainer's version from the newest folder before it got a request.
            assert engine.pool.live_servers == fleet.urls
            completions = engine.generate(_requests(10 + step), PARAMS)
            _assert_exact_delivery(completions, _requests(10 + step), version=version)
            assert _resynced_before_serving(fleet.records(target), pid, folder=folder, version=version)

        assert fleet.supervisor.restarts == [1, 1, 0]
        assert engine.metrics() == {"rollout/servers_live": 3.0, "rollout/servers_down": 0.0,
                                    "rollout/servers_stale": 0.0, "rollout/servers_retired": 0.0,
                                    "rollout/server_recoveries": 2.0}


@pytest.mark.timeout(120)
def test_a_server_that_keeps_dying_is_retired_and_the_run_continues(tmp_path, caplog):
    # Server 2 answers one /generate per process and dies on the next: twice is one failure too many.
    flags = [["--delay-s", "0.02"]] * 2 + [["--mode", "die_after", "--die-after", "1", "--delay-s", "0.02"]]
    with Fleet(tmp_path, flags, max_restarts=1) as fleet:
        engine = SGLangEngine.attach(fleet.urls, config=_engine_config(max_server_failures=1))
        folder = str(tmp_path / "v1")
        SGLangWeights(engine.pool).load_from_disk(folder, version=1)
        with caplog.at_level(logging.ERROR, logger="pipeline.rollout.sglang.servers"):
            for step in range(4):
                completions = engine.generate(_requests(step), PARAMS)
                _assert_exact_delivery(completions, _requests(step), version=1)
                _recover(engine)
        assert list(engine.pool.retired_servers) == [fleet.urls[2]]
        assert engine.pool.live_servers == fleet.urls[:2]
        retired_lines = [r.getMessage() for r in caplog.records if "retiring SGLang server" in r.getMessage()]
        assert len(retired_lines) == 1 and fleet.urls[2] in retired_lines[0] and "2 of 3 servers left" in retired_lines[0]
        assert engine.metrics()["rollout/servers_retired"] == 1.0
        deadline = time.monotonic() + 10
        while not fleet.supervisor.retired[2] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert fleet.supervisor.retired == [False, False, True] and fleet.supervisor.restarts == [0, 0, 1]
        # Its one restart was re-synced too before it served.
        restarted = fleet.records(2)
        pids = list(dict.fromkeys(r["pid"] for r in restarted))
        assert len(pids) == 2 and _resynced_before_serving(restarted, pids[1], folder=folder, version=1)


@pytest.mark.timeout(60)
def test_below_min_servers_the_run_fails_with_one_clear_error(tmp_path):
    servers = start_fake_servers(tmp_path, [dict(delay_s=0.02), dict(mode="die_after", die_after=0)])
    try:
        engine = SGLangEngine.attach([s.url for s in servers], config=_engine_config(max_server_failures=0,
                                                                                       min_servers=2))
        with pytest.raises(RolloutError, match=r"only 1 of 2 SGLang servers left, below rollout.min_servers=2; "
                                               r"retired: \{'http://127.0.0.1:\d+': 'failure 1 \(max_server_failures=0\)"):
            engine.generate(_requests(0), PARAMS)
    finally:
        for server in servers:
            server.kill()


def test_min_servers_is_checked_against_the_servers_at_load():
    with pytest.raises(ConfigError, match="min_servers: 3 exceeds the 2 servers"):
        RolloutConfig(engine="sglang", servers=["http://a:1", "http://b:2"], weights_dir="w", min_servers=3)
    rollout = RolloutConfig(engine="sglang", servers=["http://a:1", "http://b:2"], weights_dir="w", min_servers=2,
                            max_server_failures=5, server_recovery_timeout_s=60.0, health_timeout_s=7.0)
    client = SGLangClientConfig.from_rollout(rollout, show_progress=False)
    assert (client.min_servers, client.max_server_failures, client.recovery_timeout_s, client.probe_timeout_s) == (
        2, 5, 60.0, 7.0)


def test_supervisor_restarts_an_exited_process_within_its_budget(tmp_path):
    # No URL, no health probes: exits alone drive it. Budget 2: the third exit retires the server.
    command = ServerCommand(command=(sys.executable, "-c", "raise SystemExit(5)"))
    supervisor = Supervisor([command], max_restarts=2, probe_interval_s=0.01)
    with supervisor:
        deadline = time.monotonic() + 30
        while supervisor.num_active and time.monotonic() < deadline:
            supervisor.check()
            time.sleep(0.01)
    assert supervisor.restarts == [2] and supervisor.retired == [True] and supervisor.last_exit == 5


def ignores(pid: int, sig: int) -> bool:
    """Whether process ``pid`` ignores ``sig``: bit sig-1 of the ``SigIgn`` mask in ``/proc/<pid>/status``."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    raise AssertionError(f"no SigIgn line for process {pid}")


def test_a_restarted_server_still_ignores_sigusr1_and_still_dies_of_sigterm(tmp_path):
    # A server that exits at its first start and sleeps at its second, recording each start's process id.
    starts = tmp_path / "starts"
    script = "\n".join(["import os, sys, time", "first = not os.path.exists(sys.argv[1])",
                        "with open(sys.argv[1], 'a') as log:", "    log.write(f'{os.getpid()}\\n')",
                        "sys.exit(3) if first else time.sleep(60)"])
    supervisor = Supervisor([ServerCommand(command=(sys.executable, "-c", script, str(starts)))], max_restarts=1,
                            probe_interval_s=0.01, ignored_signals=(signal.SIGUSR1,))
    before = signal.getsignal(signal.SIGUSR1)
    with supervisor:
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN  # the supervisor's process too
        deadline = time.monotonic() + 30
        while supervisor.restarts != [1] and time.monotonic() < deadline:
            supervisor.check()
            time.sleep(0.01)
        assert supervisor.restarts == [1] and supervisor.last_exit == 3  # the first start exited, once
        (pid,) = supervisor.pids
        while (not starts.is_file() or str(pid) not in starts.read_text().split()) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ignores(pid, signal.SIGUSR1)  # inherited through the restart's exec
        os.kill(pid, signal.SIGUSR1)  # what SLURM's --signal=USR1@N sends every process of the step
        time.sleep(0.3)
        supervisor.check()
        assert supervisor.pids == [pid] and supervisor.restarts == [1]
        os.kill(pid, signal.SIGTERM)  # the end of the job still ends a server
        while supervisor.num_active and time.monotonic() < deadline:
            supervisor.check()
            time.sleep(0.01)
        assert supervisor.retired == [True] and supervisor.last_exit == -signal.SIGTERM
    assert signal.getsignal(signal.SIGUSR1) == before  # restored by close


def test_serve_role_outlives_a_retired_server_while_min_servers_remain(tmp_path):
    from pipeline.launch import task

    marker = tmp_path / "rl.done"
    crasher = [[sys.executable, "-c", "raise SystemExit(4)"]]
    threading.Timer(1.0, lambda: marker.write_text("1:0\n")).start()
    # Retired after one restart, but 2 servers on other nodes still meet min_servers=2: serve on.
    assert task.serve(crasher, done_marker=marker, token="1:0", poll_s=0.05, urls=["http://127.0.0.1:9"],
                      max_restarts=1, min_servers=2, servers_elsewhere=2) == 0
    # Alone below min_servers: the role ends with the server's exit status, so the job ends too.
    assert task.serve(crasher, done_marker=marker, token="2:0", poll_s=0.05, urls=["http://127.0.0.1:9"],
                      max_restarts=1, min_servers=2, servers_elsewhere=1) == 4


def test_a_campaign_stage_needs_min_servers_servers():
    import dataclasses

    from recipes.campaigns import llama31_8b

    stage = llama31_8b(output_dir="runs/l8").stage("rl-grpo")
    assert stage.resources.rollout is not None
    count = stage.resources.rollout.nodes * stage.resources.rollout.servers_per_node
    rollout = dataclasses.replace(stage.config.rollout, min_servers=count + 1)
    with pytest.raises(ConfigError, match=f"config.rollout.min_servers: {count + 1} exceeds the {count} servers"):
        dataclasses.replace(stage, config=dataclasses.replace(stage.config, rollout=rollout))


def _version_buckets(version: int) -> list[list[tuple[str, Any]]]:
    import torch

    generator = torch.Generator().manual_seed(version)
    return [[("model.a", torch.randn(4, 3, generator=generator)), ("model.b", torch.randn(5, generator=generator))],
            [("model.c", torch.randn(2, 2, generator=generator))]]


def _distributed_worker(rank: int, world_size: int, tmp_dir: str) -> dict[str, Any]:
    import torch

    from pipeline.rollout.weight_sync import DistributedSyncedEngine

    tmp = Path(tmp_dir)
    flags = [["--join-groups", "--group-timeout-s", "10", "--weights-out", str(tmp / f"server{i}.safetensors")]
             for i in range(2)]
    # A fake server joining a gloo group answers no probe until every member joined: a wide hang window.
    with Fleet(tmp, flags, max_restarts=1, probe_timeout_s=2.0, max_failed_probes=5) as fleet:
        client = SGLangEngine.attach(fleet.urls, config=_engine_config(max_server_failures=1))
        sink = SGLangWeights(client.pool, update_group=UpdateGroupSettings(
            backend="gloo", master_address="127.0.0.1", ranks_per_server=1))
        engine = DistributedSyncedEngine(client, sink=sink, bucket_bytes=1 << 20)
        engine.consume(iter(_version_buckets(1)), version=1)
        first_pid = fleet.supervisor.pids[1]
        os.kill(first_pid, signal.SIGKILL)  # between two steps: no request in flight
        completions = client.generate(_requests(1), PARAMS)
        _assert_exact_delivery(completions, _requests(1), version=1)
        _recover(client)
        stale = dict(client.metrics())
        new_pid = fleet.supervisor.pids[1]
        engine.consume(iter(_version_buckets(2)), version=2)
        from safetensors.torch import load_file

        received = load_file(str(tmp / "server1.safetensors"))
        expected = dict(pair for bucket in _version_buckets(2) for pair in bucket)
        completions = client.generate(_requests(2), PARAMS)
        _assert_exact_delivery(completions, _requests(2), version=2)
        paths = [r["path"] for r in fleet.records(1) if r["pid"] == new_pid]
        # The server that stayed up left the first group before joining the second: one communicator each.
        survivor = [(r["path"], r["body"].get("group_name")) for r in fleet.records(0)
                    if r["path"] in ("/init_weights_update_group", "/destroy_weights_update_group")]
        engine.close()
        return {"stale": stale, "restarted": new_pid != first_pid, "live": client.pool.live_servers, "urls": fleet.urls,
                "equal": received.keys() == expected.keys() and all(torch.equal(received[k], v)
                                                                   for k, v in expected.items()),
                "paths": paths, "survivor": survivor}


@pytest.mark.slow  # a spawned trainer rank and torch-importing servers: 10 s idle, 40 s on a loaded machine
@pytest.mark.distributed  # the trainer rank and two servers in one gloo group, all busy at once
@pytest.mark.timeout(180)
def test_a_restarted_server_rejoins_a_new_update_group_before_it_serves(tmp_path):
    from tests.distributed_utils import run_distributed

    outcome = run_distributed(_distributed_worker, world_size=1, args=(str(tmp_path),), timeout_s=160.0)[0]
    assert outcome["restarted"]
    # Healthy again but at its launch weights: out of the rotation until the next sync.
    assert outcome["stale"]["rollout/servers_stale"] == 1.0 and outcome["stale"]["rollout/servers_live"] == 1.0
    assert outcome["equal"] and outcome["live"] == outcome["urls"]
    paths = outcome["paths"]
    # Taken back only after a session it might still hold was closed (none was: SGLang refuses the close);
    # at the next sync its session opened first, then it joined the new group.
    assert paths[:3] == ["/end_weight_update", "/begin_weight_update", "/init_weights_update_group"]
    session = paths[1:]
    assert "/generate" in session and session.index("/end_weight_update") < session.index("/generate")
    (init, first), (destroy, destroyed), (again, second) = outcome["survivor"]
    assert (init, destroy, again) == ("/init_weights_update_group", "/destroy_weights_update_group",
                                      "/init_weights_update_group")
    # Group names carry the trainer process's own prefix: a server that outlived another trainer holds none of them.
    assert destroyed == first and first.startswith("winnow-weights-") and first.endswith("-0")
    assert second == first.removesuffix("-0") + "-1"


def test_model_info_version_is_read_from_sglangs_own_response_struct():
    from tests.rollout import sglang_schema

    types = sglang_schema.api_types()
    answer = types.GetModelInfoResponse(model_path="m", weight_version="7").to_json_value()
    assert api.parse_model_info_version(answer, initial_version=0, current_version=7) == 7
    started = types.GetModelInfoResponse(model_path="m", weight_version="default").to_json_value()
    assert api.parse_model_info_version(started, initial_version=2, current_version=7) == 2
    # No version to check: the server cannot be taken back on trust.
    with pytest.raises(api.MalformedResponse, match="weight_version"):
        api.parse_model_info_version(types.GetModelInfoResponse(model_path="m").to_json_value(), initial_version=0,
                                     current_version=7)
    # The paths the engine and the supervisor use are routes of SGLang's HTTP server.
    routes = (sglang_schema.sglang_dir() / "srt" / "entrypoints" / "http_server.py").read_text()
    for path in (api.HEALTH_PATH, api.HEALTH_GENERATE_PATH, api.MODEL_INFO_PATH):
        assert f'@app.get("{path}")' in routes


_SUPERVISING = """
import sys, time
from pipeline.rollout.supervise import ServerCommand, Supervisor
supervisor = Supervisor([ServerCommand(command=(sys.executable, "-c", "import time; time.sleep(120)"))], max_restarts=0)
with supervisor:
    print(supervisor._servers[0].process.pid, flush=True)
    time.sleep(120)
"""


def test_servers_die_with_a_killed_supervising_process():
    import subprocess

    parent = subprocess.Popen([sys.executable, "-c", _SUPERVISING], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    server_pid = int(parent.stdout.readline())
    os.kill(parent.pid, signal.SIGKILL)  # the serve role killed -9 (or its node role, which it dies with)
    parent.wait(timeout=10)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{server_pid}").exists() and time.monotonic() < deadline:
        state = Path(f"/proc/{server_pid}/stat").read_text().split()[2] if Path(f"/proc/{server_pid}").exists() else "X"
        if state == "Z":  # dead, waiting for init to reap it
            break
        time.sleep(0.05)
    alive = Path(f"/proc/{server_pid}").exists() and Path(f"/proc/{server_pid}/stat").read_text().split()[2] != "Z"
    assert not alive, "the server outlived the process that supervised it"
