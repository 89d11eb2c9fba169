"""sample_next_tokens / nucleus_mask against loop references and the sampling distribution."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.rollout.sampling import nucleus_mask, sample_next_tokens


def _nucleus_reference(probs: list[float], top_p: float) -> list[bool]:
    """SGLang's rule written as a loop: walk tokens by descending probability (ties by id),
    keep a token while the mass before it is ≤ top_p."""
    order = sorted(range(len(probs)), key=lambda v: (-probs[v], v))
    keep = [False] * len(probs)
    mass_before = 0.0
    for v in order:
        keep[v] = mass_before <= top_p
        mass_before += probs[v]
    return keep


def test_nucleus_hand_case() -> None:
    # p = [0.1, 0.5, 0.15, 0.25]; by rank: 0.5 (id 1), 0.25 (id 3), 0.15 (id 2), 0.1 (id 0)
    # mass before each:                   0.0        0.5         0.75        0.9
    logprobs = torch.tensor([[0.1, 0.5, 0.15, 0.25]]).log()
    assert nucleus_mask(logprobs, 0.4).tolist() == [[False, True, False, False]]
    assert nucleus_mask(logprobs, 0.6).tolist() == [[False, True, False, True]]
    assert nucleus_mask(logprobs, 0.8).tolist() == [[False, True, True, True]]
    assert nucleus_mask(logprobs, 1.0).tolist() == [[True, True, True, True]]


def test_nucleus_matches_loop_reference() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 50, generator=generator, dtype=torch.float64) * 3
    logprobs = torch.log_softmax(logits, dim=-1)
    for top_p in (0.05, 0.3, 0.7, 0.95, 1.0):
        got = nucleus_mask(logprobs, top_p)
        expected = [_nucleus_reference(row.exp().tolist(), top_p) for row in logprobs]
        assert got.tolist() == expected


def test_top_p_one_keeps_tokens_whose_float32_prefix_sum_reaches_one() -> None:
    logits = torch.tensor([[40.0, 0.0, -5.0, -30.0]])  # the head alone rounds to mass 1.0 in float32
    assert nucleus_mask(torch.log_softmax(logits, -1), 1.0).all()


def test_greedy_takes_argmax_and_reports_untempered_logprob() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, -1.0, 3.0]])  # row 2: a tie, lowest id wins
    tokens, logprobs = sample_next_tokens(logits, temperature=0.0)
    assert tokens.tolist() == [1, 0]
    expected = torch.log_softmax(logits, dim=-1)[[0, 1], [1, 0]]
    torch.testing.assert_close(logprobs, expected)


def test_reported_logprobs_are_of_the_temperature_scaled_full_distribution() -> None:
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(256, 30, generator=generator) * 2
    tokens, logprobs = sample_next_tokens(logits, temperature=0.6, top_p=0.5, generator=generator)
    full = torch.log_softmax(logits.double() / 0.6, dim=-1)
    torch.testing.assert_close(logprobs.double(), full.gather(-1, tokens[:, None]).squeeze(-1), atol=1e-6, rtol=0)
    # Not the log-prob renormalised over the nucleus, which would be larger.
    kept = nucleus_mask(full, 0.5)
    renormalised = full - torch.logsumexp(full.masked_fill(~kept, -math.inf), dim=-1, keepdim=True)
    assert (renormalised.gather(-1, tokens[:, None]).squeeze(-1) > logprobs.double() + 1e-3).any()


def test_sample_frequencies_match_the_truncated_distribution() -> None:
    # One distribution, 40k independent rows: frequencies within 4 standard errors of
    # π_T renormalised over the nucleus.
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    temperature, top_p = 0.8, 0.8
    num_rows = 40_000
    generator = torch.Generator().manual_seed(2)
    tokens, _ = sample_next_tokens(
        logits.expand(num_rows, -1), temperature=temperature, top_p=top_p, generator=generator
    )
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    keep = torch.tensor(_nucleus_reference(probs.tolist(), top_p))
    target = torch.where(keep, probs, 0.0)
    target = target / target.sum()
    freq = torch.bincount(tokens, minlength=6).double() / num_rows
    stderr = (target * (1 - target) / num_rows).sqrt()
    assert ((freq - target).abs() <= 4 * stderr + 1e-12).all(), (freq, target)
    assert freq[~keep].sum() == 0


def test_seeded_generator_is_deterministic() -> None:
    logits = torch.randn(8, 20, generator=torch.Generator().manual_seed(3))
    a, _ = sample_next_tokens(logits, temperature=1.0, generator=torch.Generator().manual_seed(9))
    b, _ = sample_next_tokens(logits, temperature=1.0, generator=torch.Generator().manual_seed(9))
    assert torch.equal(a, b)


def test_bad_inputs() -> None:
    with pytest.raises(ValueError, match=r"\(B, V\)"):
        sample_next_tokens(torch.zeros(5), temperature=1.0)
    with pytest.raises(ValueError, match="temperature"):
        sample_next_tokens(torch.zeros(1, 5), temperature=-0.1)
    with pytest.raises(ValueError, match="top_p"):
        nucleus_mask(torch.zeros(1, 5), 1.5)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    top_p=st.floats(0.01, 1.0),
    temperature=st.floats(0.05, 3.0),
    scale=st.floats(0.1, 20.0),
)
def test_property_samples_lie_in_the_nucleus(seed: int, top_p: float, temperature: float, scale: float) -> None:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(16, 40, generator=generator) * scale
    tokens, logprobs = sample_next_tokens(logits, temperature=temperature, top_p=top_p, generator=generator)
    kept = nucleus_mask(torch.log_softmax(logits.float() / temperature, dim=-1), top_p)
    assert kept.gather(-1, tokens[:, None]).all()
    assert (logprobs <= 1e-6).all() and torch.isfinite(logprobs).all()
