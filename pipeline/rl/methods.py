"""The loop's methods, chosen once from the registries by the config's names.

Each slot is a plain callable with its options bound here, so the loop calls
``methods.advantage(rewards=..., group_ids=...)`` without knowing which method it is.
Schedules (D³S's N_s and K, E3's τ) are state objects owned by the loop and passed
in as arguments each step.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch

import pipeline.algorithms  # noqa: F401  (fills the registries)
from pipeline.algorithms.d3s import D3SSchedule
from pipeline.algorithms.e3 import TemperatureScheduler
from pipeline.algorithms.registry import ADVANTAGES, SAMPLE_SELECTORS, TOKEN_WEIGHTS
from pipeline.config import AlgorithmConfig
from pipeline.trainer.losses import PolicyLoss


@dataclass(slots=True)
class Methods:
    advantage: Callable
    select_samples: Callable | None
    token_weightings: list[tuple[str, Callable]]
    loss: PolicyLoss
    d3s_schedule: D3SSchedule | None
    temperature: TemperatureScheduler | None
    stateful: dict[str, object] = field(default_factory=dict)  # name → object with state_dict()

    @property
    def needs_token_stats(self) -> bool:
        """Whether log-probs and entropies are needed before the update (token weights, E3's τ)."""
        return bool(self.token_weightings) or self.temperature is not None


def build_methods(cfg: AlgorithmConfig, *, total_steps: int, group_size: int, vocab_size: int,
                  temperature: float) -> Methods:
    # PODS keeps N of G samples too; it reads N from the same schedule (held fixed by d3s.dynamic=false).
    uses_d3s = cfg.sample_selector in ("d3s_intra", "d3s_cross", "pods") or "d3s_topk" in cfg.token_weights
    schedule = None
    if uses_d3s:
        schedule = D3SSchedule(
            total_steps=total_steps,
            num_keep_init=min(cfg.d3s.num_keep_init, group_size),
            num_keep_final=min(cfg.d3s.num_keep_final, group_size),
            keep_ratio_init=cfg.d3s.keep_ratio_init,
            keep_ratio_final=cfg.d3s.keep_ratio_final,
            dynamic=cfg.d3s.dynamic,
        )
    selector = None if cfg.sample_selector == "none" else SAMPLE_SELECTORS.get(cfg.sample_selector)
    weightings = []
    for name in cfg.token_weights:
        options = {"scope": cfg.d3s.token_scope} if name == "d3s_topk" else {"scope": cfg.cw_grpo_scope}
        weightings.append((name, partial(TOKEN_WEIGHTS.get(name), **options)))
    scheduler = None
    if cfg.temperature == "e3":
        anneal = cfg.e3.anneal_start_fraction
        scheduler = TemperatureScheduler(
            vocab_size=vocab_size, initial_temperature=temperature,
            min_temperature=cfg.e3.min_temperature, max_temperature=cfg.e3.max_temperature,
            anneal_start=None if anneal is None else int(anneal * total_steps),
            max_steps=None if anneal is None else total_steps, eta=cfg.e3.eta,
        )
    stateful = {name: obj for name, obj in (("d3s_schedule", schedule), ("temperature", scheduler)) if obj is not None}
    return Methods(
        advantage=pool_aware_advantage(cfg.advantage, baseline_weight=cfg.baseline_weight),
        select_samples=selector,
        token_weightings=weightings,
        loss=PolicyLoss(cfg.loss, aggregation=cfg.aggregation, eps_low=cfg.eps_low, eps_high=cfg.eps_high,
                        kl_coef=cfg.kl_coef, entropy_coef=cfg.entropy_coef),
        d3s_schedule=schedule,
        temperature=scheduler,
        stateful=stateful,
    )


def pool_aware_advantage(name: str, *, baseline_weight: str) -> Callable:
    """``fn(rewards=, group_ids=, pool_rewards=, pool_group_ids=)`` for any registered advantage.

    Advantages with a pool-level baseline (Reinforce-Ada's ``global_baseline``) see every
    sample drawn for a prompt; the others see only the samples the update trains on.
    """
    fn = ADVANTAGES.get(name)
    if "pool_rewards" in inspect.signature(fn).parameters:
        return partial(fn, weight=baseline_weight)

    def without_pool(*, rewards, group_ids, pool_rewards, pool_group_ids):  # noqa: ARG001
        return fn(rewards=rewards, group_ids=group_ids)

    return without_pool


def token_weights(methods: Methods, *, advantages: torch.Tensor, entropy: torch.Tensor, logprobs: torch.Tensor,
                  response_mask: torch.Tensor, group_ids: torch.Tensor, keep_mask: torch.Tensor,
                  keep_ratio: float | None) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Multiply the configured token weightings; returns (weights, token_mask, metrics).

    D³S top-K yields 0/1 weights that define the token mask; later weightings (CW-GRPO)
    see only the kept tokens, so CW's mean weight is 1 over the tokens in the loss.
    """
    weights = keep_mask[:, None].to(torch.float32) * response_mask  # (S, T)
    token_mask = response_mask & keep_mask[:, None]  # (S, T)
    metrics: dict = {}
    for name, fn in methods.token_weightings:
        extra = {"keep_ratio": keep_ratio, "sample_keep_mask": keep_mask} if name == "d3s_topk" else {}
        w, m = fn(advantages=advantages, entropy=entropy, logprobs=logprobs, response_mask=token_mask,
                  group_ids=group_ids, **extra)
        weights = weights * w
        token_mask = token_mask & w.bool()  # weights are non-negative: non-zero means kept
        metrics.update(m)
    return weights, token_mask, metrics
