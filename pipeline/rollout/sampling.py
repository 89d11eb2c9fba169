"""One decoding step: draw the next token of every row and report its log-probability.

``sample_next_tokens`` is a pure tensor function shared by the local engine and its
tests. For logits ``z`` (one row per sequence) and temperature ``T > 0``:

    log π_T(v) = z_v / T − logsumexp(z / T)                (reported, full vocabulary)
    keep(v)    = mass of the tokens ranked above v under π_T ≤ top_p   (nucleus)
    token      = argmax_v [ log π_T(v) + g_v ]  over kept v,  g_v ~ Gumbel(0, 1)

The Gumbel-max draw is an exact sample from ``π_T`` renormalised over the kept set;
``g = −log E`` with ``E ~ Exp(1)`` drawn from the caller's ``torch.Generator``, so a
seeded generator makes the step deterministic. The nucleus rule is SGLang's
(``top_k_top_p_min_p_sampling_from_probs_torch`` zeroes a token when
``cumsum − p > top_p``), so ``top_p = 1`` keeps every token even when float32 sums
reach 1 early. Ties in the sort are broken by token id (stable sort) so the kept set
does not depend on the sort implementation.

``T == 0`` is greedy: ``argmax z`` (the lowest id among exact ties, as ``torch.argmax``
and ``transformers`` do), and the reported log-probability is of ``softmax(z)``.
"""

from __future__ import annotations

import torch

__all__ = ["nucleus_mask", "sample_next_tokens"]


def nucleus_mask(logprobs: torch.Tensor, top_p: float) -> torch.Tensor:
    """``(B, V)`` bool: tokens kept by nucleus sampling of the rows of ``logprobs`` ``(B, V)``."""
    if not (0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must lie in (0, 1], got {top_p}")
    sorted_logprobs, order = torch.sort(logprobs, dim=-1, descending=True, stable=True)
    sorted_probs = sorted_logprobs.exp()
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # (B, V) exclusive prefix sums
    keep_sorted = mass_before <= top_p
    return torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)


def sample_next_tokens(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of ``logits`` ``(B, V)``; return ``(tokens (B,) int64, logprobs (B,) float32)``.

    See the module docstring for the math. Logits are promoted to float32 first, so
    the reported log-probabilities are float32 whatever the model dtype.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be (B, V), got shape {tuple(logits.shape)}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    logits = logits.float()
    if temperature == 0:
        tokens = logits.argmax(dim=-1)
        logprobs = torch.log_softmax(logits, dim=-1)
        return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)

    logprobs = torch.log_softmax(logits / temperature, dim=-1)  # (B, V)
    exponential = torch.empty_like(logprobs).exponential_(generator=generator)
    # exponential_ may return exactly 0 in float32; −log 0 would force that token.
    scores = logprobs - exponential.clamp_min_(torch.finfo(torch.float32).tiny).log_()
    if top_p < 1.0:
        scores = scores.masked_fill_(~nucleus_mask(logprobs, top_p), float("-inf"))
    tokens = scores.argmax(dim=-1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)
