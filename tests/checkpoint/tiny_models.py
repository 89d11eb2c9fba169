"""Tiny random Llama/Qwen2/Qwen3 models for the checkpoint tests."""

from __future__ import annotations

from typing import Any

import torch

from pipeline.checkpoint.hf_map import expected_hf_shapes
from pipeline.models.spec import ModelSpec

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def tiny_spec(
    family: str = "llama",
    *,
    tie_embeddings: bool = False,
    num_query_groups: int = 2,
    num_attention_heads: int = 4,
    hidden_size: int = 32,
    ffn_hidden_size: int = 48,
    num_layers: int = 4,
    vocab_size: int = 100,
    **overrides: Any,
) -> ModelSpec:
    """A model small enough to convert in milliseconds; vocab 100 is not a multiple of 128 on purpose.

    Qwen3 gets heads wider than ``hidden_size / num_attention_heads`` unless ``head_dim`` is
    given, as the published Qwen3-4B has (2,560 hidden, 32 heads of 128), so q/o projections
    are not square and a head_dim mix-up changes shapes.
    """
    if family == "qwen3":
        overrides.setdefault("head_dim", 2 * hidden_size // num_attention_heads)
    return ModelSpec(
        family=family,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        ffn_hidden_size=ffn_hidden_size,
        num_layers=num_layers,
        num_attention_heads=num_attention_heads,
        num_query_groups=num_query_groups,
        max_position_embeddings=overrides.pop("max_position_embeddings", 131072),
        qkv_bias=family == "qwen2",
        tie_embeddings=tie_embeddings,
        **overrides,
    )


# (family, tied, query groups): Llama and Qwen2 each tied and untied, GQA and MHA; Qwen3
# tied (as its 0.6B-4B sizes) and untied (8B and up).
SPEC_CASES = [
    ("llama", False, 2),
    ("llama", True, 2),
    ("llama", False, 4),
    ("qwen2", False, 2),
    ("qwen2", True, 1),
    ("qwen2", True, 4),
    ("qwen3", True, 2),
    ("qwen3", False, 4),
]


def spec_case_id(case: tuple[str, bool, int]) -> str:
    family, tied, groups = case
    return f"{family}-{'tied' if tied else 'untied'}-g{groups}"


def random_hf_state(spec: ModelSpec, *, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Every HF tensor of ``spec`` filled with distinct random values (norms and biases too)."""
    generator = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(shape, generator=generator, dtype=torch.float32).to(dtype)
        for name, shape in expected_hf_shapes(spec).items()
    }


def hf_model_class(spec: ModelSpec):
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    return {
        "llama": (LlamaForCausalLM, LlamaConfig),
        "qwen2": (Qwen2ForCausalLM, Qwen2Config),
        "qwen3": (Qwen3ForCausalLM, Qwen3Config),
    }[spec.family]


def build_hf_model(spec: ModelSpec, *, seed: int = 0) -> torch.nn.Module:
    """A transformers model of ``spec`` with random weights, fp32, eval mode, eager attention."""
    model_class, config_class = hf_model_class(spec)
    config = config_class(**spec.to_hf_config())
    config._attn_implementation = "eager"
    # Larger than the usual 0.02 so that logits are O(1) and a wrong RoPE or layout
    # changes them by far more than the parity tolerance.
    config.initializer_range = 0.2
    torch.manual_seed(seed)
    model = model_class(config).eval()
    # Norm weights (Qwen3's per-head q/k norms too) start at one and biases at zero;
    # randomize so every tensor matters.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.1)
    return model


def hf_saved_state(model: torch.nn.Module, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """The tensors ``save_pretrained`` stores: the state dict without the tied head."""
    state = dict(model.state_dict())
    if spec.tie_embeddings:
        del state["lm_head.weight"]
    return state
