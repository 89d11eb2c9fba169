"""Weight sync from a Transformer Engine actor: its state dict carries TE names, the map must follow.

The TE spec cannot be built on a CPU, so the TE state dict is made from the fixture
``tests/models/te_names.py`` (the names TE 2.11 and megatron-core 0.16.1 give each
module) with a real local model's tensors. The fixture itself is checked against
megatron's own local→TE renaming of the local spec (``sharded_state_dict_keys_map``).
"""

from __future__ import annotations

import types

import pytest
import torch

from pipeline.models.factory import build_gpt_model
from pipeline.models.layer_spec import LayerSpecChoice, local_layer_spec
from pipeline.models.spec import ModelSpec
from pipeline.rollout.weight_sync import actor_hf_state
from tests.distributed_utils import one_rank_context
from tests.models.te_names import te_state_dict_names

SPECS = {
    "llama-untied": ModelSpec(family="llama", vocab_size=64, hidden_size=32, ffn_hidden_size=64, num_layers=2,
                              num_attention_heads=4, num_query_groups=2, max_position_embeddings=64),
    "qwen2-tied-qkv-bias": ModelSpec(family="qwen2", vocab_size=64, hidden_size=32, ffn_hidden_size=64, num_layers=2,
                                     num_attention_heads=4, num_query_groups=2, max_position_embeddings=64,
                                     qkv_bias=True, tie_embeddings=True),
}


@pytest.fixture(scope="module")
def context():
    with one_rank_context() as ctx:
        yield ctx


def _to_te_name(name: str) -> str:
    """megatron's own renaming of local-spec keys to TE-spec keys (used for distributed checkpoints)."""
    for local, te in local_layer_spec().submodules.sharded_state_dict_keys_map.items():
        marker = f".{local}"
        if marker in name:
            return name.replace(marker, f".{te}", 1)
    return name


def _fake_actor(spec: ModelSpec, state: dict[str, object], layer_spec: str):
    return types.SimpleNamespace(
        spec=spec,
        context=types.SimpleNamespace(rank=0, world_size=1, tensor_parallel=1, pipeline_parallel=1, tp_rank=0,
                                      pp_rank=0, dp_rank=0, cp_rank=0, device=torch.device("cpu")),
        module=types.SimpleNamespace(state_dict=lambda: state),
        layer_spec_choice=LayerSpecChoice(name=layer_spec, reason="test"),
    )


@pytest.mark.parametrize("name", sorted(SPECS))
def test_te_named_state_dict_syncs_like_the_local_one(context, name):
    spec = SPECS[name]
    local_state = build_gpt_model(spec, parallel_context=context, seed=0).state_dict()
    local_params = {k: v for k, v in local_state.items() if not k.endswith("_extra_state")}

    fixture = te_state_dict_names(num_layers=spec.num_layers, qkv_bias=spec.qkv_bias, tied=spec.tie_embeddings)
    fixture_params = [n for n in fixture if not n.endswith("_extra_state")]
    renamed = {_to_te_name(k): v for k, v in local_params.items()}
    assert sorted(renamed) == sorted(fixture_params), "the fixture disagrees with megatron's local→TE renaming"
    # Where megatron's own modules are the same in both specs, so are their extra states.
    shared = {"output_layer._extra_state"}
    assert shared <= set(local_state) and shared <= set(fixture)

    # The TE actor's state dict: exactly the fixture's keys, TE's serialized FP8 metadata included.
    te_state = {n: renamed[n] if n in renamed else torch.zeros(8, dtype=torch.uint8) for n in fixture}
    expected = dict(actor_hf_state(_fake_actor(spec, local_state, "local")))
    synced = dict(actor_hf_state(_fake_actor(spec, te_state, "te")))
    assert list(synced) == list(expected) and expected
    for hf_name, tensor in expected.items():
        assert torch.equal(synced[hf_name], tensor), hf_name

    # What the first sync of a TE actor did before the map followed the layer spec.
    with pytest.raises(ValueError, match="does not match the model"):
        dict(actor_hf_state(_fake_actor(spec, te_state, "local")))
