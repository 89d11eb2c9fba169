"""The rank-0 object collectives (one definition, used by the weight sync too) and the one-rank megatron
layout that checkpoint conversion and ``load_policy`` share (``pipeline.parallel.rendezvous``)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.distributed_utils import run_distributed


def _collectives_worker(rank: int, world_size: int, run_dir: str) -> dict:
    import torch.distributed as dist

    from pipeline.errors import UserError
    from pipeline.eval.policy import load_policy
    from pipeline.parallel import weight_transfer
    from pipeline.parallel.rendezvous import (
        all_gather_objects,
        broadcast_from_rank0,
        gather_to_rank0,
        single_rank_megatron,
    )

    dist.init_process_group("gloo")
    try:
        outcome = {
            "broadcast": broadcast_from_rank0({"plan": rank} if rank == 0 else None, world_size=world_size),
            "gather": gather_to_rank0(f"rank{rank}", rank=rank, world_size=world_size),
            "all_gather": all_gather_objects(rank * 10, world_size=world_size),
            # The weight sync's control objects travel through the same two collectives.
            "sync_broadcast": broadcast_from_rank0("control", world_size=world_size)
            == weight_transfer.sync_broadcast("control", world_size=world_size),
        }
        refusals = []
        for attempt in (lambda: single_rank_megatron(0, purpose="conversion").__enter__(),
                        lambda: load_policy(run_dir)):
            try:
                attempt()
            except UserError as error:
                refusals.append(str(error))
        outcome["refusals"] = refusals
        return outcome
    finally:
        dist.destroy_process_group()


def _load_policy_worker(rank: int, world_size: int, hf_dir: str, run_dir: str) -> dict:
    from megatron.core import parallel_state

    from pipeline.checkpoint.convert import hf_to_megatron
    from pipeline.eval.policy import load_policy
    from pipeline.parallel.context import ParallelContext
    from pipeline.parallel.rendezvous import process_group_initialized, single_rank_megatron

    hf_to_megatron(hf=hf_dir, out=run_dir, verify=False)  # its own one-rank layout, torn down again
    shutil.copytree(Path(hf_dir) / "tokenizer", Path(run_dir) / "tokenizer")
    outcome: dict = {"after_convert": (process_group_initialized(), parallel_state.model_parallel_is_initialized())}

    # torchrun's environment (RANK, WORLD_SIZE, MASTER_PORT of this spawned rank) is ignored:
    # the load brings up a one-rank gloo group of its own and tears it down.
    with single_rank_megatron(1, purpose="probe") as own:
        outcome["own"] = (type(own).__name__, own.world_size, own.backend if own else None)
        with single_rank_megatron(2, purpose="probe") as nested:
            outcome["nested"] = nested  # the layout already there is reused
    policy = load_policy(run_dir)
    outcome["fresh"] = {name: tensor.clone() for name, tensor in policy.hf_model.state_dict().items()}
    outcome["after_load"] = (process_group_initialized(), parallel_state.model_parallel_is_initialized())

    # A process that already runs a one-rank megatron layout: the load reuses it and leaves it up.
    context = ParallelContext.initialize(tensor_parallel=1, pipeline_parallel=1, seed=0, rank=0, world_size=1,
                                         local_rank=0, backend="gloo")
    try:
        policy = load_policy(run_dir)
        outcome["reused"] = {name: tensor.clone() for name, tensor in policy.hf_model.state_dict().items()}
        outcome["still_up"] = parallel_state.model_parallel_is_initialized()
    finally:
        context.destroy()
    return outcome


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict:
    """A tiny HF model, converted to a winnow checkpoint (with a tokenizer) in a spawned one-rank process."""
    from tests.checkpoint.tiny_models import build_hf_model, tiny_spec
    from tests.rollout.test_weight_sync_streamed import _tokenizer

    root = tmp_path_factory.mktemp("rendezvous")
    model = build_hf_model(tiny_spec("llama", tie_embeddings=False, num_query_groups=2))
    model.save_pretrained(root / "hf")
    _tokenizer(root / "hf" / "tokenizer")
    (outcome,) = run_distributed(_load_policy_worker, world_size=1, args=(str(root / "hf"), str(root / "run")))
    return {"outcome": outcome, "run": root / "run", "expected": model.state_dict()}


@pytest.mark.distributed
def test_load_policy_brings_up_a_one_rank_layout_or_reuses_the_process_own(converted):
    outcome, expected = converted["outcome"], converted["expected"]
    assert outcome["after_convert"] == (False, False)
    assert outcome["own"] == ("ParallelContext", 1, "gloo") and outcome["nested"] is None
    assert outcome["after_load"] == (False, False)  # torn down after the load
    assert outcome["still_up"]  # the process's own layout is left alone
    for loaded in (outcome["fresh"], outcome["reused"]):
        assert sorted(loaded) == sorted(expected)
        for name, tensor in expected.items():
            assert torch.equal(loaded[name], tensor), name


@pytest.mark.distributed
def test_rank0_collectives_and_the_one_rank_refusals_on_two_ranks(converted):
    outcomes = run_distributed(_collectives_worker, world_size=2, args=(str(converted["run"]),))
    for rank, outcome in enumerate(outcomes):
        assert outcome["broadcast"] == {"plan": 0}
        assert outcome["all_gather"] == [0, 10]
        assert outcome["sync_broadcast"]
        assert outcome["gather"] == (["rank0", "rank1"] if rank == 0 else None)
        conversion, evaluation = outcome["refusals"]
        assert conversion == "conversion needs a one-rank process; this one is part of a 2-rank group"
        assert evaluation.startswith("loading a policy for evaluation needs a one-rank process")


def test_the_weight_sync_uses_the_rendezvous_collectives():
    from pipeline.parallel import rendezvous, weight_transfer

    assert weight_transfer.sync_broadcast is rendezvous.broadcast_from_rank0
    assert weight_transfer.sync_gather is rendezvous.gather_to_rank0
    assert weight_transfer.sync_gather("only", rank=0, world_size=1) == ["only"]
