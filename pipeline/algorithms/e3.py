"""E3: dynamic rollout budgets and entropy-targeting temperature scheduling.

Paper: "Enhancing Efficiency and Exploration in Reinforcement Learning for
LLMs" (Liao, Xi, Chen, Leng, Hu, Zeng, Liu, Wan).

§4.1 Dynamic rollout budget
    ``accumulate_prompt_rewards``  cumulative reward r^c_i and rollout count n^c_i.
    ``difficulty_ranks``           k_i = rank(q_i)/|D|, rank by descending r^c_i/n^c_i.
    (the run keeps r^c, n^c and k in its ``PromptStatsStore``; ``pipeline.rl.sampling.E3Budget``
    re-ranks at each pass end)
    ``e3_budget_bounds``           G_min/G_max start at G and widen by a step per
                                   pass over D up to limits (§4.1, §5.1: step 2).
    ``e3_rollout_budgets``         Algorithm 1 (batch budget B·G conserved exactly;
                                   step 4 in exact integers given ``rank_denominator``).
    ``rank_numerators``            k_i = n_i/q as exact integers n_i.
§4.2 Temperature scheduling
    ``entropy_temperature_update`` Eq. 4: τ ← τ·(1 + τ·ln α / (ln|V| + ln ln|V|)).
    ``annealed_target_entropy``    Eq. 5: cosine from H_init to η·H_init.
    ``TemperatureScheduler``       state object combining Eq. 4 and Eq. 5.

The temperature changes the policy being optimised, not only the sampler: the
paper (§4.2, "logits are also divided by the temperature during forward
propagation after sampling") requires the trainer to compute log-probabilities
and entropies from ``logits / τ`` with the *same* τ the sampler used for that
batch. Record τ with each rollout batch and pass it to the trainer; a mismatch
makes the importance ratio π_θ/π_old wrong from the first token.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "TemperatureScheduler",
    "accumulate_prompt_rewards",
    "annealed_target_entropy",
    "difficulty_ranks",
    "e3_budget_bounds",
    "e3_rollout_budgets",
    "entropy_temperature_update",
    "rank_numerators",
]


# ---------------------------------------------------------------------------
# §4.1 Dynamic rollout budget allocation
# ---------------------------------------------------------------------------


def e3_rollout_budgets(
    *,
    difficulty: torch.Tensor,
    group_size: int,
    min_budget: int,
    max_budget: int,
    rank_denominator: int | None = None,
) -> tuple[torch.Tensor, dict[str, float | torch.Tensor]]:
    """Algorithm 1 (Dynamic Rollout Budget): per-prompt rollout counts G_i.

    ``difficulty`` is the ``(B,)`` batch of normalised ranks k_i (larger =
    harder). Steps: N_total = B·G; G_i = G_min; N_rem = N_total − B·G_min;
    G_i += ⌊N_rem · k_i / Σ_j k_j⌋; then the leftover N_total − Σ G_i is
    handed out greedily in descending k (ties: lower index first), each prompt
    taking as much as it can up to G_max before the next one gets any — the
    reading of "greedily … respecting G_max" used by the authors' code
    (github.com/LiaoMengqi/E3-RL4LLMs, ``get_rollout_n_per_prompt``).

    One deviation: step 4 as printed can push a very hard prompt past G_max
    (e.g. k = (1, 0.01), G = 8, G_min = 4, G_max = 10 gives 4 + ⌊7.92⌋ = 11);
    we cap it at G_max there and let the greedy step move the excess, so both
    stated properties hold: Σ G_i = B·G exactly and G_min ≤ G_i ≤ G_max (which
    needs G_min ≤ G ≤ G_max, checked). If Σ k = 0 the proportional step adds
    nothing and the greedy step distributes everything.

    Exact step 4 (``rank_denominator``): k_i = rank_i/|D| is a fraction, and the
    quotient ``N_rem · k_i / Σ_j k_j`` is often an integer (ranks (3, 1, 4) of
    |D| = 5 with N_rem = 24 give 24 · 3/8 = 9), which float division can land
    just below (8.999…, floored to 8: a rollout moves to the greedy step's
    hardest prompt). Given ``rank_denominator`` q, every k_i must be a multiple
    of 1/q (checked); k_i is recovered as the exact fraction n_i/q with
    n_i = round(k_i · q) — exact for q < 2⁴⁰, since a correctly rounded n/q
    times q is within far less than 1/2 of n — and step 4 becomes the integer
    quotient ``⌊N_rem · n_i / Σ_j n_j⌋`` (q cancels), with step 6 ordered by
    n_i. For the ranks of ``difficulty_ranks`` q = 2·|D| (tied prompts share a
    half-integer mean rank; an unranked prompt's 1/2 is |D|/q). Without it,
    step 4 runs in float64 as before.
    """
    if difficulty.dim() != 1:
        raise ValueError(f"difficulty must be 1-D (B,), got shape {tuple(difficulty.shape)}")
    if difficulty.numel() and not bool(torch.isfinite(difficulty).all()):
        raise ValueError("difficulty contains non-finite values")
    if bool((difficulty < 0).any()):
        raise ValueError("difficulty ranks must be non-negative")
    if not (0 <= min_budget <= group_size <= max_budget):
        raise ValueError(
            f"need 0 ≤ min_budget ≤ group_size ≤ max_budget, got {min_budget}, {group_size}, {max_budget}"
        )
    k = difficulty.to(torch.float64)
    num_prompts = k.numel()
    total = num_prompts * group_size
    budgets = torch.full((num_prompts,), min_budget, dtype=torch.int64, device=k.device)
    remaining = total - num_prompts * min_budget
    if rank_denominator is not None:
        k = rank_numerators(k, rank_denominator=rank_denominator)  # (B,) int64, k·q exactly
        k_sum = int(k.sum())
        if k_sum > 0:
            if remaining * int(k.max()) >= 2**62:
                raise ValueError(f"N_rem · max numerator overflows int64 (N_rem={remaining}, q={rank_denominator})")
            shares = torch.div(remaining * k, k_sum, rounding_mode="floor")
            budgets = torch.clamp(budgets + shares, max=max_budget)
    else:
        k_sum = float(k.sum())
        if k_sum > 0:
            shares = torch.floor(remaining * (k / k_sum)).to(torch.int64)
            budgets = torch.clamp(budgets + shares, max=max_budget)
    remaining = total - int(budgets.sum())
    assert remaining >= 0, remaining
    order = torch.argsort(k, descending=True, stable=True)  # (B,)
    capacity = (max_budget - budgets)[order]  # (B,)
    capacity_before = torch.cumsum(capacity, 0) - capacity
    extra = torch.clamp(remaining - capacity_before, min=0)
    extra = torch.minimum(extra, capacity)
    budgets[order] += extra
    assert int(budgets.sum()) == total
    metrics: dict[str, float | torch.Tensor] = {
        "e3/budget_min": float(budgets.min()) if num_prompts else 0.0,
        "e3/budget_max": float(budgets.max()) if num_prompts else 0.0,
        "e3/budget_at_max_fraction": float((budgets == max_budget).sum()) / num_prompts if num_prompts else 0.0,
    }
    return budgets, metrics


def rank_numerators(difficulty: torch.Tensor, *, rank_denominator: int) -> torch.Tensor:
    """n_i with k_i = n_i / q exactly, for ``difficulty`` ``(B,)`` float k that are multiples of 1/q.

    ``q = rank_denominator`` (2·|D| for ``difficulty_ranks``). k_i · q is within
    ~n_i · 2⁻⁵² of the integer n_i for a correctly rounded k_i = fl(n_i/q), so
    rounding recovers n_i exactly while q < 2⁴⁰; anything further than 1e-3 from
    an integer is not such a k and raises ``ValueError``. Returns int64 ``(B,)``.
    """
    if isinstance(rank_denominator, bool) or not isinstance(rank_denominator, int) or not (
        1 <= rank_denominator < 2**40
    ):
        raise ValueError(f"rank_denominator must be an integer in [1, 2^40), got {rank_denominator!r}")
    scaled = difficulty.to(torch.float64) * rank_denominator  # (B,)
    numerators = torch.round(scaled)
    if scaled.numel() and float((scaled - numerators).abs().max()) > 1e-3:
        worst = int((scaled - numerators).abs().argmax())
        raise ValueError(
            f"difficulty[{worst}] = {float(difficulty[worst])!r} is not a multiple of 1/{rank_denominator}; "
            "pass the denominator of the ranks (2·|D| for difficulty_ranks)"
        )
    return numerators.to(torch.int64)


def e3_budget_bounds(
    *,
    num_completed_passes: int,
    group_size: int,
    min_limit: int,
    max_limit: int,
    step: int = 2,
) -> tuple[int, int]:
    """(G_min, G_max) after ``num_completed_passes`` full passes over the dataset.

    §4.1: both start at G ("to avoid … allocating higher budgets to challenging
    questions under an undertrained policy"); after each pass G_max grows and
    G_min shrinks until the predefined limits. §5.1 uses a step of 2 per pass.
    During the first pass the allocation is therefore uniform.
    """
    if num_completed_passes < 0 or step < 0:
        raise ValueError(f"num_completed_passes and step must be ≥ 0, got {num_completed_passes}, {step}")
    if not (0 <= min_limit <= group_size <= max_limit):
        raise ValueError(
            f"need 0 ≤ min_limit ≤ group_size ≤ max_limit, got {min_limit}, {group_size}, {max_limit}"
        )
    widening = step * num_completed_passes
    return max(group_size - widening, min_limit), min(group_size + widening, max_limit)


def accumulate_prompt_rewards(
    *,
    reward_sum: torch.Tensor,
    num_rollouts: torch.Tensor,
    prompt_ids: torch.Tensor,
    rewards: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """r^c_i += Σ rewards, n^c_i += count for every rollout ``(S,)`` of prompt ``prompt_ids`` ``(S,)``.

    Cumulative over the whole run (§4.1: "cumulative rollout count … and
    cumulative reward"); returns new ``(D,)`` tensors.
    """
    if prompt_ids.shape != rewards.shape or rewards.dim() != 1:
        raise ValueError("prompt_ids and rewards must be 1-D (S,) of one shape")
    if rewards.numel():
        if not bool(torch.isfinite(rewards).all()):
            raise ValueError("rewards contain non-finite values")
        if int(prompt_ids.min()) < 0 or int(prompt_ids.max()) >= reward_sum.numel():
            raise ValueError(f"prompt ids must lie in [0, {reward_sum.numel()})")
    ids = prompt_ids.long()
    new_sum = reward_sum.index_add(0, ids, rewards.to(reward_sum.dtype))
    new_count = num_rollouts.index_add(0, ids, torch.ones_like(ids, dtype=num_rollouts.dtype))
    return new_sum, new_count


def difficulty_ranks(
    *, reward_sum: torch.Tensor, num_rollouts: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float | torch.Tensor]]:
    """k_i = rank(q_i) / |D| with rank 1 for the highest average reward (§4.1).

    Larger k = harder. Choices the paper leaves open: tied averages (common —
    every never-solved prompt has average 0) share the mean of their ranks, so
    equally hard prompts get equal budgets; |D| counts the prompts seen so far;
    a prompt never rolled out gets the neutral mean rank (|D|+1)/(2|D|).
    Returns ``(k (D,) float64, metrics)``.
    """
    seen = num_rollouts > 0
    num_seen = int(seen.sum())
    num_prompts = reward_sum.numel()
    if num_seen == 0:
        return torch.full((num_prompts,), 0.5, dtype=torch.float64), {"e3/num_ranked": 0.0}
    averages = reward_sum[seen].to(torch.float64) / num_rollouts[seen].to(torch.float64)
    sorted_avgs, order = torch.sort(averages, descending=True, stable=True)
    _, tie_ids, tie_sizes = torch.unique_consecutive(sorted_avgs, return_inverse=True, return_counts=True)
    tie_starts = torch.cumsum(tie_sizes, 0) - tie_sizes  # 0-based first position of each tie block
    mean_rank = tie_starts.to(torch.float64) + (tie_sizes.to(torch.float64) + 1.0) / 2.0  # 1-based
    ranks_seen = torch.empty(num_seen, dtype=torch.float64)
    ranks_seen[order] = mean_rank[tie_ids]
    k = torch.full((num_prompts,), (num_seen + 1) / (2.0 * num_seen), dtype=torch.float64)
    k[seen] = ranks_seen / num_seen
    return k, {"e3/num_ranked": float(num_seen), "e3/mean_reward_seen": float(averages.mean())}


# ---------------------------------------------------------------------------
# §4.2 Temperature scheduling
# ---------------------------------------------------------------------------


def entropy_temperature_update(
    *, temperature: float, entropy: float, target_entropy: float, vocab_size: int
) -> float:
    """Eq. 4: τ_{t+1} = τ_t · (1 + τ_t · ln α / (ln|V| + ln ln|V|)), α = H_target / H_t.

    Derived in Appendix A (Eq. 13 with Δ ≈ ln|V| + ln ln|V|) for low-entropy
    next-token distributions; entropy below target (α > 1) raises τ. The result
    is not clamped here; ``TemperatureScheduler`` applies its bounds.
    """
    if vocab_size < 3:
        raise ValueError(f"vocab_size must be ≥ 3 so that ln ln|V| > 0, got {vocab_size}")
    if not (math.isfinite(entropy) and entropy > 0):
        raise ValueError(f"entropy must be finite and > 0, got {entropy}")
    if not (math.isfinite(target_entropy) and target_entropy > 0):
        raise ValueError(f"target entropy must be finite and > 0, got {target_entropy}")
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be finite and > 0, got {temperature}")
    log_alpha = math.log(target_entropy) - math.log(entropy)
    log_vocab = math.log(vocab_size)
    return temperature * (1.0 + temperature * log_alpha / (log_vocab + math.log(log_vocab)))


def annealed_target_entropy(
    *, step: int, initial_entropy: float, eta: float, anneal_start: int, max_steps: int
) -> float:
    """Eq. 5: H_anneal(t) = H_init · [η + (1 − η) · ½(1 + cos(π (t − t_anneal)/(t_max − t_anneal)))].

    Equal to H_init for t ≤ t_anneal and to η·H_init for t ≥ t_max (clamped
    there; the paper defines it on [t_anneal, t_max]).
    """
    if not (0.0 <= eta < 1.0):
        raise ValueError(f"eta must lie in [0, 1), got {eta}")
    if not (0 <= anneal_start < max_steps):
        raise ValueError(f"need 0 ≤ anneal_start < max_steps, got {anneal_start}, {max_steps}")
    progress = min(max((step - anneal_start) / (max_steps - anneal_start), 0.0), 1.0)
    return initial_entropy * (eta + (1.0 - eta) * 0.5 * (1.0 + math.cos(math.pi * progress)))


class TemperatureScheduler:
    """The E3 temperature scheduler (§4.2, Eq. 4) with optional annealing (Eq. 5).

    ``update(entropy=H_t, step=t)`` takes the mean token entropy of step t's
    rollouts, measured on the tempered distribution ``softmax(logits / τ_t)``
    the sampler used, and returns τ_{t+1} for the next rollout. The target is
    H_init for t < t_anneal and H_anneal(t) of Eq. 5 from t_anneal on (the
    paper's "once t ≥ t_anneal"); §5.1 uses η = 0.9 and t_anneal = ⌊0.6·t_max⌋.
    H_init is the entropy of the first observed step unless given (the paper:
    "the average entropy of the first batch"); that first update leaves τ
    unchanged (α = 1).

    The clamp of τ to [min_temperature, max_temperature] is ours: Eq. 4 is a
    small-step linearisation and a large entropy overshoot (α ≪ 1) would send
    τ towards or below 0. See the module docstring: the trainer must divide
    logits by the same τ the sampler used.
    """

    def __init__(
        self,
        *,
        vocab_size: int,
        initial_temperature: float = 1.0,
        initial_entropy: float | None = None,
        min_temperature: float = 0.1,
        max_temperature: float = 2.0,
        anneal_start: int | None = None,
        max_steps: int | None = None,
        eta: float = 0.9,
    ) -> None:
        if vocab_size < 3:
            raise ValueError(f"vocab_size must be ≥ 3, got {vocab_size}")
        if not (0 < min_temperature <= initial_temperature <= max_temperature):
            raise ValueError(
                "need 0 < min_temperature ≤ initial_temperature ≤ max_temperature, got "
                f"{min_temperature}, {initial_temperature}, {max_temperature}"
            )
        if initial_entropy is not None and not (math.isfinite(initial_entropy) and initial_entropy > 0):
            raise ValueError(f"initial_entropy must be finite and > 0, got {initial_entropy}")
        if (anneal_start is None) != (max_steps is None):
            raise ValueError("anneal_start and max_steps must be given together (or neither)")
        if anneal_start is not None:
            assert max_steps is not None
            if not (0 <= anneal_start < max_steps):
                raise ValueError(f"need 0 ≤ anneal_start < max_steps, got {anneal_start}, {max_steps}")
        if not (0.0 <= eta < 1.0):
            raise ValueError(f"eta must lie in [0, 1), got {eta}")
        self.vocab_size = vocab_size
        self.min_temperature = min_temperature
        self.max_temperature = max_temperature
        self.anneal_start = anneal_start
        self.max_steps = max_steps
        self.eta = eta
        self.temperature = float(initial_temperature)
        self.initial_entropy = initial_entropy
        self.last_step: int | None = None

    def target_entropy(self, step: int) -> float:
        if self.initial_entropy is None:
            raise ValueError("the target entropy is unknown until the first entropy is observed")
        if self.anneal_start is None or step < self.anneal_start:
            return self.initial_entropy
        assert self.max_steps is not None
        return annealed_target_entropy(
            step=step,
            initial_entropy=self.initial_entropy,
            eta=self.eta,
            anneal_start=self.anneal_start,
            max_steps=self.max_steps,
        )

    def update(self, *, entropy: float, step: int) -> tuple[float, dict[str, float | torch.Tensor]]:
        entropy = float(entropy)
        if not (math.isfinite(entropy) and entropy > 0):
            raise ValueError(f"entropy must be finite and > 0, got {entropy}")
        if self.last_step is not None and step <= self.last_step:
            raise ValueError(f"steps must increase: got step {step} after {self.last_step}")
        if self.initial_entropy is None:
            self.initial_entropy = entropy
        target = self.target_entropy(step)
        proposed = entropy_temperature_update(
            temperature=self.temperature,
            entropy=entropy,
            target_entropy=target,
            vocab_size=self.vocab_size,
        )
        self.temperature = min(max(proposed, self.min_temperature), self.max_temperature)
        self.last_step = step
        metrics: dict[str, float | torch.Tensor] = {
            "e3/temperature": self.temperature,
            "e3/target_entropy": target,
            "e3/entropy": entropy,
            "e3/temperature_clamped": float(proposed != self.temperature),
        }
        return self.temperature, metrics

    def state_dict(self) -> dict[str, float | int | None]:
        return {
            "temperature": self.temperature,
            "initial_entropy": self.initial_entropy,
            "last_step": self.last_step,
        }

    def load_state_dict(self, state: dict[str, float | int | None]) -> None:
        for key in ("temperature", "initial_entropy", "last_step"):
            if key not in state:
                raise ValueError(f"TemperatureScheduler state is missing {key!r}")
        temperature = state["temperature"]
        if temperature is None or not (math.isfinite(float(temperature)) and float(temperature) > 0):
            raise ValueError(f"TemperatureScheduler state has an invalid temperature {temperature!r}")
        self.temperature = float(temperature)
        initial = state["initial_entropy"]
        self.initial_entropy = None if initial is None else float(initial)
        last = state["last_step"]
        self.last_step = None if last is None else int(last)
