"""Kernel fusions per layer implementation: the TE path must not need APEX.

megatron-core 0.16.1's output layer is always a local ``ColumnParallelLinear``, and its
constructor raises when ``gradient_accumulation_fusion`` is on and APEX's
``fused_weight_gradient_mlp_cuda`` is missing — which is every pip install (TE does
not ship it). The constructor itself is the judge here.
"""

from __future__ import annotations

import pytest
from megatron.core.tensor_parallel.layers import ColumnParallelLinear

from pipeline.models.factory import CPU_DISABLED_FUSIONS, build_transformer_config, kernel_fusions
from pipeline.models.layer_spec import LayerSpecChoice, apex_fused_wgrad_available
from pipeline.models.spec import ModelSpec
from tests.distributed_utils import one_rank_context

TE = LayerSpecChoice(name="te", reason="test")
LOCAL = LayerSpecChoice(name="local", reason="test")
SPEC = ModelSpec(family="llama", vocab_size=64, hidden_size=32, ffn_hidden_size=64, num_layers=2,
                 num_attention_heads=4, num_query_groups=2, max_position_embeddings=64)


def test_te_without_apex_turns_only_the_gradient_accumulation_fusion_off():
    without = kernel_fusions(TE, has_cuda=True, has_apex_wgrad=False)
    with_apex = kernel_fusions(TE, has_cuda=True, has_apex_wgrad=True)
    assert without["gradient_accumulation_fusion"] is False and with_apex["gradient_accumulation_fusion"] is True
    assert {k: v for k, v in without.items() if k != "gradient_accumulation_fusion"} == \
        {k: v for k, v in with_apex.items() if k != "gradient_accumulation_fusion"}
    assert without["apply_rope_fusion"] and without["bias_activation_fusion"]  # TE's own kernels stay on
    assert not kernel_fusions(LOCAL, has_cuda=True, has_apex_wgrad=True)["gradient_accumulation_fusion"]
    assert kernel_fusions(TE, has_cuda=False, has_apex_wgrad=True) == dict.fromkeys(CPU_DISABLED_FUSIONS, False)


@pytest.fixture(scope="module")
def context():
    with one_rank_context() as ctx:
        yield ctx


def _output_layer(config):
    return ColumnParallelLinear(SPEC.hidden_size, SPEC.vocab_size, config=config, init_method=config.init_method,
                                bias=False, skip_bias_add=False, gather_output=False)


def test_megatrons_output_layer_accepts_the_te_selection_without_apex(context):
    assert not apex_fused_wgrad_available()  # pip environments, CI included
    selected = kernel_fusions(TE, has_cuda=True, has_apex_wgrad=apex_fused_wgrad_available())
    flag = selected["gradient_accumulation_fusion"]
    config = build_transformer_config(SPEC, choice=LOCAL, overrides={"gradient_accumulation_fusion": flag})
    assert _output_layer(config).weight.shape == (SPEC.vocab_size, SPEC.hidden_size)
    # What the TE path set before: megatron refuses it without APEX.
    refused = build_transformer_config(SPEC, choice=LOCAL, overrides={"gradient_accumulation_fusion": True})
    with pytest.raises(RuntimeError, match="fused_weight_gradient_mlp_cuda"):
        _output_layer(refused)
