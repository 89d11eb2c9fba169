"""Overhead of D³S selection + CW-GRPO weights on top of the GRPO loss, measured in one run.

Inputs: 64 prompts × 16 responses × 1,024 tokens of per-token log-probs, entropies
and masks (ragged response lengths), float32 on CPU. Baseline: GRPO advantages +
GRPO loss forward and backward. Extras: the same plus D³S cross-group sample
selection (N_s = 8), D³S top-K% token selection (K = 20%) and CW-GRPO weights.
The two are timed alternately (order swapped every repeat, so drift on a shared
machine hits both alike) after one untimed warm-up call each; prints the median of
each, their ratio (target ≤ 1.10) and the median time of every extra on its own.

    .venv/bin/python tools/bench/algorithms.py [--prompts 64 --group 16 --tokens 1024 --repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pipeline.algorithms import advantages as adv
from pipeline.algorithms import cw_grpo, d3s, losses


def make_inputs(num_prompts: int, group_size: int, num_tokens: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    rows = num_prompts * group_size
    group_ids = torch.arange(num_prompts).repeat_interleave(group_size)  # (S,)
    rewards = (torch.rand(rows, generator=generator) < 0.4).float()  # (S,)
    lengths = torch.randint(num_tokens // 4, num_tokens + 1, (rows,), generator=generator)
    response_mask = torch.arange(num_tokens)[None, :] < lengths[:, None]  # (S, T)
    old_logprobs = -torch.rand(rows, num_tokens, generator=generator) * 3  # (S, T)
    logprobs = (old_logprobs + 0.01 * torch.randn(rows, num_tokens, generator=generator)).requires_grad_()
    entropy = torch.rand(rows, num_tokens, generator=generator) * 2  # (S, T)
    return group_ids, rewards, response_mask, old_logprobs, logprobs, entropy


def grpo_only(group_ids, rewards, response_mask, old_logprobs, logprobs, entropy):
    sample_adv, _ = adv.grpo_advantages(rewards=rewards, group_ids=group_ids)
    token_adv = sample_adv[:, None].expand_as(logprobs)
    loss, _ = losses.grpo_loss(logprobs=logprobs, old_logprobs=old_logprobs, advantages=token_adv,
                               response_mask=response_mask)
    loss.backward()


def select_samples(group_ids, rewards):
    sample_adv, _ = adv.grpo_advantages(rewards=rewards, group_ids=group_ids)
    (keep, sample_adv), _ = d3s.d3s_cross_select(advantages=sample_adv, rewards=rewards, group_ids=group_ids, num_keep=8)
    return keep, sample_adv


def select_tokens(keep, sample_adv, group_ids, response_mask, entropy):
    topk, _ = d3s.d3s_topk_token_weights(advantages=sample_adv, entropy=entropy, logprobs=None,
                                          response_mask=response_mask, group_ids=group_ids, keep_ratio=0.2,
                                          sample_keep_mask=keep)
    # 0/1 weights that are 0 off the response: their bool view is the token mask (⊆ response_mask).
    return topk.bool()


def reweight_tokens(sample_adv, group_ids, token_mask, logprobs):
    weights, _ = cw_grpo.cw_grpo_token_weights(advantages=sample_adv, entropy=None, logprobs=logprobs.detach(),
                                               response_mask=token_mask, group_ids=group_ids)
    return weights


def grpo_with_d3s_cw(group_ids, rewards, response_mask, old_logprobs, logprobs, entropy):
    keep, sample_adv = select_samples(group_ids, rewards)
    token_mask = select_tokens(keep, sample_adv, group_ids, response_mask, entropy)
    weights = reweight_tokens(sample_adv, group_ids, token_mask, logprobs)
    token_adv = sample_adv[:, None] * weights
    loss, _ = losses.grpo_loss(logprobs=logprobs, old_logprobs=old_logprobs, advantages=token_adv,
                               response_mask=response_mask, token_mask=token_mask)
    loss.backward()


def seconds(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def alternating_medians(inputs, repeats: int) -> tuple[float, float]:
    """Median seconds of grpo_only and grpo_with_d3s_cw, run alternately on the same inputs."""
    times: dict = {grpo_only: [], grpo_with_d3s_cw: []}
    for repeat in range(repeats + 1):  # repeat 0 warms up allocators and caches, untimed
        order = (grpo_only, grpo_with_d3s_cw) if repeat % 2 else (grpo_with_d3s_cw, grpo_only)
        for fn in order:
            inputs[4].grad = None
            elapsed = seconds(fn, *inputs)
            if repeat:
                times[fn].append(elapsed)
    return statistics.median(times[grpo_only]), statistics.median(times[grpo_with_d3s_cw])


def extras_breakdown(inputs, repeats: int) -> dict[str, float]:
    """Median seconds of each extra on its own, on the inputs the full path gives it."""
    group_ids, rewards, response_mask, _, logprobs, entropy = inputs
    sample_adv, _ = adv.grpo_advantages(rewards=rewards, group_ids=group_ids)
    keep, kept_adv = select_samples(group_ids, rewards)
    token_mask = select_tokens(keep, kept_adv, group_ids, response_mask, entropy)
    steps = {
        "D³S sample selection (Eq. 7)": lambda: d3s.d3s_cross_select(
            advantages=sample_adv, rewards=rewards, group_ids=group_ids, num_keep=8),
        "D³S token top-K (Eq. 8)": lambda: select_tokens(keep, kept_adv, group_ids, response_mask, entropy),
        "CW-GRPO weights": lambda: reweight_tokens(kept_adv, group_ids, token_mask, logprobs),
    }
    medians = {}
    for name, step in steps.items():
        step()
        medians[name] = statistics.median(seconds(step) for _ in range(repeats))
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--group", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    inputs = make_inputs(args.prompts, args.group, args.tokens)
    base, extra = alternating_medians(inputs, args.repeats)
    print(f"inputs: {args.prompts} prompts × {args.group} responses × {args.tokens} tokens, "
          f"{torch.get_num_threads()} threads")
    print(f"GRPO loss (fwd+bwd)                 : {base * 1e3:8.1f} ms")
    print(f"GRPO + D³S sample/token + CW-GRPO   : {extra * 1e3:8.1f} ms")
    print(f"ratio                               : {extra / base:8.3f}  (target ≤ 1.10)")
    for name, median in extras_breakdown(inputs, args.repeats).items():
        print(f"  {name:34s}: {median * 1e3:8.2f} ms")


if __name__ == "__main__":
    main()
