"""A stop asked for during a step's update is checkpointed before the new weights go to the SGLang servers.

SLURM's ``--signal=USR1@N`` gives the trainer N seconds to checkpoint. The step the signal
lands in finishes its update, then the loop checkpoints and leaves without pushing the
updated weights (a 7B broadcast, or an export every server reads) and without scoring the
held-out set on them: that push would spend the lead time, and hang or fail on servers that
are going away. The resumed run pushes the checkpoint's weights before it generates, then
scores the held-out set for the stopped step and logs its row.

Checked against a fake SGLang server (``tests.rollout.fake_sglang``: real HTTP, every request
logged, tokens that depend only on prompt, seed and weight version, so a sample generated
with a version the uninterrupted run would not have used changes the rows), at
``rollout.max_staleness`` 0 (a push after every update) and 1 (a push after the update of a
scored step), with the stop in the update of a scored step: the server's log shows no push
after the stopped step's update until the resumed run's first request, which is that push;
and the stopped-and-resumed run's rows and weights equal the uninterrupted run's.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch

from tests.distributed_utils import run_distributed
from tests.rl.test_rl_loop import _config, _weights

NUM_STEPS = 3
STOPPED_STEP = 2  # the signal arrives during this step's update (1-based); eval_every=2 scores it
SETTINGS = ["rollout.engine=sglang", "rollout.request_timeout_s=30", "rollout.max_server_failures=0",
            f"steps={NUM_STEPS}", f"optim.total_steps={NUM_STEPS}", "eval_every=2",
            "checkpoint.every_steps=10",  # the only checkpoint before the end is the stop's
            "group_size=8"]  # reward variance in the first step and in the one after the stop: both train


def _runs_worker(rank, world_size, tmp, cache, staleness):
    """An uninterrupted run, then a run stopped by SIGUSR1 in step ``STOPPED_STEP``'s update and resumed,
    on one fake server; each run's slice of the server's request log."""
    from pipeline.checkpoint.manager import CheckpointManager
    from pipeline.metrics import read_metrics
    from pipeline.models.tokenizer import load_tokenizer
    from pipeline.parallel.context import ParallelContext
    from pipeline.stages import rl as rl_stage
    from pipeline.trainer.actor import Actor
    from tests.rollout.fake_sglang import start_fake_servers

    def config(name, urls):
        return _config(f"{tmp}/{name}", [f"bootstrap.cache_dir={cache}", f"rollout.servers={json.dumps(urls)}",
                                         f"rollout.weights_dir={tmp}/{name}/weights",
                                         f"rollout.max_staleness={staleness}", *SETTINGS])

    unserved = config("straight", ["http://127.0.0.1:9"])
    context = ParallelContext.initialize(tensor_parallel=1, pipeline_parallel=1, seed=unserved.seed)
    # The fake tokens stay below the policy's vocabulary, so it trains on them.
    policy = rl_stage.initial_policy(unserved, context=context)
    (server,) = start_fake_servers(Path(tmp), [{"vocab_size": len(load_tokenizer(policy.tokenizer_dir))}])
    weights = {}
    original_finish, original_train_step = rl_stage.finish, Actor.train_step
    updates = {"count": 0, "signal_at": None}

    def finish(run):
        weights[str(run.output_dir)] = _weights(run.actor.module)
        original_finish(run)

    def train_step(self, *args, **kwargs):
        result = original_train_step(self, *args, **kwargs)
        updates["count"] += 1
        if updates["count"] == updates["signal_at"]:
            os.kill(os.getpid(), signal.SIGUSR1)  # as SLURM's --signal=USR1@N, while the step updates
        return result

    rl_stage.finish, Actor.train_step = finish, train_step
    boundaries = []  # the server's request count at the end of each run
    try:
        rl_stage.run_rl(config("straight", [server.url]), context=context)
        boundaries.append(len(server.requests()))
        updates.update(count=0, signal_at=STOPPED_STEP)
        rl_stage.run_rl(config("stopped", [server.url]), context=context)
        boundaries.append(len(server.requests()))
        checkpoints = CheckpointManager(f"{tmp}/stopped/ckpt", keep_last=10).list_steps()
        rows_at_stop = read_metrics(f"{tmp}/stopped/run/metrics.jsonl")
        updates.update(signal_at=None)
        rl_stage.run_rl(config("stopped", [server.url]), context=context)
        requests = server.requests()
    finally:
        server.kill()
    return {"rows": {name: read_metrics(f"{tmp}/{name}/run/metrics.jsonl") for name in ("straight", "stopped")},
            "weights": {name: weights[f"{tmp}/{name}/run"] for name in ("straight", "stopped")},
            "checkpoints_after_stop": checkpoints, "rows_at_stop": rows_at_stop,
            "requests": {"straight": requests[:boundaries[0]], "stopped": requests[boundaries[0]:boundaries[1]],
                         "resumed": requests[boundaries[1]:]}}


def _pushed(requests):
    return [int(r["body"]["weight_version"]) for r in requests if r["path"] == "/update_weights_from_disk"]


def _comparable(rows):
    return [{k: v for k, v in row.items() if not k.startswith(("time/", "rollout/server"))} for row in rows]


@pytest.mark.slow
@pytest.mark.parametrize("staleness", [0, 1], ids=["synchronous", "one_step_off_policy"])
def test_a_stop_checkpoints_before_the_weight_push_and_the_resumed_run_is_exact(tmp_path, bootstrap_cache_dir,
                                                                                 staleness):
    (outcome,) = run_distributed(_runs_worker, world_size=1, timeout_s=400,
                                 args=(str(tmp_path), str(bootstrap_cache_dir), staleness))
    requests = outcome["requests"]
    # Version k + 1 is the weights after k updates: the uninterrupted run pushes every one of them.
    assert _pushed(requests["straight"]) == list(range(1, NUM_STEPS + 2))
    # The stopped run pushed the weights its steps generated with, not those of the stopped update
    # (version STOPPED_STEP + 1), and checkpointed that update.
    assert _pushed(requests["stopped"]) == list(range(1, STOPPED_STEP + 1))
    assert outcome["checkpoints_after_stop"] == [STOPPED_STEP]
    # Its row waits in the checkpoint for the held-out score of the weights the push would have carried.
    assert [row["step"] for row in outcome["rows_at_stop"]] == list(range(STOPPED_STEP))
    # The resumed run's first request to the server is the push of the checkpoint's weights.
    resumed = requests["resumed"]
    assert resumed[0]["path"] == "/update_weights_from_disk"
    assert _pushed(resumed) == [STOPPED_STEP + 1, NUM_STEPS + 1]

    rows = outcome["rows"]
    assert [row["step"] for row in rows["straight"]] == list(range(NUM_STEPS + 1))
    assert "eval/pass@1" in rows["straight"][STOPPED_STEP]  # the stopped step is a scored one
    assert _comparable(rows["stopped"]) == _comparable(rows["straight"])
    for name, tensor in outcome["weights"]["straight"].items():
        assert torch.equal(outcome["weights"]["stopped"][name], tensor), name
    # The runs trained before the stop and after the resume, so equal weights prove something.
    assert rows["straight"][1]["grad_norm"] > 0 and rows["straight"][NUM_STEPS]["grad_norm"] > 0


def _agreement_worker(rank, world_size):
    import torch.distributed as dist

    from pipeline.rl.setup import StopRequest

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        with StopRequest() as stop:
            before = stop.requested(world_size=world_size)
            if rank == 1:
                os.kill(os.getpid(), signal.SIGUSR1)  # heard by one rank only, so far
            return before, stop.requested(world_size=world_size)
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_a_signal_heard_by_one_rank_stops_every_rank():
    # Skipping the push and checkpointing are collective: every rank must take the same branch.
    assert run_distributed(_agreement_worker, world_size=2, timeout_s=120) == [(False, True), (False, True)]

