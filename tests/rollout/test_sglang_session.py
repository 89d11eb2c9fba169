"""SGLang 0.5.23's weight-update session: tensor and NCCL updates run between begin and end.

The fake servers refuse a tensor or distributed update outside a session, a second
begin and an end without a begin, as SGLang's scheduler does; bodies are decoded with
the strict mirrors of ``BeginWeightUpdateReqInput`` / ``EndWeightUpdateReqInput``.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

from pipeline.parallel.rendezvous import free_port
from pipeline.parallel.weight_transfer import UpdateGroup
from pipeline.rollout import sglang_api as api
from pipeline.rollout.sglang_engine import SGLangClientConfig, SGLangEngine
from pipeline.rollout.types import RolloutError
from tests.rollout.fake_sglang import start_fake_servers

CONFIG = SGLangClientConfig(max_attempts=2, backoff_initial_s=0.05, backoff_max_s=0.1, startup_timeout_s=20.0,
                            health_poll_s=0.05, watchdog_interval_s=None, admin_timeout_s=10.0, show_progress=False)


def _admin_paths(server) -> list[str]:
    return [r["path"] for r in server.requests() if r["path"] != "/generate"]


@pytest.mark.timeout(60)
def test_the_fake_server_enforces_the_session(tmp_path: Path) -> None:
    (server,) = start_fake_servers(tmp_path, [{}])
    try:
        body = api.update_weights_from_tensor_body([b"rank0"], version=1)
        outside = httpx.post(server.url + api.UPDATE_FROM_TENSOR_PATH, json=body, timeout=10)
        assert outside.status_code == 400 and "must run between begin_weight_update()" in outside.json()["message"]
        assert httpx.post(server.url + api.END_WEIGHT_UPDATE_PATH, json={}, timeout=10).status_code == 400
        begin = api.begin_weight_update_body()
        assert httpx.post(server.url + api.BEGIN_WEIGHT_UPDATE_PATH, json=begin, timeout=10).status_code == 200
        assert httpx.post(server.url + api.BEGIN_WEIGHT_UPDATE_PATH, json=begin, timeout=10).status_code == 400
        inside = httpx.post(server.url + api.UPDATE_FROM_TENSOR_PATH, json=body, timeout=10)
        assert inside.status_code == 200 and inside.json()["success"] is True
        typo = httpx.post(server.url + api.BEGIN_WEIGHT_UPDATE_PATH, json={"selectr": "all"}, timeout=10)
        assert typo.status_code == 400 and "selectr" in typo.json()["message"]
    finally:
        server.kill()


@pytest.mark.timeout(60)
def test_tensor_and_distributed_updates_run_inside_a_session(tmp_path: Path) -> None:
    servers = start_fake_servers(tmp_path, [{"join_groups": True}, {"join_groups": True}])
    try:
        engine = SGLangEngine.attach([s.url for s in servers], config=CONFIG)
        engine.update_weights_from_tensor([b"\x80\x04rank0"], version=1)
        engine.update_weights_from_disk("/exports/step_2", version=2)  # no session needed
        # The servers join the trainer's gloo group and receive the announced tensor by broadcast.
        port, norm = free_port(), torch.arange(8, dtype=torch.bfloat16)
        with ThreadPoolExecutor(max_workers=1) as pool:
            joined = pool.submit(engine.init_weights_update_group, master_address="127.0.0.1", master_port=port,
                                 world_size=3, ranks_per_server=1, backend="gloo")
            group = UpdateGroup.join(master_address="127.0.0.1", master_port=port, rank=0, world_size=3,
                                     name="weight_update_group", backend="gloo", timeout_s=30.0)
            joined.result()
            updated = pool.submit(engine.update_weights_from_distributed, ["model.norm.weight"],
                                  dtypes=["bfloat16"], shapes=[[8]], version=3)
            group.broadcast([norm])
            updated.result()
        group.destroy()
        assert engine.weight_version == 3 and len(engine.live_servers) == 2
        for server in servers:
            assert _admin_paths(server) == [
                "/begin_weight_update", "/update_weights_from_tensor", "/end_weight_update", "/flush_cache",
                "/update_weights_from_disk", "/flush_cache", "/init_weights_update_group",
                "/begin_weight_update", "/update_weights_from_distributed", "/end_weight_update", "/flush_cache",
            ]
            assert torch.equal(server.weights()["model.norm.weight"], norm)
    finally:
        for server in servers:
            server.kill()


@pytest.mark.timeout(60)
def test_a_failed_update_still_closes_the_session(tmp_path: Path) -> None:
    servers = start_fake_servers(tmp_path, [{"fail_updates": True}])
    try:
        engine = SGLangEngine.attach([s.url for s in servers], config=CONFIG)
        with pytest.raises(RolloutError, match="failed on every server"):
            engine.update_weights_from_tensor([b"rank0"], version=1)
        assert _admin_paths(servers[0]) == [
            "/begin_weight_update", "/update_weights_from_tensor", "/end_weight_update"]
        assert engine.weight_version == 0
        # The session was closed: the next update can open one again.
        with pytest.raises(RolloutError, match="refusing the update"):
            engine.update_weights_from_tensor([b"rank0"], version=1)
        assert _admin_paths(servers[0])[-3:] == [
            "/begin_weight_update", "/update_weights_from_tensor", "/end_weight_update"]
    finally:
        for server in servers:
            server.kill()
