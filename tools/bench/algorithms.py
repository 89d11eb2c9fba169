"""Overhead of D³S selection + CW-GRPO weights on top of the GRPO loss, measured in one run.

Inputs: 64 prompts × 16 responses × 1,024 tokens of per-token log-probs, entropies
and masks (ragged response lengths), float32 on CPU. Baseline: GRPO advantages +
GRPO loss forward and backward. Extras: the same plus D³S cross-group sample
selection (N_s = 8), D³S top-K% token selection (K = 20%) and CW-GRPO weights.
Prints the median of several repeats of each and the ratio (target ≤ 1.10).

    .venv/bin/python tools/bench/algorithms.py [--prompts 64 --group 16 --tokens 1024 --repeats 7]
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


def grpo_with_d3s_cw(group_ids, rewards, response_mask, old_logprobs, logprobs, entropy):
    sample_adv, _ = adv.grpo_advantages(rewards=rewards, group_ids=group_ids)
    (keep, sample_adv), _ = d3s.d3s_cross_select(advantages=sample_adv, rewards=rewards, group_ids=group_ids, num_keep=8)
    topk, _ = d3s.d3s_topk_token_weights(advantages=sample_adv, entropy=entropy, logprobs=None,
                                          response_mask=response_mask, group_ids=group_ids, keep_ratio=0.2,
                                          sample_keep_mask=keep)
    token_mask = topk > 0
    weights, _ = cw_grpo.cw_grpo_token_weights(advantages=sample_adv, entropy=None, logprobs=logprobs.detach(),
                                               response_mask=response_mask & token_mask, group_ids=group_ids)
    token_adv = sample_adv[:, None] * weights
    loss, _ = losses.grpo_loss(logprobs=logprobs, old_logprobs=old_logprobs, advantages=token_adv,
                               response_mask=response_mask, token_mask=token_mask)
    loss.backward()


def median_seconds(fn, inputs, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):  # the first run warms up allocators
        inputs[4].grad = None
        start = time.perf_counter()
        fn(*inputs)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--group", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    inputs = make_inputs(args.prompts, args.group, args.tokens)
    base = median_seconds(grpo_only, inputs, args.repeats)
    extra = median_seconds(grpo_with_d3s_cw, inputs, args.repeats)
    print(f"inputs: {args.prompts} prompts × {args.group} responses × {args.tokens} tokens, "
          f"{torch.get_num_threads()} threads")
    print(f"GRPO loss (fwd+bwd)                 : {base * 1e3:8.1f} ms")
    print(f"GRPO + D³S sample/token + CW-GRPO   : {extra * 1e3:8.1f} ms")
    print(f"ratio                               : {extra / base:8.3f}  (target ≤ 1.10)")


if __name__ == "__main__":
    main()
