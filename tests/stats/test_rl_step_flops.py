"""One RL step's FLOPs by hand (``pipeline.rl.step``): prefill once per prompt, decode per sample, the
update of the kept rows, the extra log-prob forwards, the estimator's reading at its own size, and the
MFU on a known card only."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pipeline.models.spec import ModelSpec
from pipeline.rl.rollouts import RolloutBatch
from pipeline.rl.step import count_step_flops, policy_step_flops, step_metrics
from pipeline.rollout.types import Completion
from pipeline.stats import flops as F

SPEC = ModelSpec(family="llama", vocab_size=320, hidden_size=128, ffn_hidden_size=352, num_layers=4,
                 num_attention_heads=4, num_query_groups=4, max_position_embeddings=128)
POLICY = F.ForwardCost.from_spec(SPEC)
TINY_BERT = {"hidden_size": 32, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2}


def _completion(group: int, length: int) -> Completion:
    return Completion(prompt_id=f"p{group}", sample_index=0, token_ids=torch.ones(length, dtype=torch.long),
                      logprobs=torch.zeros(length), finish_reason="stop", weight_version=1)


def _pool() -> RolloutBatch:
    """Prompt 0 (3 tokens) answered twice, in 4 and 2 tokens; prompt 1 (5 tokens) once, in 1; prompt 2 (2 tokens)
    not sampled (an Ada-Seq prompt that got no round, say)."""
    prompts = [[1, 2, 3], [1, 2, 3, 4, 5], [7, 8]]
    lengths = [(0, 4), (0, 2), (1, 1)]
    return RolloutBatch(torch.tensor([10, 11, 12]), prompts, torch.tensor([group for group, _ in lengths]),
                        [_completion(group, length) for group, length in lengths], ["a", "b", "c"],
                        torch.tensor([1.0, 0.0, 1.0]))


def test_policy_flops_of_a_step_by_hand():
    pool = _pool()
    counted = policy_step_flops(POLICY, pool=pool, train=pool, kept_rows=torch.tensor([0, 2]), logprob_forwards=2,
                                question_forward=False)
    # Prompts 0 and 1 were prefilled once each; prompt 2 had no sample.
    assert counted.flops["prefill"] == F.prefill_flops(POLICY, 3) + F.prefill_flops(POLICY, 5)
    assert counted.tokens["prefill"] == 8
    assert counted.flops["generation"] == (F.generation_flops(POLICY, prompt_tokens=3, generated_tokens=4)
                                           + F.generation_flops(POLICY, prompt_tokens=3, generated_tokens=2)
                                           + F.generation_flops(POLICY, prompt_tokens=5, generated_tokens=1))
    assert counted.tokens["generation"] == 7
    # Kept rows 0 (3 + 4 tokens) and 2 (5 + 1) are trained; both extra forwards read all three rows.
    rows = [7, 5, 6]
    assert counted.flops["update"] == pytest.approx(
        F.update_flops(POLICY, 7) + F.update_flops(POLICY, 6) + 2 * sum(F.sequence_forward_flops(POLICY, n)
                                                                        for n in rows), rel=1e-15)
    assert counted.tokens["update"] == 13
    assert counted.flops["estimator"] == 0 and counted.tokens["estimator"] == 0

    with_questions = policy_step_flops(POLICY, pool=pool, train=pool, kept_rows=torch.tensor([0, 2]),
                                       logprob_forwards=0, question_forward=True, recompute="full")
    # DEPO's distillation target: the actor reads every pool prompt once more.
    assert with_questions.flops["prefill"] == counted.flops["prefill"] + sum(
        F.prefill_flops(POLICY, n) for n in (3, 5, 2))
    assert with_questions.flops["update"] == F.update_flops(POLICY, 7, recompute="full") + \
        F.update_flops(POLICY, 6, recompute="full")


class _Estimator:
    """What the step reads of the difficulty estimator: its cumulative reading and its description."""

    def __init__(self) -> None:
        self.num_encoded_tokens = {"train": 0, "inference": 0}

    def describe(self) -> dict:
        return {"bert_config": TINY_BERT}


def _run(*, estimator=None, device: str = "cpu", world_size: int = 8):
    prompt_filter = SimpleNamespace(trainer=SimpleNamespace(model=estimator)) if estimator else SimpleNamespace()
    return SimpleNamespace(
        actor=SimpleNamespace(spec=SPEC, device=torch.device(device)),
        sampling=SimpleNamespace(prompt_filter=prompt_filter, budget=SimpleNamespace(), sampler=SimpleNamespace(),
                                 needs_question_logprobs=False),
        cfg=SimpleNamespace(trainer=SimpleNamespace(recompute="none")), context=SimpleNamespace(world_size=world_size))


def test_the_estimator_is_charged_its_own_size_per_step():
    estimator = _Estimator()
    run, counter, pool = _run(estimator=estimator), F.FlopCounter(), _pool()
    estimator.num_encoded_tokens = {"train": 100, "inference": 40}
    row = count_step_flops(run, counter, step=1, pool=pool, train=pool, kept_rows=torch.tensor([0]),
                           logprob_forwards=1, seconds={})
    per_token = 2 * 2 * (4 * 32 * 32 + 2 * 32 * 128)  # 49,152: the tiny encoder's forward
    assert row["flops/estimator"] == per_token * (3 * 100 + 40) and row["tokens/estimator"] == 140
    # Charged like policy tokens it would have been 140 × 1.69 MFLOPs, 34 times as much.
    assert row["flops/estimator"] < 0.05 * 140 * 3 * POLICY.token(0)
    estimator.num_encoded_tokens = {"train": 130, "inference": 60}
    second = count_step_flops(run, counter, step=2, pool=pool, train=pool, kept_rows=torch.tensor([0]),
                              logprob_forwards=1, seconds={})
    assert second["flops/estimator"] == per_token * (3 * 30 + 20)
    assert second["flops/cumulative/estimator"] == per_token * (3 * 130 + 60)
    assert second["flops/cumulative/total"] == pytest.approx(row["flops/total"] + second["flops/total"], rel=1e-15)
    assert second["tokens/cumulative/generation"] == 14 and "perf/mfu" not in second  # the CPU has no MFU


def test_mfu_only_on_a_card_with_a_known_peak():
    pool = _pool()
    run = _run(device="cpu", world_size=8)
    seconds = {"generate": 5.0, "logprobs": 0.5, "update": 1.5}
    row = count_step_flops(run, F.FlopCounter(), step=1, pool=pool, train=pool, kept_rows=torch.tensor([0, 1, 2]),
                           logprob_forwards=0, seconds=seconds, device_name="NVIDIA H100 80GB HBM3")
    assert row["perf/mfu"] == pytest.approx(row["flops/update"] / (2.0 * 8 * 989e12))
    unknown = count_step_flops(run, F.FlopCounter(), step=1, pool=pool, train=pool,
                               kept_rows=torch.tensor([0]), logprob_forwards=0, seconds=seconds,
                               device_name="NVIDIA GeForce RTX 4090")
    assert "perf/mfu" not in unknown and unknown["flops/total"] > 0


def test_the_metrics_row_carries_the_flops():
    pool = _pool()
    update = SimpleNamespace(loss=0.1, grad_norm=1.0, skipped=False, learning_rate=1e-5, metrics={})
    flops = count_step_flops(_run(), F.FlopCounter(), step=1, pool=pool, train=pool, kept_rows=torch.tensor([0]),
                             logprob_forwards=1, seconds={})
    row = step_metrics(pool=pool, update=update, temperature=1.0, mean_entropy=0.5, tokens=7, gradient_tokens=4,
                       zero_variance=1, num_filtered=0, num_candidates=3, mismatch={}, method_metrics={}, ledger={},
                       rollout={}, seconds={"update": 1.0}, flops=flops)
    for key in ("flops/generation", "flops/prefill", "flops/update", "flops/estimator", "flops/total",
                "flops/cumulative/total", "tokens/update"):
        assert row[key] == flops[key]
