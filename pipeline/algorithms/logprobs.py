"""Token log-probabilities and entropies from hidden states, without materializing logits.

For ``N`` tokens, hidden size ``H`` and a vocabulary of ``V`` the logits are an
``(N, V)`` float32 tensor — 8 GiB for 16k tokens × 128k vocab — and autograd
through ``log_softmax`` keeps several such tensors alive. The RL update only
needs two numbers per token, so ``token_logprobs_and_entropy`` streams over
``N`` in chunks: forward holds one ``(chunk, V_local)`` float32 buffer, reused
by every chunk, and saves only ``O(N)`` statistics; backward recomputes each
chunk's logits into the same kind of buffer and turns them, in place, into the
logit gradient. The price is one extra ``(chunk × H × V)`` matmul per chunk in
backward (measured on CPU it is more than repaid by not touching the
materialized tensors: tools/bench/logprobs_memory.py). When one chunk covers
every token and a backward will follow, forward keeps its buffer (the shifted
logits) for backward instead: the working set stays one buffer, it just lives
until backward, and the recomputing matmul (a quarter of the head's matmul
work) disappears. On the actor's micro-batches nothing else is allocated in
between (the head's backward is the first of the micro-batch), so the peak
does not move.

Math, with ``z = h Wᵀ / τ``, ``logZ = logsumexp(z)``, ``p = softmax(z)``:

    log p(y) = z_y − logZ                       H = logZ − Σ_v p_v z_v
    ∂log p(y)/∂z_v = 1[v = y] − p_v             ∂H/∂z_v = −p_v (log p_v + H)

Vocabulary sharding (tensor parallel): this rank holds rows
``[vocab_start, vocab_start + V_local)`` of the output weight. The global max
comes from ``reducer.max``, the global sums (``Σ e^{z−m}``, ``Σ e^{z−m}(z−m)``,
the target logit, which only its owning rank contributes) from one
``reducer.sum`` per chunk, plus one ``reducer.sum`` per call that checks each
target is owned by exactly one rank. Backward needs no communication: the
gradient of the replicated outputs w.r.t. this rank's logits uses only the
global ``m``, ``log Σ e^{z−m}`` and ``H`` saved in forward (the
``reducer.sum`` contract: backward is the identity). The returned ``hidden`` gradient is this rank's partial sum
over its vocabulary slice; the caller's tensor-parallel region all-reduces it,
exactly as for Megatron's column-parallel output layer.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.autograd.function import once_differentiable

from pipeline.algorithms.reducers import LOCAL, Reducer

__all__ = ["TokenLogprobs", "logprobs_from_logits", "token_logprobs_and_entropy"]

# Of the chunk_size rows of the working buffer, 1/16 (at least one row) are
# scratch for the elementwise passes, which run on row slices of that height;
# the rest hold one chunk's logits. A single allocation thus bounds the float32
# working set, and a chunk needs only ~16 slice iterations (few GPU launches).
_SCRATCH_FRACTION = 16


class TokenLogprobs(NamedTuple):
    logprobs: torch.Tensor  # (N,) log π(target)
    entropy: torch.Tensor | None  # (N,) entropy of π, None when not requested


class _WorkingBuffer(NamedTuple):
    logits: torch.Tensor  # (rows_per_chunk, V_local)
    scratch: torch.Tensor  # (slice_rows, V_local)
    rows_per_chunk: int


def _working_buffer(like: torch.Tensor, *, num_tokens: int, chunk_size: int, vocab_local: int) -> _WorkingBuffer:
    """One ``(≤ chunk_size, V_local)`` float32 (float64 for float64 input) allocation, reused by every chunk.

    Reuse matters on CPU too: a fresh 100 MiB block per chunk is a page fault per
    4 KiB, seconds of system time per step.
    """
    slice_rows = max(1, chunk_size // _SCRATCH_FRACTION)
    rows_per_chunk = chunk_size - slice_rows
    logit_rows = min(rows_per_chunk, num_tokens)
    slice_rows = min(slice_rows, max(1, logit_rows))
    dtype = torch.promote_types(like.dtype, torch.float32)
    buffer = like.new_empty((logit_rows + slice_rows, vocab_local), dtype=dtype)
    return _WorkingBuffer(buffer[:logit_rows], buffer[logit_rows:], rows_per_chunk)


def _row_slices(num_rows: int, step: int) -> list[slice]:
    return [slice(start, min(start + step, num_rows)) for start in range(0, num_rows, step)]


def _chunk_logits(
    hidden_chunk: torch.Tensor,  # (c, H)
    weight: torch.Tensor,  # (V_local, H)
    inv_temperature: float,
    out: torch.Tensor,  # (c, V_local)
) -> torch.Tensor:
    """Write ``hidden_chunk · weightᵀ / τ`` into ``out``; τ scales the small ``(c, H)`` side."""
    scaled = hidden_chunk * inv_temperature if inv_temperature != 1.0 else hidden_chunk
    if weight.dtype == out.dtype:
        return torch.mm(scaled, weight.t(), out=out)
    # Low-precision weights: matmul in their dtype, statistics in float32.
    return out.copy_(scaled @ weight.t())


class _ChunkedLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,  # (N, H)
        weight: torch.Tensor,  # (V_local, H)
        targets: torch.Tensor,  # (N,) int64, global vocabulary ids
        inv_temperature: float,
        chunk_size: int,
        vocab_start: int,
        reducer: Reducer,
        compute_entropy: bool,
        keep_single_chunk: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        num_tokens = hidden.shape[0]
        vocab_local = weight.shape[0]
        stats_dtype = torch.promote_types(hidden.dtype, torch.float32)
        # logZ = shift + log_sum is kept as two numbers: folded into one float32 it
        # would round to the ulp of |max logit| and every log p would inherit that
        # absolute error (seen as 1e-3 relative gradient error at logits ~ 1e3).
        shift = hidden.new_empty(num_tokens, dtype=stats_dtype)  # (N,) global max logit m
        log_sum = hidden.new_empty(num_tokens, dtype=stats_dtype)  # (N,) log Σ e^{z−m}
        target_shifted = hidden.new_empty(num_tokens, dtype=stats_dtype)  # (N,) z_y − m
        entropy = hidden.new_zeros(num_tokens, dtype=stats_dtype)  # (N,)
        local_targets = targets - vocab_start  # (N,)
        owned = (local_targets >= 0) & (local_targets < vocab_local)  # (N,)
        gather_index = torch.where(owned, local_targets, torch.zeros_like(local_targets))  # (N,)
        # One collective and one host sync for the whole call, before any heavy work.
        owners = reducer.sum(owned.to(stats_dtype))  # (N,) shards holding each target
        if num_tokens and not bool((owners == 1).all()):
            bad = int((owners != 1).nonzero()[0])
            raise ValueError(
                f"target id {int(targets[bad])} at token {bad} is owned by {int(owners[bad])} "
                "vocabulary shards, must be exactly one; is it outside the vocabulary?"
            )

        work = _working_buffer(hidden, num_tokens=num_tokens, chunk_size=chunk_size, vocab_local=vocab_local)
        slice_rows = work.scratch.shape[0]
        for start in range(0, num_tokens, work.rows_per_chunk):
            stop = min(start + work.rows_per_chunk, num_tokens)
            rows = slice(start, stop)
            num_rows = stop - start
            block = _chunk_logits(hidden[rows], weight, inv_temperature, work.logits[:num_rows])  # (c, V_local)
            chunk_shift = reducer.max(block.amax(dim=1))  # (c,) global max, no gradient
            block.sub_(chunk_shift[:, None])  # z − m
            target_partial = torch.where(
                owned[rows], block.gather(1, gather_index[rows, None]).squeeze(1), 0.0
            )  # (c,)
            sum_exp = block.new_empty(num_rows)  # (c,) Σ e^{z−m}
            sum_exp_shifted = block.new_zeros(num_rows)  # (c,) Σ e^{z−m}(z−m)
            for part in _row_slices(num_rows, slice_rows):
                unnormalized = torch.exp(block[part], out=work.scratch[: part.stop - part.start])  # (r, V_local)
                sum_exp[part] = unnormalized.sum(dim=1)
                if compute_entropy:
                    # In place: linalg.vecdot would allocate an (r, V_local) product.
                    sum_exp_shifted[part] = unnormalized.mul_(block[part]).sum(dim=1)
            totals = reducer.sum(torch.stack([target_partial, sum_exp, sum_exp_shifted]))  # (3, c)
            chunk_log_sum = totals[1].log()
            shift[rows] = chunk_shift
            log_sum[rows] = chunk_log_sum
            target_shifted[rows] = totals[0]
            if compute_entropy:
                entropy[rows] = chunk_log_sum - totals[2] / totals[1]
        # A single chunk's buffer now holds z − m for every token: backward's starting point.
        # Kept as a ctx attribute, not a saved tensor, because backward consumes it in place;
        # a second backward through a retained graph finds None and recomputes.
        ctx.kept_work = work if keep_single_chunk and num_tokens <= work.rows_per_chunk else None
        del work

        logprobs = target_shifted - log_sum
        ctx.save_for_backward(hidden, weight, gather_index, owned, shift, log_sum, entropy)
        ctx.inv_temperature = inv_temperature
        ctx.chunk_size = chunk_size
        ctx.compute_entropy = compute_entropy
        if not compute_entropy:
            ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logprobs: torch.Tensor | None, grad_entropy: torch.Tensor | None):
        hidden, weight, gather_index, owned, shift, log_sum, entropy = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        num_tokens = hidden.shape[0]
        vocab_local = weight.shape[0]
        inv_temperature = ctx.inv_temperature
        stats_dtype = shift.dtype
        if grad_logprobs is None:
            grad_logprobs = shift.new_zeros(num_tokens)
        grad_logprobs = grad_logprobs.to(stats_dtype)
        use_entropy = ctx.compute_entropy and grad_entropy is not None
        if use_entropy:
            grad_entropy = grad_entropy.to(stats_dtype)
            # dL/dz_v = −p_v (a + g_H log p_v) + g_lp 1[v = y]  with  a = g_lp + g_H H
            offset = grad_logprobs + grad_entropy * entropy  # (N,)
        else:
            offset = grad_logprobs

        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        # Accumulated over chunks, so kept in at least float32 until the end.
        # The first chunk writes it, the others accumulate; without tokens it stays zero.
        allocate = torch.empty if num_tokens else torch.zeros
        grad_weight = allocate(weight.shape, dtype=stats_dtype, device=weight.device) if need_weight else None
        work, kept = ctx.kept_work, ctx.kept_work is not None
        ctx.kept_work = None
        if not kept:
            work = _working_buffer(hidden, num_tokens=num_tokens, chunk_size=ctx.chunk_size, vocab_local=vocab_local)
        slice_rows = work.scratch.shape[0]
        for start in range(0, num_tokens, work.rows_per_chunk):
            stop = min(start + work.rows_per_chunk, num_tokens)
            rows = slice(start, stop)
            num_rows = stop - start
            hidden_chunk = hidden[rows]  # (c, H)
            block = work.logits[:num_rows]  # (c, V_local)
            if not kept:
                _chunk_logits(hidden_chunk, weight, inv_temperature, block)
                block.sub_(shift[rows, None])  # z − m
            for part in _row_slices(num_rows, slice_rows):
                token_rows = slice(start + part.start, start + part.stop)
                log_probs = block[part].sub_(log_sum[token_rows, None])  # (r, V_local) log p, a view
                probs = torch.exp(log_probs, out=work.scratch[: part.stop - part.start])
                if use_entropy:
                    log_probs.mul_(grad_entropy[token_rows, None]).add_(offset[token_rows, None])
                    log_probs.mul_(probs).neg_()
                else:
                    torch.mul(probs, offset[token_rows, None].neg(), out=log_probs)
            block.scatter_add_(
                1, gather_index[rows, None], torch.where(owned[rows], grad_logprobs[rows], 0.0)[:, None]
            )  # block is now dL/dz
            if need_hidden:
                if weight.dtype == block.dtype:
                    torch.mm(block, weight, out=grad_hidden[rows])
                else:
                    # Never upcast the whole weight (a copy per chunk); round the logit
                    # gradient to its dtype, as autograd through a bf16 output layer would.
                    grad_hidden[rows] = block.to(weight.dtype) @ weight
                if inv_temperature != 1.0:
                    grad_hidden[rows] *= inv_temperature
            if need_weight:
                scaled_hidden = hidden_chunk.to(stats_dtype)
                if inv_temperature != 1.0:
                    scaled_hidden = scaled_hidden * inv_temperature
                if start == 0:
                    torch.mm(block.t(), scaled_hidden, out=grad_weight)
                else:
                    grad_weight.addmm_(block.t(), scaled_hidden)
        del work
        if need_weight:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None


def token_logprobs_and_entropy(
    *,
    hidden: torch.Tensor,
    output_weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    vocab_start: int = 0,
    reducer: Reducer = LOCAL,
    compute_entropy: bool = True,
) -> TokenLogprobs:
    """``log π(targets)`` and the entropy of ``π = softmax(hidden · output_weightᵀ / τ)``.

    ``hidden`` ``(N, H)``, ``output_weight`` ``(V_local, H)`` (this rank's vocabulary
    rows starting at global id ``vocab_start``), ``targets`` ``(N,)`` global ids.
    Each target must belong to exactly one shard (``ValueError`` otherwise).
    Both outputs are differentiable w.r.t. ``hidden`` and ``output_weight``;
    statistics are float32 (float64 for float64 inputs). The float32 working
    set, in forward and in backward, is one ``(chunk_size, V_local)`` buffer:
    ``chunk_size − max(1, chunk_size // 16)`` rows of logits per chunk plus
    scratch rows for the elementwise passes (a bf16 weight adds the transient
    bf16 matmul output, half a block). When every token fits in one chunk and a
    backward will follow, that buffer lives from forward to backward and
    backward skips recomputing the logits; size ``chunk_size`` to cover a
    micro-batch where that memory is affordable. ``temperature`` divides the logits, as
    in sampling, so the log-probs match the distribution the rollout engine
    sampled from.

    Entropy here is the per-token entropy of D³S Eq. 8 ("Learning More with
    Less: A Dynamic Dual-Level Down-Sampling Framework for Efficient Policy
    Optimization"). Returns a
    ``TokenLogprobs`` (no metrics: nothing here is worth logging per step).
    """
    if hidden.dim() != 2 or output_weight.dim() != 2:
        raise ValueError(
            f"hidden must be (N, H) and output_weight (V_local, H); got {tuple(hidden.shape)} "
            f"and {tuple(output_weight.shape)}"
        )
    if hidden.shape[1] != output_weight.shape[1]:
        raise ValueError(f"hidden size {hidden.shape[1]} != output_weight size {output_weight.shape[1]}")
    if hidden.dtype != output_weight.dtype or not hidden.is_floating_point():
        raise ValueError(f"hidden ({hidden.dtype}) and output_weight ({output_weight.dtype}) need one floating dtype")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets must be (N,) = ({hidden.shape[0]},), got {tuple(targets.shape)}")
    if targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"targets must be integer token ids, got {targets.dtype}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size < 2:
        raise ValueError(f"chunk_size must be ≥ 2 (a logits row and a scratch row), got {chunk_size}")
    logprobs, entropy = _ChunkedLogprobEntropy.apply(
        hidden,
        output_weight,
        targets.long(),
        1.0 / temperature,
        chunk_size,
        vocab_start,
        reducer,
        compute_entropy,
        torch.is_grad_enabled() and (hidden.requires_grad or output_weight.requires_grad),
    )
    return TokenLogprobs(logprobs, entropy if compute_entropy else None)


def logprobs_from_logits(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    *,
    compute_entropy: bool = True,
) -> TokenLogprobs:
    """Log-probs of ``targets`` ``(B, T)`` and entropies from materialized logits ``(B, T, V)``.

    For engines that already hold full logits (HF models). Computed in float32
    (float64 for float64 logits) through plain autograd; results are ``(B, T)``.
    """
    if logits.dim() != 3 or targets.shape != logits.shape[:2]:
        raise ValueError(
            f"logits must be (B, T, V) and targets (B, T); got {tuple(logits.shape)} and {tuple(targets.shape)}"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    scaled = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if temperature != 1.0:
        scaled = scaled / temperature
    log_probs = torch.log_softmax(scaled, dim=-1)  # (B, T, V)
    target_logprobs = log_probs.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)  # (B, T)
    entropy = None
    if compute_entropy:
        entropy = -(log_probs.exp() * log_probs).sum(dim=-1)  # (B, T)
    return TokenLogprobs(target_logprobs, entropy)
