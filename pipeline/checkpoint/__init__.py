"""winnow checkpoints on disk and Hugging Face ⇄ megatron-core conversion.

* ``artifact``: what a checkpoint on disk is: ``resolve_checkpoint``, manifest and
  ``checkpoint_spec``, the tokenizer lookup, ``is_hf_folder``, ``load_weights``.
* ``manager``: ``CheckpointManager``, atomic and resharding training checkpoints with exact resume.
* ``hf_map``: ``PARAM_MAP`` (one table for both directions), TP split/merge, PP layer split.
* ``hf_io``: ``HFCheckpointReader`` (validated, tensor-by-tensor) and ``write_hf_checkpoint``
  (sharded, atomic).
* ``convert``: streaming ``hf_to_megatron_state`` / ``megatron_to_hf_state``, and the whole-checkpoint
  conversions ``hf_to_megatron`` / ``megatron_to_hf`` (``winnow convert``).
* ``gate``: the logit verification gate every conversion passes.
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
