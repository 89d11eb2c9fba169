"""pipeline.models.layout against the independent oracle of tests/oracles/sharding.py.

Pure tensor reshapes on tiny models, at TP = 1, 2, 4 and PP = 1, 2 with a padded
vocabulary: both production paths that use the layout (HF conversion through
``hf_map`` and the actor's ``shard_full_state_dict``) must give every rank exactly the
tensors the oracle gives it. The oracle's partition table is checked against the marks
of a real megatron model in tests/models/test_gpt_factory.py.
"""

from __future__ import annotations

import pytest
import torch

from pipeline.checkpoint import hf_map
from pipeline.models import layout
from tests.checkpoint.tiny_models import SPEC_CASES, spec_case_id, tiny_spec
from tests.oracles import sharding as oracle

TP_SIZES = (1, 2, 4)
PP_SIZES = (1, 2)
DIVISIBLE_BY = 8  # vocab 100 pads to 104, 112, 128 at TP = 1, 2, 4


def _random_hf_state(spec) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=generator) for name, shape in hf_map.expected_hf_shapes(spec).items()}


@pytest.mark.parametrize("tp_size", TP_SIZES)
@pytest.mark.parametrize("dim, stride", [(None, 1), (0, 1), (1, 1), (0, 2), (1, 2)])
def test_tp_split_and_merge_match_the_oracle(tp_size, dim, stride):
    full = torch.randn(16, 24)
    partition = layout.TPPartition(dim, stride)
    shards = layout.split_tp(full, partition=partition, tp_size=tp_size)
    for tp_rank, shard in enumerate(shards):
        expected = oracle.tp_shard(full, dim=dim, stride=stride, tp_rank=tp_rank, tp_size=tp_size)
        assert torch.equal(shard, expected)
        assert torch.equal(layout.shard_tp(full, partition=partition, tp_rank=tp_rank, tp_size=tp_size), expected)
        assert tuple(shard.shape) == layout.tp_shard_shape(full.shape, partition=partition, tp_size=tp_size)
    assert torch.equal(layout.merge_tp(shards, partition=partition), full)


def test_tp_split_refuses_blocks_that_do_not_divide():
    with pytest.raises(ValueError, match="fc1: block size 3 .* not divisible by tp_size 2"):
        layout.split_tp(torch.zeros(6, 4), partition=layout.TPPartition(0, 2), tp_size=2, name="fc1")


@pytest.mark.parametrize("tp_size", TP_SIZES)
@pytest.mark.parametrize("divisible_by", [1, 8, 128])
def test_padded_vocab_size_matches_the_oracle(tp_size, divisible_by):
    for vocab_size in range(1, 600, 7):
        expected = oracle.padded_vocab_size(vocab_size, make_vocab_size_divisible_by=divisible_by, tp_size=tp_size)
        actual = layout.padded_vocab_size(vocab_size, make_vocab_size_divisible_by=divisible_by, tp_size=tp_size)
        assert actual == expected, vocab_size


def test_vocab_padding_is_zero_rows_and_unpadding_drops_them():
    table = torch.randn(100, 8)
    padded = layout.pad_vocab(table, padded_vocab_size=128)
    assert torch.equal(padded[:100], table) and not padded[100:].any()
    assert torch.equal(layout.unpad_vocab(padded, vocab_size=100), table)
    assert layout.pad_vocab(table, padded_vocab_size=100) is table
    with pytest.raises(ValueError, match="padded_vocab_size 64 < vocab_size 100"):
        layout.pad_vocab(table, padded_vocab_size=64)


@pytest.mark.parametrize("pp_size", [1, 2, 4])
def test_layer_split_matches_the_oracle(pp_size):
    split = layout.LayerSplit.build(num_layers=8, pp_size=pp_size)
    for pp_rank in range(pp_size):
        layers = oracle.stage_layers(num_layers=8, pp_size=pp_size, pp_rank=pp_rank)
        assert list(range(split.offset(pp_rank), split.offset(pp_rank) + split.layers_per_stage[pp_rank])) == layers
        assert [split.global_layer(pp_rank, local) for local in range(len(layers))] == layers


def _grid():
    for case in SPEC_CASES:
        for tp_size in TP_SIZES:
            for pp_size in PP_SIZES:
                yield pytest.param(case, tp_size, pp_size, id=f"{spec_case_id(case)}-tp{tp_size}-pp{pp_size}")


def _spec_and_layout(case, *, tp_size: int, pp_size: int):
    family, tied, groups = case
    spec = tiny_spec(family, tie_embeddings=tied, num_query_groups=groups, num_layers=4, vocab_size=100)
    return spec, layout.MegatronLayout.build(
        spec, tp_size=tp_size, pp_size=pp_size, make_vocab_size_divisible_by=DIVISIBLE_BY
    )


def _oracle_full_state(spec, hf_state, *, tp_size: int) -> dict[str, torch.Tensor]:
    padded = oracle.padded_vocab_size(spec.vocab_size, make_vocab_size_divisible_by=DIVISIBLE_BY, tp_size=tp_size)
    state = oracle.megatron_full_state(hf_state, dims=spec, padded_vocab_size=padded)
    if spec.qk_layernorm:  # Qwen3's per-head norms: copied as they are, replicated over TP (the oracle's default)
        for layer in range(spec.num_layers):
            for hf_name, name in (("q_norm", "q_layernorm"), ("k_norm", "k_layernorm")):
                state[f"decoder.layers.{layer}.self_attention.{name}.weight"] = (
                    hf_state[f"model.layers.{layer}.self_attn.{hf_name}.weight"])
    return state


def _oracle_shard(spec, full_state, *, tp_rank: int, tp_size: int, pp_rank: int, pp_size: int):
    return oracle.stage_shard(
        full_state,
        num_layers=spec.num_layers,
        tie_embeddings=spec.tie_embeddings,
        pp_rank=pp_rank,
        pp_size=pp_size,
        tp_rank=tp_rank,
        tp_size=tp_size,
    )


def _assert_same_state(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(actual) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(actual[name], tensor), name


@pytest.mark.parametrize("case, tp_size, pp_size", _grid())
def test_hf_conversion_shards_match_the_oracle(case, tp_size, pp_size):
    spec, megatron_layout = _spec_and_layout(case, tp_size=tp_size, pp_size=pp_size)
    hf_state = _random_hf_state(spec)
    full_state = _oracle_full_state(spec, hf_state, tp_size=tp_size)
    for pp_rank in range(pp_size):
        params = list(hf_map.resolve_params(spec, layout=megatron_layout, pp_rank=pp_rank))
        shards_by_rank = [{} for _ in range(tp_size)]
        for param in params:
            full = hf_map.hf_to_megatron_tensor(
                param,
                [hf_state[name] for name in param.hf_names],
                dims=spec,
                padded_vocab_size=megatron_layout.padded_vocab_size,
            )
            for tp_rank, shard in enumerate(hf_map.split_tp(param, full, tp_size=tp_size)):
                shards_by_rank[tp_rank][param.megatron_name] = shard
            merged = hf_map.merge_tp(param, [shards[param.megatron_name] for shards in shards_by_rank])
            assert torch.equal(merged, full)
        for tp_rank, shards in enumerate(shards_by_rank):
            expected = _oracle_shard(
                spec, full_state, tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size
            )
            _assert_same_state(shards, expected)
            assert {name: tuple(t.shape) for name, t in shards.items()} == hf_map.expected_megatron_shapes(
                spec, layout=megatron_layout, pp_rank=pp_rank
            )


class _FakeStage(torch.nn.Module):
    """Parameters named, shaped and partition-marked like one rank of a local-spec GPTModel stage."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], *, global_layers: list[int], tied: bool):
        super().__init__()
        self.share_embeddings_and_output_weights = tied
        self.decoder = torch.nn.Module()
        self.decoder.layers = torch.nn.ModuleList(torch.nn.Module() for _ in global_layers)
        for layer, global_layer in zip(self.decoder.layers, global_layers):
            layer.layer_number = global_layer + 1  # megatron numbers layers from 1 across stages
        for name, shape in shapes.items():
            *path, leaf = name.split(".")
            module = self
            for part in path:
                if not hasattr(module, part):
                    module.add_module(part, torch.nn.Module())
                module = getattr(module, part)
            parameter = torch.nn.Parameter(torch.empty(shape))
            dim, stride = oracle.partition_of(name)
            if dim is not None:
                parameter.tensor_model_parallel, parameter.partition_dim, parameter.partition_stride = True, dim, stride
            module.register_parameter(leaf, parameter)


@pytest.mark.parametrize("case, tp_size, pp_size", _grid())
def test_actor_shard_full_state_dict_matches_the_oracle(case, tp_size, pp_size):
    spec, _ = _spec_and_layout(case, tp_size=tp_size, pp_size=pp_size)
    full_state = _oracle_full_state(spec, _random_hf_state(spec), tp_size=tp_size)
    for pp_rank in range(pp_size):
        global_layers = oracle.stage_layers(num_layers=spec.num_layers, pp_size=pp_size, pp_rank=pp_rank)
        for tp_rank in range(tp_size):
            expected = _oracle_shard(
                spec, full_state, tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size
            )
            model = _FakeStage(
                {name: tuple(t.shape) for name, t in expected.items()},
                global_layers=global_layers,
                tied=spec.tie_embeddings,
            )
            actual = layout.shard_full_state_dict(model, full_state, tp_rank=tp_rank, tp_size=tp_size)
            _assert_same_state(actual, expected)
            for name, _ in model.named_parameters():
                assert layout.global_parameter_name(model, name) == oracle.global_parameter_name(model, name)
