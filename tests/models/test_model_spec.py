"""ModelSpec <-> Hugging Face config.json: Llama-3, Qwen2 and Qwen3 configs, both transformers spellings, bad configs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import LlamaConfig, Qwen2Config, Qwen3Config

from pipeline.models.spec import ModelSpec

# Llama-3.1-8B's config.json (transformers 4.x spelling), trimmed to the keys a reader sees.
LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}

# The published Qwen3 configs (pipeline/models/published/configs).
_FIXTURES = Path(__file__).resolve().parents[2] / "pipeline" / "models" / "published" / "configs"
QWEN3_4B = json.loads((_FIXTURES / "Qwen3-4B.json").read_text())
QWEN3_8B = json.loads((_FIXTURES / "Qwen3-8B.json").read_text())

# Qwen2.5-1.5B's config.json.
QWEN25_15B = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "hidden_act": "silu",
    "hidden_size": 1536,
    "initializer_range": 0.02,
    "intermediate_size": 8960,
    "max_position_embeddings": 131072,
    "max_window_layers": 28,
    "model_type": "qwen2",
    "num_attention_heads": 12,
    "num_hidden_layers": 28,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 131072,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def test_llama31_config():
    spec = ModelSpec.from_hf_config(LLAMA31_8B)
    assert spec == ModelSpec(
        family="llama",
        vocab_size=128256,
        hidden_size=4096,
        ffn_hidden_size=14336,
        num_layers=32,
        num_attention_heads=32,
        num_query_groups=8,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        norm_eps=1e-5,
        qkv_bias=False,
        tie_embeddings=False,
    )
    assert spec.kv_channels == 128


def test_qwen25_config():
    spec = ModelSpec.from_hf_config(QWEN25_15B)
    assert spec.family == "qwen2"
    assert (spec.num_attention_heads, spec.num_query_groups, spec.kv_channels) == (12, 2, 128)
    assert spec.qkv_bias is True  # Qwen2 always has q/k/v biases
    assert spec.tie_embeddings is True
    assert spec.rope_theta == 1e6 and spec.rope_scaling is None
    assert spec.norm_eps == 1e-6


@pytest.mark.parametrize(("config", "tied", "groups"), [(QWEN3_4B, True, 8), (QWEN3_8B, False, 8)], ids=["4B", "8B"])
def test_qwen3_configs(config, tied, groups):
    spec = ModelSpec.from_hf_config(config)
    assert spec.family == "qwen3" and spec.qk_layernorm
    assert spec.qkv_bias is False  # Qwen3 dropped Qwen2's q/k/v biases
    assert (spec.num_query_groups, spec.kv_channels, spec.tie_embeddings) == (groups, 128, tied)
    # 4B's heads are wider than hidden / heads (2560 / 32 = 80); 8B's equal it (4096 / 32).
    assert spec.head_dim == (128 if config is QWEN3_4B else None)
    assert spec.rope_theta == 1e6 and spec.rope_scaling is None
    assert ModelSpec.from_hf_config(dict(config, model_type="qwen2")).qk_layernorm is False


def test_transformers5_rope_parameters_spelling():
    # transformers 5 writes rope_theta and the scaling keys under rope_parameters.
    hf = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16384,
        rope_theta=500000.0,
        rope_scaling=dict(LLAMA31_8B["rope_scaling"], factor=32.0),
    ).to_dict()
    assert "rope_parameters" in hf
    spec = ModelSpec.from_hf_config(hf)
    assert spec.rope_theta == 500000.0
    assert spec.rope_scaling["factor"] == 32.0
    qwen = ModelSpec.from_hf_config(
        Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True).to_dict()
    )
    assert qwen.rope_theta == 10000.0 and qwen.rope_scaling is None and qwen.tie_embeddings


@pytest.mark.parametrize("config", [LLAMA31_8B, QWEN25_15B, QWEN3_4B], ids=["llama", "qwen2", "qwen3"])
def test_round_trip_through_hf_config_and_transformers(config):
    spec = ModelSpec.from_hf_config(config)
    exported = spec.to_hf_config()
    assert ModelSpec.from_hf_config(exported) == spec
    # transformers itself reads the export back to the same architecture.
    hf_class = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[spec.family]
    reloaded = hf_class.from_dict(exported).to_dict()
    assert ModelSpec.from_hf_config(reloaded) == spec
    assert reloaded["rope_parameters"]["rope_theta"] == spec.rope_theta


def test_reads_a_path_to_the_file_or_its_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN25_15B))
    assert ModelSpec.from_hf_config(tmp_path) == ModelSpec.from_hf_config(QWEN25_15B)
    assert ModelSpec.from_hf_config(str(tmp_path / "config.json")) == ModelSpec.from_hf_config(QWEN25_15B)
    with pytest.raises(ValueError, match="config: no config.json"):
        ModelSpec.from_hf_config(tmp_path / "missing")


def test_defaults_for_omitted_keys():
    minimal = {key: LLAMA31_8B[key] for key in
               ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads")}
    spec = ModelSpec.from_hf_config(minimal)
    # LlamaConfig's class defaults; no GQA when num_key_value_heads is absent.
    assert spec.num_query_groups == spec.num_attention_heads
    assert (spec.max_position_embeddings, spec.rope_theta, spec.norm_eps) == (2048, 10000.0, 1e-6)
    assert spec.tie_embeddings is False


def test_explicit_head_dim():
    spec = ModelSpec.from_hf_config(dict(LLAMA31_8B, head_dim=64))
    assert spec.kv_channels == 64 and spec.head_dim == 64
    # The derived value spelled out is the same spec as leaving it out.
    assert ModelSpec.from_hf_config(dict(LLAMA31_8B, head_dim=128)) == ModelSpec.from_hf_config(LLAMA31_8B)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"model_type": "mistral"}, "model_type"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"attention_dropout": 0.1}, "attention_dropout"),
        ({"vocab_size": None}, "vocab_size"),
        ({"num_key_value_heads": 5}, "num_query_groups"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, r"rope_scaling\.rope_type"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, r"rope_scaling\.rope_type"),
        ({"rope_scaling": dict(LLAMA31_8B["rope_scaling"], low_freq_factor=2.0)}, r"rope_scaling\.low_freq_factor"),
        (
            {"rope_scaling": dict(LLAMA31_8B["rope_scaling"], original_max_position_embeddings=4096)},
            r"rope_scaling\.original_max_position_embeddings",
        ),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, r"rope_scaling\.low_freq_factor"),
        ({"rope_scaling": dict(LLAMA31_8B["rope_scaling"], factor=0.5)}, r"rope_scaling\.factor"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}, "rope_theta"),
        ({"hidden_size": 4095}, "hidden_size"),
    ],
)
def test_unsupported_llama_configs_name_the_field(change, field):
    with pytest.raises(ValueError, match=field):
        ModelSpec.from_hf_config(dict(LLAMA31_8B, **change))


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
        (
            {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}},
            r"rope_parameters\.rope_type",
        ),
    ],
)
def test_unsupported_qwen2_configs_name_the_field(change, field):
    with pytest.raises(ValueError, match=field):
        ModelSpec.from_hf_config(dict(QWEN25_15B, **change))


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"attention_bias": True}, "attention_bias"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"}, "model_type"),
    ],
)
def test_unsupported_qwen3_configs_name_the_field(change, field):
    with pytest.raises(ValueError, match=field):
        ModelSpec.from_hf_config(dict(QWEN3_4B, **change))


def test_direct_construction_is_validated():
    base = ModelSpec.from_hf_config(QWEN25_15B).to_dict()
    with pytest.raises(ValueError, match="family"):
        ModelSpec(**dict(base, family="gpt2"))
    with pytest.raises(ValueError, match="num_layers"):
        ModelSpec(**dict(base, num_layers=0))
    with pytest.raises(ValueError, match="activation"):
        ModelSpec(**dict(base, activation="gelu"))
    with pytest.raises(ValueError, match="norm_eps"):
        ModelSpec(**dict(base, norm_eps=0.0))
