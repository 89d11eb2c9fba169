"""Model architecture and the megatron ``GPTModel`` factory.

* ``spec``: ``ModelSpec`` (Llama/Qwen2/Qwen3 architecture) <-> Hugging Face ``config.json``.
* ``families``: ``FAMILIES``, one ``ModelFamily`` row per family (Hugging Face names, biases,
  q/k norms, config defaults), read wherever a family's facts are needed.
* ``layer_spec``: ``select_layer_spec`` (Transformer Engine/FP8 or megatron's local
  modules), ``LayerSpecChoice``, ``FP8Options``.
* ``factory``: ``build_transformer_config``, ``build_gpt_model``.
* ``layout``: the TP/PP/vocabulary layout, written once (``MegatronLayout``,
  ``LayerSplit``, ``split_tp``/``merge_tp``, vocabulary padding, fused q/k/v and
  gate/up rows) and ``shard_full_state_dict`` (a full state dict -> one TP/PP rank's shard).

Only ``ModelSpec`` is imported eagerly; the rest load on first attribute access
(all but ``layout`` import megatron-core, which takes seconds).
"""

from __future__ import annotations

import importlib
from typing import Any

from pipeline.models.spec import ModelSpec

_LAZY_EXPORTS = {
    "FP8Options": "pipeline.models.layer_spec",
    "LayerSpecChoice": "pipeline.models.layer_spec",
    "select_layer_spec": "pipeline.models.layer_spec",
    "build_gpt_model": "pipeline.models.factory",
    "build_transformer_config": "pipeline.models.factory",
    "shard_full_state_dict": "pipeline.models.layout",
}

__all__ = ["ModelSpec", *_LAZY_EXPORTS]


def __getattr__(name: str) -> Any:
    if name not in _LAZY_EXPORTS:
        raise AttributeError(f"module 'pipeline.models' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY_EXPORTS[name]), name)
