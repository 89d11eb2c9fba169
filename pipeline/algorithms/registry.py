"""Name → function registries through which the RL loop picks its methods once.

Every registered function is pure (tensors in, ``(result, metrics)`` out) and
keyword-only. The contract of each registry:

``ADVANTAGES``
    ``fn(*, rewards, group_ids, **options) -> (advantages, metrics)``;
    ``rewards``/``group_ids``/``advantages`` are ``(S,)`` over the samples of a
    batch, groups may be ragged.
``POLICY_LOSSES``
    ``fn(*, logprobs, old_logprobs, advantages, response_mask, **options) -> (loss, metrics)``;
    all ``(B, T)``; ``advantages`` is per token (already multiplied by any token
    weights); ``loss`` is a scalar with gradient w.r.t. ``logprobs``.
``SAMPLE_SELECTORS``
    ``fn(*, advantages, rewards, group_ids, num_keep, generator, **options) -> ((keep_mask, advantages), metrics)``;
    ``keep_mask`` is a ``(S,)`` bool; the returned advantages are those the update
    uses (PODS re-normalises inside the subset, D³S does not).
``TOKEN_WEIGHTS``
    ``fn(*, advantages, entropy, logprobs, response_mask, group_ids, **options) -> (weights, metrics)``;
    ``advantages`` is ``(B,)`` per sample, the rest ``(B, T)``; ``weights`` is a
    ``(B, T)`` non-negative tensor without gradient that multiplies the advantage.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    """A named table of functions; unknown names fail with the allowed ones listed."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        def decorator(fn: F) -> F:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._entries[name] = fn
            return fn

        return decorator

    def get(self, name: str) -> F:
        try:
            return self._entries[name]
        except KeyError:
            raise ValueError(
                f"unknown {self.kind} {name!r}; choose one of {sorted(self._entries)}"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries


ADVANTAGES: Registry = Registry("advantage")
POLICY_LOSSES: Registry = Registry("policy loss")
SAMPLE_SELECTORS: Registry = Registry("sample selector")
TOKEN_WEIGHTS: Registry = Registry("token weighting")
