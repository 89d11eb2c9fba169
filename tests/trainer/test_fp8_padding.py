"""FP8 micro-batch alignment: TE's FP8 GEMMs need rows × length to be a multiple of 16.

Padding appends fully masked positions; without FP8 it never happens (the CPU demo's
numbers cannot move), and with it the real positions' log-probs and the loss stay the same.
"""

from __future__ import annotations

import pytest
import torch

from pipeline.models.layer_spec import FP8Options
from pipeline.trainer.batch import TrainBatch, pad_to_token_multiple
from tests.distributed_utils import one_rank_context


def _batch(rows: int, length: int, *, seed: int = 0, vocab: int = 32) -> TrainBatch:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, vocab, (rows, length), generator=generator)  # (B, T)
    lengths = torch.tensor([length - 3 * (r % 3) for r in range(rows)])
    positions = torch.arange(length)
    tokens = torch.where(positions < lengths[:, None], tokens, 0)
    response = (positions >= 4) & (positions < lengths[:, None])
    return TrainBatch(tokens=tokens, response_mask=response, advantages=torch.randn(rows, length, generator=generator),
                      old_logprobs=-torch.rand(rows, length, generator=generator), token_mask=response.clone())


def test_fp8_options_ask_for_16_only_when_enabled():
    assert FP8Options(enabled=True, recipe="delayed").token_multiple == 16
    assert FP8Options(enabled=True, recipe="current").token_multiple == 16
    assert FP8Options().token_multiple == 1


@pytest.mark.parametrize("rows, length, padded", [(3, 37, 48), (4, 37, 40), (8, 37, 38), (16, 37, 37), (1, 5, 16)])
def test_padding_makes_the_token_count_a_multiple_with_the_fewest_positions(rows, length, padded):
    batch = _batch(rows, length)
    out = pad_to_token_multiple(batch, multiple=16)
    assert out.tokens.shape == (rows, padded) and (rows * padded) % 16 == 0
    assert all((rows * shorter) % 16 for shorter in range(length, padded))
    if padded == length:
        assert out is batch
        return
    real = slice(0, length)
    for name in ("tokens", "response_mask", "advantages", "old_logprobs", "token_mask"):
        assert torch.equal(getattr(out, name)[:, real], getattr(batch, name)), name
        assert not getattr(out, name)[:, length:].any(), name  # token 0, masks False, zeros
    assert out.ref_logprobs is None and out.seq_lengths.tolist() == batch.seq_lengths.tolist()


def test_without_fp8_nothing_is_padded():
    batch = _batch(3, 37)
    assert pad_to_token_multiple(batch, multiple=1) is batch
    with pytest.raises(ValueError, match="multiple"):
        pad_to_token_multiple(batch, multiple=0)


@pytest.fixture(scope="module")
def context():
    with one_rank_context() as ctx:
        yield ctx


def test_padded_micro_batches_give_the_same_logprobs_and_loss(context):
    """A CPU actor told to align like an FP8 one: 3 rows × 37 tokens run as 3 × 48."""
    from pipeline.config import OptimConfig, TrainerConfig
    from pipeline.models.spec import ModelSpec
    from pipeline.trainer.actor import Actor
    from pipeline.trainer.losses import CrossEntropyLoss

    spec = ModelSpec(family="llama", vocab_size=32, hidden_size=16, ffn_hidden_size=32, num_layers=2,
                     num_attention_heads=2, num_query_groups=2, max_position_embeddings=64)
    batch = _batch(3, 37)
    results = []
    for multiple in (1, 16):
        actor = Actor(spec=spec, context=context, trainer=TrainerConfig(micro_batch_tokens=4096),
                      optim=OptimConfig(lr=1e-3), seed=0)
        assert actor.token_multiple == 1  # FP8 is off on a CPU
        actor.token_multiple = multiple
        seen = []
        original = actor.model.forward
        actor.model.forward = lambda *args, **kwargs: (seen.append(args[0].shape), original(*args, **kwargs))[1]
        logprobs = actor.compute_logprobs(batch)
        step = actor.train_step(batch, CrossEntropyLoss())
        assert {shape[1] for shape in seen} == {37 if multiple == 1 else 48}
        results.append((logprobs, step.loss, step.grad_norm))
    (plain, plain_loss, plain_norm), (padded, padded_loss, padded_norm) = results
    assert padded.shape == plain.shape == (3, 37)
    torch.testing.assert_close(padded, plain, rtol=0, atol=1e-6)
    assert padded_loss == pytest.approx(plain_loss, rel=1e-6)
    assert padded_norm == pytest.approx(plain_norm, rel=1e-5)
