"""Weight syncs over SGLang's update group when a server fails, each fault injected into fake SGLang servers.

The fakes (``tests.rollout.fake_sglang``) are real processes: they join the trainer's gloo group
and receive each bucket by broadcast, keep SGLang's session rules, and fail on cue: a refused
``/begin_weight_update``, death or a stop (``SIGSTOP``) when a bucket is announced, a ``tp_size``
other than the group's, a slow load from disk with failing health probes. The trainer side is the
real client (``SGLangWeights`` on an ``SGLangEngine``'s pool) and the real ``Supervisor``. Every
timeout is seconds, so each test takes a few.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from pipeline.config import RolloutConfig
from pipeline.configlib import ConfigError
from pipeline.parallel.rendezvous import reserved_port
from pipeline.rollout.sglang import protocol as api
from pipeline.rollout.sglang.client import SGLangClientConfig
from pipeline.rollout.sglang.generation import SGLangEngine
from pipeline.rollout.leases import WeightLoadLeases, load_leases_dir
from pipeline.rollout.sglang.weights import (
    COLLECTIVE_TIMEOUT_MARGIN_S,
    SGLangWeights,
    UpdateGroupSettings,
    collective_timeout_s,
)
from pipeline.rollout.supervise import ServerCommand, Supervisor
from pipeline.rollout.types import GenerationRequest, RolloutError, SamplingParams
from pipeline.rollout.weight_sync import DistributedSyncedEngine
from tests.rollout.fake_sglang import REPO_ROOT, start_fake_servers

ADMIN_TIMEOUT_S = 3.0


def _config(**overrides: Any) -> SGLangClientConfig:
    settings: dict[str, Any] = dict(max_attempts=2, backoff_initial_s=0.05, backoff_max_s=0.1, startup_timeout_s=20.0,
                                    health_poll_s=0.05, watchdog_interval_s=None, probe_timeout_s=2.0,
                                    admin_timeout_s=ADMIN_TIMEOUT_S, max_server_failures=2, show_progress=False)
    settings.update(overrides)
    return SGLangClientConfig(**settings)


def _sink(engine: SGLangEngine, *, ranks_per_server: int = 1, **kwargs: Any) -> SGLangWeights:
    return SGLangWeights(engine.pool, update_group=UpdateGroupSettings(
        backend="gloo", master_address="127.0.0.1", ranks_per_server=ranks_per_server), **kwargs)


def _buckets(version: int, *, big: bool = False) -> list[list[tuple[str, torch.Tensor]]]:
    """Three buckets of one version. ``big``: the first holds 16 MB, more than a socket buffers, so a
    broadcast to a member that never receives cannot complete."""
    generator = torch.Generator().manual_seed(version)
    first = torch.randn(4_000_000 if big else 12, generator=generator)
    return [[("model.a", first), ("model.b", torch.randn(5, generator=generator))],
            [("model.c", torch.randn(2, 2, generator=generator))],
            [("model.d", torch.randn(7, generator=generator))]]


def _push(sink: SGLangWeights, buckets: list[list[tuple[str, torch.Tensor]]], *, version: int) -> None:
    sink.begin_update(version=version)
    completed = False
    try:
        for bucket in buckets:
            sink.send_bucket(bucket, version=version)
        completed = True
    finally:
        sink.end_update(version=version, completed=completed)


def _holds(server, buckets: list[list[tuple[str, torch.Tensor]]]) -> bool:
    expected = dict(pair for bucket in buckets for pair in bucket)
    received = server.weights()
    return received.keys() == expected.keys() and all(torch.equal(received[k], v) for k, v in expected.items())


def _admin_paths(server) -> list[str]:
    return [r["path"] for r in server.requests() if r["path"] != "/generate"]


def _kill(servers) -> None:
    for server in servers:
        server.kill()


# ----------------------------------------------------------------------------------- a failing begin


@pytest.mark.timeout(60)
def test_a_server_whose_session_does_not_open_never_joins_the_group(tmp_path: Path) -> None:
    servers = start_fake_servers(tmp_path, [dict(join_groups=True), dict(join_groups=True, fail_begin=True)])
    try:
        leases = tmp_path / "leases"
        engine = SGLangEngine.attach([s.url for s in servers], config=_config(load_leases_dir=str(leases)))
        sink = _sink(engine)
        buckets = _buckets(1, big=True)
        started = time.monotonic()
        sink.begin_update(version=1)
        # The session's server holds a weight-load lease until the end: its supervisor counts no hang meanwhile.
        assert [WeightLoadLeases(leases).active(s.url) for s in servers] == [True, False]
        for bucket in buckets:
            sink.send_bucket(bucket, version=1)
        sink.end_update(version=1, completed=True)
        elapsed = time.monotonic() - started
        sink.close()
        assert not WeightLoadLeases(leases).active(servers[0].url)
        # The group held only the server whose session opened: no broadcast waited for the other one
        # (it would have until the collective timeout, a minute here).
        assert elapsed < 15.0, elapsed
        assert engine.weight_version == 1 and engine.pool.live_servers == [servers[0].url]
        assert "/begin_weight_update for version 1 failed" in engine.pool.dead_servers[servers[1].url]
        assert _holds(servers[0], buckets)
        first, refused = _admin_paths(servers[0]), _admin_paths(servers[1])
        assert first[:2] == ["/begin_weight_update", "/init_weights_update_group"]
        init = next(r["body"] for r in servers[0].requests() if r["path"] == "/init_weights_update_group")
        assert init["world_size"] == 2
        # Refused: taken for a session left open, closed, refused again, dropped; never in the group.
        assert refused == ["/begin_weight_update", "/end_weight_update", "/begin_weight_update"]
    finally:
        _kill(servers)


# ------------------------------------------------------------------------------- a death mid-broadcast


@pytest.mark.timeout(60)
def test_a_server_that_dies_mid_broadcast_is_dropped_and_the_update_finishes_in_a_new_group(tmp_path: Path) -> None:
    servers = start_fake_servers(tmp_path, [dict(join_groups=True, group_timeout_s=3.0),
                                            dict(join_groups=True, group_timeout_s=3.0, die_on_bucket=2)])
    try:
        engine = SGLangEngine.attach([s.url for s in servers], config=_config())
        sink = _sink(engine)
        buckets = _buckets(1)
        _push(sink, buckets, version=1)
        assert servers[1].process.wait(timeout=10) == 3
        assert engine.weight_version == 1 and engine.pool.live_servers == [servers[0].url]
        dead = engine.pool.servers[1]
        assert dead.state == "down" and "unreachable during the update to version 1" in dead.dead_reason
        # It holds part of the update: whatever version it reports later, it waits for a full one.
        assert dead.partial_weights
        assert _holds(servers[0], buckets)
        paths = _admin_paths(servers[0])
        # The survivor left the broken group, joined a new one, got the interrupted bucket again and the rest.
        assert paths == ["/begin_weight_update", "/init_weights_update_group", "/update_weights_from_distributed",
                         "/update_weights_from_distributed", "/destroy_weights_update_group",
                         "/init_weights_update_group", "/update_weights_from_distributed",
                         "/update_weights_from_distributed", "/end_weight_update", "/flush_cache"]
        inits = [r["body"] for r in servers[0].requests() if r["path"] == "/init_weights_update_group"]
        assert [body["world_size"] for body in inits] == [3, 2] and inits[0]["group_name"] != inits[1]["group_name"]
        sink.close()
    finally:
        _kill(servers)


@pytest.mark.timeout(60)
def test_an_update_gives_up_after_max_group_reforms_with_one_clear_error(tmp_path: Path) -> None:
    # One server dies at the first bucket, another at the first bucket's second try: two group failures.
    servers = start_fake_servers(tmp_path, [dict(join_groups=True, group_timeout_s=3.0),
                                            dict(join_groups=True, group_timeout_s=3.0, die_on_bucket=1),
                                            dict(join_groups=True, group_timeout_s=3.0, die_on_bucket=2)])
    try:
        engine = SGLangEngine.attach([s.url for s in servers], config=_config())
        synced = DistributedSyncedEngine(engine, sink=_sink(engine, max_group_reforms=1), bucket_bytes=1 << 20)
        taken = []
        buckets = _buckets(1)
        with pytest.raises(RolloutError, match=r"weight sync to version 1 failed; the next sync starts a new update: "
                                               r"the update group failed 2 times in the update to version 1, more "
                                               r"than the 1 new groups one update may form; last: http://127.0.0.1"):
            synced.consume((taken.append(i) or bucket for i, bucket in enumerate(buckets)), version=1)
        assert taken == [0, 1, 2]  # every bucket was still taken: the other trainer ranks leave the sync together
        assert engine.weight_version == 0 and engine.pool.live_servers == [servers[0].url]
        # The session of the server left was closed, so its next update can open one.
        assert _admin_paths(servers[0])[-1] == "/end_weight_update"
        synced.close()
    finally:
        _kill(servers)


# ------------------------------------------------------------------- a stop mid-broadcast: the timeouts


def test_the_collective_timeout_is_the_http_limit_plus_a_margin() -> None:
    for admin_timeout_s in (ADMIN_TIMEOUT_S, SGLangClientConfig().admin_timeout_s):
        assert collective_timeout_s(admin_timeout_s) == admin_timeout_s + COLLECTIVE_TIMEOUT_MARGIN_S
    assert COLLECTIVE_TIMEOUT_MARGIN_S >= 30.0  # room for the announcement's head start and the abort
    pool = SGLangEngine(["http://127.0.0.1:9"], config=_config()).pool
    assert SGLangWeights(pool).collective_timeout_s == ADMIN_TIMEOUT_S + COLLECTIVE_TIMEOUT_MARGIN_S


@pytest.mark.timeout(90)
def test_a_server_that_stops_mid_broadcast_is_named_by_its_http_timeout_before_the_collective_one(
        tmp_path: Path) -> None:
    servers = start_fake_servers(tmp_path, [dict(join_groups=True, group_timeout_s=3.0),
                                            dict(join_groups=True, group_timeout_s=3.0, hang_on_bucket=1)])
    try:
        engine = SGLangEngine.attach([s.url for s in servers], config=_config())
        sink = _sink(engine)
        buckets = _buckets(1, big=True)  # the broadcast itself waits for the stopped server
        started = time.monotonic()
        _push(sink, buckets, version=1)
        elapsed = time.monotonic() - started
        # Ended by the HTTP limit (3 s), which names the server, not the collective timeout (63 s) that names none.
        assert elapsed < ADMIN_TIMEOUT_S + 15.0 < sink.collective_timeout_s, elapsed
        reason = engine.pool.dead_servers[servers[1].url]
        assert (f"no answer from {servers[1].url}/update_weights_from_distributed within {ADMIN_TIMEOUT_S:g}s"
                in reason)
        assert engine.weight_version == 1 and _holds(servers[0], buckets)
        sink.close()
    finally:
        _kill(servers)


# ------------------------------------------------------------------------------- a stale open session


@pytest.mark.timeout(60)
def test_a_session_left_open_by_an_earlier_trainer_is_closed_and_the_update_goes_on(tmp_path: Path) -> None:
    servers = start_fake_servers(tmp_path, [dict(join_groups=True), dict(join_groups=True)])
    try:
        # A trainer died mid-update: server 1 still holds its session.
        assert httpx.post(servers[1].url + api.BEGIN_WEIGHT_UPDATE_PATH, json=api.begin_weight_update_body(),
                          timeout=10).status_code == 200
        engine = SGLangEngine.attach([s.url for s in servers], config=_config())
        sink = _sink(engine)
        buckets = _buckets(1)
        _push(sink, buckets, version=1)
        sink.close()
        assert engine.pool.live_servers == [s.url for s in servers] and engine.weight_version == 1
        assert all(_holds(server, buckets) for server in servers)
        assert _admin_paths(servers[1])[:4] == ["/begin_weight_update", "/begin_weight_update", "/end_weight_update",
                                                "/begin_weight_update"]
    finally:
        _kill(servers)


@pytest.mark.timeout(60)
def test_a_recovered_server_s_stale_session_is_closed_before_it_is_taken_back(tmp_path: Path) -> None:
    servers = start_fake_servers(tmp_path, [dict(join_groups=True), dict(join_groups=True)])
    try:
        engine = SGLangEngine.attach([s.url for s in servers], config=_config())
        sink = _sink(engine)
        _push(sink, _buckets(1), version=1)
        # Server 1 was dropped in the middle of the next update (its part timed out), yet lives on with
        # that update's session open and part of its weights labelled with the new version.
        stale = engine.pool.servers[1]
        engine.pool.drop(stale, "no answer within 3s (injected)")
        stale.partial_weights = True
        assert httpx.post(servers[1].url + api.BEGIN_WEIGHT_UPDATE_PATH, json=api.begin_weight_update_body(),
                          timeout=10).status_code == 200
        before = len(_admin_paths(servers[1]))
        engine.pool.check_servers()
        # Closed on recovery, and kept out of the rotation (stale) until an update brings it all the weights.
        assert _admin_paths(servers[1])[before:] == ["/end_weight_update"]
        assert stale.state == "stale" and "holds part of a weight update" in stale.dead_reason
        buckets = _buckets(2)
        _push(sink, buckets, version=2)
        sink.close()
        assert stale.state == "live" and not stale.partial_weights and _holds(servers[1], buckets)
    finally:
        _kill(servers)


# --------------------------------------------------------------------------------- a wrong tp_size


@pytest.mark.timeout(60)
def test_a_server_tp_size_other_than_the_groups_fails_at_the_first_contact_naming_the_field(tmp_path: Path) -> None:
    servers = start_fake_servers(tmp_path, [dict(join_groups=True), dict(join_groups=True, tp_size=2)])
    try:
        engine = SGLangEngine.attach([s.url for s in servers], config=_config())
        sink = _sink(engine, ranks_per_server=1)
        message = (rf"rollout.server_tensor_parallel=1 \(each server's ranks in the weight update group\), but "
                   rf"{servers[1].url} runs tp_size=2: set it to the servers' --tp-size")
        # The first generation finds it, before a step's worth of samples.
        with pytest.raises(ConfigError, match=message):
            engine.generate([GenerationRequest("p", [1, 2, 3], 2)], SamplingParams(max_new_tokens=3, seed=1))
        # So does a sync, before any session or group, and the sync raises it as it is (a user error),
        # after taking every bucket.
        synced = DistributedSyncedEngine(engine, sink=sink, bucket_bytes=1 << 20)
        taken = []
        with pytest.raises(ConfigError, match=message):
            synced.consume((taken.append(i) or bucket for i, bucket in enumerate(_buckets(1))), version=1)
        assert taken == [0, 1, 2]
        assert [server.requests() for server in servers] == [[], []]
        synced.close()
    finally:
        _kill(servers)


def test_tp_size_is_read_where_sglang_reports_it() -> None:
    from tests.rollout import sglang_schema

    root = sglang_schema.sglang_dir() / "srt"
    assert f'@app.get("{api.SERVER_INFO_PATH}")' in (root / "entrypoints" / "http_server.py").read_text()
    # /server_info is the flat resolved ServerArgs, tp_size one of its Parallel fields.
    assert "    tp_size: A[" in (root / "arg_groups" / "fields" / "parallel.py").read_text()
    assert api.parse_server_info_tp_size({"tp_size": 4, "pp_size": 1}) == 4
    for bad in ({}, {"tp_size": "2"}, {"tp_size": 0}, {"tp_size": True}, []):
        with pytest.raises(api.MalformedResponse, match="tp_size"):
            api.parse_server_info_tp_size(bad)


# ------------------------------------------------------------ the supervisor: its window, a slow load


@pytest.fixture
def server_port() -> Iterator[int]:
    """A port for the supervised server, held from everyone else while it runs and restarts."""
    with reserved_port() as port:
        yield port


# Answers its first health probe, then 503 at once to every later one: a scheduler that stopped answering,
# seen through a front end that fails fast.
_FAILS_FAST = """
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
class Handler(BaseHTTPRequestHandler):
    probes = 0
    def do_GET(self):
        Handler.probes += 1
        self.send_response(200 if Handler.probes == 1 else 503)
        self.send_header("Content-Length", "0")
        self.end_headers()
    def log_message(self, *args):
        pass
ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""


@pytest.mark.timeout(60)
def test_the_hang_window_is_probe_timeouts_on_the_clock_however_fast_each_probe_fails(server_port: int) -> None:
    port = server_port
    url = f"http://127.0.0.1:{port}"
    supervisor = Supervisor([ServerCommand(command=(sys.executable, "-c", _FAILS_FAST, str(port)), url=url)],
                            max_restarts=1, probe_timeout_s=0.5, probe_interval_s=0.02, max_failed_probes=4,
                            startup_timeout_s=20.0)
    assert supervisor.hang_window_s == 2.0  # 4 probes' timeouts
    with supervisor:
        deadline = time.monotonic() + 30
        first_failure = None
        while supervisor.restarts == [0] and time.monotonic() < deadline:
            supervisor.check()
            failing_since = supervisor._servers[0].failing_since
            if first_failure is None and failing_since is not None:
                first_failure = failing_since
            time.sleep(0.02)
        restarted_at = time.monotonic()
    assert supervisor.restarts == [1] and first_failure is not None
    # Dozens of probes failed within the first 0.2 s; the server was still given the whole window.
    assert supervisor.hang_window_s <= restarted_at - first_failure < supervisor.hang_window_s + 1.5


@pytest.mark.timeout(90)
def test_a_server_loading_weights_for_the_trainer_is_not_killed_for_failing_its_probes(tmp_path: Path,
                                                                                        server_port: int) -> None:
    port = server_port
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "server.jsonl"
    leases = load_leases_dir(tmp_path / "weights")
    command = (sys.executable, "-m", "tests.rollout.fake_sglang", "--port", str(port), "--port-file",
               str(tmp_path / "server.port"), "--log", str(log), "--load-delay-s", "5")
    # A window of 2 s against a 5-s load whose every health probe fails (503).
    supervisor = Supervisor([ServerCommand(command=command, url=url)], max_restarts=1, probe_timeout_s=1.0,
                            probe_interval_s=0.05, max_failed_probes=2, startup_timeout_s=30.0,
                            load_leases=WeightLoadLeases(leases), env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    stop = threading.Event()
    with supervisor:
        watcher = threading.Thread(target=supervisor.run, kwargs={"until": stop.is_set}, daemon=True)
        watcher.start()
        try:
            engine = SGLangEngine.attach([url], config=_config(load_leases_dir=str(leases), admin_timeout_s=20.0))
            deadline = time.monotonic() + 20
            while not supervisor._servers[0].healthy and time.monotonic() < deadline:
                time.sleep(0.05)
            started = time.monotonic()
            SGLangWeights(engine.pool).load_from_disk(str(tmp_path / "weights" / "v1"), version=1)
            assert time.monotonic() - started >= 5.0  # the load took its time, with failing probes throughout
            assert not WeightLoadLeases(leases).active(url)  # released when the load ended
            assert supervisor.restarts == [0] and engine.weight_version == 1
            # Once the lease is gone, failing probes count again: the same server is a hang after its window.
            pid = supervisor.pids[0]
            os.kill(pid, signal.SIGSTOP)
            deadline = time.monotonic() + 20
            while supervisor.pids[0] in (pid, None) and time.monotonic() < deadline:  # restarted: a new process
                time.sleep(0.05)
            assert supervisor.restarts == [1] and supervisor.pids[0] != pid
        finally:
            stop.set()
            watcher.join(timeout=30)


def test_the_client_leases_under_the_shared_weights_folder() -> None:
    rollout = RolloutConfig(engine="sglang", servers=["http://a:1"], weights_dir="/shared/w")
    assert SGLangClientConfig.from_rollout(rollout).load_leases_dir == "/shared/w/.loading"
    distributed = RolloutConfig(engine="sglang", servers=["http://a:1"], sync="distributed")
    assert SGLangClientConfig.from_rollout(distributed).load_leases_dir is None
    leases = WeightLoadLeases("/shared/w/.loading")
    assert leases.path("http://node-3:30002") == Path("/shared/w/.loading/node-3_30002.json")
