"""Time and peak memory of chunked vs materialized log-probs + entropy (forward + backward).

    .venv/bin/python -m tools.bench.logprobs_memory                # 16k tokens, H=1024, V=32k: ~85 s on 2 idle cores
    .venv/bin/python -m tools.bench.logprobs_memory --tokens 4096  # quicker

Each variant runs in its own subprocess. Peak memory is the kernel's resident
set high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs`` once the
inputs exist; it counts every page torch's CPU allocator touched) minus the
resident set right after the inputs were created; the gradients of ``hidden`` and
``output_weight`` are outputs every variant must produce, so they are reported
apart and the "excess" is peak − gradients, to compare with one
``(chunk, V)`` float32 block. Both variants compute
``loss = Σ g₁·logp + g₂·entropy`` with the same random ``g₁, g₂`` and the parent
checks that they agree. Writes ``<out>/logprobs_memory.json`` and ``<out>/logprobs_memory.png``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from tools.bench.report import Panel, save

REPO = Path(__file__).resolve().parents[2]  # the children run as `-m tools.bench.logprobs_memory` from here
MIB = 1 << 20
# Targets of docs/benchmarks.md: chunked fwd+bwd time / materialized, and chunked excess in (chunk, V) blocks.
TIME_RATIO_TARGET = 1.2
EXCESS_BLOCKS_TARGET = 1.0


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # reported in kB
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak_rss() -> bool:
    """Reset the kernel's RSS high-water mark (VmHWM), Linux ≥ 4.0; False if not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


def _run_variant(args: argparse.Namespace) -> dict[str, float]:
    import torch

    from pipeline.algorithms.logprobs import logprobs_from_logits, token_logprobs_and_entropy

    if args.threads:
        torch.set_num_threads(args.threads)

    def compute(hidden, weight, targets):
        if args.child == "chunked":
            result = token_logprobs_and_entropy(
                hidden=hidden,
                output_weight=weight,
                targets=targets,
                temperature=args.temperature,
                chunk_size=args.chunk_size,
            )
            return result.logprobs, result.entropy
        result = logprobs_from_logits((hidden @ weight.t()).unsqueeze(0), targets.unsqueeze(0), args.temperature)
        return result.logprobs.squeeze(0), result.entropy.squeeze(0)

    def make_inputs(num_tokens: int, seed: int):
        # In-place scaling: a temporary here would raise the high-water mark before the run.
        generator = torch.Generator().manual_seed(seed)
        hidden = torch.randn(num_tokens, args.hidden, generator=generator).mul_(0.5).requires_grad_()
        weight = torch.randn(args.vocab, args.hidden, generator=generator).mul_(args.hidden**-0.5).requires_grad_()
        targets = torch.randint(0, args.vocab, (num_tokens,), generator=generator)
        grad_logprobs = torch.randn(num_tokens, generator=generator)
        grad_entropy = torch.randn(num_tokens, generator=generator)
        return hidden, weight, targets, grad_logprobs, grad_entropy

    # Warm up on one chunk of tokens: the BLAS library keeps packing
    # workspaces (~10-20 MiB) after its first large GEMM, and those belong to the
    # process baseline, not to either variant. Blocks this size are mmapped and
    # go back to the OS when freed, so the warm-up cannot pre-pay the run's memory.
    hidden, weight, targets, g1, g2 = make_inputs(min(args.tokens, args.chunk_size), seed=1)
    logprobs, entropy = compute(hidden, weight, targets)
    ((logprobs * g1).sum() + (entropy * g2).sum()).backward()
    del hidden, weight, targets, g1, g2, logprobs, entropy

    hidden, weight, targets, g1, g2 = make_inputs(args.tokens, seed=0)
    baseline = _status_bytes("VmRSS")
    if not _reset_peak_rss() and _status_bytes("VmHWM") > baseline + 8 * MIB:
        raise RuntimeError("cannot reset VmHWM and the high-water mark already exceeds the inputs")
    start = time.perf_counter()
    logprobs, entropy = compute(hidden, weight, targets)
    forward_s = time.perf_counter() - start
    ((logprobs * g1).sum() + (entropy * g2).sum()).backward()
    total_s = time.perf_counter() - start
    peak = _status_bytes("VmHWM")
    return {
        "forward_s": forward_s,
        "total_s": total_s,
        "peak_above_inputs_mib": (peak - baseline) / MIB,
        "logprob_sum": float(logprobs.detach().double().sum()),
        "entropy_sum": float(entropy.detach().double().sum()),
        "grad_hidden_norm": float(hidden.grad.double().norm()),
        "grad_weight_norm": float(weight.grad.double().norm()),
    }


def main(argv: Sequence[str] | None = None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--chunk-size", type=int, default=1024)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--out", default="runs/bench/logprobs_memory", help="output directory")
    parser.add_argument("--child", choices=["chunked", "materialized"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child:
        print(json.dumps(_run_variant(args)))
        return None

    results = {}
    for variant in ("materialized", "chunked"):
        command = [sys.executable, "-m", "tools.bench.logprobs_memory", "--child", variant] + [
            f"--tokens={args.tokens}",
            f"--hidden={args.hidden}",
            f"--vocab={args.vocab}",
            f"--chunk-size={args.chunk_size}",
            f"--temperature={args.temperature}",
            f"--threads={args.threads}",
        ]
        completed = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=False)
        if completed.returncode != 0:
            sys.exit(f"{variant} run failed:\n{completed.stderr}")
        results[variant] = json.loads(completed.stdout.strip().splitlines()[-1])

    float_bytes = 4
    block_mib = args.chunk_size * args.vocab * float_bytes / MIB
    logits_mib = args.tokens * args.vocab * float_bytes / MIB
    grads_mib = (args.tokens + args.vocab) * args.hidden * float_bytes / MIB
    print(
        f"tokens={args.tokens} hidden={args.hidden} vocab={args.vocab} chunk={args.chunk_size} float32, "
        f"forward+backward"
    )
    print(f"one (chunk, V) block: {block_mib:.0f} MiB; full logits: {logits_mib:.0f} MiB; "
          f"hidden+weight gradients: {grads_mib:.0f} MiB")
    print(f"{'variant':<14}{'fwd s':>8}{'fwd+bwd s':>11}{'peak MiB':>10}{'excess MiB':>12}{'excess/block':>14}")
    for variant, result in results.items():
        result["excess_mib"] = result["peak_above_inputs_mib"] - grads_mib
        result["excess_blocks"] = result["excess_mib"] / block_mib
        print(
            f"{variant:<14}{result['forward_s']:>8.2f}{result['total_s']:>11.2f}"
            f"{result['peak_above_inputs_mib']:>10.0f}{result['excess_mib']:>12.0f}{result['excess_blocks']:>14.2f}"
        )
    chunked, materialized = results["chunked"], results["materialized"]
    time_ratio = chunked["total_s"] / materialized["total_s"]
    memory_ratio = chunked["peak_above_inputs_mib"] / materialized["peak_above_inputs_mib"]
    print(
        f"chunked / materialized: time {time_ratio:.2f}x (target ≤ {TIME_RATIO_TARGET:g}), "
        f"peak memory {memory_ratio:.3f}x; chunked excess {chunked['excess_blocks']:.2f} blocks "
        f"(target ≤ {EXCESS_BLOCKS_TARGET:g})"
    )
    disagreements = [
        f"variants disagree on {key}: chunked {chunked[key]} vs materialized {materialized[key]}"
        for key in ("logprob_sum", "entropy_sum", "grad_hidden_norm", "grad_weight_norm")
        if abs(chunked[key] - materialized[key]) > 1e-3 * max(1.0, abs(materialized[key]))
    ]
    if not disagreements:
        print("variants agree on log-probs, entropies and gradients (rel. tol 1e-3)")

    summary = {
        "block_mib": block_mib, "logits_mib": logits_mib, "gradients_mib": grads_mib, "variants": results,
        "time_ratio": time_ratio, "time_ratio_target": TIME_RATIO_TARGET, "peak_memory_ratio": memory_ratio,
        "excess_blocks_target": EXCESS_BLOCKS_TARGET, "variants_agree": not disagreements,
    }
    panels = [
        Panel(title="forward + backward time (one run each)", xlabel="seconds",
              bars={variant: result["total_s"] for variant, result in results.items()},
              markers={variant: result["forward_s"] for variant, result in results.items()},
              marker_label="forward only"),
        Panel(title="peak resident memory above the inputs (log scale)", xlabel="MiB",
              bars={variant: result["peak_above_inputs_mib"] for variant, result in results.items()},
              lines={"hidden + weight gradients": grads_mib,
                     f"gradients + {EXCESS_BLOCKS_TARGET:g} (chunk, V) block (target)":
                         grads_mib + EXCESS_BLOCKS_TARGET * block_mib},
              log_scale=True),
        Panel(title="chunked / materialized, forward + backward", xlabel="ratio (lower is better)",
              bars={"time": time_ratio, "peak memory": memory_ratio},
              lines={f"time target ≤ {TIME_RATIO_TARGET:g}": TIME_RATIO_TARGET}),
    ]
    save(args.out, "logprobs_memory", settings={k: v for k, v in vars(args).items() if k != "child"},
         results=summary, panels=panels, threads=args.threads or None,
         title=f"Chunked vs materialized log-probs + entropy ({args.tokens} tokens, hidden {args.hidden}, "
               f"vocab {args.vocab}, chunk {args.chunk_size})")
    if disagreements:
        sys.exit("\n".join(disagreements))
    return summary


if __name__ == "__main__":
    main()
