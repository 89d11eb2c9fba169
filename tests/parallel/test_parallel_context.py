"""ParallelContext on gloo ranks: layouts, groups, reducers, and the TP vocabulary reducer under log-probs.

One two-rank run (module fixture) goes through three layouts, each on its own
rendezvous port: TP=2 (initialized from torchrun's environment), PP=2 and DP=2
(explicit address). Tests assert on what the ranks returned.

Tolerances: the reducers move exact values (sum of two floats, max), so their
checks are exact. The TP=2 log-prob/entropy and logsumexp results sum shard
statistics in another order than the TP=1 computation: rtol=1e-5, atol=1e-6.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed_utils import reserved_port, run_distributed

VOCAB, HIDDEN, NUM_TOKENS = 64, 16, 10
RTOL, ATOL = 1e-5, 1e-6


def _inputs() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(11)
    return {
        "hidden": torch.randn(NUM_TOKENS, HIDDEN, generator=generator),  # (N, H)
        "weight": torch.randn(VOCAB, HIDDEN, generator=generator) / HIDDEN**0.5,  # (V, H)
        "targets": torch.randint(0, VOCAB, (NUM_TOKENS,), generator=generator),  # (N,)
        "logprob_coef": torch.randn(NUM_TOKENS, generator=generator),  # (N,)
        "entropy_coef": torch.randn(NUM_TOKENS, generator=generator),  # (N,)
    }


def _vocab_parallel_logsumexp(logits_shard: torch.Tensor, reducer) -> torch.Tensor:
    """logsumexp over a vocabulary split across ranks: (N, V_local) -> (N,)."""
    shift = reducer.max(logits_shard.max(dim=-1).values)  # (N,)
    return reducer.sum((logits_shard - shift[:, None]).exp().sum(dim=-1)).log() + shift


def _logprob_terms(hidden, weight, targets, *, vocab_start, reducer, logprob_coef, entropy_coef):
    from pipeline.algorithms.logprobs import token_logprobs_and_entropy

    out = token_logprobs_and_entropy(hidden=hidden, output_weight=weight, targets=targets, temperature=0.7,
                                     chunk_size=4, vocab_start=vocab_start, reducer=reducer)
    objective = (out.logprobs * logprob_coef + out.entropy * entropy_coef).sum()
    return out, objective


def _tp2_checks(ctx) -> dict:
    from pipeline.parallel import cpu_compat

    reducer = ctx.tp_vocab_reducer()
    rank = ctx.tp_rank
    result = {
        "sizes": (ctx.rank, ctx.world_size, ctx.tensor_parallel, ctx.pipeline_parallel, ctx.data_parallel),
        "tp_rank": rank,
        "pipeline_position": (ctx.is_pipeline_first, ctx.is_pipeline_last),
        "vocab_range": ctx.vocab_range(VOCAB),
        "device": ctx.device,
        "compat_enabled": cpu_compat.is_enabled(),
        "group_sizes": tuple(torch.distributed.get_world_size(g) for g in (ctx.tp_group, ctx.pp_group, ctx.dp_group)),
    }

    # sum: all-reduce forward, identity backward, input untouched.
    x = torch.tensor([rank + 1.0, 2.0 * (rank + 1)], requires_grad=True)
    summed = reducer.sum(x)
    (summed * torch.tensor([1.0, 2.0])).sum().backward()
    result["sum"] = (summed.detach(), x.detach().clone(), x.grad.clone())

    # max: detached, input untouched.
    y = torch.tensor([float(rank), -float(rank)], requires_grad=True)
    maximum = reducer.max(y)
    result["max"] = (maximum, maximum.requires_grad, y.detach().clone())

    # A vocab-parallel logsumexp and its gradient w.r.t. this rank's logits.
    start, end = ctx.vocab_range(VOCAB)
    full_logits = torch.randn(NUM_TOKENS, VOCAB, generator=torch.Generator().manual_seed(5)) * 3
    shard = full_logits[:, start:end].clone().requires_grad_()
    lse = _vocab_parallel_logsumexp(shard, reducer)
    (lse * torch.arange(1.0, NUM_TOKENS + 1)).sum().backward()
    result["logsumexp"] = (lse.detach(), shard.grad.clone())

    # Chunked log-probs/entropy on this rank's vocabulary rows vs the whole vocabulary.
    inputs = _inputs()
    hidden = inputs["hidden"].clone().requires_grad_()
    weight_shard = inputs["weight"][start:end].clone().requires_grad_()
    out, objective = _logprob_terms(hidden, weight_shard, inputs["targets"], vocab_start=start, reducer=reducer,
                                    logprob_coef=inputs["logprob_coef"], entropy_coef=inputs["entropy_coef"])
    objective.backward()
    result["logprobs"] = (out.logprobs.detach(), out.entropy.detach(), hidden.grad.clone(), weight_shard.grad.clone())
    return result


def _pp2_checks(ctx) -> dict:
    value = torch.tensor([float(ctx.pp_rank) + 10.0])
    return {
        "pp_rank": ctx.pp_rank,
        "pipeline_position": (ctx.is_pipeline_first, ctx.is_pipeline_last),
        "pipeline_last_rank": ctx.pipeline_last_rank,
        "in_embedding_group": ctx.embedding_group is not None,
        "broadcast": ctx.broadcast_from_last_stage(value).clone(),
        "sizes": (ctx.tensor_parallel, ctx.pipeline_parallel, ctx.data_parallel),
    }


def _dp2_checks(ctx) -> dict:
    reducer = ctx.tp_vocab_reducer()  # a one-rank group: no communication
    x = torch.ones(2, requires_grad=True)
    value = torch.tensor([1.0, float(ctx.dp_rank)])
    return {
        "dp_rank": ctx.dp_rank,
        "dp_sum": ctx.dp_sum(value),
        "dp_sum_with_cp": ctx.dp_sum(value, with_context_parallel=True),
        "dp_sum_input": value,
        "one_rank_sum_is_input": reducer.sum(x) is x,
        "sizes": (ctx.tensor_parallel, ctx.pipeline_parallel, ctx.data_parallel),
    }


def _layouts_worker(rank: int, world_size: int, second_port: int, third_port: int) -> dict:
    import torch.distributed as dist

    from pipeline.parallel import cpu_compat
    from pipeline.parallel.context import ParallelContext

    results = {}
    ctx = ParallelContext.initialize(tensor_parallel=2, pipeline_parallel=1, seed=3)  # torchrun env
    results["tp2"] = _tp2_checks(ctx)
    ctx.destroy()
    results["after_destroy"] = (dist.is_initialized(), cpu_compat.is_enabled())

    ctx = ParallelContext.initialize(tensor_parallel=1, pipeline_parallel=2, seed=3, rank=rank, world_size=world_size,
                                     master_addr="127.0.0.1", master_port=second_port)
    results["pp2"] = _pp2_checks(ctx)
    ctx.destroy()

    ctx = ParallelContext.initialize(tensor_parallel=1, pipeline_parallel=1, data_parallel=2, seed=3, rank=rank,
                                     world_size=world_size, master_addr="127.0.0.1", master_port=third_port)
    results["dp2"] = _dp2_checks(ctx)
    with pytest.raises(ValueError, match="data_parallel: 1"):
        ParallelContext.initialize(tensor_parallel=1, pipeline_parallel=1, data_parallel=1, seed=3)
    with pytest.raises(ValueError, match="does not divide world_size=2"):
        ParallelContext.initialize(tensor_parallel=1, pipeline_parallel=3, seed=3)
    ctx.destroy()
    return results


@pytest.fixture(scope="module")
def ranks():
    with reserved_port() as second_port, reserved_port() as third_port:
        return run_distributed(_layouts_worker, world_size=2, args=(second_port, third_port))


@pytest.mark.distributed
def test_tp2_layout(ranks):
    for rank, result in enumerate(ranks):
        tp2 = result["tp2"]
        assert tp2["sizes"] == (rank, 2, 2, 1, 1)
        assert tp2["tp_rank"] == rank  # TP ranks are adjacent global ranks
        assert tp2["pipeline_position"] == (True, True)
        assert tp2["vocab_range"] == (32 * rank, 32 * rank + 32)
        assert tp2["device"] == torch.device("cpu")
        assert tp2["compat_enabled"] is True
        assert tp2["group_sizes"] == (2, 1, 1)
        # destroy() tore down the process group and the compat layer it had set up.
        assert result["after_destroy"] == (False, False)


@pytest.mark.distributed
def test_tp_sum_reduces_forward_and_passes_gradient_through(ranks):
    for rank, result in enumerate(ranks):
        summed, x_after, x_grad = result["tp2"]["sum"]
        assert torch.equal(summed, torch.tensor([3.0, 6.0]))  # (1 + 2, 2 + 4)
        assert torch.equal(x_after, torch.tensor([rank + 1.0, 2.0 * (rank + 1)]))
        assert torch.equal(x_grad, torch.tensor([1.0, 2.0]))  # identity, not the group size times it


@pytest.mark.distributed
def test_tp_max_is_detached(ranks):
    for rank, result in enumerate(ranks):
        maximum, requires_grad, y_after = result["tp2"]["max"]
        assert torch.equal(maximum, torch.tensor([1.0, 0.0]))
        assert requires_grad is False
        assert torch.equal(y_after, torch.tensor([float(rank), -float(rank)]))


@pytest.mark.distributed
def test_vocab_parallel_logsumexp_matches_full_vocabulary(ranks):
    full_logits = (torch.randn(NUM_TOKENS, VOCAB, generator=torch.Generator().manual_seed(5)) * 3).requires_grad_()
    expected = torch.logsumexp(full_logits, dim=-1)
    (expected * torch.arange(1.0, NUM_TOKENS + 1)).sum().backward()
    for rank, result in enumerate(ranks):
        lse, shard_grad = result["tp2"]["logsumexp"]
        torch.testing.assert_close(lse, expected.detach(), rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(shard_grad, full_logits.grad[:, 32 * rank : 32 * rank + 32], rtol=RTOL, atol=ATOL)


@pytest.mark.distributed
def test_tp2_token_logprobs_and_entropy_match_tp1(ranks):
    from pipeline.algorithms.reducers import LOCAL

    inputs = _inputs()
    hidden = inputs["hidden"].clone().requires_grad_()
    weight = inputs["weight"].clone().requires_grad_()
    reference, objective = _logprob_terms(hidden, weight, inputs["targets"], vocab_start=0, reducer=LOCAL,
                                          logprob_coef=inputs["logprob_coef"], entropy_coef=inputs["entropy_coef"])
    objective.backward()
    # The TP=1 values themselves against log_softmax, so the comparison is not vacuous.
    log_probs = torch.log_softmax(inputs["hidden"] @ inputs["weight"].T / 0.7, dim=-1)
    torch.testing.assert_close(reference.logprobs, log_probs.gather(1, inputs["targets"][:, None])[:, 0],
                               rtol=RTOL, atol=ATOL)

    hidden_grad_sum = torch.zeros_like(hidden)
    for rank, result in enumerate(ranks):
        logprobs, entropy, hidden_grad, weight_grad = result["tp2"]["logprobs"]
        torch.testing.assert_close(logprobs, reference.logprobs.detach(), rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(entropy, reference.entropy.detach(), rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(weight_grad, weight.grad[32 * rank : 32 * rank + 32], rtol=RTOL, atol=ATOL)
        hidden_grad_sum += hidden_grad
    # Each rank's hidden gradient is its vocabulary slice's share; the TP region sums them.
    torch.testing.assert_close(hidden_grad_sum, hidden.grad, rtol=RTOL, atol=ATOL)


@pytest.mark.distributed
def test_pp2_layout_and_broadcast_from_last_stage(ranks):
    for rank, result in enumerate(ranks):
        pp2 = result["pp2"]
        assert pp2["sizes"] == (1, 2, 1)
        assert pp2["pp_rank"] == rank
        assert pp2["pipeline_position"] == (rank == 0, rank == 1)
        assert pp2["pipeline_last_rank"] == 1
        assert pp2["in_embedding_group"] is True  # first and last stage share tied embeddings
        assert torch.equal(pp2["broadcast"], torch.tensor([11.0]))  # the last stage's value everywhere


@pytest.mark.distributed
def test_dp2_sum_and_one_rank_reducer(ranks):
    for rank, result in enumerate(ranks):
        dp2 = result["dp2"]
        assert dp2["sizes"] == (1, 1, 2) and dp2["dp_rank"] == rank
        assert torch.equal(dp2["dp_sum"], torch.tensor([2.0, 1.0]))  # (1 + 1, 0 + 1)
        assert torch.equal(dp2["dp_sum_with_cp"], torch.tensor([2.0, 1.0]))  # CP=1: same group
        assert torch.equal(dp2["dp_sum_input"], torch.tensor([1.0, float(rank)]))  # input untouched
        assert dp2["one_rank_sum_is_input"] is True


def test_initialize_argument_errors(monkeypatch):
    from pipeline.parallel.context import ParallelContext

    with pytest.raises(ValueError, match="tensor_parallel"):
        ParallelContext.initialize(tensor_parallel=0, pipeline_parallel=1, seed=0)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="backend: 'nccl' needs CUDA"):
            ParallelContext.initialize(tensor_parallel=1, pipeline_parallel=1, seed=0, backend="nccl")
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    if not torch.distributed.is_initialized():
        with pytest.raises(ValueError, match="rank/world_size"):
            ParallelContext.initialize(tensor_parallel=1, pipeline_parallel=1, seed=0)
        # Ranks of a larger group must meet somewhere; a one-rank group needs no address.
        with pytest.raises(ValueError, match="master_addr/master_port"):
            ParallelContext.initialize(tensor_parallel=1, pipeline_parallel=1, seed=0, rank=0, world_size=2)
        # The layout is validated before the process group comes up.
        with pytest.raises(ValueError, match="does not divide world_size=1"):
            ParallelContext.initialize(tensor_parallel=2, pipeline_parallel=1, seed=0, rank=0, world_size=1)
        assert not torch.distributed.is_initialized()
        monkeypatch.setenv("RANK", "zero")
        with pytest.raises(ValueError, match="RANK: expected an integer"):
            ParallelContext.initialize(tensor_parallel=1, pipeline_parallel=1, seed=0)
