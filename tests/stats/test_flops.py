"""The FLOPs count by hand: one forward, prefill, generation and update against sums over positions,
the estimator at its own size, the card peaks and the run's cumulative counter."""

from __future__ import annotations

import pytest

from pipeline.stats import flops as F

# The demo's bootstrap policy (ModelConfig's defaults, vocabulary 320): h = 128, F = 352, 4 layers, 4 heads of 32.
DEMO_POLICY = F.ForwardCost.decoder(hidden_size=128, ffn_hidden_size=352, num_layers=4, q_width=128, kv_width=128,
                                    vocab_size=320)
# The estimator's tiny encoder (DifficultyEstimator.tiny): BERT, 2 layers of width 32, FFN 128.
TINY_ESTIMATOR = {"hidden_size": 32, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2}
# Qwen2.5-Math-7B: 28 layers, h = 3584, 28 query heads and 4 KV heads of 128, FFN 18944, vocabulary 152064.
QWEN_7B = F.ForwardCost.decoder(hidden_size=3584, ffn_hidden_size=18944, num_layers=28, q_width=3584, kv_width=512,
                                vocab_size=152064)


def _forward_by_positions(cost: F.ForwardCost, contexts) -> int:
    """Exact integer sum of one token's forward at each context: 2N + 4·L·w·c."""
    return sum(2 * cost.matmul_parameters + 4 * cost.num_layers * cost.attention_width * c for c in contexts)


def test_a_decoder_counts_its_layer_matmuls_and_the_output_head():
    # Per layer: QKV 128·(128 + 2·128) = 49,152, output 128·128 = 16,384, SwiGLU 3·128·352 = 135,168.
    assert F.decoder_layer_matmul_parameters(hidden_size=128, ffn_hidden_size=352, q_width=128,
                                             kv_width=128) == 200_704
    assert DEMO_POLICY.matmul_parameters == 4 * 200_704 + 320 * 128 == 843_776
    assert DEMO_POLICY.token(0) == 1_687_552
    assert DEMO_POLICY.token(10) == 1_687_552 + 4 * 4 * 128 * 10


def test_prefill_and_generation_are_sums_over_positions():
    # A 3-token prompt is read at contexts 1, 2, 3; 4 generated tokens feed back the first 3 at 4, 5, 6.
    assert F.prefill_flops(DEMO_POLICY, 3) == _forward_by_positions(DEMO_POLICY, [1, 2, 3])
    assert F.generation_flops(DEMO_POLICY, prompt_tokens=3, generated_tokens=4) == \
        _forward_by_positions(DEMO_POLICY, [4, 5, 6])
    assert F.generation_flops(DEMO_POLICY, prompt_tokens=3, generated_tokens=1) == 0  # the prefill yielded it
    assert F.generation_flops(DEMO_POLICY, prompt_tokens=3, generated_tokens=0) == 0


@pytest.mark.parametrize(("prompt", "response"), [(1, 1), (17, 5), (1024, 3072), (4000, 28_000)])
def test_closed_forms_match_float64_sums_at_7b(prompt, response):
    """Exact integer sums against the closed forms, at sizes where the float64 result exceeds 2^53."""
    prefill = F.prefill_flops(QWEN_7B, prompt)
    generation = F.generation_flops(QWEN_7B, prompt_tokens=prompt, generated_tokens=response)
    assert prefill == pytest.approx(_forward_by_positions(QWEN_7B, range(1, prompt + 1)), rel=1e-14)
    assert generation == pytest.approx(_forward_by_positions(QWEN_7B, range(prompt + 1, prompt + response)),
                                       rel=1e-14)
    # Reading the prompt and decoding is one causal forward over all but the last token.
    assert prefill + generation == pytest.approx(F.sequence_forward_flops(QWEN_7B, prompt + response - 1), rel=1e-14)


def test_update_is_three_forwards_plus_what_recompute_redoes():
    length = 4096
    forward = F.sequence_forward_flops(QWEN_7B, length)
    attention = 4 * 28 * 3584 * length * (length + 1) / 2
    assert forward == pytest.approx(2 * QWEN_7B.matmul_parameters * length + attention, rel=1e-15)
    assert F.update_flops(QWEN_7B, length) == 3 * forward
    assert F.update_flops(QWEN_7B, length, recompute="full") == 4 * forward
    assert F.update_flops(QWEN_7B, length, recompute="selective") == pytest.approx(3 * forward + attention, rel=1e-15)
    # The published 7,615,616,512 parameters less the input embedding (152064·3584), the RMSNorm weights
    # (2 per layer and the final one, 3584 each) and the q/k/v biases (3584 + 2·512 per layer): 1.84e14 per
    # 4,096-token row, 6·N·s plus the causal attention.
    assert QWEN_7B.matmul_parameters == 7_615_616_512 - 152064 * 3584 - (2 * 28 + 1) * 3584 - 28 * (3584 + 2 * 512)
    assert F.update_flops(QWEN_7B, length) == pytest.approx(1.84e14, rel=0.01)


def test_an_estimator_token_costs_its_own_encoder_not_a_policy_token():
    tiny = F.ForwardCost.from_bert_config(TINY_ESTIMATOR)
    # Per layer: Q, K, V, output 4·32² = 4,096 and the FFN 2·32·128 = 8,192.
    assert tiny.matmul_parameters == 2 * (4 * 32 * 32 + 2 * 32 * 128) == 24_576
    assert F.estimator_flops(tiny, {"train": 10, "inference": 5}) == 49_152 * (3 * 10 + 5)
    # About 3% of the demo policy's forward per token, not 100%.
    assert F.estimator_flops(tiny, {"inference": 1}) / DEMO_POLICY.token(0) == pytest.approx(0.0291, abs=5e-4)
    with pytest.raises(ValueError, match="bert_config"):
        F.ForwardCost.from_bert_config({"hidden_size": 32})


def test_the_tiny_estimators_dimensions_are_the_ones_counted():
    from pipeline.estimator import DifficultyEstimator

    described = DifficultyEstimator.tiny().describe()["bert_config"]
    assert F.ForwardCost.from_bert_config(described) == F.ForwardCost.from_bert_config(TINY_ESTIMATOR)


def test_a_spec_and_its_decoder_dimensions_cost_the_same():
    from pipeline.models.spec import ModelSpec

    spec = ModelSpec(family="qwen2", vocab_size=152064, hidden_size=3584, ffn_hidden_size=18944, num_layers=28,
                     num_attention_heads=28, num_query_groups=4, max_position_embeddings=4096, qkv_bias=True)
    assert F.ForwardCost.from_spec(spec) == QWEN_7B


@pytest.mark.parametrize(("name", "peak"), [
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H100 NVL", 835e12),
    ("NVIDIA H200", 989e12), ("NVIDIA H200 NVL", 835e12), ("NVIDIA A100-SXM4-80GB", 312e12),
    ("NVIDIA A100-PCIE-40GB", 312e12), ("NVIDIA GeForce RTX 4090", None), ("Tesla V100-SXM2-16GB", None),
])
def test_card_peaks_by_cuda_name(name, peak):
    assert F.peak_bf16_flops(name) == peak


def test_mfu():
    assert F.mfu(989e12 * 8 * 0.4, seconds=2.0, num_gpus=8, peak_flops=989e12) == pytest.approx(0.2)


def test_counter_accumulates_and_round_trips():
    counter = F.FlopCounter()
    first = F.StepFlops(flops={"generation": 10.0, "prefill": 2.0, "update": 30.0, "estimator": 1.0},
                        tokens={"generation": 5, "prefill": 3, "update": 8, "estimator": 4})
    counter.add(1, first)
    counter.add(2, first)
    row = counter.metrics(first)
    assert row["flops/total"] == 43.0 and row["tokens/update"] == 8
    assert row["flops/cumulative/update"] == 60.0 and row["flops/cumulative/total"] == 86.0
    assert row["tokens/cumulative/estimator"] == 8 and row["flops/counted_from_step"] == 1
    assert counter.estimator_step_tokens({"train": 30, "inference": 7}) == {"train": 30, "inference": 7}
    assert counter.estimator_step_tokens({"train": 45, "inference": 9}) == {"train": 15, "inference": 2}
    restored = F.FlopCounter()
    restored.load_state_dict(counter.state_dict())
    assert restored == counter


def test_a_resume_without_a_count_starts_counting_at_its_first_step():
    counter = F.FlopCounter()
    counter.load_state_dict(None)  # a checkpoint saved before the count existed
    # The estimator's cumulative reading before the resume is not charged to the first step.
    assert counter.estimator_step_tokens({"train": 300, "inference": 70}) == {"train": 0, "inference": 0}
    counter.add(7, F.StepFlops(flops={"generation": 1.0, "prefill": 0.0, "update": 0.0, "estimator": 0.0}))
    counter.add(8, F.StepFlops(flops={"generation": 1.0, "prefill": 0.0, "update": 0.0, "estimator": 0.0}))
    assert counter.counted_from_step == 7 and counter.flops["generation"] == 2.0
    assert counter.estimator_step_tokens({"train": 310, "inference": 70}) == {"train": 10, "inference": 0}


@pytest.mark.parametrize(("value", "text"), [(None, "n/a"), (0, "0"), (1.234e12, "1.23e12"), (9.996e11, "1.00e12"),
                                             (5.0, "5.00e0"), (49_152.0, "4.92e4")])
def test_format_flops(value, text):
    assert F.format_flops(value) == text
