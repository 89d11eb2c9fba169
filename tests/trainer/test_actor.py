"""The Megatron actor on CPU gloo: training works, micro-batching is exact, TP/PP agree.

Tolerances. The first step compares pure fp32 rounding (TP=2 sums partial matmul
products across ranks; other micro-batch splits sum gradients in another order):
rtol 1e-5. Later steps go through Adam, whose update m/(√v+ε) turns rounding in
near-zero gradient coordinates into visible weight differences: rtol 2e-4 after
three steps at lr 1e-3.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.distributed_utils import run_distributed

SEED = 4321
VOCAB, SEQ, ROWS = 64, 12, 6


def _spec():
    from pipeline.models.spec import ModelSpec

    return ModelSpec(family="llama", vocab_size=VOCAB, hidden_size=32, ffn_hidden_size=64, num_layers=2,
                     num_attention_heads=4, num_query_groups=2, max_position_embeddings=64)


def _batch():
    from pipeline.trainer.batch import TrainBatch

    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(1, VOCAB, (ROWS, SEQ), generator=generator)  # (B, T)
    lengths = torch.tensor([12, 9, 7, 12, 5, 10])  # ragged rows, right-padded
    positions = torch.arange(SEQ)
    tokens = torch.where(positions < lengths[:, None], tokens, 0)
    response_mask = (positions >= 3) & (positions < lengths[:, None])  # prompt = first 3 tokens
    return TrainBatch(tokens=tokens, response_mask=response_mask)


def _actor(tp: int, pp: int, *, micro_batch_tokens: int, lr: float = 1e-2, context=None):
    from pipeline.config import OptimConfig, TrainerConfig
    from pipeline.parallel.context import ParallelContext
    from pipeline.trainer.actor import Actor

    if context is None:
        context = ParallelContext.initialize(tensor_parallel=tp, pipeline_parallel=pp, seed=SEED)
    return Actor(spec=_spec(), context=context,
                 trainer=TrainerConfig(micro_batch_tokens=micro_batch_tokens, logprob_chunk_size=16),
                 optim=OptimConfig(lr=lr), seed=SEED)


def _train_worker(rank, world_size, tp, pp, micro_batch_tokens, weights_path, num_steps, lr=1e-3):
    from safetensors.torch import load_file, save_file

    from pipeline.trainer.losses import CrossEntropyLoss

    actor = _actor(tp, pp, micro_batch_tokens=micro_batch_tokens, lr=lr)
    if not os.path.exists(weights_path):
        state = {k: v.contiguous() for k, v in actor.module.state_dict().items() if not k.endswith("_extra_state")}
        save_file(state, weights_path)
    else:
        actor.load_full_state_dict(load_file(weights_path))
    batch = _batch()
    first_logprobs = actor.compute_logprobs(batch)
    steps = [actor.train_step(batch, CrossEntropyLoss()) for _ in range(num_steps)]
    return {"losses": [s.loss for s in steps], "grad_norms": [s.grad_norm for s in steps],
            "micro_batches": steps[0].num_micro_batches, "logprobs": first_logprobs,
            "skipped": [s.skipped for s in steps]}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("actor") / "weights.safetensors")
    (result,) = run_distributed(_train_worker, world_size=1, args=(1, 1, 10_000, path, 3))
    return path, result


def _assert_same_trajectory(got, expected):
    assert got["losses"][0] == pytest.approx(expected["losses"][0], rel=1e-5)
    assert got["grad_norms"][0] == pytest.approx(expected["grad_norms"][0], rel=1e-5)
    assert got["losses"] == pytest.approx(expected["losses"], rel=2e-4)
    assert got["grad_norms"] == pytest.approx(expected["grad_norms"], rel=2e-4)


def test_sft_loss_falls_and_matches_logprobs(reference, tmp_path):
    path, _ = reference
    (result,) = run_distributed(_train_worker, world_size=1, args=(1, 1, 10_000, path, 4, 1e-2))
    losses = result["losses"]
    batch = _batch()
    # The first step's loss is the mean NLL of the response tokens under the initial weights.
    expected = -(result["logprobs"][batch.response_mask]).mean().item()
    assert losses[0] == pytest.approx(expected, rel=1e-5)
    assert losses[-1] < losses[0] - 0.05, losses
    assert not any(result["skipped"])


def test_micro_batching_does_not_change_loss_or_grad_norm(reference, tmp_path):
    path, result = reference
    (small,) = run_distributed(_train_worker, world_size=1, args=(1, 1, 24, path, 3))
    # 24-token budget: the 6 ragged rows split into several micro-batches.
    assert small["micro_batches"] > 1
    _assert_same_trajectory(small, result)


@pytest.mark.distributed
@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_parallel_layouts_match_single_rank(reference, tp, pp):
    path, result = reference
    outcomes = run_distributed(_train_worker, world_size=tp * pp, args=(tp, pp, 36, path, 3))
    for outcome in outcomes:
        _assert_same_trajectory(outcome, result)
        torch.testing.assert_close(outcome["logprobs"], result["logprobs"], rtol=1e-4, atol=1e-5)
    # Every rank, the first pipeline stage included (it gets no loss outputs), ran the same micro-batches.
    micro_batches = [outcome["micro_batches"] for outcome in outcomes]
    assert micro_batches == [micro_batches[0]] * len(outcomes) and micro_batches[0] > 1


def _precision_worker(rank, world_size, precision, fp8):
    from pipeline.config import OptimConfig, TrainerConfig
    from pipeline.parallel.context import ParallelContext
    from pipeline.trainer.actor import Actor
    from pipeline.trainer.losses import CrossEntropyLoss

    context = ParallelContext.initialize(tensor_parallel=1, pipeline_parallel=1, seed=SEED)
    try:
        actor = Actor(spec=_spec(), context=context, optim=OptimConfig(lr=1e-2), seed=SEED,
                      trainer=TrainerConfig(micro_batch_tokens=10_000, logprob_chunk_size=16,
                                            precision=precision, fp8=fp8))
    except ValueError as error:
        return str(error)
    dtypes = {name: p.dtype for name, p in actor.module.named_parameters()}
    losses = [actor.train_step(_batch(), CrossEntropyLoss()).loss for _ in range(4)]
    return dtypes, losses


def test_bf16_weights_train_with_fp32_master_copies():
    dtypes, losses = run_distributed(_precision_worker, world_size=1, args=("bf16", "off"))[0]
    # Matmul weights are bf16; megatron's torch-norm wrapper keeps norm weights in fp32.
    assert {d for n, d in dtypes.items() if "layernorm" not in n} == {torch.bfloat16}, dtypes
    assert losses[-1] < losses[0]


def test_fp8_without_transformer_engine_is_a_clear_error():
    message = run_distributed(_precision_worker, world_size=1, args=("fp32", "delayed"))[0]
    assert "FP8 needs Transformer Engine and CUDA" in message


def _nan_worker(rank, world_size):
    from pipeline.trainer.losses import CrossEntropyLoss

    class PoisonedLoss(CrossEntropyLoss):
        """NaN on the second call: a bad batch, a numerical blow-up."""

        calls = 0

        def __call__(self, **kwargs):
            loss, metrics = super().__call__(**kwargs)
            PoisonedLoss.calls += 1
            return (loss * float("nan") if PoisonedLoss.calls == 2 else loss), metrics

    actor = _actor(1, 1, micro_batch_tokens=10_000)
    loss = PoisonedLoss()
    first = actor.train_step(_batch(), loss)
    before = {k: v.clone() for k, v in actor.module.state_dict().items() if not k.endswith("_extra_state")}
    poisoned = actor.train_step(_batch(), loss)
    unchanged = all(torch.equal(before[k], v) for k, v in actor.module.state_dict().items() if k in before)
    after = actor.train_step(_batch(), loss)
    return first.skipped, poisoned.skipped, unchanged, actor.num_skipped_steps, after.skipped, after.loss


def test_non_finite_loss_skips_the_step_and_leaves_weights_untouched():
    first, poisoned, unchanged, num_skipped, after, after_loss = run_distributed(_nan_worker, world_size=1)[0]
    assert (first, poisoned, after) == (False, True, False)
    assert unchanged and num_skipped == 1
    assert after_loss == after_loss  # finite again


def _infinite_gradient_worker(rank, world_size):
    from pipeline.trainer.losses import CrossEntropyLoss

    class InfiniteGradient(CrossEntropyLoss):
        """A finite loss whose gradient overflows on the second call."""

        calls = 0

        def __call__(self, *, logprobs, **kwargs):
            InfiniteGradient.calls += 1
            if InfiniteGradient.calls == 2:
                logprobs.register_hook(lambda grad: grad * float("inf"))
            return super().__call__(logprobs=logprobs, **kwargs)

    actor = _actor(1, 1, micro_batch_tokens=10_000)
    loss = InfiniteGradient()
    actor.train_step(_batch(), loss)
    before = {k: v.clone() for k, v in actor.module.state_dict().items() if not k.endswith("_extra_state")}
    poisoned = actor.train_step(_batch(), loss)
    unchanged = all(torch.equal(before[k], v) for k, v in actor.module.state_dict().items() if k in before)

    # The check itself, on hand-set gradients: +inf and −inf in different tensors sum to NaN.
    params = [p for p in actor.model.parameters() if getattr(p, "main_grad", None) is not None]
    verdicts = []
    for poison in ({}, {0: float("inf")}, {0: float("inf"), 1: float("-inf")}, {1: float("nan")}):
        for param in params:
            param.main_grad.normal_()
        for index, value in poison.items():
            params[index].main_grad.view(-1)[3] = value
        verdicts.append(actor._grads_finite())
    return poisoned.loss, poisoned.skipped, unchanged, verdicts


def test_non_finite_gradient_of_a_finite_loss_skips_the_step():
    loss, skipped, unchanged, verdicts = run_distributed(_infinite_gradient_worker, world_size=1)[0]
    assert loss == loss and abs(loss) < float("inf")
    assert skipped and unchanged
    assert verdicts == [True, False, False, False]


def _direction_worker(rank, world_size):
    from pipeline.algorithms.losses import grpo_loss
    from pipeline.trainer.losses import PolicyLoss

    actor = _actor(1, 1, micro_batch_tokens=10_000, lr=1e-3)
    batch = _batch()
    before = actor.compute_logprobs(batch)
    sign = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0, -1.0])[:, None]  # (B, 1)
    batch.advantages = sign * batch.response_mask
    batch.old_logprobs = before
    actor.train_step(batch, PolicyLoss(grpo_loss))
    after = actor.compute_logprobs(batch)
    change = ((after - before) * batch.response_mask).sum(dim=1) / batch.response_mask.sum(dim=1)  # (B,)
    return change


def test_policy_gradient_raises_positive_and_lowers_negative_advantage_sequences():
    change = run_distributed(_direction_worker, world_size=1)[0]
    assert (change[0::2] > 0).all() and (change[1::2] < 0).all(), change


def test_the_head_chunk_follows_the_logits_buffer_budget():
    from types import SimpleNamespace

    from pipeline.config import TrainerConfig
    from pipeline.trainer.actor import Actor

    fake = SimpleNamespace(trainer=TrainerConfig(logprob_buffer_mib=1))
    assert Actor._logprob_chunk_size(fake, 256) == 2**20 // (4 * 256)  # 1024 tokens of 256 float32 logits
    assert Actor._logprob_chunk_size(fake, 10**9) == 2  # never fewer than two tokens
    fake.trainer = TrainerConfig(logprob_chunk_size=48)
    assert Actor._logprob_chunk_size(fake, 256) == 48
