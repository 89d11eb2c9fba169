"""TP/PP parity of the GPTModel factory on gloo: same weights and batch give the same loss and grads.

Each spawned rank first builds the TP=1/PP=1 reference model (fresh init with a
fixed seed), runs one forward/backward through megatron's schedule and keeps the
full state dict and gradients. It then re-initializes the layout under test,
loads its shard of the reference weights (``shard_full_state_dict``), runs the
same microbatches through ``get_forward_backward_func`` (1F1B when PP > 1) and
compares:

* loss: the mean over microbatches of the mean token cross-entropy;
* every local gradient against the matching shard of the reference gradient;
* the global gradient norm (each distinct parameter counted once), also as
  megatron's optimizer computes it (``get_grad_norm_fp32``).

These runs also exercise the CPU compatibility layer at megatron's distributed
call sites: p2p ``synchronize`` and buffers, the schedules' ``device="cuda"``
counters, ``.cuda()`` of the tied output weight on the last stage.

Tolerances. PP=2 with TP=1 and untied embeddings performs the reference's
operations in the reference's order (stages only move activations), so loss
and gradients are compared for exact equality. TP=2 splits matmuls and sums
partial products across ranks, and tied embeddings sum the embedding and
output-layer gradients in a different order, so those compare within fp32
rounding: rtol=1e-5, atol=1e-6 (gradient entries are O(1e-2)).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from tests.distributed_utils import run_distributed

pytestmark = pytest.mark.distributed

SEED = 1234
BATCH, SEQ, NUM_MICROBATCHES = 4, 16, 2
RTOL, ATOL = 1e-5, 1e-6


def _spec(*, tie_embeddings: bool):
    from pipeline.models.spec import ModelSpec

    return ModelSpec(
        family="qwen2" if tie_embeddings else "llama",
        vocab_size=128,
        hidden_size=64,
        ffn_hidden_size=128,
        num_layers=2,
        num_attention_heads=4,
        num_query_groups=2,
        max_position_embeddings=64,
        rope_theta=10000.0,
        qkv_bias=tie_embeddings,
        tie_embeddings=tie_embeddings,
    )


def _microbatches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 128, (BATCH, SEQ + 1), generator=generator)  # (B, T+1)
    ids, labels = tokens[:, :-1], tokens[:, 1:]  # (B, T) each
    size = BATCH // NUM_MICROBATCHES
    return [(ids[i : i + size], labels[i : i + size]) for i in range(0, BATCH, size)]


def _forward_backward(model, ctx) -> float:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    positions = torch.arange(SEQ).unsqueeze(0)  # (1, T)
    causal_mask = torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool).triu(1)  # True = masked
    data = iter(_microbatches())

    def forward_step(data_iterator, model):
        ids, labels = next(data_iterator)
        output = model(ids, positions.expand_as(ids), causal_mask, labels=labels)  # (b, T) on the last stage

        def loss_func(token_losses):
            loss = token_losses.float().mean()
            # A copy: the schedule divides the returned loss by num_microbatches in place.
            return loss, {"loss": loss.detach().clone()}

        return output, loss_func

    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=data,
        model=[model],
        num_microbatches=NUM_MICROBATCHES,
        seq_length=SEQ,
        micro_batch_size=BATCH // NUM_MICROBATCHES,
        forward_only=False,
    )
    loss = torch.zeros(())
    if ctx.is_pipeline_last:
        loss = torch.stack([entry["loss"] for entry in losses]).mean()
    return ctx.broadcast_from_last_stage(loss).item()


def _synchronize_tied_embedding_grads(model, ctx) -> None:
    # Megatron's finalize_model_grads does this for DDP-wrapped models: the first and
    # last stage each hold part of the tied weight's gradient.
    group = ctx.embedding_group
    if model.share_embeddings_and_output_weights and ctx.pipeline_parallel > 1 and group is not None:
        weight = model.shared_embedding_or_output_weight()
        dist.all_reduce(weight.grad, group=group)


def _grads_for_norm(model, ctx) -> list[torch.Tensor]:
    """Each distinct gradient once across the model-parallel group."""
    grads = []
    for name, param in model.named_parameters():
        replicated_across_tp = not getattr(param, "tensor_model_parallel", False)
        if replicated_across_tp and ctx.tp_rank != 0:
            continue
        if name == "output_layer.weight" and model.share_embeddings_and_output_weights:
            continue  # the tied copy on the last stage; counted with the embedding
        grads.append(param.grad)
    return grads


def _global_grad_norm(model, ctx) -> float:
    squares = torch.zeros((), dtype=torch.float64)
    for grad in _grads_for_norm(model, ctx):
        squares += grad.double().pow(2).sum()
    dist.all_reduce(squares, group=ctx.model_parallel_group)
    return squares.sqrt().item()


def _megatron_grad_norm(model, ctx) -> float:
    # megatron's optimizer computes the norm this way (device="cuda" buffers inside).
    from megatron.core.optimizer.clip_grads import get_grad_norm_fp32

    return get_grad_norm_fp32(_grads_for_norm(model, ctx), grad_stats_parallel_group=ctx.model_parallel_group)


def _run_config(rank: int, *, tie_embeddings: bool, layouts: list[tuple[int, int]]) -> dict:
    from pipeline.models.factory import build_gpt_model
    from pipeline.parallel.context import ParallelContext
    from tests.oracles.sharding import shard_full_state_dict

    spec = _spec(tie_embeddings=tie_embeddings)
    ctx = ParallelContext.initialize(tensor_parallel=1, pipeline_parallel=1, seed=SEED)
    reference = build_gpt_model(spec, parallel_context=ctx, seed=SEED)
    reference_loss = _forward_backward(reference, ctx)
    reference_norm = _global_grad_norm(reference, ctx)
    full_weights = {name: p.detach().clone() for name, p in reference.named_parameters()}
    full_grads = {name: p.grad.detach().clone() for name, p in reference.named_parameters()}
    ctx.destroy()

    results = {"reference": (reference_loss, reference_norm)}
    for tp, pp in layouts:
        ctx = ParallelContext.initialize(tensor_parallel=tp, pipeline_parallel=pp, seed=SEED)
        model = build_gpt_model(spec, parallel_context=ctx, seed=SEED + 1)  # different init on purpose
        model.load_state_dict(
            shard_full_state_dict(model, full_weights, tp_rank=ctx.tp_rank, tp_size=tp), strict=True
        )
        loss = _forward_backward(model, ctx)
        _synchronize_tied_embedding_grads(model, ctx)
        norm = _global_grad_norm(model, ctx)
        expected = shard_full_state_dict(model, full_grads, tp_rank=ctx.tp_rank, tp_size=tp)
        grads = {name: (p.grad.clone(), expected[name]) for name, p in model.named_parameters()}
        results[(tp, pp)] = (loss, norm, grads, _megatron_grad_norm(model, ctx))
        ctx.destroy()
    return results


def _parity_worker(rank: int, world_size: int, configs: list[tuple[bool, list[tuple[int, int]]]]) -> dict:
    # One process group for all layouts: re-creating the default group on the same
    # port races against the previous store's shutdown. Contexts reuse it.
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    results = {tie: _run_config(rank, tie_embeddings=tie, layouts=layouts) for tie, layouts in configs}
    dist.destroy_process_group()
    return results


def _assert_layout_matches(results, layout, *, exact: bool) -> None:
    reference_loss, reference_norm = results["reference"]
    loss, norm, grads, megatron_norm = results[layout]
    assert math.isfinite(reference_loss) and reference_loss > 0
    assert megatron_norm == pytest.approx(norm, rel=1e-6)  # fp32 accumulation inside megatron
    if exact:
        assert loss == reference_loss, layout
        assert norm == pytest.approx(reference_norm, rel=1e-12)
        for name, (actual, expected) in grads.items():
            assert torch.equal(actual, expected), (layout, name)
    else:
        assert loss == pytest.approx(reference_loss, rel=RTOL, abs=ATOL), layout
        assert norm == pytest.approx(reference_norm, rel=RTOL), layout
        for name, (actual, expected) in grads.items():
            torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL, msg=f"{layout} {name}")


@pytest.fixture(scope="module")
def two_ranks():
    """Both embedding configurations, TP=2 and PP=2, in one two-rank run (spawning costs seconds)."""
    layouts = [(2, 1), (1, 2)]
    return run_distributed(_parity_worker, world_size=2, args=([(False, layouts), (True, layouts)],))


def test_tp2_matches_tp1(two_ranks):
    for rank_results in two_ranks:
        _assert_layout_matches(rank_results[False], (2, 1), exact=False)
    # Both ranks report the same global quantities.
    assert two_ranks[0][False][(2, 1)][:2] == two_ranks[1][False][(2, 1)][:2]


def test_pp2_1f1b_matches_tp1_exactly(two_ranks):
    for rank_results in two_ranks:
        _assert_layout_matches(rank_results[False], (1, 2), exact=True)


def test_tied_embeddings_and_qkv_bias_under_tp2_and_pp2(two_ranks):
    for rank_results in two_ranks:
        _assert_layout_matches(rank_results[True], (2, 1), exact=False)
        _assert_layout_matches(rank_results[True], (1, 2), exact=False)


def test_losses_are_nontrivial(two_ranks):
    # A fresh init predicts a near-uniform distribution: loss close to log(vocab).
    for tie in (False, True):
        reference_loss, reference_norm = two_ranks[0][tie]["reference"]
        assert abs(reference_loss - math.log(128)) < 0.1 and reference_norm > 0


@pytest.mark.slow
def test_tp2_pp2_matches_tp1_on_four_ranks():
    results = run_distributed(_parity_worker, world_size=4, args=([(True, [(2, 2)])],), timeout_s=240)
    for rank_results in results:
        _assert_layout_matches(rank_results[True], (2, 2), exact=False)
