"""Whole-model HF → megatron → HF conversion: bit-exact for full, TP-sharded and PP-split states."""

from __future__ import annotations

import pytest
import torch

from pipeline.checkpoint.convert import copy_into_model, hf_to_megatron_state, megatron_to_hf_state
from pipeline.checkpoint.hf_map import MegatronLayout, expected_megatron_shapes
from tests.checkpoint.tiny_models import SPEC_CASES, random_hf_state, spec_case_id, tiny_spec

LAYOUTS = [
    # (tp, pp, first-stage layers, last-stage layers)
    (1, 1, None, None),
    (2, 1, None, None),
    (1, 2, None, None),
    (2, 2, None, None),
    (1, 3, 2, None),  # uneven: 2 + 1 + 1
    (4, 1, None, None),
]


def _sharded_states(hf_state, spec, layout):
    """states[pp_rank][tp_rank] as each rank of the megatron model would load them."""
    return [
        [
            dict(hf_to_megatron_state(hf_state, spec=spec, layout=layout, tp_rank=tp_rank, pp_rank=pp_rank))
            for tp_rank in range(layout.tp_size)
        ]
        for pp_rank in range(layout.pp_size)
    ]


def _assert_bit_exact(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert list(actual) == list(expected)
    for name, tensor in expected.items():
        assert actual[name].dtype == tensor.dtype, name
        assert torch.equal(actual[name], tensor), name


@pytest.mark.parametrize("case", SPEC_CASES, ids=spec_case_id)
@pytest.mark.parametrize("tp, pp, first, last", LAYOUTS, ids=lambda v: str(v))
def test_hf_megatron_hf_round_trip_is_bit_exact(case, tp, pp, first, last):
    family, tied, groups = case
    if groups % tp and tp % groups:
        pytest.skip("megatron cannot shard this many query groups over this TP size")
    spec = tiny_spec(family, tie_embeddings=tied, num_query_groups=groups)
    layout = MegatronLayout.build(
        spec, tp_size=tp, pp_size=pp, num_layers_in_first_stage=first, make_vocab_size_divisible_by=16
    )
    hf_state = random_hf_state(spec, seed=7, dtype=torch.bfloat16)
    states = _sharded_states(hf_state, spec, layout)
    for pp_rank, stage in enumerate(states):
        expected_shapes = expected_megatron_shapes(spec, layout=layout, pp_rank=pp_rank)
        for state in stage:
            assert {name: tuple(t.shape) for name, t in state.items()} == expected_shapes
    _assert_bit_exact(dict(megatron_to_hf_state(states, spec=spec, layout=layout)), hf_state)


@pytest.mark.parametrize("case", SPEC_CASES[:4], ids=spec_case_id)
def test_shards_are_the_split_of_the_full_state_and_reassemble_to_it(case):
    family, tied, groups = case
    spec = tiny_spec(family, tie_embeddings=tied, num_query_groups=groups)
    hf_state = random_hf_state(spec, seed=3)
    full = dict(hf_to_megatron_state(hf_state, spec=spec, layout=MegatronLayout.build(spec, padded_vocab_size=128)))
    layout = MegatronLayout.build(spec, tp_size=2, pp_size=2, padded_vocab_size=128)
    states = _sharded_states(hf_state, spec, layout)
    # Stage 1 holds global layers 2 and 3 under local indices 0 and 1.
    fc2 = "decoder.layers.{}.mlp.linear_fc2.weight"
    assert torch.equal(torch.cat([states[1][0][fc2.format(1)], states[1][1][fc2.format(1)]], dim=1), full[fc2.format(3)])
    embed = "embedding.word_embeddings.weight"
    assert torch.equal(torch.cat([states[0][0][embed], states[0][1][embed]]), full[embed])
    assert full[embed].shape[0] == 128 and not full[embed][spec.vocab_size :].any()


def test_tied_embedding_copy_on_the_last_stage_is_checked_not_exported():
    spec = tiny_spec("qwen2", tie_embeddings=True)
    layout = MegatronLayout.build(spec, pp_size=2)
    hf_state = random_hf_state(spec)
    states = _sharded_states(hf_state, spec, layout)
    assert torch.equal(states[1][0]["output_layer.weight"], states[0][0]["embedding.word_embeddings.weight"])
    exported = dict(megatron_to_hf_state(states, spec=spec, layout=layout))
    assert "lm_head.weight" not in exported
    states[1][0]["output_layer.weight"] = states[1][0]["output_layer.weight"].clone()
    states[1][0]["output_layer.weight"][0, 0] += 1.0
    with pytest.raises(ValueError, match="output_layer.weight on pipeline stage 1 differs"):
        dict(megatron_to_hf_state(states, spec=spec, layout=layout))


def test_megatron_state_with_missing_or_unexpected_names_is_refused():
    spec = tiny_spec("llama")
    layout = MegatronLayout.build(spec)
    state = dict(hf_to_megatron_state(random_hf_state(spec), spec=spec, layout=layout))
    # megatron's state_dict() carries `_extra_state` entries without weights: ignored.
    with_extra = {**state, "output_layer._extra_state": None}
    assert len(dict(megatron_to_hf_state([[with_extra]], spec=spec, layout=layout))) == len(random_hf_state(spec))
    missing = {k: v for k, v in state.items() if k != "decoder.layers.3.mlp.linear_fc1.weight"}
    with pytest.raises(ValueError, match=r"missing \['decoder.layers.3.mlp.linear_fc1.weight'\]"):
        next(megatron_to_hf_state([[missing]], spec=spec, layout=layout))
    with pytest.raises(ValueError, match=r"unexpected \['decoder.layers.4.mlp.linear_fc1.weight'\]"):
        next(megatron_to_hf_state([[{**state, "decoder.layers.4.mlp.linear_fc1.weight": torch.zeros(1)}]], spec=spec, layout=layout))
    with pytest.raises(ValueError, match="expected states for 1 pipeline stages x 2 TP ranks"):
        next(megatron_to_hf_state([[state]], spec=spec, layout=MegatronLayout.build(spec, tp_size=2)))


def test_missing_hf_tensor_is_named():
    spec = tiny_spec("qwen2")
    hf_state = random_hf_state(spec)
    del hf_state["model.layers.2.self_attn.v_proj.bias"]
    with pytest.raises(KeyError, match="model.layers.2.self_attn.v_proj.bias"):
        dict(hf_to_megatron_state(hf_state, spec=spec, layout=MegatronLayout.build(spec)))


def test_only_the_requested_stage_reads_hf_tensors():
    spec = tiny_spec("llama", num_layers=4)
    hf_state = random_hf_state(spec)
    read: list[str] = []

    def reader(name: str) -> torch.Tensor:
        read.append(name)
        return hf_state[name]

    layout = MegatronLayout.build(spec, pp_size=2)
    dict(hf_to_megatron_state(reader, spec=spec, layout=layout, tp_rank=0, pp_rank=1))
    assert read and all(name.startswith(("model.layers.2.", "model.layers.3.", "model.norm", "lm_head")) for name in read)


def test_tp_shards_do_not_keep_the_full_tensor_alive():
    spec = tiny_spec("llama")
    layout = MegatronLayout.build(spec, tp_size=2)
    shard = dict(hf_to_megatron_state(random_hf_state(spec), spec=spec, layout=layout, tp_rank=1))
    qkv = shard["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert qkv.untyped_storage().nbytes() == qkv.numel() * qkv.element_size()


def test_copy_into_model_requires_every_parameter_exactly_once():
    model = torch.nn.Linear(3, 2)
    weight, bias = torch.randn(2, 3), torch.randn(2)
    copy_into_model(model, [("weight", weight), ("bias", bias)])
    assert torch.equal(model.weight, weight) and torch.equal(model.bias, bias)
    with pytest.raises(ValueError, match=r"missing tensors for parameters \['bias'\]"):
        copy_into_model(model, [("weight", weight)])
    with pytest.raises(ValueError, match="unexpected tensor 'scale'"):
        copy_into_model(model, [("scale", weight)])
    with pytest.raises(ValueError, match="given twice"):
        copy_into_model(model, [("weight", weight), ("weight", weight)])
    with pytest.raises(ValueError, match=r"weight: tensor shape \(3, 2\)"):
        copy_into_model(model, [("weight", weight.T)])
