"""build_transformer_config / build_gpt_model / layout.shard_full_state_dict on a one-rank gloo group (CPU)."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from pipeline.models.factory import CPU_DISABLED_FUSIONS, build_gpt_model, build_transformer_config
from pipeline.models.layer_spec import LayerSpecChoice
from pipeline.models.layout import TPPartition, global_parameter_name, shard_full_state_dict
from pipeline.models.spec import ModelSpec
from tests.distributed_utils import one_rank_context
from tests.oracles.sharding import partition_of

VOCAB, HIDDEN, FFN, HEADS, GROUPS, SEQ = 128, 64, 96, 4, 2, 12
HEAD_DIM = HIDDEN // HEADS
LOCAL = LayerSpecChoice(name="local", reason="test")


def _spec(**changes) -> ModelSpec:
    fields = dict(
        family="llama",
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        ffn_hidden_size=FFN,
        num_layers=2,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        max_position_embeddings=64,
        rope_theta=500000.0,
        norm_eps=1e-5,
    )
    return ModelSpec(**(fields | changes))


QWEN = dict(family="qwen2", qkv_bias=True, tie_embeddings=True, rope_theta=1e6, norm_eps=1e-6)
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}


@pytest.fixture(scope="module")
def context():
    with one_rank_context() as ctx:
        yield ctx


def _causal_mask(device: torch.device | None = None) -> torch.Tensor:
    return torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool, device=device).triu(1)  # True = masked


@pytest.mark.parametrize("changes", [{}, QWEN], ids=["llama", "qwen2"])
def test_parameter_names_and_shapes(context, changes):
    spec = _spec(**changes)
    model = build_gpt_model(spec, parallel_context=context, seed=1)
    qkv_rows = (HEADS + 2 * GROUPS) * HEAD_DIM
    expected = {"embedding.word_embeddings.weight": (VOCAB, HIDDEN), "decoder.final_layernorm.weight": (HIDDEN,)}
    for layer in range(2):
        prefix = f"decoder.layers.{layer}."
        expected |= {
            prefix + "input_layernorm.weight": (HIDDEN,),
            prefix + "self_attention.linear_qkv.weight": (qkv_rows, HIDDEN),
            prefix + "self_attention.linear_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
            prefix + "pre_mlp_layernorm.weight": (HIDDEN,),
            prefix + "mlp.linear_fc1.weight": (2 * FFN, HIDDEN),  # [gate; up]
            prefix + "mlp.linear_fc2.weight": (HIDDEN, FFN),
        }
        if spec.qkv_bias:
            expected[prefix + "self_attention.linear_qkv.bias"] = (qkv_rows,)
    if not spec.tie_embeddings:
        expected["output_layer.weight"] = (VOCAB, HIDDEN)
    assert {name: tuple(p.shape) for name, p in model.named_parameters()} == expected


def test_norms_activation_and_cpu_settings(context):
    model = build_gpt_model(_spec(), parallel_context=context, seed=1)
    config = model.config
    norms = [model.decoder.final_layernorm] + [
        norm for layer in model.decoder.layers for norm in (layer.input_layernorm, layer.pre_mlp_layernorm)
    ]
    assert all(type(norm) is torch.nn.RMSNorm and norm.eps == 1e-5 for norm in norms)
    assert config.gated_linear_unit and config.activation_func is F.silu
    assert not config.add_bias_linear and not config.add_qkv_bias
    assert (config.hidden_dropout, config.attention_dropout) == (0.0, 0.0)
    assert config.use_cpu_initialization
    assert not any(getattr(config, name) for name in CPU_DISABLED_FUSIONS)
    assert not [m for m in model.modules() if "transformer_engine" in type(m).__module__]


def test_swiglu_uses_first_half_of_fc1_as_gate(context):
    # Checkpoint converters depend on this layout: fc1 = [gate; up], out = W2 (silu(gate) * up).
    model = build_gpt_model(_spec(), parallel_context=context, seed=1)
    mlp = model.decoder.layers[0].mlp
    x = torch.randn(3, 1, HIDDEN, device=mlp.linear_fc1.weight.device)  # (T, B, H)
    gate, up = mlp.linear_fc1.weight.chunk(2, dim=0)
    expected = F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), mlp.linear_fc2.weight)
    output, bias = mlp(x)
    assert bias is None
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scaling", [None, LLAMA3_SCALING], ids=["default", "llama3"])
def test_rope_frequencies_match_transformers(context, scaling):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    spec = _spec(rope_scaling=scaling, max_position_embeddings=16384)
    model = build_gpt_model(spec, parallel_context=context, seed=1)
    hf_config = LlamaConfig.from_dict(spec.to_hf_config())
    hf_inv_freq = LlamaRotaryEmbedding(config=hf_config).inv_freq
    torch.testing.assert_close(model.rotary_pos_emb.inv_freq, hf_inv_freq.float(), rtol=1e-6, atol=0)
    if scaling is not None:  # the scaling actually changed the low frequencies
        plain = 1.0 / (spec.rope_theta ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
        assert not torch.allclose(model.rotary_pos_emb.inv_freq, plain)


def test_forward_logits_loss_and_default_mask(context):
    model = build_gpt_model(_spec(**QWEN), parallel_context=context, seed=1)
    device = next(model.parameters()).device  # the context's: the CPU under the gloo fixture on any machine
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=generator).to(device)  # (B, T)
    labels = torch.randint(0, VOCAB, (2, SEQ), generator=generator).to(device)  # (B, T)
    positions = torch.arange(SEQ, device=device).expand(2, SEQ)  # (B, T)
    logits = model(ids, positions, _causal_mask(device))  # (B, T, V)
    assert logits.shape == (2, SEQ, VOCAB)
    # attention_mask=None makes megatron build a causal mask on device="cuda" (compat layer).
    torch.testing.assert_close(model(ids, positions, None), logits, rtol=0, atol=0)
    token_losses = model(ids, positions, _causal_mask(device), labels=labels)  # (B, T)
    expected = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="none").view(2, SEQ)
    torch.testing.assert_close(token_losses, expected, rtol=1e-5, atol=1e-5)
    # Causality: changing the last token leaves earlier logits untouched.
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % VOCAB
    torch.testing.assert_close(model(changed, positions, _causal_mask(device))[:, :-1], logits[:, :-1], rtol=0, atol=0)


def test_seed_makes_initialization_reproducible(context):
    def weights(seed: int) -> dict[str, torch.Tensor]:
        model = build_gpt_model(_spec(), parallel_context=context, seed=seed)
        return {name: p.detach() for name, p in model.named_parameters()}

    first, second, other = weights(5), weights(5), weights(6)
    assert all(torch.equal(first[name], second[name]) for name in first)
    fc1 = "decoder.layers.0.mlp.linear_fc1.weight"
    assert not torch.equal(first[fc1], other[fc1])


def test_pipeline_position_flags(context):
    first_stage = build_gpt_model(_spec(), parallel_context=context, post_process=False)
    last_stage = build_gpt_model(_spec(), parallel_context=context, pre_process=False)
    first_names = {name for name, _ in first_stage.named_parameters()}
    last_names = {name for name, _ in last_stage.named_parameters()}
    assert "embedding.word_embeddings.weight" in first_names and "output_layer.weight" not in first_names
    assert "decoder.final_layernorm.weight" not in first_names
    assert "output_layer.weight" in last_names and "embedding.word_embeddings.weight" not in last_names


def test_shard_full_state_dict_on_one_rank_is_the_identity(context):
    model = build_gpt_model(_spec(**QWEN), parallel_context=context, seed=1)
    full = {name: p.detach().clone() for name, p in model.named_parameters()}
    local = shard_full_state_dict(model, full, tp_rank=0, tp_size=1)
    assert local.keys() == model.state_dict().keys()
    assert all(torch.equal(local[name], full[name]) for name in full)
    fc2 = "decoder.layers.1.mlp.linear_fc2.weight"
    assert global_parameter_name(model, fc2) == fc2  # one stage: local and global names agree


@pytest.mark.parametrize("changes", [{}, QWEN], ids=["llama", "qwen2"])
def test_megatrons_partition_marks_are_the_oracles_table(context, changes):
    # The table-driven oracle of tests/models/test_layout.py stands for these marks.
    model = build_gpt_model(_spec(**changes), parallel_context=context, seed=1)
    for name, parameter in model.named_parameters():
        partition = TPPartition.of_megatron_parameter(parameter)
        assert (partition.dim, partition.stride) == partition_of(name), name


def test_shard_full_state_dict_errors(context):
    model = build_gpt_model(_spec(), parallel_context=context, seed=1)
    full = {name: p.detach().clone() for name, p in model.named_parameters()}
    with pytest.raises(ValueError, match="missing 'output_layer.weight'"):
        shard_full_state_dict(model, {k: v for k, v in full.items() if k != "output_layer.weight"},
                              tp_rank=0, tp_size=1)
    wrong = dict(full, **{"decoder.layers.0.mlp.linear_fc1.weight": torch.zeros(3, HIDDEN)})
    with pytest.raises(ValueError, match=r"decoder\.layers\.0\.mlp\.linear_fc1\.weight: shape"):
        shard_full_state_dict(model, wrong, tp_rank=0, tp_size=1)
    with pytest.raises(ValueError, match="tp_rank"):
        shard_full_state_dict(model, full, tp_rank=1, tp_size=1)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"pipeline_parallel": 3}, "num_layers"),
        ({"tensor_parallel": 3}, "num_attention_heads"),
        ({"tensor_parallel": 4}, "num_query_groups"),
        ({"tensor_parallel": 2, "sequence_parallel": True}, "sequence_parallel"),
        ({"params_dtype": torch.float64}, "params_dtype"),
        ({"overrides": {"no_such_field": 1}}, "overrides.no_such_field"),
        ({"overrides": {"perform_initialization": False}}, "overrides.perform_initialization"),
    ],
)
def test_transformer_config_rejects(kwargs, field):
    with pytest.raises(ValueError, match=field):
        build_transformer_config(_spec(), choice=LOCAL, **kwargs)


def test_transformer_config_layout_dtype_and_overrides():
    config = build_transformer_config(_spec(rope_scaling=LLAMA3_SCALING), choice=LOCAL, tensor_parallel=2,
                                      pipeline_parallel=2, params_dtype=torch.bfloat16,
                                      overrides={"recompute_granularity": "selective"})
    assert (config.tensor_model_parallel_size, config.pipeline_model_parallel_size) == (2, 2)
    assert config.bf16 and config.pipeline_dtype == torch.bfloat16
    assert config.recompute_granularity == "selective"
    assert (config.num_query_groups, config.kv_channels, config.layernorm_epsilon) == (GROUPS, HEAD_DIM, 1e-5)


def test_vocab_must_divide_across_tensor_parallel_ranks():
    fake_context = types.SimpleNamespace(tensor_parallel=3, pipeline_parallel=1, context_parallel=1, pp_rank=0,
                                         is_pipeline_first=True, is_pipeline_last=True)
    with pytest.raises(ValueError, match="vocab_size: 128 is not divisible by tensor_parallel=3"):
        build_gpt_model(_spec(), parallel_context=fake_context)
