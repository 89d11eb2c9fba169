"""The model families winnow builds, one row each: everything that differs between Llama, Qwen2 and Qwen3.

Every module that needs a per-family fact reads it from ``FAMILIES`` (or ``model_family``)
instead of testing a family's name: the ``config.json`` reader and writer
(``pipeline.models.spec``), the Hugging Face folder reader (``pipeline.checkpoint.hf_io``), the
planner (``pipeline.launch.plan``, through ``ModelSpec``), the bootstrap policy
(``pipeline.stages.bootstrap``) and the rehearsal's stand-in tokenizer. What a row holds and what
else a new family needs: ``docs/model-families.md``.

All three families are the same megatron ``GPTModel`` (pre-norm RMSNorm, RoPE, grouped-query
attention, SwiGLU); a row only switches the parts megatron exposes as flags (``add_qkv_bias``,
``qk_layernorm``) and records how Hugging Face spells and defaults the family's config.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal, Mapping

__all__ = ["FAMILIES", "Family", "ModelFamily", "model_family"]

# The names ModelSpec.family may take; a test checks it lists exactly the rows of FAMILIES.
Family = Literal["llama", "qwen2", "qwen3"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelFamily:
    """One decoder family: its Hugging Face names, its architecture switches and its config defaults.

    ``hf_defaults``: the values the family's transformers config class assumes for keys a
    ``config.json`` may leave out (a test compares them with transformers). ``head_dim`` None
    means ``hidden_size // num_attention_heads``.

    ``unsupported_switches``: Hugging Face config keys that, when true, add something the megatron
    model winnow builds does not have, each with what it would add. The reader refuses a config
    that sets one (naming the key); the writer writes each as false.

    ``tokenizer_fixture``: the folder under ``pipeline/models/published/tokenizers`` holding the
    family's small stand-in tokenizer (real special tokens and chat template), with the family's
    ``bos_token`` and its stop tokens ``eos_tokens`` (the first one when a config names a single
    ``eos_token_id``).
    """

    model_type: str  # config.json "model_type", and ModelSpec.family
    architecture: str  # config.json "architectures" entry: the transformers *ForCausalLM class
    qkv_bias: bool  # q, k and v projections carry a bias (o_proj never): megatron's add_qkv_bias
    qk_norm: bool  # an RMSNorm over every query and key head before RoPE: megatron's qk_layernorm
    hf_defaults: Mapping[str, Any]
    unsupported_switches: Mapping[str, str]
    tokenizer_fixture: str
    bos_token: str
    eos_tokens: tuple[str, ...]


def _transformers_defaults(*, max_position_embeddings: int, head_dim: int | None = None) -> Mapping[str, Any]:
    # The class defaults LlamaConfig, Qwen2Config and Qwen3Config share; positions and head_dim differ.
    return MappingProxyType({
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "head_dim": head_dim,
    })


# What each switch adds. attention_bias biases o_proj as well as q/k/v, which megatron's
# add_qkv_bias does not model (Qwen2 has no such key: its q/k/v biases are always on, o_proj never).
_ATTENTION_BIAS = "biased q/k/v/o projections"
_MLP_BIAS = "biased MLP projections"
_SLIDING_WINDOW = "sliding-window attention"

_LLAMA3_TOKENS = {"tokenizer_fixture": "llama3", "bos_token": "<|begin_of_text|>",
                  "eos_tokens": ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")}
# Qwen3 keeps Qwen2.5's vocabulary and chat tokens.
_QWEN25_TOKENS = {"tokenizer_fixture": "qwen2_5", "bos_token": "<|endoftext|>", "eos_tokens": ("<|im_end|>",)}

FAMILIES: Mapping[str, ModelFamily] = MappingProxyType({family.model_type: family for family in (
    ModelFamily(
        model_type="llama", architecture="LlamaForCausalLM", qkv_bias=False, qk_norm=False,
        hf_defaults=_transformers_defaults(max_position_embeddings=2048),
        unsupported_switches=MappingProxyType({"attention_bias": _ATTENTION_BIAS, "mlp_bias": _MLP_BIAS}),
        **_LLAMA3_TOKENS,
    ),
    ModelFamily(
        model_type="qwen2", architecture="Qwen2ForCausalLM", qkv_bias=True, qk_norm=False,
        hf_defaults=_transformers_defaults(max_position_embeddings=32768),
        unsupported_switches=MappingProxyType({"use_sliding_window": _SLIDING_WINDOW}),
        **_QWEN25_TOKENS,
    ),
    # Qwen2 without the q/k/v biases plus per-head q/k RMSNorm; head_dim is its own (128 by default,
    # not hidden_size / num_attention_heads).
    ModelFamily(
        model_type="qwen3", architecture="Qwen3ForCausalLM", qkv_bias=False, qk_norm=True,
        hf_defaults=_transformers_defaults(max_position_embeddings=32768, head_dim=128),
        unsupported_switches=MappingProxyType({"attention_bias": _ATTENTION_BIAS,
                                               "use_sliding_window": _SLIDING_WINDOW}),
        **_QWEN25_TOKENS,
    ),
)})


def model_family(name: Any, *, field: str = "model_type") -> ModelFamily:
    """The row of ``name``; a ``ValueError`` naming ``field`` and the supported families otherwise."""
    family = FAMILIES.get(name) if isinstance(name, str) else None
    if family is None:
        raise ValueError(f"{field}: expected one of {sorted(FAMILIES)}, got {name!r}")
    return family
