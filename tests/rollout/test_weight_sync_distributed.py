"""The distributed transport end to end on CPU: fake SGLang servers in their own processes join the
trainer's gloo update group and receive every bucket by broadcast (``tests.rollout.fake_sglang``,
every request validated against SGLang's own structs).

Several syncs with training in between leave each server bit-equal to the trainer. Then one
server dies when a bucket of the next sync is announced: that sync drops it, forms a new group
with the surviving server, sends the bucket again and finishes, leaving the survivor bit-equal;
so does the sync after it.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed_utils import run_distributed

BUCKET_BYTES = 8 * 1024


def _worker(rank, world_size, tmp_dir):
    from pathlib import Path

    from pipeline.rollout.sglang.client import SGLangClientConfig
    from pipeline.rollout.sglang.generation import SGLangEngine
    from pipeline.rollout.sglang.weights import SGLangWeights, UpdateGroupSettings
    from pipeline.rollout.types import RolloutError
    from pipeline.rollout.weight_export import stage_buckets
    from pipeline.rollout.weight_sync import DistributedSyncedEngine, actor_hf_state, sync_actor_to_engine
    from pipeline.trainer.losses import CrossEntropyLoss
    from tests.rollout.fake_sglang import start_fake_servers
    from tests.trainer.test_actor import _actor, _batch

    actor = _actor(1, 1, micro_batch_tokens=10_000, lr=3e-2)
    num_buckets = sum(1 for _ in stage_buckets(actor, bucket_bytes=BUCKET_BYTES))
    num_syncs = 3
    # The second server dies when the second bucket of sync num_syncs + 1 is announced to it.
    die_on = num_syncs * num_buckets + 2
    servers = start_fake_servers(Path(tmp_dir), [dict(join_groups=True, group_timeout_s=3.0),
                                                 dict(join_groups=True, group_timeout_s=3.0, die_on_bucket=die_on)])
    try:
        client = SGLangEngine.attach([s.url for s in servers],
                                     config=SGLangClientConfig(admin_timeout_s=60.0, show_progress=False))
        sink = SGLangWeights(client.pool, update_group=UpdateGroupSettings(
            backend="gloo", master_address="127.0.0.1", ranks_per_server=1))
        engine = DistributedSyncedEngine(client, sink=sink, bucket_bytes=BUCKET_BYTES)

        def matches(server) -> bool:
            expected = dict(actor_hf_state(actor))
            received = server.weights()
            return received.keys() == expected.keys() and all(torch.equal(received[k], v) for k, v in expected.items())

        synced = []
        for version in range(1, num_syncs + 1):
            actor.train_step(_batch(), CrossEntropyLoss())
            sync_actor_to_engine(actor, engine, version=version)
            synced.append([matches(server) for server in servers])
        actor.train_step(_batch(), CrossEntropyLoss())
        try:
            sync_actor_to_engine(actor, engine, version=num_syncs + 1)
            failure = None
        except RolloutError as error:
            failure = str(error)
        survived = matches(servers[0])
        actor.train_step(_batch(), CrossEntropyLoss())
        sync_actor_to_engine(actor, engine, version=num_syncs + 2)
        recovered = matches(servers[0])
        requests = [[r["path"] for r in server.requests()] for server in servers]
        return {"num_buckets": num_buckets, "synced": synced, "failure": failure, "survived": survived,
                "recovered": recovered, "live": client.pool.live_servers, "urls": [s.url for s in servers],
                "version": client.weight_version, "requests": requests, "second_exit": servers[1].process.poll()}
    finally:
        for server in servers:
            server.kill()


@pytest.mark.slow
def test_distributed_sync_bit_equal_and_finishes_without_a_server_that_dies(tmp_path):
    outcome = run_distributed(_worker, world_size=1, args=(str(tmp_path),), timeout_s=240.0)[0]
    assert outcome["num_buckets"] >= 4  # several buckets per sync
    assert outcome["synced"] == [[True, True]] * 3
    # The sync that lost a server finished with the other: no error, the survivor bit-equal.
    assert outcome["failure"] is None and outcome["survived"]
    assert outcome["second_exit"] == 3
    assert outcome["recovered"] and outcome["live"] == outcome["urls"][:1] and outcome["version"] == 5
    first = outcome["requests"][0]
    # The group was formed once, and once more in the sync that lost a server; every bucket ran inside a session,
    # and the bucket the failure interrupted was sent again.
    assert first.count("/init_weights_update_group") == 2
    assert first.count("/begin_weight_update") == first.count("/end_weight_update") == 5
    assert first.count("/update_weights_from_distributed") == 5 * outcome["num_buckets"] + 1
