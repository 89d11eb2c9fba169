"""Hugging Face ⇄ megatron-core checkpoints: the name/shape map, conversion, HF folder I/O.

* ``hf_map``: ``PARAM_MAP`` (one table for both directions), TP split/merge, PP layer split.
* ``convert``: streaming ``hf_to_megatron_state`` / ``megatron_to_hf_state``.
* ``hf_io``: ``HFCheckpointReader`` (validated, tensor-by-tensor) and ``write_hf_checkpoint``
  (sharded, atomic).
"""

from pipeline.checkpoint.convert import copy_into_model, hf_to_megatron_state, megatron_to_hf_state
from pipeline.checkpoint.hf_io import CheckpointError, HFCheckpointReader, write_hf_checkpoint
from pipeline.checkpoint.hf_map import LayerSplit, MegatronLayout, padded_vocab_size

__all__ = [
    "CheckpointError",
    "HFCheckpointReader",
    "LayerSplit",
    "MegatronLayout",
    "copy_into_model",
    "hf_to_megatron_state",
    "megatron_to_hf_state",
    "padded_vocab_size",
    "write_hf_checkpoint",
]
