"""Chunked log-probs/entropy against the materialized float64 computation."""

from __future__ import annotations

import collections
import math
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from pipeline.algorithms.logprobs import logprobs_from_logits, token_logprobs_and_entropy


def _inputs(num_tokens: int, hidden_size: int, vocab: int, *, seed: int = 0, dtype=torch.float64, scale=1.0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, hidden_size, generator=generator, dtype=dtype) * scale
    weight = torch.randn(vocab, hidden_size, generator=generator, dtype=dtype) / math.sqrt(hidden_size)
    targets = torch.randint(0, vocab, (num_tokens,), generator=generator)
    grad_logprobs = torch.randn(num_tokens, generator=generator, dtype=dtype)
    grad_entropy = torch.randn(num_tokens, generator=generator, dtype=dtype)
    return hidden, weight, targets, grad_logprobs, grad_entropy


def _reference(hidden, weight, targets, temperature, grad_logprobs, grad_entropy):
    """Materialized float64: logits, log_softmax, gather, −Σ p log p; gradients by autograd."""
    hidden = hidden.detach().double().requires_grad_()
    weight = weight.detach().double().requires_grad_()
    logits = hidden @ weight.t() / temperature
    log_probs = torch.log_softmax(logits, dim=-1)
    logprobs = log_probs.gather(1, targets[:, None]).squeeze(1)
    entropy = -(log_probs.exp() * log_probs).sum(dim=-1)
    (logprobs * grad_logprobs.double() + entropy * grad_entropy.double()).sum().backward()
    return logprobs.detach(), entropy.detach(), hidden.grad, weight.grad


def _chunked(hidden, weight, targets, grad_logprobs, grad_entropy, **options):
    hidden = hidden.detach().clone().requires_grad_()
    weight = weight.detach().clone().requires_grad_()
    result = token_logprobs_and_entropy(hidden=hidden, output_weight=weight, targets=targets, **options)
    (result.logprobs * grad_logprobs + result.entropy * grad_entropy).sum().backward()
    return result.logprobs.detach(), result.entropy.detach(), hidden.grad, weight.grad


@pytest.mark.parametrize("chunk_size", [2, 7, 16, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_matches_materialized_float64(chunk_size, temperature):
    hidden, weight, targets, g_lp, g_h = _inputs(37, 12, 53, scale=2.0)
    got = _chunked(hidden, weight, targets, g_lp, g_h, temperature=temperature, chunk_size=chunk_size)
    expected = _reference(hidden, weight, targets, temperature, g_lp, g_h)
    for actual, reference in zip(got, expected):
        torch.testing.assert_close(actual, reference, rtol=1e-10, atol=1e-12)


@settings(max_examples=25, deadline=None)
@given(
    num_tokens=st.integers(1, 40),
    vocab=st.integers(2, 70),
    chunk_size=st.integers(2, 50),
    seed=st.integers(0, 2**16),
)
def test_property_matches_reference_and_bounds(num_tokens, vocab, chunk_size, seed):
    hidden, weight, targets, g_lp, g_h = _inputs(num_tokens, 6, vocab, seed=seed, scale=3.0)
    got = _chunked(hidden, weight, targets, g_lp, g_h, chunk_size=chunk_size)
    expected = _reference(hidden, weight, targets, 1.0, g_lp, g_h)
    for actual, reference in zip(got, expected):
        torch.testing.assert_close(actual, reference, rtol=1e-9, atol=1e-11)
    logprobs, entropy = got[0], got[1]
    assert bool((logprobs <= 1e-12).all())
    assert bool((entropy >= -1e-12).all()) and bool((entropy <= math.log(vocab) + 1e-9).all())


def test_hand_computed_logits():
    # softmax(0, ln 2, ln 3) = (1/6, 2/6, 3/6): log p(target 2) = ln(1/2),
    # H = −(1/6 ln 1/6 + 1/3 ln 1/3 + 1/2 ln 1/2) = 1.0114042647.
    # As hidden states: h = (1,), W = (0, ln 2, ln 3)ᵀ.
    hidden = torch.tensor([[1.0]], dtype=torch.float64)
    weight = torch.tensor([[0.0], [math.log(2)], [math.log(3)]], dtype=torch.float64)
    result = token_logprobs_and_entropy(hidden=hidden, output_weight=weight, targets=torch.tensor([2]))
    assert result.logprobs.item() == pytest.approx(math.log(0.5))
    assert result.entropy.item() == pytest.approx(1.0114042647)
    logits_result = logprobs_from_logits((hidden @ weight.t())[None], torch.tensor([[2]]))
    assert logits_result.logprobs.item() == pytest.approx(math.log(0.5))
    assert logits_result.entropy.item() == pytest.approx(1.0114042647)


def test_extreme_logits_are_stable():
    hidden, weight, targets, g_lp, g_h = _inputs(9, 4, 20, scale=300.0)  # logits in the hundreds
    hidden, weight, g_lp, g_h = hidden.float(), weight.float(), g_lp.float(), g_h.float()
    got = _chunked(hidden, weight, targets, g_lp, g_h, chunk_size=4)
    expected = _reference(hidden, weight, targets, 1.0, g_lp, g_h)  # float64 from the same float32 inputs
    for actual, reference in zip(got, expected):
        assert bool(torch.isfinite(actual).all())
        torch.testing.assert_close(actual.double(), reference, rtol=1e-4, atol=1e-3)


def test_without_entropy_and_partial_requires_grad():
    hidden, weight, targets, g_lp, _ = _inputs(11, 5, 17)
    hidden = hidden.clone().requires_grad_()
    result = token_logprobs_and_entropy(hidden=hidden, output_weight=weight, targets=targets,
                                        chunk_size=4, compute_entropy=False)
    assert result.entropy is None
    (result.logprobs * g_lp).sum().backward()
    _, _, ref_hidden_grad, _ = _reference(hidden, weight, targets, 1.0, g_lp, torch.zeros_like(g_lp))
    torch.testing.assert_close(hidden.grad, ref_hidden_grad)
    # Only the entropy used downstream: grad_logprobs arrives as None.
    weight_leaf = weight.clone().requires_grad_()
    result = token_logprobs_and_entropy(hidden=hidden.detach(), output_weight=weight_leaf, targets=targets, chunk_size=3)
    result.entropy.sum().backward()
    _, _, _, ref_weight_grad = _reference(hidden, weight, targets, 1.0, torch.zeros_like(g_lp), torch.ones_like(g_lp))
    torch.testing.assert_close(weight_leaf.grad, ref_weight_grad)


def test_bfloat16_weights_close_to_float32():
    hidden, weight, targets, g_lp, g_h = _inputs(20, 16, 40, dtype=torch.float32)
    hidden16, weight16 = hidden.bfloat16(), weight.bfloat16()
    logprobs, entropy, hidden_grad, weight_grad = _chunked(hidden16, weight16, targets, g_lp, g_h, chunk_size=8)
    assert logprobs.dtype == torch.float32 and hidden_grad.dtype == torch.bfloat16
    expected = _reference(hidden16, weight16, targets, 1.0, g_lp, g_h)
    torch.testing.assert_close(logprobs.double(), expected[0], rtol=0, atol=5e-2)
    torch.testing.assert_close(entropy.double(), expected[1], rtol=0, atol=5e-2)
    torch.testing.assert_close(hidden_grad.double(), expected[2], rtol=0, atol=5e-2)
    torch.testing.assert_close(weight_grad.double(), expected[3], rtol=0, atol=5e-2)


def test_empty_input():
    hidden = torch.zeros(0, 4, requires_grad=True)
    result = token_logprobs_and_entropy(
        hidden=hidden, output_weight=torch.randn(10, 4), targets=torch.zeros(0, dtype=torch.long)
    )
    assert result.logprobs.shape == (0,) and result.entropy.shape == (0,)


def test_validation():
    hidden, weight, targets, *_ = _inputs(4, 3, 5)
    with pytest.raises(ValueError, match="owned by 0 vocabulary shards"):
        token_logprobs_and_entropy(hidden=hidden, output_weight=weight, targets=torch.tensor([0, 1, 5, 2]))
    with pytest.raises(ValueError, match="chunk_size"):
        token_logprobs_and_entropy(hidden=hidden, output_weight=weight, targets=targets, chunk_size=1)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs_and_entropy(hidden=hidden, output_weight=weight, targets=targets, temperature=0.0)
    with pytest.raises(ValueError, match="one floating dtype"):
        token_logprobs_and_entropy(hidden=hidden.float(), output_weight=weight, targets=targets)
    with pytest.raises(ValueError, match="hidden size"):
        token_logprobs_and_entropy(hidden=hidden, output_weight=weight[:, :2], targets=targets)
    with pytest.raises(ValueError, match="targets"):
        token_logprobs_and_entropy(hidden=hidden, output_weight=weight, targets=targets[:2])


# ---------------------------------------------------------------- vocabulary sharding
class _ThreadGroup:
    """All-reduce among ``world`` threads of this process: one thread per simulated rank."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.slots: list[torch.Tensor | None] = [None] * world
        self.barrier = threading.Barrier(world, timeout=20)
        self.num_collectives = 0

    def all_reduce(self, rank: int, tensor: torch.Tensor, op) -> torch.Tensor:
        self.slots[rank] = tensor.detach().clone()
        self.barrier.wait()
        result = op(torch.stack(self.slots))  # same order on every rank → bit-identical results
        if rank == 0:
            self.num_collectives += 1
        self.barrier.wait()  # nobody overwrites a slot before everyone has read
        return result


class _ShardReducer:
    def __init__(self, group: _ThreadGroup, rank: int) -> None:
        self.group, self.rank = group, rank

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        total = self.group.all_reduce(self.rank, tensor, lambda stacked: stacked.sum(0))
        # Forward: the all-reduced value; backward: identity (reducers.py contract).
        return tensor + (total - tensor).detach()

    def max(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.rank, tensor, lambda stacked: stacked.amax(0)).detach()


def _run_ranks(hidden_leaf, shards, vocab_starts, targets, *, temperature=1.0, chunk_size=8):
    """Run one call per simulated rank, each in its own thread; returns (outputs, errors, group)."""
    world = len(shards)
    group = _ThreadGroup(world)
    outputs: list = [None] * world
    errors: list[BaseException | None] = [None] * world

    def rank_main(rank: int) -> None:
        try:
            outputs[rank] = token_logprobs_and_entropy(
                hidden=hidden_leaf,
                output_weight=shards[rank],
                targets=targets,
                temperature=temperature,
                chunk_size=chunk_size,
                vocab_start=vocab_starts[rank],
                reducer=_ShardReducer(group, rank),
            )
        except BaseException as error:  # surfaced by the caller
            # No barrier.abort() here: a rank raising right after a collective would break
            # the barrier under a peer still leaving it. A rank failing alone makes its
            # peers time out instead (BrokenBarrierError), which the caller reports.
            errors[rank] = error

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outputs, errors, group


@pytest.mark.parametrize("boundaries", [(0, 26, 53), (0, 10, 53), (0, 20, 35, 53)])
@pytest.mark.parametrize("temperature", [1.0, 0.8])
@pytest.mark.parametrize("chunk_size", [8, 64], ids=["chunks", "one-chunk"])
def test_vocab_sharded_equals_unsharded(boundaries, temperature, chunk_size):
    hidden, weight, targets, g_lp, g_h = _inputs(29, 8, 53, scale=2.0)
    hidden_leaf = hidden.clone().requires_grad_()  # shared: partial hidden grads add up, as TP's all-reduce does
    shards = [weight[a:b].clone().requires_grad_() for a, b in zip(boundaries, boundaries[1:])]
    outputs, errors, group = _run_ranks(hidden_leaf, shards, boundaries[:-1], targets, temperature=temperature,
                                        chunk_size=chunk_size)
    assert errors == [None] * len(shards)
    for result in outputs:  # every rank's loss, from its replicated outputs
        (result.logprobs * g_lp + result.entropy * g_h).sum().backward()

    ref_logprobs, ref_entropy, ref_hidden_grad, ref_weight_grad = _reference(
        hidden, weight, targets, temperature, g_lp, g_h
    )
    for result in outputs:
        torch.testing.assert_close(result.logprobs.detach(), ref_logprobs, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(result.entropy.detach(), ref_entropy, rtol=1e-10, atol=1e-12)
    # Each rank backpropagated the same replicated loss; the shared hidden leaf accumulated the
    # ranks' partial gradients (each over its own vocabulary slice), which is what the
    # tensor-parallel all-reduce in backward produces.
    torch.testing.assert_close(hidden_leaf.grad, ref_hidden_grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(torch.cat([shard.grad for shard in shards]), ref_weight_grad, rtol=1e-10, atol=1e-12)


def test_vocab_sharded_target_ownership_is_checked():
    hidden, weight, _, _, _ = _inputs(4, 3, 10)
    shards = [weight[:5], weight[5:]]
    # id 12 is in no shard; with overlapping shards (0-5, 4-10) id 4 would be in two.
    for starts, shard_list, target in (((0, 5), shards, 12), ((0, 4), [weight[:5], weight[4:]], 4)):
        _, errors, _ = _run_ranks(hidden, shard_list, starts, torch.tensor([1, target, 2, 3]))
        assert all(isinstance(error, ValueError) and "token 1" in str(error) for error in errors), errors


# ---------------------------------------------------------------- memory bound
class _NewAllocations(TorchDispatchMode):
    """Records the byte size of every tensor storage an aten op creates (not views, in-place or out=)."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        existing = {
            t.untyped_storage().data_ptr()
            for t in torch.utils._pytree.tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in existing:
                self.sizes.append(t.untyped_storage().nbytes())
        return out


def test_forward_and_backward_allocate_one_block_each():
    num_tokens, hidden_size, vocab, chunk_size = 512, 16, 1000, 64
    block_bytes = chunk_size * vocab * 4
    hidden, weight, targets, g_lp, g_h = _inputs(num_tokens, hidden_size, vocab, dtype=torch.float32)
    hidden.requires_grad_()
    weight.requires_grad_()
    with _NewAllocations() as recorder:
        result = token_logprobs_and_entropy(hidden=hidden, output_weight=weight, targets=targets, chunk_size=chunk_size)
        (result.logprobs * g_lp + result.entropy * g_h).sum().backward()
    large = [size for size in recorder.sizes if size > block_bytes // 4]
    assert max(recorder.sizes) <= block_bytes
    assert large == [block_bytes, block_bytes], large  # the forward buffer, then the backward buffer

    # The recorder does see materialized logits: the reference allocates several (N, V) tensors.
    with _NewAllocations() as recorder:
        reference = logprobs_from_logits((hidden @ weight.t())[None], targets[None])
        (reference.logprobs * g_lp + reference.entropy * g_h).sum().backward()
    assert sum(size >= num_tokens * vocab * 4 for size in recorder.sizes) >= 3


class _OpCounts(TorchDispatchMode):
    """Counts aten ops by name (``mm``, ``addmm``...)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def test_single_chunk_keeps_its_logits_for_backward():
    # 60 tokens fill the 64 − 64 // 16 logit rows of one chunk exactly.
    num_tokens, hidden_size, vocab, chunk_size = 60, 16, 1000, 64
    block_bytes = chunk_size * vocab * 4
    hidden, weight, targets, g_lp, g_h = _inputs(num_tokens, hidden_size, vocab, dtype=torch.float32)
    hidden.requires_grad_()
    weight.requires_grad_()
    with _NewAllocations() as forward_allocations, _OpCounts() as forward_ops:
        result = token_logprobs_and_entropy(hidden=hidden, output_weight=weight, targets=targets, chunk_size=chunk_size)
    with _NewAllocations() as backward_allocations, _OpCounts() as backward_ops:
        (result.logprobs * g_lp + result.entropy * g_h).sum().backward()
    assert [size for size in forward_allocations.sizes if size > block_bytes // 4] == [block_bytes]
    assert max(backward_allocations.sizes) == weight.numel() * 4  # the weight gradient; no logits block
    # One logits matmul in forward; backward only the two gradient matmuls, no recomputation.
    assert (forward_ops.counts["mm"], backward_ops.counts["mm"], backward_ops.counts["addmm"]) == (1, 2, 0)

    expected = _reference(hidden, weight, targets, 1.0, g_lp, g_h)
    got = (result.logprobs.detach(), result.entropy.detach(), hidden.grad, weight.grad)
    for actual, reference in zip(got, expected):
        torch.testing.assert_close(actual.double(), reference, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("chunk_size", [4, 1000], ids=["chunks", "one-chunk"])
def test_backward_through_a_retained_graph_twice(chunk_size):
    # The kept buffer is consumed by the first backward; the second one recomputes.
    hidden, weight, targets, g_lp, g_h = _inputs(13, 5, 17, scale=2.0)
    hidden_leaf, weight_leaf = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    result = token_logprobs_and_entropy(hidden=hidden_leaf, output_weight=weight_leaf, targets=targets,
                                        chunk_size=chunk_size)
    loss = (result.logprobs * g_lp + result.entropy * g_h).sum()
    loss.backward(retain_graph=True)
    loss.backward()
    _, _, ref_hidden_grad, ref_weight_grad = _reference(hidden, weight, targets, 1.0, g_lp, g_h)
    torch.testing.assert_close(hidden_leaf.grad, 2 * ref_hidden_grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(weight_leaf.grad, 2 * ref_weight_grad, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------- materialized logits helper
def test_logprobs_from_logits_matches_loop_and_temperature():
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 3, 7, generator=generator, dtype=torch.float64) * 4
    targets = torch.randint(0, 7, (2, 3), generator=generator)
    result = logprobs_from_logits(logits, targets, temperature=0.5)
    for b in range(2):
        for t in range(3):
            z = [float(v) / 0.5 for v in logits[b, t]]
            log_z = math.log(sum(math.exp(v) for v in z))
            probs = [math.exp(v - log_z) for v in z]
            assert result.logprobs[b, t].item() == pytest.approx(z[int(targets[b, t])] - log_z)
            assert result.entropy[b, t].item() == pytest.approx(-sum(p * math.log(p) for p in probs))
    with pytest.raises(ValueError, match="logits must be"):
        logprobs_from_logits(logits[0], targets)
