"""Overhead of D³S selection + CW-GRPO weights on top of the GRPO loss, measured in one run.

Inputs: 64 prompts × 16 responses × 1,024 tokens of per-token log-probs, entropies
and masks (ragged response lengths), float32 on CPU. Baseline: GRPO advantages +
GRPO loss forward and backward over every response, as the RL loop updates GRPO.
Extras: D³S cross-group sample selection (N_s = 8), D³S top-K% token selection
(K = 20%) and CW-GRPO weights, then the loss two ways:

* as the RL loop runs it (``pipeline/stages/rl.py``): the weights are computed on
  the whole batch with the sample keep mask, and the update takes only the kept
  rows (``TrainBatch.select``), so the loss runs on N_s of every G responses;
* on the same rows as the baseline (the dropped rows masked out): the extras'
  pure added cost, with the loss doing the same work on both sides.

The three are timed round-robin (order rotated every repeat, so drift on a shared
machine hits all alike) after one untimed warm-up call each; prints the median of
each, the ratios to the baseline (target ≤ 1.10 for the loop's path) and the
median time of every extra on its own; writes them, with the fastest repeat of each, to
``<out>/algorithms.json`` and ``<out>/algorithms.png``.

    .venv/bin/python -m tools.bench.algorithms [--prompts 64 --group 16 --tokens 1024 --repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

import torch

from pipeline.algorithms import advantages as adv
from pipeline.algorithms import cw_grpo, d3s, losses

from tools.bench.report import Panel, save

RATIO_TARGET = 1.10  # the RL loop's path / the GRPO loss


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


def d3s_cw_same_rows(group_ids, rewards, response_mask, old_logprobs, logprobs, entropy):
    keep, sample_adv = select_samples(group_ids, rewards)
    token_mask = select_tokens(keep, sample_adv, group_ids, response_mask, entropy)
    weights = reweight_tokens(sample_adv, group_ids, token_mask, logprobs)
    token_adv = sample_adv[:, None] * weights
    loss, _ = losses.grpo_loss(logprobs=logprobs, old_logprobs=old_logprobs, advantages=token_adv,
                               response_mask=response_mask, token_mask=token_mask)
    loss.backward()


def d3s_cw_kept_rows(group_ids, rewards, response_mask, old_logprobs, logprobs, entropy):
    keep, sample_adv = select_samples(group_ids, rewards)
    token_mask = select_tokens(keep, sample_adv, group_ids, response_mask, entropy)
    weights = reweight_tokens(sample_adv, group_ids, token_mask, logprobs)
    token_adv = sample_adv[:, None] * weights
    rows = keep.nonzero().squeeze(1)  # the rows the update sees, as TrainBatch.select(kept_rows)
    loss, _ = losses.grpo_loss(logprobs=logprobs[rows], old_logprobs=old_logprobs[rows],
                               advantages=token_adv[rows], response_mask=response_mask[rows],
                               token_mask=token_mask[rows])
    loss.backward()


def seconds(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def round_robin_times(fns, inputs, repeats: int) -> list[list[float]]:
    """Seconds of each repeat of each of ``fns``, run round-robin on the same inputs."""
    times: list[list[float]] = [[] for _ in fns]
    for repeat in range(repeats + 1):  # repeat 0 warms up allocators and caches, untimed
        for offset in range(len(fns)):
            index = (repeat + offset) % len(fns)
            inputs[4].grad = None
            elapsed = seconds(fns[index], *inputs)
            if repeat:
                times[index].append(elapsed)
    return times


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


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--group", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--out", default="runs/bench/algorithms", help="output directory")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    inputs = make_inputs(args.prompts, args.group, args.tokens)
    paths = {"GRPO loss, all rows": grpo_only, "D³S + CW-GRPO, kept rows (RL loop)": d3s_cw_kept_rows,
             "D³S + CW-GRPO, all rows": d3s_cw_same_rows}
    times = dict(zip(paths, round_robin_times(tuple(paths.values()), inputs, args.repeats)))
    medians = {name: statistics.median(t) for name, t in times.items()}
    fastest = {name: min(t) for name, t in times.items()}
    base, kept_rows, same_rows = medians.values()
    extras = extras_breakdown(inputs, args.repeats)
    results = {
        "paths": {name: {"median_s": medians[name], "fastest_s": fastest[name], "times_s": times[name],
                         "ratio": medians[name] / base} for name in paths},
        "ratio_kept_rows": kept_rows / base, "ratio_kept_rows_target": RATIO_TARGET,
        "ratio_same_rows": same_rows / base, "extras_median_s": extras,
    }
    print(f"inputs: {args.prompts} prompts × {args.group} responses × {args.tokens} tokens, "
          f"{torch.get_num_threads()} threads")
    print(f"GRPO loss (fwd+bwd), all rows                  : {base * 1e3:8.1f} ms")
    print(f"D³S + CW-GRPO, loss on the kept rows (RL loop) : {kept_rows * 1e3:8.1f} ms"
          f"  ratio {kept_rows / base:6.3f}  (target ≤ {RATIO_TARGET:.2f})")
    print(f"D³S + CW-GRPO, loss on all rows (added cost)   : {same_rows * 1e3:8.1f} ms"
          f"  ratio {same_rows / base:6.3f}")
    for name, median in extras.items():
        print(f"  {name:34s}: {median * 1e3:8.2f} ms")

    panels = [
        Panel(title="GRPO loss fwd+bwd, with and without the D³S + CW-GRPO extras (median of the repeats)",
              xlabel="ms per call", bars={name: t * 1e3 for name, t in medians.items()},
              markers={name: t * 1e3 for name, t in fastest.items()}),
        Panel(title="ratio to the GRPO loss over all rows, median", xlabel="ratio (lower is faster)",
              bars={name: medians[name] / base for name in list(paths)[1:]},
              lines={f"target ≤ {RATIO_TARGET:.2f} (RL loop)": RATIO_TARGET}),
        Panel(title="each extra on its own, median", xlabel="ms per call",
              bars={name: t * 1e3 for name, t in extras.items()}),
    ]
    save(args.out, "algorithms", settings=vars(args), results=results, panels=panels,
         title=f"D³S + CW-GRPO overhead ({args.prompts} prompts × {args.group} responses × {args.tokens} tokens)")
    return results


if __name__ == "__main__":
    main()
