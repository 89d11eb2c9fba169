"""``SGLangWeights``, the servers' ``WeightSink``: a streamed update runs inside SGLang 0.5.23's weight-update session.

The fake servers refuse a distributed update outside a session, a second begin and an end
without a begin, as SGLang's scheduler does; bodies are decoded with the strict mirrors of
``BeginWeightUpdateReqInput`` / ``EndWeightUpdateReqInput``.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

from pipeline.rollout.sglang import protocol as api
from pipeline.rollout.sglang.client import SGLangClientConfig
from pipeline.rollout.sglang.generation import SGLangEngine
from pipeline.rollout.sglang.weights import SGLangWeights, UpdateGroupSettings
from pipeline.rollout.types import RolloutError, WeightSink
from tests.rollout.fake_sglang import start_fake_servers

CONFIG = SGLangClientConfig(max_attempts=2, backoff_initial_s=0.05, backoff_max_s=0.1, startup_timeout_s=20.0,
                            health_poll_s=0.05, watchdog_interval_s=None, admin_timeout_s=10.0, show_progress=False)


def _admin_paths(server) -> list[str]:
    return [r["path"] for r in server.requests() if r["path"] != "/generate"]


@pytest.mark.timeout(60)
def test_the_fake_server_enforces_the_session(tmp_path: Path) -> None:
    (server,) = start_fake_servers(tmp_path, [{}])
    try:
        body = api.update_weights_from_distributed_body(["model.norm.weight"], dtypes=["float32"], shapes=[[4]],
                                                        version=1)
        outside = httpx.post(server.url + api.UPDATE_FROM_DISTRIBUTED_PATH, json=body, timeout=10)
        assert outside.status_code == 400 and "must run between begin_weight_update()" in outside.json()["message"]
        assert httpx.post(server.url + api.END_WEIGHT_UPDATE_PATH, json={}, timeout=10).status_code == 400
        begin = api.begin_weight_update_body()
        assert httpx.post(server.url + api.BEGIN_WEIGHT_UPDATE_PATH, json=begin, timeout=10).status_code == 200
        assert httpx.post(server.url + api.BEGIN_WEIGHT_UPDATE_PATH, json=begin, timeout=10).status_code == 400
        inside = httpx.post(server.url + api.UPDATE_FROM_DISTRIBUTED_PATH, json=body, timeout=10)
        assert inside.status_code == 200 and inside.json()["success"] is True
        typo = httpx.post(server.url + api.BEGIN_WEIGHT_UPDATE_PATH, json={"selectr": "all"}, timeout=10)
        assert typo.status_code == 400 and "selectr" in typo.json()["message"]
    finally:
        server.kill()


def _sink(engine: SGLangEngine) -> SGLangWeights:
    return SGLangWeights(engine.pool, update_group=UpdateGroupSettings(
        backend="gloo", master_address="127.0.0.1", ranks_per_server=1))


@pytest.mark.timeout(60)
def test_streamed_updates_run_inside_a_session_and_disk_loads_need_none(tmp_path: Path) -> None:
    servers = start_fake_servers(tmp_path, [{"join_groups": True}, {"join_groups": True}])
    try:
        engine = SGLangEngine.attach([s.url for s in servers], config=CONFIG)
        sink = _sink(engine)
        assert isinstance(sink, WeightSink)
        sink.load_from_disk("/exports/step_1", version=1)  # no session needed
        # The servers join the trainer's gloo group and receive the announced tensors by broadcast.
        norm, bias = torch.arange(8, dtype=torch.bfloat16), torch.ones(3)
        sink.begin_update(version=2)
        sink.send_bucket([("model.norm.weight", norm)], version=2)
        sink.send_bucket([("model.bias", bias)], version=2)
        sink.end_update(version=2, completed=True)
        sink.close()
        assert engine.weight_version == 2 and len(engine.pool.live_servers) == 2
        offsets = []
        for server in servers:
            # The session opens first; only then does the server join the group.
            assert _admin_paths(server) == [
                "/update_weights_from_disk", "/flush_cache", "/begin_weight_update", "/init_weights_update_group",
                "/update_weights_from_distributed", "/update_weights_from_distributed", "/end_weight_update",
                "/flush_cache",
            ]
            offsets.append(server.requests()[3]["body"]["rank_offset"])
            received = server.weights()
            assert torch.equal(received["model.norm.weight"], norm) and torch.equal(received["model.bias"], bias)
        assert offsets == [1, 2]
    finally:
        for server in servers:
            server.kill()


@pytest.mark.timeout(60)
def test_an_incomplete_update_closes_the_session_and_keeps_the_version(tmp_path: Path) -> None:
    servers = start_fake_servers(tmp_path, [{"join_groups": True}])
    try:
        engine = SGLangEngine.attach([s.url for s in servers], config=CONFIG)
        sink = _sink(engine)
        sink.begin_update(version=1)
        sink.end_update(version=1, completed=False)
        assert engine.weight_version == 0
        assert _admin_paths(servers[0]) == ["/begin_weight_update", "/init_weights_update_group", "/end_weight_update"]
        # The session was closed: the next update opens one again, in the group already formed.
        sink.begin_update(version=1)
        sink.send_bucket([("model.norm.weight", torch.zeros(4))], version=1)
        sink.end_update(version=1, completed=True)
        sink.close()
        assert engine.weight_version == 1
        assert _admin_paths(servers[0])[3:] == [
            "/begin_weight_update", "/update_weights_from_distributed", "/end_weight_update", "/flush_cache"]
        with pytest.raises(ValueError, match="current weight version 1"):
            sink.load_from_disk("/exports/step_1", version=1)
    finally:
        for server in servers:
            server.kill()


@pytest.mark.timeout(60)
def test_servers_without_an_update_group_take_weights_from_disk_only(tmp_path: Path) -> None:
    servers = start_fake_servers(tmp_path, [{}])
    try:
        engine = SGLangEngine.attach([s.url for s in servers], config=CONFIG)
        with pytest.raises(RolloutError, match="from disk only"):
            SGLangWeights(engine.pool).begin_update(version=1)
        assert _admin_paths(servers[0]) == []
    finally:
        for server in servers:
            server.kill()
