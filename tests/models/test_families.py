"""The family table: every row against transformers, and the planner sizing exactly what ``ModelSpec`` parses."""

from __future__ import annotations

import json
from pathlib import Path
from typing import get_args, get_type_hints

import pytest
import torch
import transformers

from pipeline.cli import main
from pipeline.config import ModelConfig
from pipeline.errors import EXIT_USER_ERROR
from pipeline.launch import plan as planner
from pipeline.models.families import FAMILIES, Family, model_family
from pipeline.models.spec import ModelSpec

ROOT = Path(__file__).resolve().parents[2]
PUBLISHED = ROOT / "pipeline" / "models" / "published"
PUBLISHED_CONFIGS = sorted((PUBLISHED / "configs").glob("*.json"))

# One small config per family, as a Hugging Face config.json spells it: q/k/v biases (qwen2),
# q/k norms with heads wider than hidden / heads (qwen3), GQA and a tied head.
SMALL = {
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 96, "hidden_size": 32,
              "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 256, "tie_word_embeddings": False},
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 96, "hidden_size": 32,
              "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 256, "tie_word_embeddings": True, "use_sliding_window": False},
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 96, "hidden_size": 32,
              "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 16, "max_position_embeddings": 256, "tie_word_embeddings": False,
              "attention_bias": False, "use_sliding_window": False},
}


def _transformers_parameters(config: dict) -> int:
    """Parameters of the model transformers builds from ``config`` (a tied head counted once)."""
    hf_config = transformers.AutoConfig.for_model(**config)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config)
    return sum(parameter.numel() for parameter in model.parameters())


def test_the_family_literal_lists_exactly_the_table():
    assert set(get_args(Family)) == set(FAMILIES)
    assert set(SMALL) == set(FAMILIES)  # a new family brings its small config (docs/model-families.md)
    # A bootstrap's from-scratch policy can only name a family the table has.
    assert set(get_args(get_type_hints(ModelConfig)["family"])) <= set(FAMILIES)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_each_row_matches_its_transformers_config_class(name):
    family = FAMILIES[name]
    model_class = getattr(transformers, family.architecture)
    config_class = model_class.config_class
    assert config_class.model_type == family.model_type
    defaults = config_class(hidden_size=64, num_attention_heads=4)
    rope_theta = defaults.rope_parameters["rope_theta"] if hasattr(defaults, "rope_parameters") else defaults.rope_theta
    written = family.hf_defaults
    assert (written["max_position_embeddings"], written["rms_norm_eps"], written["rope_theta"],
            written["tie_word_embeddings"], written["hidden_act"]) == (
        defaults.max_position_embeddings, defaults.rms_norm_eps, rope_theta, defaults.tie_word_embeddings,
        defaults.hidden_act)
    # None in the table: hidden_size // num_attention_heads, as transformers derives it (or leaves it unset).
    expected_head_dims = (16, None) if written["head_dim"] is None else (written["head_dim"],)  # 64 / 4 heads
    assert getattr(defaults, "head_dim", None) in expected_head_dims
    for switch in family.unsupported_switches:
        assert getattr(defaults, switch) is False, switch  # a real key of the config, off by default


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_each_rows_tokenizer_fixture_holds_its_special_tokens(name):
    family = FAMILIES[name]
    tokenizer = json.loads((PUBLISHED / "tokenizers" / family.tokenizer_fixture / "tokenizer.json").read_text())
    added = {token["content"] for token in tokenizer["added_tokens"]}
    assert {family.bos_token, *family.eos_tokens} <= added


@pytest.mark.parametrize("name", sorted(SMALL))
def test_small_configs_are_sized_as_transformers_builds_them(name):
    config = SMALL[name]
    from_config = planner.ModelDims.from_hf_config(config, name=name)
    from_spec = planner.ModelDims.from_spec(ModelSpec.from_hf_config(config), name=name)
    assert from_config == from_spec
    assert (from_spec.qkv_bias, from_spec.qk_norm) == (FAMILIES[name].qkv_bias, FAMILIES[name].qk_norm)
    assert from_spec.num_parameters() == _transformers_parameters(config)


@pytest.mark.parametrize("path", PUBLISHED_CONFIGS, ids=[path.stem for path in PUBLISHED_CONFIGS])
def test_published_configs_give_the_same_dims_from_the_file_and_from_its_spec(path):
    from_config = planner.ModelDims.from_hf_config(path)
    spec = ModelSpec.from_hf_config(path)
    assert from_config == planner.ModelDims.from_spec(spec, name=path.stem)
    assert from_config.qk_norm == spec.qk_layernorm == (json.loads(path.read_text())["model_type"] == "qwen3")


def test_a_qwen3_checkpoints_spec_keeps_its_q_and_k_norms():
    # What a winnow Qwen3-8B checkpoint's manifest holds: the planner used to drop the norms here.
    spec = ModelSpec(**ModelSpec.from_hf_config(PUBLISHED / "configs" / "Qwen3-8B.json").to_dict())
    dims = planner.ModelDims.from_spec(spec, name="Qwen3-8B")
    assert dims.qk_norm
    assert dims.num_parameters() == 8_190_735_360  # the published count, 36 × 2 × 128 norm weights included


def test_a_qwen3_config_without_head_dim_gets_transformers_default():
    # Qwen3Config defaults head_dim to 128 whatever hidden_size / num_attention_heads is.
    config = {key: value for key, value in SMALL["qwen3"].items() if key != "head_dim"}
    spec = ModelSpec.from_hf_config(config)
    assert spec.kv_channels == transformers.Qwen3Config(**config).head_dim == 128
    assert planner.ModelDims.from_hf_config(config).num_parameters() == _transformers_parameters(config)


def test_an_unknown_model_type_names_the_supported_families(tmp_path, capsys):
    message = r"model_type: expected one of \['llama', 'qwen2', 'qwen3'\], got 'mistral'"
    with pytest.raises(ValueError, match=message):
        model_family("mistral")
    config = dict(SMALL["llama"], model_type="mistral", architectures=["MistralForCausalLM"])
    with pytest.raises(ValueError, match=message):
        ModelSpec.from_hf_config(config)
    with pytest.raises(ValueError, match=message):
        planner.ModelDims.from_hf_config(config)
    with pytest.raises(ValueError, match=r"family: expected one of \['llama', 'qwen2', 'qwen3'\], got 'gpt2'"):
        ModelSpec(**dict(ModelSpec.from_hf_config(SMALL["llama"]).to_dict(), family="gpt2"))
    folder = tmp_path / "Mistral-7B"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    assert main(["plan", "--model", str(folder), "--preset", "d3s_qwen25_math_7b"]) == EXIT_USER_ERROR
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--model: model_type: expected one of" in errors[0], errors


def test_the_writer_turns_every_unsupported_switch_off_and_names_the_architecture():
    for name, family in FAMILIES.items():
        written = ModelSpec.from_hf_config(SMALL[name]).to_hf_config()
        assert written["architectures"] == [family.architecture] and written["model_type"] == name
        assert all(written[switch] is False for switch in family.unsupported_switches)
        for switch in family.unsupported_switches:
            with pytest.raises(ValueError, match=f"^{switch}: "):
                ModelSpec.from_hf_config(dict(SMALL[name], **{switch: True}))


def test_a_bootstrap_policy_is_sized_from_its_spec():
    from pipeline.config import BootstrapConfig

    cfg = BootstrapConfig()
    qwen = BootstrapConfig(model=ModelConfig(family="qwen2"))
    llama_dims, qwen_dims = planner.bootstrap_model_dims(cfg), planner.bootstrap_model_dims(qwen)
    assert (llama_dims.qkv_bias, qwen_dims.qkv_bias) == (False, True)
    assert qwen_dims.num_parameters() - llama_dims.num_parameters() == cfg.model.num_layers * (
        qwen_dims.q_width + 2 * qwen_dims.kv_width)
