"""Data parallelism: each DP rank trains its own rows, and together they make DP=1's update."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.trainer.batch import balance_rows
from tests.distributed_utils import run_distributed
from tests.trainer.test_actor import SEED, _actor, _batch, _spec

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "d3s")


def test_balance_rows_hand_case():
    # LPT: 12 → share 0, 12 → share 1, 10 → share 0 (22), 9 → share 1 (21), 7 → share 1 (28), 5 → share 0 (27).
    shares = balance_rows(torch.tensor([12, 9, 7, 12, 5, 10]), 2)
    assert [s.tolist() for s in shares] == [[0, 4, 5], [1, 2, 3]]


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 4000), min_size=0, max_size=40), num_shares=st.integers(1, 8))
def test_balance_rows_covers_every_row_once_within_the_lpt_bound(lengths, num_shares):
    shares = balance_rows(torch.tensor(lengths, dtype=torch.long), num_shares)
    assert len(shares) == num_shares
    assert sorted(row for share in shares for row in share.tolist()) == list(range(len(lengths)))
    assert all(share.tolist() == sorted(share.tolist()) for share in shares)
    if lengths:
        loads = [sum(lengths[row] for row in share.tolist()) for share in shares]
        # Graham's bound against the trivial lower bound max(mean load, longest row).
        lower = max(sum(lengths) / num_shares, max(lengths))
        assert max(loads) <= (4 / 3) * lower + 1e-9


def _policy_batch(aggregation_with_tokens: bool):
    batch = _batch()
    generator = torch.Generator().manual_seed(11)
    batch.advantages = torch.randn(batch.tokens.shape, generator=generator) * batch.response_mask  # (B, T)
    batch.old_logprobs = None
    if aggregation_with_tokens:
        batch.token_mask = batch.response_mask & (torch.rand(batch.tokens.shape, generator=generator) < 0.6)
    return batch


def _dp_worker(rank, world_size, tp, weights_path, aggregation, num_steps):
    from safetensors.torch import load_file, save_file

    from pipeline.algorithms.losses import grpo_loss
    from pipeline.trainer.losses import PolicyLoss

    actor = _actor(tp, 1, micro_batch_tokens=30, lr=1e-2)
    if rank == 0 and not os.path.exists(weights_path):
        state = {k: v.contiguous() for k, v in actor.module.state_dict().items() if not k.endswith("_extra_state")}
        save_file(state, weights_path)
    if world_size > 1 or os.path.exists(weights_path):
        actor.load_full_state_dict(load_file(weights_path))
    batch = _policy_batch(aggregation == "d3s")
    share = actor.data_parallel_share(batch)
    # The π_old pass: count the rows this rank's model is fed while it scores the batch.
    scored = []
    hook = actor.module.register_forward_pre_hook(lambda module, args: scored.append(int(args[0].shape[0])))
    logprobs, entropy = actor.compute_token_stats(batch)
    hook.remove()
    loss = PolicyLoss(grpo_loss, aggregation=aggregation)
    steps = [actor.train_step(batch, loss) for _ in range(num_steps)]
    return {"losses": [s.loss for s in steps], "grad_norms": [s.grad_norm for s in steps],
            "rows": share.tokens.shape[0], "dp_rank": actor.context.dp_rank, "seed": SEED,
            "scored_rows": sum(scored), "logprobs": logprobs, "entropy": entropy}


@pytest.mark.distributed
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_dp2_trains_its_own_rows_and_matches_dp1(tmp_path, aggregation):
    path = str(tmp_path / "weights.safetensors")
    (single,) = run_distributed(_dp_worker, world_size=1, args=(1, path, aggregation, 3))
    pair = run_distributed(_dp_worker, world_size=2, args=(1, path, aggregation, 3))
    assert sorted(outcome["dp_rank"] for outcome in pair) == [0, 1]
    assert sum(outcome["rows"] for outcome in pair) == single["rows"] == 6  # every row once
    # The π_old pass: each rank scores a part of the batch, together every row once, and every
    # rank ends with the whole batch's log-probs and entropies, bit for bit DP=1's.
    assert single["scored_rows"] == 6
    assert sum(outcome["scored_rows"] for outcome in pair) == 6
    assert all(0 < outcome["scored_rows"] < 6 for outcome in pair)
    for outcome in pair:
        assert torch.equal(outcome["logprobs"], single["logprobs"]) and torch.equal(outcome["entropy"], single["entropy"])
        assert outcome["losses"] == pytest.approx(single["losses"], rel=1e-5)
        assert outcome["grad_norms"] == pytest.approx(single["grad_norms"], rel=1e-5)


@pytest.mark.distributed
@pytest.mark.slow
def test_tp2_dp2_matches_dp1(tmp_path):
    path = str(tmp_path / "weights.safetensors")
    (single,) = run_distributed(_dp_worker, world_size=1, args=(1, path, "d3s", 2))
    quad = run_distributed(_dp_worker, world_size=4, args=(2, path, "d3s", 2))
    assert sorted(outcome["dp_rank"] for outcome in quad) == [0, 0, 1, 1]
    assert sum(outcome["rows"] for outcome in quad if outcome["dp_rank"] >= 0) == 2 * single["rows"]  # 2 TP ranks each
    assert sum(outcome["scored_rows"] for outcome in quad) == 2 * single["scored_rows"]  # each row once per TP rank
    for outcome in quad:
        # TP splits the heads' sums, so equal to fp32 rounding rather than bit for bit.
        torch.testing.assert_close(outcome["logprobs"], single["logprobs"], rtol=1e-5, atol=1e-5)
        assert outcome["losses"] == pytest.approx(single["losses"], rel=1e-5)
        assert outcome["grad_norms"] == pytest.approx(single["grad_norms"], rel=1e-5)


def _tiny_batch_worker(rank, world_size):
    from pipeline.trainer.losses import CrossEntropyLoss

    actor = _actor(1, 1, micro_batch_tokens=10_000, lr=1e-2)
    batch = _batch().select(torch.tensor([1]))  # one row, two DP ranks
    share = actor.data_parallel_share(batch)
    step = actor.train_step(batch, CrossEntropyLoss())
    return int(share.response_mask.sum()), step.loss, step.skipped


@pytest.mark.distributed
def test_a_rank_without_rows_trains_a_masked_placeholder():
    outcomes = run_distributed(_tiny_batch_worker, world_size=2)
    tokens = sorted(outcome[0] for outcome in outcomes)
    assert tokens[0] == 0 and tokens[1] > 0  # one rank got the row, the other a placeholder
    assert outcomes[0][1] == pytest.approx(outcomes[1][1]) and not any(outcome[2] for outcome in outcomes)


def _optimizer_worker(rank, world_size, ckpt, distributed_optimizer):
    from pipeline.checkpoint.manager import CheckpointManager
    from pipeline.config import OptimConfig, TrainerConfig
    from pipeline.parallel.context import ParallelContext
    from pipeline.trainer.actor import Actor
    from pipeline.trainer.losses import CrossEntropyLoss

    context = ParallelContext.initialize(tensor_parallel=1, pipeline_parallel=1, seed=SEED)

    def actor():
        return Actor(spec=_spec(), context=context, optim=OptimConfig(lr=1e-2), seed=SEED,
                     trainer=TrainerConfig(micro_batch_tokens=30, logprob_chunk_size=16,
                                           distributed_optimizer=distributed_optimizer))

    def state_bytes(trained):
        inner = trained.optimizer.optimizer
        return sum(t.numel() * t.element_size() for state in inner.state.values() for t in state.values()
                   if torch.is_tensor(t) and t.dim() > 0)

    trained = actor()
    first = [trained.train_step(_batch(), CrossEntropyLoss()).loss for _ in range(2)]
    manager = CheckpointManager(ckpt, keep_last=1, rank=context.rank, world_size=context.world_size)
    manager.save(2, actor=trained, state={}, tensors={})
    straight = [trained.train_step(_batch(), CrossEntropyLoss()) for _ in range(2)]
    resumed_actor = actor()
    manager.load(manager.newest_valid(), actor=resumed_actor)
    resumed = [resumed_actor.train_step(_batch(), CrossEntropyLoss()) for _ in range(2)]
    return {"distributed": trained.distributed_optimizer, "bytes": state_bytes(trained), "first": first,
            "straight": [(s.loss, s.grad_norm) for s in straight], "resumed": [(s.loss, s.grad_norm) for s in resumed]}


@pytest.mark.distributed
def test_distributed_optimizer_halves_the_state_and_resumes_exactly(tmp_path):
    """On by default at DP=2: each rank holds half of Adam's moments; a save/load resumes bit for bit."""
    sharded = run_distributed(_optimizer_worker, world_size=2, args=(str(tmp_path / "a"), None))
    replicated = run_distributed(_optimizer_worker, world_size=2, args=(str(tmp_path / "b"), False))
    assert all(outcome["distributed"] for outcome in sharded) and not any(o["distributed"] for o in replicated)
    full = replicated[0]["bytes"]
    assert sum(outcome["bytes"] for outcome in sharded) == full  # the shards partition the state
    assert all(0.4 * full <= outcome["bytes"] <= 0.6 * full for outcome in sharded)
    for outcome in sharded:
        assert outcome["resumed"] == outcome["straight"]  # exact, loss and gradient norm
        assert outcome["first"] == pytest.approx(replicated[0]["first"], rel=1e-6)
        assert [loss for loss, _ in outcome["straight"]] == pytest.approx(
            [loss for loss, _ in replicated[0]["straight"]], rel=1e-5)
