"""A Transformer Engine model loads checkpoints of megatron's local layer spec.

TE's norms (the final norm, Qwen3's q/k norms) define ``get_extra_state``, so megatron asks
the checkpoint for their ``…._extra_state`` objects; the converter and CPU runs build the local
spec, whose torch norms have none. Without TE here, the TE side is a local-spec model whose
final norm and q/k norms carry extra state the way TE's ``RMSNorm`` does (``TEStyleRMSNorm``),
which makes megatron's ``sharded_state_dict`` ask for exactly the objects a TE actor asks for.
(TE's attention has extra state too, but megatron's ``TEDotProductAttention`` leaves it out of
the sharded state dict and TE drops it from ``load_state_dict``'s missing keys itself.)
"""

from __future__ import annotations

import copy
import itertools
from pathlib import Path

import pytest
import torch

from pipeline.checkpoint.artifact import WEIGHTS_DIR, load_weights
from pipeline.errors import CheckpointError
from tests.checkpoint.tiny_models import build_hf_model, tiny_spec

LLAMA = tiny_spec("llama", tie_embeddings=False, num_query_groups=2)
QWEN3 = tiny_spec("qwen3", tie_embeddings=True, num_query_groups=2)
# Llama's shapes plus q/k/v biases: a model asking for tensors a Llama checkpoint lacks.
QWEN2_SHAPED_LIKE_LLAMA = tiny_spec("qwen2", tie_embeddings=False, num_query_groups=2)
SPECS = {"llama": LLAMA, "qwen3": QWEN3}


class TEStyleRMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm, built as megatron builds a norm, with extra state as TE's ``RMSNorm`` keeps
    its FP8 metadata: ``get_extra_state`` returns it, ``set_extra_state`` records what a load hands
    back (``received``). Each instance's state differs from every other's."""

    _instances = itertools.count(1)

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused) -> None:
        super().__init__(hidden_size, eps=eps)
        # Stands for TE's serialized metadata (a byte tensor).
        self.own_extra_state = torch.tensor(list(divmod(next(self._instances), 256)), dtype=torch.uint8)
        self.received: list[object] = []

    def kept_its_own_extra_state(self) -> bool:
        """The load handed this module its own extra state back, once."""
        return len(self.received) == 1 and torch.equal(self.received[0], self.own_extra_state)

    def get_extra_state(self) -> torch.Tensor:
        return self.own_extra_state

    def set_extra_state(self, state: object) -> None:
        self.received.append(state)


def _te_style_layer_spec(spec):
    from pipeline.models.layer_spec import LayerSpecChoice, local_layer_spec

    layer = copy.deepcopy(local_layer_spec(qk_layernorm=spec.qk_layernorm))
    attention = layer.submodules.self_attention.submodules
    if spec.qk_layernorm:
        attention.q_layernorm = attention.k_layernorm = TEStyleRMSNorm
    return layer, LayerSpecChoice(name="local", reason="test: TE-style extra state")


def _build_te_style_from_now_on(monkeypatch) -> None:
    """Models and actors built after this call get the TE-style final norm and q/k norms."""
    from pipeline.models import factory
    from pipeline.trainer import actor as actor_module

    monkeypatch.setattr(factory, "final_norm_module", lambda choice: TEStyleRMSNorm)
    monkeypatch.setattr(actor_module, "select_layer_spec", lambda spec, **_: _te_style_layer_spec(spec))


def _te_style_model(spec, monkeypatch) -> torch.nn.Module:
    from pipeline.models.factory import build_gpt_model

    _build_te_style_from_now_on(monkeypatch)
    return build_gpt_model(spec, layer_spec=_te_style_layer_spec(spec), seed=7)


def _extra_state_modules(model: torch.nn.Module) -> dict[str, TEStyleRMSNorm]:
    return {name: module for name, module in model.named_modules() if isinstance(module, TEStyleRMSNorm)}


@pytest.fixture(scope="module")
def converted(tmp_path_factory, megatron_single_rank) -> dict[str, dict[str, Path]]:
    """``winnow convert hf-to-megatron`` of a tiny Llama and a tiny Qwen3 (q/k norms)."""
    from pipeline.checkpoint.convert import hf_to_megatron

    runs = {}
    for name, spec in SPECS.items():
        root = tmp_path_factory.mktemp(name)
        build_hf_model(spec).save_pretrained(root / "hf")
        hf_to_megatron(hf=root / "hf", out=root / "run", verify=False)
        runs[name] = {"hf": root / "hf", "run": root / "run"}
    return runs


@pytest.mark.parametrize("name", list(SPECS))
def test_the_te_style_model_asks_for_extra_states_the_converter_did_not_write(
    converted, megatron_single_rank, monkeypatch, name
):
    from megatron.core.dist_checkpointing import ShardedObject
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    model = _te_style_model(SPECS[name], monkeypatch)
    asked = {v.key for v in model.sharded_state_dict().values() if isinstance(v, ShardedObject)}
    te_only = {"decoder.final_layernorm._extra_state"}
    if name == "qwen3":
        te_only |= {"decoder.layers.self_attention.q_layernorm._extra_state",
                    "decoder.layers.self_attention.k_layernorm._extra_state"}
    assert te_only <= asked
    weights = converted[name]["run"] / "step_00000000" / WEIGHTS_DIR
    saved = {entry.key for entry in load_sharded_metadata(str(weights)).values()}
    assert not te_only & saved
    assert "decoder.layers.self_attention.linear_qkv._extra_state" in saved  # the local linears write theirs


@pytest.mark.parametrize("name", list(SPECS))
def test_a_te_style_model_loads_the_converted_checkpoint_exactly(converted, megatron_single_rank, monkeypatch, name):
    from pipeline.checkpoint.convert import hf_to_megatron_state
    from pipeline.checkpoint.hf_io import HFCheckpointReader
    from pipeline.checkpoint.hf_map import MegatronLayout

    spec = SPECS[name]
    expected = dict(hf_to_megatron_state(dict(HFCheckpointReader.open(converted[name]["hf"]).iter_tensors()),
                                         spec=spec, layout=MegatronLayout.build(spec)))
    model = _te_style_model(spec, monkeypatch)
    load_weights(converted[name]["run"], model)
    parameters = dict(model.named_parameters())
    assert sorted(parameters) == sorted(expected)
    for key, tensor in expected.items():
        assert torch.equal(parameters[key], tensor), key
    # Each module got its own extra state back, once: it keeps what it had.
    modules = _extra_state_modules(model)
    assert len(modules) == 1 + (2 * spec.num_layers if spec.qk_layernorm else 0)
    for module_name, module in modules.items():
        assert module.kept_its_own_extra_state(), (module_name, module.received)


def test_a_weight_the_checkpoint_lacks_still_fails_naming_it(converted, megatron_single_rank, monkeypatch):
    # A Qwen2-shaped model (q/k/v biases) from the Llama checkpoint: the biases are missing
    # beside the TE-style extra states, and only the extra states may be missing.
    model = _te_style_model(QWEN2_SHAPED_LIKE_LLAMA, monkeypatch)
    with pytest.raises(CheckpointError, match=r"cannot load the model weights .*linear_qkv\.bias"):
        load_weights(converted["llama"]["run"], model)


def test_a_te_style_actor_resumes_from_a_local_actors_training_checkpoint(tmp_path, megatron_single_rank,
                                                                         monkeypatch):
    from pipeline.checkpoint.manager import CheckpointManager
    from pipeline.trainer.losses import CrossEntropyLoss
    from tests.trainer.test_actor import _actor, _batch

    batch, loss = _batch(), CrossEntropyLoss()
    local = _actor(1, 1, micro_batch_tokens=10_000, context=megatron_single_rank)
    assert not _extra_state_modules(local.module)
    local.train_step(batch, loss)
    manager = CheckpointManager(tmp_path / "run", keep_last=1)
    manager.save(1, actor=local, state={"data_position": 5})

    _build_te_style_from_now_on(monkeypatch)
    te_style = _actor(1, 1, micro_batch_tokens=10_000, context=megatron_single_rank)
    assert _extra_state_modules(te_style.module)
    with torch.no_grad():  # the weights must come from the checkpoint
        for parameter in te_style.module.parameters():
            parameter.add_(1.0)
    loaded = manager.load(manager.newest_valid(), actor=te_style)
    assert loaded.step == 1 and loaded.state == {"data_position": 5}
    weights = {k: v for k, v in te_style.module.state_dict().items() if not k.endswith("_extra_state")}
    for key, tensor in local.module.state_dict().items():
        if not key.endswith("_extra_state"):
            assert torch.equal(weights[key], tensor), key
    for module_name, module in _extra_state_modules(te_style.module).items():
        assert module.kept_its_own_extra_state(), (module_name, module.received)
    # The optimizer state came along: the next step is the local actor's next step.
    assert te_style.train_step(batch, loss).loss == local.train_step(batch, loss).loss
