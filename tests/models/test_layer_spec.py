"""Layer-spec selection (TE vs local) and the FP8 -> TransformerConfig mapping.

The TE spec cannot be instantiated without Transformer Engine and CUDA, so the
'te' branch is tested with both reported present and megatron's TE spec builder
replaced by a marker; the local spec is checked to contain no TE module.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm

from pipeline.models import layer_spec as layer_spec_module
from pipeline.models.factory import build_transformer_config
from pipeline.models.layer_spec import FP8Options, LayerSpecChoice, final_norm_module, select_layer_spec
from pipeline.models.spec import ModelSpec

SPEC = ModelSpec(
    family="qwen2",
    vocab_size=128,
    hidden_size=64,
    ffn_hidden_size=128,
    num_layers=2,
    num_attention_heads=4,
    num_query_groups=2,
    max_position_embeddings=64,
    qkv_bias=True,
)
TE_MARKER = ModuleSpec(module=torch.nn.Identity)
TE_QK_MARKER = ModuleSpec(module=torch.nn.Identity)
QWEN3 = dataclasses.replace(SPEC, family="qwen3", qkv_bias=False, head_dim=32)


@pytest.fixture
def environment(monkeypatch):
    """Report Transformer Engine and CUDA as present or absent."""

    def set_environment(*, te: bool, cuda: bool) -> None:
        monkeypatch.setattr(layer_spec_module, "transformer_engine_available", lambda: te)
        monkeypatch.setattr(layer_spec_module, "cuda_available", lambda: cuda)
        monkeypatch.setattr(layer_spec_module, "te_layer_spec",
                            lambda *, qk_layernorm: TE_MARKER if not qk_layernorm else TE_QK_MARKER)

    return set_environment


def _module_classes(spec) -> list[type]:
    """Every class a spec tree names (modules and submodule classes)."""
    found = []
    if isinstance(spec, type):
        return [spec]
    if isinstance(spec, ModuleSpec):
        found.append(spec.module)
        spec = spec.submodules
    if spec is not None and dataclasses.is_dataclass(spec):
        for field in dataclasses.fields(spec):
            found += _module_classes(getattr(spec, field.name))
    return found


@pytest.mark.parametrize(("te", "cuda", "missing"), [(False, False, "transformer_engine and CUDA"),
                                                     (True, False, "CUDA"),
                                                     (False, True, "transformer_engine")])
def test_local_unless_te_and_cuda(environment, te, cuda, missing):
    environment(te=te, cuda=cuda)
    spec, choice = select_layer_spec(SPEC)
    assert choice == LayerSpecChoice(name="local", reason=f"{missing} not available", fp8_recipe=None)
    assert spec is not TE_MARKER


def test_te_when_both_present(environment):
    environment(te=True, cuda=True)
    spec, choice = select_layer_spec(SPEC)
    assert spec is TE_MARKER
    assert choice.name == "te" and choice.fp8_recipe is None
    assert choice.to_dict() == {"name": "te", "reason": "transformer_engine importable and CUDA available",
                                "fp8_recipe": None}


def test_qwen3_gets_per_head_q_and_k_norms_in_either_spec(environment):
    environment(te=True, cuda=True)
    assert select_layer_spec(QWEN3)[0] is TE_QK_MARKER
    environment(te=False, cuda=False)
    attention = select_layer_spec(QWEN3)[0].submodules.self_attention.submodules
    assert attention.q_layernorm is WrappedTorchNorm and attention.k_layernorm is WrappedTorchNorm
    attention = select_layer_spec(SPEC)[0].submodules.self_attention.submodules
    assert attention.q_layernorm is IdentityOp and attention.k_layernorm is IdentityOp


def test_prefer_te_false_forces_local(environment):
    environment(te=True, cuda=True)
    spec, choice = select_layer_spec(SPEC, prefer_te=False)
    assert choice.name == "local" and choice.reason == "prefer_te=False"
    assert spec is not TE_MARKER


@pytest.mark.parametrize(("recipe", "megatron_recipe"), [("delayed", "delayed"), ("current", "tensorwise")])
def test_fp8_with_te_sets_the_config_fields(environment, recipe, megatron_recipe):
    environment(te=True, cuda=True)
    fp8 = FP8Options(enabled=True, recipe=recipe, margin=1, amax_history_len=16, amax_compute_algo="most_recent")
    _, choice = select_layer_spec(SPEC, fp8=fp8)
    assert choice.fp8_recipe == recipe
    # On the CPU: the TE spec's fusions on a GPU need TE's kernels (the config refuses RoPE
    # fusion without them), and this checks only the FP8 mapping, which is the same there.
    config = build_transformer_config(SPEC, choice=choice, fp8=fp8, params_dtype=torch.bfloat16,
                                      device=torch.device("cpu"))
    assert (config.fp8, config.fp8_recipe, config.fp8_margin) == ("hybrid", megatron_recipe, 1)
    assert (config.fp8_amax_history_len, config.fp8_amax_compute_algo) == (16, "most_recent")
    assert config.fp8_wgrad is True and config.fp8_param is False
    assert config.bf16 and config.params_dtype == torch.bfloat16


def test_fp8_disabled_leaves_fp8_off(environment):
    environment(te=True, cuda=True)
    _, choice = select_layer_spec(SPEC, fp8=FP8Options(enabled=False))
    assert choice.fp8_recipe is None
    assert build_transformer_config(SPEC, choice=choice, fp8=FP8Options(), device=torch.device("cpu")).fp8 is None


@pytest.mark.parametrize(("te", "cuda", "prefer_te"), [(False, True, True), (True, False, True), (True, True, False)])
def test_fp8_without_te_spec_is_an_error(environment, te, cuda, prefer_te):
    environment(te=te, cuda=cuda)
    with pytest.raises(ValueError, match="fp8.enabled"):
        select_layer_spec(SPEC, prefer_te=prefer_te, fp8=FP8Options(enabled=True))
    local = LayerSpecChoice(name="local", reason="test")
    with pytest.raises(ValueError, match="fp8.enabled"):
        build_transformer_config(SPEC, choice=local, fp8=FP8Options(enabled=True))


def test_fp8_options_validation():
    with pytest.raises(ValueError, match="fp8.recipe"):
        FP8Options(recipe="mxfp8")
    with pytest.raises(ValueError, match="fp8.format"):
        FP8Options(format="e5m2")
    with pytest.raises(ValueError, match="fp8.amax_history_len"):
        FP8Options(amax_history_len=0)


def test_local_spec_has_no_transformer_engine_module(environment):
    environment(te=True, cuda=False)
    spec, choice = select_layer_spec(SPEC)
    classes = _module_classes(spec)
    assert WrappedTorchNorm in classes
    assert not [cls for cls in classes if "transformer_engine" in cls.__module__]
    assert final_norm_module(choice) is WrappedTorchNorm


def test_transformer_engine_is_absent_here():
    # The real probes on this CPU machine (TE is an optional GPU dependency).
    assert layer_spec_module.transformer_engine_available() is False
    assert select_layer_spec(SPEC)[1].name == "local"
