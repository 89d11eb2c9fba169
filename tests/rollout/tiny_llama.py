"""Tiny random Llama models and prompts for the local-engine tests (no hub access)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 100


def tiny_llama(
    *,
    seed: int = 0,
    eos_token_id: int | None = None,
    tie_word_embeddings: bool = False,
    max_position_embeddings: int = 128,
    num_layers: int = 2,
    hidden_size: int = 64,
    init_std: float = 0.4,
) -> LlamaForCausalLM:
    """A float32 Llama with peaked next-token distributions (``init_std`` well above the
    default 0.02), so greedy decoding has no near-ties and sampling is not uniform."""
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=0,
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=init_std,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = eos_token_id
    model.generation_config.pad_token_id = 0
    return model


def ragged_prompts(num_prompts: int, *, seed: int = 1, min_len: int = 3, max_len: int = 12) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (num_prompts,), generator=generator).tolist()
    return [torch.randint(1, VOCAB, (n,), generator=generator).tolist() for n in lengths]
