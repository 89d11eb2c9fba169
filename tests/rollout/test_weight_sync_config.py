"""``rollout.sync`` and its neighbours: bad values fail at load naming the field; the H100 campaigns sync by broadcast."""

from __future__ import annotations

import pytest

from pipeline.config import RLConfig
from pipeline.configlib import ConfigError, from_dict

SERVERS = ["http://r0:30000"]


@pytest.mark.parametrize(("rollout", "field"), [
    ({"sync": "nccl"}, "rollout.sync"),
    ({"sync_bucket_mb": 0}, "rollout.sync_bucket_mb"),
    ({"server_tensor_parallel": 0}, "rollout.server_tensor_parallel"),
    # The disk transport needs the shared folder; the distributed one does not.
    ({"engine": "sglang", "servers": SERVERS, "sync": "disk"}, "weights_dir"),
])
def test_bad_sync_settings_fail_at_load_naming_the_field(rollout, field):
    with pytest.raises(ConfigError, match=field):
        from_dict(RLConfig, {"rollout": rollout})


def test_distributed_sync_needs_no_weights_folder():
    cfg = from_dict(RLConfig, {"rollout": {"engine": "sglang", "servers": SERVERS, "sync": "distributed",
                                           "sync_bucket_mb": 256}})
    assert (cfg.rollout.sync, cfg.rollout.sync_bucket_mb, cfg.rollout.weights_dir) == ("distributed", 256, None)


def test_h100_campaigns_sync_by_broadcast_with_the_servers_tensor_parallel_size(tmp_path):
    from recipes.campaigns import llama31_8b, qwen25_math_7b

    for plan, server_tp in ((qwen25_math_7b(output_dir=tmp_path), 1), (llama31_8b(output_dir=tmp_path), 2)):
        rl_stages = [stage for stage in plan.stages if stage.kind == "rl"]
        assert len(rl_stages) == 2
        for stage in rl_stages:
            assert (stage.config.rollout.sync, stage.config.rollout.server_tensor_parallel) == ("distributed", server_tp)
