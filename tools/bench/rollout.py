"""Tokens/s of the local rollout engine vs raw ``transformers`` ``generate``, same model and batch.

    .venv/bin/python -m tools.bench.rollout                      # 16 prompts x 8 samples x 48 tokens
    .venv/bin/python -m tools.bench.rollout --prompts 32 --samples 4 --new-tokens 128 --repeats 5

The model is a random Llama built from a config (default ~0.6M parameters: 4 layers,
hidden 128, vocab 100), float32 on CPU. Both sides sample at temperature 1 with no
top-k/top-p and must produce exactly ``prompts x samples x new_tokens`` tokens
(``generate`` with ``min_new_tokens``, the engine with ``ignore_eos``; the model has no
EOS anyway). ``generate`` expands each prompt ``samples`` times before prefill
(``num_return_sequences``); the engine prefills each distinct prompt once. The two
are timed alternately, best of ``--repeats``, after one warm-up run each, so a
background load spike hurts both the same way. Writes ``<out>/rollout.json`` and
``<out>/rollout.png``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pipeline.rollout.local import LocalEngine
from pipeline.rollout.types import GenerationRequest, SamplingParams

from tools.bench.report import Panel, save

RATIO_TARGET = 0.90  # engine tokens/s / generate tokens/s, best runs


def _model(args: argparse.Namespace) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=args.max_prompt_len + args.new_tokens,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--min-prompt-len", type=int, default=8)
    parser.add_argument("--max-prompt-len", type=int, default=24)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/bench/rollout", help="output directory")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    model = _model(args)
    generator = torch.Generator().manual_seed(args.seed + 1)
    lengths = torch.randint(args.min_prompt_len, args.max_prompt_len + 1, (args.prompts,), generator=generator)
    prompts = [torch.randint(1, args.vocab, (int(n),), generator=generator).tolist() for n in lengths]
    width = max(len(p) for p in prompts)
    input_ids = torch.zeros(args.prompts, width, dtype=torch.long)
    attention_mask = torch.zeros(args.prompts, width, dtype=torch.long)
    for i, prompt in enumerate(prompts):
        input_ids[i, width - len(prompt) :] = torch.tensor(prompt)
        attention_mask[i, width - len(prompt) :] = 1
    num_tokens = args.prompts * args.samples * args.new_tokens

    engine = LocalEngine(model, max_batch_rows=args.prompts * args.samples, show_progress=False)
    requests = [GenerationRequest(f"p{i}", p, args.samples) for i, p in enumerate(prompts)]
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, seed=args.seed, ignore_eos=True)

    def run_generate() -> None:
        with torch.inference_mode():
            out = model.generate(
                input_ids,
                attention_mask=attention_mask,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=args.new_tokens,
                min_new_tokens=args.new_tokens,
                num_return_sequences=args.samples,
                pad_token_id=0,
            )
        assert out.shape == (args.prompts * args.samples, width + args.new_tokens)

    def run_engine() -> None:
        completions = engine.generate(requests, params)
        assert sum(c.num_tokens for c in completions) == num_tokens

    timings: dict[str, list[float]] = {"generate": [], "engine": []}
    run_generate(), run_engine()  # warm-up: allocator, lazy initialisation
    for _ in range(args.repeats):
        for name, fn in (("generate", run_generate), ("engine", run_engine)):
            start = time.perf_counter()
            fn()
            timings[name].append(time.perf_counter() - start)

    num_params = sum(p.numel() for p in model.parameters())
    print(
        f"model: Llama {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, {num_params / 1e3:.0f}k params, "
        f"float32, {torch.get_num_threads()} threads"
    )
    print(
        f"batch: {args.prompts} prompts x {args.samples} samples x {args.new_tokens} new tokens = {num_tokens} tokens"
    )
    sides = {}
    for name, seconds in timings.items():
        # The median of an odd count; the upper middle of an even one.
        best, median = min(seconds), sorted(seconds)[len(seconds) // 2]
        sides[name] = {"best_s": best, "median_s": median, "times_s": seconds, "tokens_per_s": num_tokens / best,
                       "median_tokens_per_s": num_tokens / median}
        print(f"{name:>9}: best {best * 1e3:8.1f} ms  median {median * 1e3:8.1f} ms  "
              f"{sides[name]['tokens_per_s']:9.0f} tokens/s")
    ratio = sides["engine"]["tokens_per_s"] / sides["generate"]["tokens_per_s"]
    median_ratio = sides["engine"]["median_tokens_per_s"] / sides["generate"]["median_tokens_per_s"]
    print(f"ratio engine / generate: {ratio:.2f}x (target >= {RATIO_TARGET:.2f}x)")

    results = {"num_parameters": num_params, "num_tokens": num_tokens, "sides": sides, "ratio": ratio,
               "ratio_target": RATIO_TARGET, "median_ratio": median_ratio}
    panels = [
        Panel(title="throughput at the median run", xlabel="tokens per second (higher is faster)",
              bars={name: side["median_tokens_per_s"] for name, side in sides.items()},
              markers={name: side["tokens_per_s"] for name, side in sides.items()}),
        Panel(title="engine / generate tokens per second", xlabel="ratio (higher is faster)",
              bars={"median runs": median_ratio, "fastest runs (headline)": ratio},
              lines={f"target ≥ {RATIO_TARGET:.2f}": RATIO_TARGET}),
    ]
    save(args.out, "rollout", settings=vars(args), results=results, panels=panels,
         title=f"Local rollout engine vs transformers generate ({args.prompts} prompts × {args.samples} samples × "
               f"{args.new_tokens} tokens, {num_params / 1e3:.0f}k params)")
    return results


if __name__ == "__main__":
    main()
