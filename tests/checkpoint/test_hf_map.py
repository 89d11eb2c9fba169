"""The HF ⇄ megatron map: names against megatron-core 0.16.1 itself, layouts against loop references."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.checkpoint.hf_map import (
    PARAM_MAP,
    ResolvedParam,
    expected_hf_shapes,
    expected_megatron_shapes,
    hf_to_megatron_tensor,
    megatron_to_hf_tensors,
    merge_tp,
    resolve_params,
    split_tp,
)
from pipeline.models.layout import LayerSplit, MegatronLayout, Parallel, Transform, padded_vocab_size
from tests.checkpoint.tiny_models import SPEC_CASES, build_hf_model, hf_saved_state, spec_case_id, tiny_spec


def _param(spec, megatron_suffix: str, *, layout: MegatronLayout | None = None) -> ResolvedParam:
    layout = layout or MegatronLayout.build(spec)
    (param,) = [p for p in resolve_params(spec, layout=layout) if p.megatron_name.endswith(megatron_suffix)]
    return param


# --- names and shapes against the real models -------------------------------------------------


def _megatron_gpt_model(spec, *, tie: bool):
    """A GPTModel from megatron's own local spec (not winnow's factory), fp32 on CPU."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        qk_layernorm=spec.qk_layernorm,
        kv_channels=spec.kv_channels,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
    )
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=spec.qk_layernorm),
        vocab_size=padded_vocab_size(spec.vocab_size, make_vocab_size_divisible_by=128, tp_size=1),
        max_sequence_length=64,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=tie,
    )


@pytest.mark.parametrize("case", SPEC_CASES, ids=spec_case_id)
def test_megatron_names_and_shapes_match_a_real_local_spec_gpt_model(megatron_single_rank, case):
    family, tied, groups = case
    spec = tiny_spec(family, tie_embeddings=tied, num_query_groups=groups, num_layers=2)
    model = _megatron_gpt_model(spec, tie=tied)
    actual = {name: tuple(p.shape) for name, p in model.named_parameters()}
    layout = MegatronLayout.build(spec, make_vocab_size_divisible_by=128)
    assert expected_megatron_shapes(spec, layout=layout, sharded=False) == actual
    assert expected_megatron_shapes(spec, layout=layout, pp_rank=0) == actual


def test_te_names_are_megatrons_own_local_to_te_key_map():
    # get_gpt_layer_local_spec declares how its norm names map onto the TE spec's fused
    # names (sharded_state_dict_keys_map); TE itself cannot be instantiated on CPU.
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    keys_map = get_gpt_layer_local_spec(normalization="RMSNorm").submodules.sharded_state_dict_keys_map
    spec = tiny_spec("qwen2", num_layers=2)
    local = [p.megatron_name for p in resolve_params(spec, layout=MegatronLayout.build(spec, layer_spec="local"))]
    te = [p.megatron_name for p in resolve_params(spec, layout=MegatronLayout.build(spec, layer_spec="te"))]

    def to_te(name: str) -> str:
        for local_prefix, te_prefix in keys_map.items():
            name = name.replace(f".{local_prefix}", f".{te_prefix}")
        return name

    assert te == [to_te(name) for name in local]
    assert "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight" in te
    assert "decoder.layers.1.mlp.linear_fc1.layer_norm_weight" in te
    assert not any("input_layernorm" in name or "pre_mlp_layernorm" in name for name in te)


@pytest.mark.parametrize("case", SPEC_CASES, ids=spec_case_id)
def test_hf_names_and_shapes_match_transformers_models(case):
    family, tied, groups = case
    spec = tiny_spec(family, tie_embeddings=tied, num_query_groups=groups, num_layers=2)
    model = build_hf_model(spec)
    actual = {name: tuple(t.shape) for name, t in hf_saved_state(model, spec).items()}
    assert expected_hf_shapes(spec) == actual


def test_every_row_of_the_map_is_used_and_each_hf_tensor_once():
    specs = [tiny_spec("qwen2", tie_embeddings=False, num_layers=2), tiny_spec("qwen3", tie_embeddings=False, num_layers=2)]
    params = [list(resolve_params(spec, layout=MegatronLayout.build(spec))) for spec in specs]
    assert {p.entry for stage in params for p in stage} == set(PARAM_MAP)
    for spec, stage in zip(specs, params):
        hf_names = [name for p in stage for name in p.hf_names]
        assert len(hf_names) == len(set(hf_names)) == len(expected_hf_shapes(spec))


# --- tensor layouts against loop references ---------------------------------------------------


def _reference_qkv(q, k, v, *, num_heads, num_groups, head_dim):
    """Megatron's layout written out: per group, its query heads, then its k head, then its v head."""
    rows = []
    heads_per_group = num_heads // num_groups
    for group in range(num_groups):
        for head in range(group * heads_per_group, (group + 1) * heads_per_group):
            rows.append(q[head * head_dim : (head + 1) * head_dim])
        rows.append(k[group * head_dim : (group + 1) * head_dim])
        rows.append(v[group * head_dim : (group + 1) * head_dim])
    return torch.cat(rows, dim=0)


@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("suffix", ["linear_qkv.weight", "linear_qkv.bias"])
def test_qkv_interleave_matches_the_reference_layout(groups, suffix):
    spec = tiny_spec("qwen2", num_query_groups=groups, num_layers=1)
    param = _param(spec, suffix)
    state = {name: torch.randn(shape) for name, shape in expected_hf_shapes(spec).items()}
    q, k, v = (state[name] for name in param.hf_names)
    fused = hf_to_megatron_tensor(param, (q, k, v), dims=spec, padded_vocab_size=spec.vocab_size)
    expected = _reference_qkv(q, k, v, num_heads=4, num_groups=groups, head_dim=8)
    assert torch.equal(fused, expected)
    back = megatron_to_hf_tensors(param, fused, dims=spec, padded_vocab_size=spec.vocab_size)
    assert all(torch.equal(a, b) for a, b in zip(back, (q, k, v)))


@pytest.mark.parametrize("groups, tp_size", [(2, 1), (2, 2), (4, 2), (4, 4), (1, 2), (2, 4)])
def test_qkv_tp_shards_hold_their_own_query_heads_and_kv_head(groups, tp_size):
    num_heads, head_dim = 8, 4
    spec = tiny_spec("llama", num_attention_heads=num_heads, num_query_groups=groups, num_layers=1)
    param = _param(spec, "linear_qkv.weight")
    q = torch.randn(num_heads * head_dim, 32)
    k = torch.randn(groups * head_dim, 32)
    v = torch.randn(groups * head_dim, 32)
    fused = hf_to_megatron_tensor(param, (q, k, v), dims=spec, padded_vocab_size=spec.vocab_size)
    shards = split_tp(param, fused, tp_size=tp_size)
    heads_per_group = num_heads // groups
    for rank, shard in enumerate(shards):
        if groups >= tp_size:
            # Rank r owns groups [r*G/tp, (r+1)*G/tp): their q heads, k and v.
            groups_per_rank = groups // tp_size
            owned = range(rank * groups_per_rank, (rank + 1) * groups_per_rank)
            expected = torch.cat(
                [
                    torch.cat(
                        [q[g * heads_per_group * head_dim : (g + 1) * heads_per_group * head_dim],
                         k[g * head_dim : (g + 1) * head_dim],
                         v[g * head_dim : (g + 1) * head_dim]]
                    )
                    for g in owned
                ]
            )
        else:
            # Fewer groups than ranks: megatron 0.16.1 keeps a contiguous 1/tp slice of the
            # fused rows and all-gathers them in the forward pass.
            rows = fused.shape[0] // tp_size
            expected = fused[rank * rows : (rank + 1) * rows]
        assert torch.equal(shard, expected)
    assert torch.equal(merge_tp(param, shards), fused)


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_fc1_tp_shards_hold_their_gate_and_up_slices(tp_size):
    spec = tiny_spec("llama", num_layers=1)
    param = _param(spec, "linear_fc1.weight")
    gate, up = torch.randn(48, 32), torch.randn(48, 32)
    fused = hf_to_megatron_tensor(param, (gate, up), dims=spec, padded_vocab_size=spec.vocab_size)
    assert torch.equal(fused, torch.cat([gate, up]))
    shards = split_tp(param, fused, tp_size=tp_size)
    rows = 48 // tp_size
    for rank, shard in enumerate(shards):
        assert torch.equal(shard, torch.cat([gate[rank * rows : (rank + 1) * rows], up[rank * rows : (rank + 1) * rows]]))
    assert torch.equal(merge_tp(param, shards), fused)


def test_row_parallel_splits_the_input_dimension():
    spec = tiny_spec("llama", num_layers=1)
    param = _param(spec, "linear_fc2.weight")
    full = torch.randn(32, 48)
    shards = split_tp(param, full, tp_size=2)
    assert [tuple(s.shape) for s in shards] == [(32, 24), (32, 24)]
    assert torch.equal(shards[1], full[:, 24:])


def test_vocab_is_padded_with_zero_rows_and_the_padding_is_dropped_on_export():
    spec = tiny_spec("llama", vocab_size=100, num_layers=1)
    layout = MegatronLayout.build(spec, tp_size=2, make_vocab_size_divisible_by=16)
    assert layout.padded_vocab_size == 128  # ceil(100 / 32) * 32
    param = _param(spec, "output_layer.weight", layout=layout)
    head = torch.randn(100, 32)
    padded = hf_to_megatron_tensor(param, (head,), dims=spec, padded_vocab_size=128)
    assert padded.shape == (128, 32)
    assert torch.equal(padded[:100], head) and not padded[100:].any()
    shards = split_tp(param, padded, tp_size=2)
    assert torch.equal(shards[1], padded[64:])
    trained = padded.clone()
    trained[100:] = 7.0  # padded rows drift in training; export must still drop them
    (exported,) = megatron_to_hf_tensors(param, trained, dims=spec, padded_vocab_size=128)
    assert torch.equal(exported, head)


@pytest.mark.parametrize(
    "vocab, divisible_by, tp, expected",
    [(100, 128, 1, 128), (128, 128, 1, 128), (129, 128, 2, 256), (151936, 128, 8, 152576), (128256, 128, 8, 129024)],
)
def test_padded_vocab_size_is_megatron_lms_rule(vocab, divisible_by, tp, expected):
    # Megatron-LM: after = ceil(orig / (divisible_by * tp)) * (divisible_by * tp).
    assert padded_vocab_size(vocab, make_vocab_size_divisible_by=divisible_by, tp_size=tp) == expected


def test_merging_replicated_shards_refuses_divergent_copies():
    spec = tiny_spec("llama", num_layers=1)
    param = _param(spec, "decoder.final_layernorm.weight")
    norm = torch.randn(32)
    assert merge_tp(param, [norm, norm.clone()]) is norm
    drifted = norm.clone()
    drifted[3] += 1e-6
    with pytest.raises(ValueError, match="differs between TP rank 0 and TP rank 1"):
        merge_tp(param, [norm, drifted])


def test_shape_errors_name_the_tensor():
    spec = tiny_spec("llama", num_layers=1)
    param = _param(spec, "linear_qkv.weight")
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight.*\(8, 32\).*\(16, 32\)"):
        hf_to_megatron_tensor(
            param, (torch.zeros(32, 32), torch.zeros(8, 32), torch.zeros(16, 32)), dims=spec, padded_vocab_size=100
        )
    with pytest.raises(ValueError, match="linear_qkv.weight"):
        megatron_to_hf_tensors(param, torch.zeros(63, 32), dims=spec, padded_vocab_size=100)


@settings(max_examples=40, deadline=None)
@given(
    groups_and_heads=st.sampled_from([(1, 2), (2, 2), (1, 4), (2, 4), (4, 4), (2, 8), (4, 8)]),
    head_dim=st.sampled_from([2, 4]),
    ffn_multiple=st.integers(1, 3),
    tp_size=st.sampled_from([1, 2, 4]),
    tie=st.booleans(),
    family=st.sampled_from(["llama", "qwen2"]),
    vocab_size=st.integers(5, 70),
)
def test_every_tensor_round_trips_exactly_through_megatron_and_tp_shards(
    groups_and_heads, head_dim, ffn_multiple, tp_size, tie, family, vocab_size
):
    groups, heads = groups_and_heads
    if heads % tp_size or (groups % tp_size and tp_size % groups):
        return  # a layout megatron itself rejects
    spec = tiny_spec(
        family,
        tie_embeddings=tie,
        num_query_groups=groups,
        num_attention_heads=heads,
        hidden_size=heads * head_dim,
        ffn_hidden_size=4 * ffn_multiple,
        num_layers=1,
        vocab_size=vocab_size,
    )
    layout = MegatronLayout.build(spec, tp_size=tp_size, make_vocab_size_divisible_by=8)
    state = {name: torch.randn(shape) for name, shape in expected_hf_shapes(spec).items()}
    for param in resolve_params(spec, layout=layout):
        full = hf_to_megatron_tensor(
            param, [state[n] for n in param.hf_names], dims=spec, padded_vocab_size=layout.padded_vocab_size
        )
        merged = merge_tp(param, split_tp(param, full, tp_size=tp_size))
        assert torch.equal(merged, full)
        back = megatron_to_hf_tensors(param, merged, dims=spec, padded_vocab_size=layout.padded_vocab_size)
        for name, tensor in zip(param.hf_names, back):
            assert torch.equal(tensor, state[name]), name


# --- pipeline layer split ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "num_layers, pp, first, last",
    [(4, 1, None, None), (4, 2, None, None), (8, 4, None, None), (7, 3, 1, None), (7, 3, None, 3), (9, 4, 1, 2), (5, 2, 2, 3)],
)
def test_layer_split_agrees_with_megatron(num_layers, pp, first, last):
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    config = TransformerConfig(
        num_layers=num_layers,
        hidden_size=8,
        num_attention_heads=2,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32,
        num_layers_in_first_pipeline_stage=first,
        num_layers_in_last_pipeline_stage=last,
    )
    split = LayerSplit.build(
        num_layers=num_layers, pp_size=pp, num_layers_in_first_stage=first, num_layers_in_last_stage=last
    )
    for pp_rank in range(pp):
        assert split.layers_per_stage[pp_rank] == get_num_layers_to_build(config, pp_rank=pp_rank)
        assert split.offset(pp_rank) == get_transformer_layer_offset(config, pp_rank=pp_rank)
    located = [split.locate(layer) for layer in range(num_layers)]
    assert [split.global_layer(*where) for where in located] == list(range(num_layers))
    assert [rank for rank, _ in located] == sorted(rank for rank, _ in located)


def test_layer_split_rejects_impossible_splits():
    with pytest.raises(ValueError, match="do not divide evenly"):
        LayerSplit.build(num_layers=5, pp_size=2)
    with pytest.raises(ValueError, match="out of range"):
        LayerSplit((2, 2)).locate(4)
    with pytest.raises(ValueError, match="pipeline stage 1"):
        LayerSplit((2, 2)).global_layer(1, 2)


def test_pp_stages_hold_their_layers_embedding_first_and_head_last():
    spec = tiny_spec("llama", tie_embeddings=True, num_layers=4)
    layout = MegatronLayout.build(spec, pp_size=2)
    stage0 = [p.megatron_name for p in resolve_params(spec, layout=layout, pp_rank=0)]
    stage1 = list(resolve_params(spec, layout=layout, pp_rank=1))
    assert stage0[0] == "embedding.word_embeddings.weight"
    assert "decoder.final_layernorm.weight" not in stage0 and "output_layer.weight" not in stage0
    assert stage1[0].megatron_name == "decoder.layers.0.input_layernorm.weight"
    assert stage1[0].hf_names == ("model.layers.2.input_layernorm.weight",)
    # Tied + pp > 1: the last stage holds megatron's copy of the embedding.
    assert stage1[-1].megatron_name == "output_layer.weight"
    assert stage1[-1].hf_names == ("model.embed_tokens.weight",)
    assert stage1[-1].entry.copy_of == "embedding.word_embeddings.weight"
    assert stage1[-1].entry.parallel is Parallel.VOCAB and stage1[-1].entry.transform is Transform.IDENTITY


def test_layout_rejects_tp_sizes_megatron_cannot_shard():
    spec = tiny_spec("llama", num_query_groups=2, num_attention_heads=4)
    with pytest.raises(ValueError, match="num_attention_heads 4 is not divisible by tp_size 8"):
        MegatronLayout.build(spec, tp_size=8)
    with pytest.raises(ValueError, match="ffn_hidden_size 48 is not divisible by tp_size 32"):
        MegatronLayout.build(tiny_spec("llama", num_attention_heads=32, num_query_groups=32, hidden_size=64), tp_size=32)
