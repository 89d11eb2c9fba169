"""Fixture: the ``state_dict()`` names of a megatron-core 0.16.1 ``GPTModel`` built with the TE layer spec.

``get_gpt_layer_with_transformer_engine_spec(qk_layernorm=False)`` (what
``pipeline.models.layer_spec.te_layer_spec`` returns) cannot be built without
Transformer Engine, so the names are written down here from the sources, one module
at a time, with TE 2.11 (the newest release megatron-core 0.16.1 accepts, < 2.12):

* ``input_layernorm`` / ``pre_mlp_layernorm`` are ``IdentityOp``: the norms live in
  the next linear, ``TELayerNormColumnParallelLinear`` → ``te.pytorch.LayerNormLinear``,
  which registers ``layer_norm_weight`` and, for ``normalization="RMSNorm"``, no
  ``layer_norm_bias`` (``module/layernorm_linear.py``).
* ``te.pytorch.Linear`` / ``LayerNormLinear`` register ``weight`` and, only with
  ``bias=True``, ``bias``; with ``bias=False`` the empty bias is a plain attribute, not
  in the state dict. megatron passes ``bias=add_qkv_bias`` to ``linear_qkv`` and
  ``add_bias_linear=False`` to the others.
* Every TE module adds ``_extra_state`` (its FP8 metadata; ``get_extra_state`` in
  ``module/base.py``); ``TEDotProductAttention`` has nothing else (vanilla softmax:
  no ``softmax_offset``); the final ``TENorm`` is ``te.pytorch.RMSNorm`` (``weight``
  and, as an ops ``BasicOperation``, ``_extra_state``).
* The embedding and the output layer are megatron's own modules, as in the local
  spec; megatron's ``ColumnParallelLinear`` also reports an ``_extra_state`` (None).

``tests/models/test_te_names.py`` checks these names against the local spec's
``sharded_state_dict_keys_map`` (megatron's own local→TE renaming for checkpoints)
and converts a state dict carrying exactly these names to Hugging Face.
"""

from __future__ import annotations

TE_LAYER_PARAMS: tuple[str, ...] = (
    "self_attention.linear_qkv.layer_norm_weight",
    "self_attention.linear_qkv.weight",
    "self_attention.linear_proj.weight",
    "mlp.linear_fc1.layer_norm_weight",
    "mlp.linear_fc1.weight",
    "mlp.linear_fc2.weight",
)
TE_LAYER_QKV_BIAS: tuple[str, ...] = ("self_attention.linear_qkv.bias",)
TE_LAYER_EXTRA_STATE: tuple[str, ...] = (
    "self_attention.linear_qkv._extra_state",
    "self_attention.core_attention._extra_state",
    "self_attention.linear_proj._extra_state",
    "mlp.linear_fc1._extra_state",
    "mlp.linear_fc2._extra_state",
)
TE_FIRST_STAGE: tuple[str, ...] = ("embedding.word_embeddings.weight",)
# The output layer exists with tied embeddings too (without a weight of its own).
TE_LAST_STAGE: tuple[str, ...] = (
    "decoder.final_layernorm.weight", "decoder.final_layernorm._extra_state", "output_layer._extra_state",
)
TE_UNTIED_OUTPUT: tuple[str, ...] = ("output_layer.weight",)


def te_state_dict_names(*, num_layers: int, qkv_bias: bool, tied: bool) -> list[str]:
    """Every key of a one-stage TE ``GPTModel.state_dict()`` (``_extra_state`` included)."""
    per_layer = TE_LAYER_PARAMS + (TE_LAYER_QKV_BIAS if qkv_bias else ()) + TE_LAYER_EXTRA_STATE
    names = list(TE_FIRST_STAGE)
    names += [f"decoder.layers.{layer}.{name}" for layer in range(num_layers) for name in per_layer]
    names += list(TE_LAST_STAGE)
    if not tied:
        names += list(TE_UNTIED_OUTPUT)
    return names
