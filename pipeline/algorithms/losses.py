"""Clipped policy-gradient losses (GRPO token ratio, GSPO sequence ratio).

Called through ``pipeline.rl.methods.POLICY_LOSSES`` with the contract
``fn(*, logprobs, old_logprobs, advantages, response_mask, **options) -> (loss, metrics)``;
every tensor is ``(B, T)``, ``advantages`` is per token and already multiplied
by any token weights, ``loss`` is a scalar to *minimize* with gradient w.r.t.
``logprobs``.

Per token ``t`` of response ``i`` the loss is

    ℓ_{i,t} = −min(ρ_{i,t} A_{i,t}, clip(ρ_{i,t}, 1 − ε_low, 1 + ε_high) A_{i,t})
              + β · k3_{i,t} − λ_H · H_{i,t}

with ``ρ`` the importance ratio of the method, ``k3`` the Schulman k3 estimator
of KL(π_θ ‖ π_ref) (``exp(δ) − δ − 1`` with ``δ = log π_ref − log π_θ``), and
``H`` a given entropy (entropy *bonus*, so it is subtracted). Clip-higher
(separate ``ε_low``/``ε_high``) follows DAPO (Yu et al., 2025).

Which tokens count, and how they are averaged
----------------------------------------------
``response_mask`` marks the response tokens ``y_i``. The optional ``token_mask``
marks the selected tokens ``𝒯`` of D³S §3.2 (top-K% of ``|A|·H``); the loss
sums over ``active = response_mask & token_mask`` only — surrogate, KL and
entropy alike, as in D³S Eq. 10 where all three sit inside ``Σ_{t∈𝒯}``.
A sequence counts as a member of the batch (``Ŝ``) when it has at least one
response token, whether or not any of its tokens was selected.

``token_mean``           ``Σ_{i,t∈active} ℓ / (number of active tokens)``
                         (DAPO token-level; the literal Eq. 10 with a batch-wide
                         ``|𝒯|``, up to its extra constant ``1/|Ŝ|``).
``seq_mean_token_mean``  ``1/|Ŝ| Σ_i 1/|y_i| Σ_{t∈active_i} ℓ`` — GRPO Eq. 1 /
                         GSPO Eq. 3 of D³S, ``|y_i|`` the full response length.
``d3s``                  ``1/|Ŝ| Σ_i 1/|𝒯_i| Σ_{t∈𝒯_i} ℓ`` — D³S Eq. 10
                         ("Learning More with Less: A Dynamic Dual-Level
                         Down-Sampling Framework for Efficient Policy Optimization").
                         Eq. 10 writes ``1/|Ŝ| · 1/|𝒯|`` outside both sums with
                         ``𝒯`` the batch-wide selection; read literally that is
                         the token mean scaled by an extra ``1/|Ŝ|``, which only
                         shrinks the step with batch size. We implement the
                         per-sequence reading ``|𝒯_i| = |𝒯 ∩ y_i|`` that matches
                         the ``1/|y_i|`` structure of Eqs. 1 and 3 it extends;
                         without a ``token_mask`` it equals ``seq_mean_token_mean``.
``dr_grpo``              ``Σ_{i,t∈active} ℓ / (|Ŝ| · L_max)`` — Dr. GRPO's constant
                         normaliser ("Understanding R1-Zero-Like Training: A Critical
                         Perspective", Liu et al. 2025, §3.1: GRPO's ``1/|o_i|`` is
                         dropped; the authors' code divides each response's token sum
                         by the generation budget, ``masked_sum(…, constant_normalizer=
                         generate_max_length)``, and averages over responses).
                         ``L_max`` is ``max_response_length``, the generation limit the
                         rollouts were sampled with — a constant, so every token weighs
                         the same whatever the length of its response; a response with
                         more tokens than ``L_max`` raises ``ValueError``.

``normalizer`` replaces the local denominator (token count for
``token_mean``, sequence count for ``seq_mean_token_mean`` and ``d3s``, sequence
count times ``L_max`` for ``dr_grpo``) by the global one — summed
over every micro-batch and data-parallel rank, see ``loss_denominator`` — so
that the sum of micro-batch losses is exactly the full-batch loss. The
per-sequence ``1/|y_i|`` and ``1/|𝒯_i|`` stay local, so a sequence must not be
split across micro-batches. Denominators are counts and are clamped to ≥ 1, so
a fully masked batch has loss 0 (with a zero gradient).

Masked positions may hold anything, NaN included: inputs are replaced by 0
with ``torch.where`` before any arithmetic, so neither the loss nor the
gradient sees them. A non-finite value at a response position raises
``ValueError``.
"""

from __future__ import annotations

import torch

Metrics = dict[str, float | torch.Tensor]

__all__ = ["AGGREGATIONS", "grpo_loss", "gspo_loss", "loss_denominator"]

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "d3s", "dr_grpo")

# exp() of a log-ratio beyond this overflows float32 in the surrogate; such a
# ratio is clipped anyway, so the clamp only removes inf/NaN, never signal.
_MAX_LOG_RATIO = 20.0


def _check_mask(mask: torch.Tensor, name: str, shape: torch.Size) -> torch.Tensor:
    if mask.shape != shape:
        raise ValueError(f"{name} shape {tuple(mask.shape)} does not match logprobs shape {tuple(shape)}")
    if mask.dtype == torch.bool:
        return mask
    if mask.is_floating_point() or mask.is_complex():
        raise ValueError(
            f"{name} must be bool or integer 0/1, got {mask.dtype}; pass token weights through the advantages"
        )
    return mask != 0


def _check_values(name: str, values: torch.Tensor, mask: torch.Tensor) -> None:
    if values.shape != mask.shape:
        raise ValueError(f"{name} shape {tuple(values.shape)} does not match logprobs shape {tuple(mask.shape)}")
    bad = mask & ~torch.isfinite(values.detach())
    if bool(bad.any()):
        row, col = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"{name}[{row}, {col}] = {float(values.detach()[row, col])} is not finite inside response_mask "
            f"({int(bad.sum())} such position(s))"
        )


def _masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # where, not multiplication: 0 * NaN is NaN, in the forward and in the backward.
    return torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))


def loss_denominator(
    response_mask: torch.Tensor,
    *,
    aggregation: str,
    token_mask: torch.Tensor | None = None,
    max_response_length: int | None = None,
) -> torch.Tensor:
    """The local denominator of ``aggregation`` for one micro-batch, as a float64 scalar.

    ``token_mean``: number of active tokens; ``seq_mean_token_mean`` and
    ``d3s``: number of sequences with at least one response token; ``dr_grpo``:
    that number times ``max_response_length`` (required there, ignored by the
    others). Sum it over all micro-batches and data-parallel ranks and pass the
    total as ``normalizer``.
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r}; choose one of {AGGREGATIONS}")
    response_mask = _check_mask(response_mask, "response_mask", response_mask.shape)
    if aggregation == "token_mean":
        active = response_mask if token_mask is None else response_mask & _check_mask(
            token_mask, "token_mask", response_mask.shape
        )
        return active.sum(dtype=torch.float64)
    num_sequences = response_mask.any(dim=1).sum(dtype=torch.float64)
    if aggregation != "dr_grpo":
        return num_sequences
    _check_max_response_length(max_response_length)
    longest = int(response_mask.sum(dim=1).max()) if response_mask.numel() else 0
    if longest > max_response_length:
        raise ValueError(
            f"a response has {longest} tokens, more than max_response_length={max_response_length}; "
            "pass the generation limit the rollouts were sampled with"
        )
    return num_sequences * max_response_length


def _check_max_response_length(max_response_length: int | None) -> None:
    if max_response_length is None:
        raise ValueError("aggregation 'dr_grpo' needs max_response_length (the generation limit L_max)")
    if isinstance(max_response_length, bool) or not isinstance(max_response_length, int) or max_response_length < 1:
        raise ValueError(f"max_response_length must be an integer ≥ 1, got {max_response_length!r}")


def _aggregate(
    per_token: torch.Tensor,  # (B, T)
    *,
    active_mask: torch.Tensor,  # (B, T)
    response_mask: torch.Tensor,  # (B, T)
    aggregation: str,
    normalizer: float | torch.Tensor | None,
    max_response_length: int | None,
) -> torch.Tensor:
    masked = _masked(per_token, active_mask)
    if aggregation in ("token_mean", "dr_grpo"):
        numerator = masked.sum()
    else:
        if aggregation == "seq_mean_token_mean":
            lengths = response_mask.sum(dim=1)  # (B,) |y_i|
        else:
            lengths = active_mask.sum(dim=1)  # (B,) |𝒯_i|
        numerator = (masked.sum(dim=1) / lengths.clamp(min=1).to(masked.dtype)).sum()
    if normalizer is None:
        denominator = loss_denominator(
            response_mask, aggregation=aggregation, token_mask=active_mask, max_response_length=max_response_length
        ).to(masked.dtype)
    else:
        denominator = torch.as_tensor(normalizer, dtype=masked.dtype, device=masked.device)
    return numerator / denominator.clamp(min=1)


def _check_normalizer(normalizer: float | torch.Tensor | None) -> None:
    if normalizer is None:
        return
    value = float(normalizer)
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"normalizer must be a finite count ≥ 0, got {value}")


def _clipped_policy_loss(
    *,
    method: str,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
    aggregation: str,
    token_mask: torch.Tensor | None,
    normalizer: float | torch.Tensor | None,
    max_response_length: int | None,
    ref_logprobs: torch.Tensor | None,
    kl_coef: float,
    entropy: torch.Tensor | None,
    entropy_coef: float,
) -> tuple[torch.Tensor, Metrics]:
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be (B, T), got shape {tuple(logprobs.shape)}")
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r}; choose one of {AGGREGATIONS}")
    if not (0 <= eps_low < 1 and eps_high >= 0):
        raise ValueError(f"need 0 ≤ eps_low < 1 and eps_high ≥ 0, got eps_low={eps_low}, eps_high={eps_high}")
    if kl_coef and ref_logprobs is None:
        raise ValueError("kl_coef is set but ref_logprobs is missing")
    if entropy_coef and entropy is None:
        raise ValueError("entropy_coef is set but entropy is missing")
    _check_normalizer(normalizer)
    if aggregation == "dr_grpo" and normalizer is None:
        _check_max_response_length(max_response_length)
    shape = logprobs.shape
    response_mask = _check_mask(response_mask, "response_mask", shape)
    active = response_mask
    if token_mask is not None:
        active = response_mask & _check_mask(token_mask, "token_mask", shape)
    _check_values("logprobs", logprobs, response_mask)
    _check_values("old_logprobs", old_logprobs, response_mask)
    _check_values("advantages", advantages, response_mask)
    if ref_logprobs is not None:
        _check_values("ref_logprobs", ref_logprobs, response_mask)
    if entropy is not None:
        _check_values("entropy", entropy, response_mask)

    logprobs = _masked(logprobs, response_mask)  # (B, T)
    old_logprobs = _masked(old_logprobs.detach(), response_mask).to(logprobs.dtype)
    advantages = _masked(advantages.detach(), response_mask).to(logprobs.dtype)
    token_log_ratio = logprobs - old_logprobs  # (B, T)

    if method == "gspo":
        # D³S Eq. 3 / GSPO-token: s_{i,t} = sg[s_i] · π_θ(y_t) / sg[π_θ(y_t)], whose value
        # is the sequence ratio s_i = exp(mean_t log ρ_{i,t}) and whose gradient is
        # s_i · ∇log π_θ(y_t) on every token.
        lengths = response_mask.sum(dim=1).clamp(min=1).to(logprobs.dtype)  # (B,)
        seq_log_ratio = token_log_ratio.detach().sum(dim=1) / lengths  # (B,)
        log_ratio = logprobs - logprobs.detach() + seq_log_ratio.unsqueeze(1)  # (B, T)
    else:
        log_ratio = token_log_ratio
    ratio = torch.exp(log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))  # (B, T)
    clipped_ratio = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    surrogate = torch.minimum(ratio * advantages, clipped_ratio * advantages)  # (B, T)

    aggregate = dict(
        active_mask=active, response_mask=response_mask, aggregation=aggregation, normalizer=normalizer,
        max_response_length=max_response_length,
    )
    # Aggregation is linear in the per-token loss, so the terms can be reduced apart
    # and reported individually without a second pass.
    pg_loss = _aggregate(-surrogate, **aggregate)
    loss = pg_loss
    metrics: Metrics = {"pg_loss": pg_loss.detach()}
    if ref_logprobs is not None:
        delta = (_masked(ref_logprobs.detach(), response_mask).to(logprobs.dtype) - logprobs).clamp(
            -_MAX_LOG_RATIO, _MAX_LOG_RATIO
        )
        k3 = torch.exp(delta) - delta - 1.0  # (B, T)
        kl_loss = _aggregate(k3, **aggregate)
        loss = loss + kl_coef * kl_loss
        metrics["kl_ref"] = kl_loss.detach()
    if entropy is not None:
        entropy_term = _aggregate(_masked(entropy, response_mask).to(logprobs.dtype), **aggregate)
        loss = loss - entropy_coef * entropy_term
        metrics["entropy"] = entropy_term.detach()
    metrics["loss"] = loss.detach()

    with torch.no_grad():
        num_active = active.sum()
        denominator = num_active.clamp(min=1).to(logprobs.dtype)
        low = active & (ratio < 1.0 - eps_low) & (advantages < 0)
        high = active & (ratio > 1.0 + eps_high) & (advantages > 0)
        token_ratio = torch.exp(token_log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
        # k3 estimate of KL(π_old ‖ π_θ) from samples of π_old: (ρ − 1) − log ρ.
        approx_kl = token_ratio - 1.0 - token_log_ratio
        metrics.update(
            {
                "clip_fraction_low": low.sum() / denominator,
                "clip_fraction_high": high.sum() / denominator,
                "clip_fraction": (low | high).sum() / denominator,
                "ratio_mean": _masked(ratio, active).sum() / denominator,
                "ratio_max": _masked(ratio, active).max() if bool(num_active) else ratio.new_zeros(()),
                "approx_kl": _masked(approx_kl, active).sum() / denominator,
                "num_tokens": num_active.to(torch.float64),
                "num_sequences": response_mask.any(dim=1).sum().to(torch.float64),
            }
        )
    return loss, metrics


def grpo_loss(
    *,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    aggregation: str = "token_mean",
    token_mask: torch.Tensor | None = None,
    normalizer: float | torch.Tensor | None = None,
    max_response_length: int | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
) -> tuple[torch.Tensor, Metrics]:
    """GRPO/PPO token-level clipped surrogate with clip-higher.

    D³S Eq. 1 ("Learning More with Less: A Dynamic Dual-Level Down-Sampling
    Framework for Efficient Policy Optimization"),
    ratio ``w_{i,t} = π_θ(y_{i,t}) / π_old(y_{i,t})``, with DAPO's asymmetric
    clip range ``[1 − eps_low, 1 + eps_high]`` (defaults 0.2/0.28, as used by
    Reinforce-Ada §4.1). Aggregation, masks, KL, entropy, ``normalizer`` and
    ``max_response_length`` (``dr_grpo`` only): see the module docstring. Metrics: ``clip_fraction_low``/``_high`` (tokens whose
    clipped branch binds — ratio below ``1−eps_low`` with ``A<0``, above
    ``1+eps_high`` with ``A>0``; they carry no gradient), ``ratio_mean``/``max``,
    ``approx_kl`` (k3 of KL(π_old‖π_θ)), ``kl_ref``, ``entropy``, ``pg_loss`` —
    all over this micro-batch's active tokens.
    """
    return _clipped_policy_loss(
        method="grpo",
        logprobs=logprobs,
        old_logprobs=old_logprobs,
        advantages=advantages,
        response_mask=response_mask,
        eps_low=eps_low,
        eps_high=eps_high,
        aggregation=aggregation,
        token_mask=token_mask,
        normalizer=normalizer,
        max_response_length=max_response_length,
        ref_logprobs=ref_logprobs,
        kl_coef=kl_coef,
        entropy=entropy,
        entropy_coef=entropy_coef,
    )


def gspo_loss(
    *,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    aggregation: str = "seq_mean_token_mean",
    token_mask: torch.Tensor | None = None,
    normalizer: float | torch.Tensor | None = None,
    max_response_length: int | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
) -> tuple[torch.Tensor, Metrics]:
    """GSPO clipped surrogate with the sequence-level ratio, token form.

    D³S Eq. 3 ("Learning More with Less: A Dynamic Dual-Level Down-Sampling
    Framework for Efficient Policy Optimization"):
    ``s_{i,t} = sg[(π_θ(y_i)/π_old(y_i))^{1/|y_i|}] · π_θ(y_{i,t}) / sg[π_θ(y_{i,t})]``.
    Eq. 3 prints the last denominator as ``sg[π_θold(y_{i,t})]``; a stop-gradient
    on the old policy would be a no-op and would make the value ``s_i · w_{i,t}``
    instead of the sequence ratio, so we read it as ``sg[π_θ(y_{i,t})]`` — GSPO's
    own token form (Zheng et al., 2025). The value of ``s_{i,t}`` is
    ``s_i = exp(mean_{t∈y_i} (log π_θ − log π_old))`` (mean over the whole
    response, not only ``token_mask``), so clipping acts on whole sequences,
    while the gradient ``s_i ∇log π_θ(y_{i,t})`` flows per token and can carry
    per-token advantages.

    Default clip range 3e-4/4e-4 is GSPO's (sequence ratios sit much closer to
    1 than token ratios); D³S Table 6 lists 0.2 — recipes set it explicitly.
    Default aggregation is Eq. 3's ``seq_mean_token_mean``. Metrics as ``grpo_loss``
    (``ratio_*`` and clip fractions are of ``s_i``; ``approx_kl`` of the token ratio).
    """
    return _clipped_policy_loss(
        method="gspo",
        logprobs=logprobs,
        old_logprobs=old_logprobs,
        advantages=advantages,
        response_mask=response_mask,
        eps_low=eps_low,
        eps_high=eps_high,
        aggregation=aggregation,
        token_mask=token_mask,
        normalizer=normalizer,
        max_response_length=max_response_length,
        ref_logprobs=ref_logprobs,
        kl_coef=kl_coef,
        entropy=entropy,
        entropy_coef=entropy_coef,
    )
