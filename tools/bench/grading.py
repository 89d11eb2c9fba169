"""Grading throughput and adversarial wall time: GradingPool vs plain math-verify.

    python -m tools.bench.grading [--num-items 4000] [--solution-items 1000] [--num-workers N] [--deadline-s 2]

Prints three measurements:

1. gradings/s for a typical RL batch (mostly integers and short fractions, ~10% that
   need sympy: radicals, pi, sets, intervals, polynomials, or no box at all) through
   ``GradingPool`` on all cores, and for a single-process math-verify baseline
   (``verify(parse(gold), parse(response))`` per item) on a sample of the same batch,
   with the ratio and how often the two disagree;
2. the same for full reference solutions (MATH-500's worked solutions and GSM8K's with
   the final ``#### n`` boxed, interleaved, with their problems so the answer rules
   run): whole responses of a few hundred to a few thousand characters, not only
   short answers;
3. the wall time of an adversarial batch (huge powers, factorials, deep nesting, a
   1 MB string, NUL bytes, unbalanced braces) against the deadline arithmetic
   ``ceil(num_timeouts / num_workers) * deadline_s + overhead_s``.

Writes them to ``<out>/grading.json`` and ``<out>/grading.png``.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import random
import time
from collections.abc import Sequence

from pipeline.data.benchmarks import load_benchmark
from pipeline.rewards import GradingPool, Reason
from tools.bench.report import Panel, save

THROUGHPUT_TARGET = 500.0  # gradings/s of the pool on a typical batch (docs/benchmarks.md)

_FILLER = (
    "Let us set up the problem. We have $a + b = {a}$ and $ab = {b}$, so by Vieta's "
    "formulas the roots satisfy $t^2 - {a}t + {b} = 0$. Checking the discriminant, "
    "$\\Delta = {a}^2 - 4 \\cdot {b}$, and simplifying step by step gives the value. "
)


def _plain_item(rng: random.Random) -> tuple[str, str]:
    """Integers, fractions and decimals; right half the time, in varied notation."""
    kind = rng.random()
    if kind < 0.6:
        value = rng.randint(-50, 2000)
        gold = str(value)
        answer = gold if rng.random() < 0.5 else str(value + rng.choice([-1, 1, 10]))
    elif kind < 0.85:
        numerator, denominator = rng.randint(1, 40), rng.randint(2, 41)
        gold = f"\\frac{{{numerator}}}{{{denominator}}}"
        right = rng.random() < 0.5
        numerator += 0 if right else 1
        answer = rng.choice(
            [
                f"\\frac{{{numerator}}}{{{denominator}}}",
                f"\\dfrac{{{numerator}}}{{{denominator}}}",
                f"{numerator}/{denominator}",
            ]
        )
    else:
        value = rng.randint(1, 999) / 100
        gold = f"{value:g}"
        answer = gold if rng.random() < 0.5 else f"{value + 0.5:g}"
    return answer, gold


def _symbolic_item(rng: random.Random) -> tuple[str, str]:
    """Answers only sympy can compare (numbers varied so no cache makes them free)."""
    n = rng.randint(2, 30)
    choices = [
        (f"{n}\\sqrt{{2}}", f"\\sqrt{{{2 * n * n}}}"),
        (f"\\frac{{\\pi}}{{{n}}}", f"\\pi/{n}"),
        (f"\\{{{n},{n + 1}\\}}", f"\\{{{n + 1},{n}\\}}"),
        (f"(0,{n}]", f"(0, {n}]"),
        (f"(x+{n})^2", f"x^2+{2 * n}x+{n * n}"),
        (f"{n}\\sqrt{{3}}", f"\\sqrt{{{3 * n * n + 1}}}"),  # wrong
    ]
    return rng.choice(choices)


def typical_batch(num_items: int, *, seed: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    pairs = []
    for _ in range(num_items):
        roll = rng.random()
        answer, gold = _symbolic_item(rng) if roll < 0.07 else _plain_item(rng)
        filler = _FILLER.format(a=rng.randint(2, 99), b=rng.randint(2, 99)) * rng.randint(2, 6)
        if roll > 0.97:  # no box: math-verify must find the answer in the text
            pairs.append((filler + f"Therefore, the final answer is {gold}.", gold))
        else:
            pairs.append((filler + f"Hence the answer is $\\boxed{{{answer}}}$.", gold))
    return pairs


def solution_batch(num_items: int) -> list[tuple[str, str, str]]:
    """``(reference solution, gold, problem)``: MATH-500 and GSM8K test, interleaved, repeated up to ``num_items``."""
    math500 = [(p.metadata["solution"], p.answer, p.problem) for p in load_benchmark("math500")[0]]
    gsm8k = []
    for prompt in load_benchmark("gsm8k")[0]:
        work, final = prompt.metadata["solution"].rsplit("####", 1)
        gsm8k.append((work + "The answer is $\\boxed{" + final.strip() + "}$.", prompt.answer, prompt.problem))
    interleaved = [item for pair in itertools.zip_longest(math500, gsm8k) for item in pair if item is not None]
    return list(itertools.islice(itertools.cycle(interleaved), num_items))


def adversarial_batch() -> list[tuple[str, str]]:
    return [
        ("\\boxed{9^{9^{9^9}}}", "5"),
        ("\\boxed{\\dfrac{5^{\\left(5^{\\left(5^{\\left(5^5\\right)}\\right)} - 4\\right)} - 5}{16}}", "5"),
        ("\\boxed{(10^8)!}", "5"),
        ("\\boxed{2^{2^{30}}}", "5"),
        ("\\boxed{10^{10^{10}}}", "5"),
        ("\\boxed{" + "(" * 3000 + "1" + ")" * 3000 + "}", "1"),
        ("\\boxed{" + "\\frac{1}{" * 120 + "2" + "}" * 120 + "}", "1"),
        ("x" * 1_000_000 + "\\boxed{5}", "5"),
        ("1+" * 500_000, "5"),
        ("\x00" * 1_000_000, "5"),
        ("\\boxed{1\x00}", "1"),
        ("\\boxed{\\frac{1}{2}" + "{" * 5000, "1/2"),
        ("}" * 5000 + "\\boxed{5}", "5"),
    ]


def math_verify_baseline(pairs: Sequence[tuple[str, ...]]) -> tuple[float, list[bool]]:
    """Plain math-verify in this process, with its default 5 s signal timeouts."""
    from math_verify import parse, verify

    start = time.perf_counter()
    verdicts = [verify(parse("\\boxed{" + gold + "}"), parse(response)) for response, gold, *_ in pairs]
    return len(pairs) / (time.perf_counter() - start), verdicts


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-items", type=int, default=4000)
    parser.add_argument("--baseline-items", type=int, default=400)
    parser.add_argument("--solution-items", type=int, default=1000,
                        help="full reference solutions graded by the pool (math-verify gets --baseline-items of them)")
    parser.add_argument("--num-workers", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--deadline-s", type=float, default=2.0)
    parser.add_argument("--overhead-s", type=float, default=1.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/bench/grading", help="output directory")
    args = parser.parse_args(argv)

    pairs = typical_batch(args.num_items, seed=args.seed)
    start = time.perf_counter()
    with GradingPool(args.num_workers, deadline_s=args.deadline_s) as pool:
        startup_s = time.perf_counter() - start
        start = time.perf_counter()
        grades = pool.grade_batch(pairs)
        pool_rate = len(pairs) / (time.perf_counter() - start)
        metrics = pool.metrics
        print(f"pool startup: {startup_s:.2f} s ({args.num_workers} workers)")
        print(
            f"typical batch: {len(pairs)} items, {metrics['num_fast_path']:.0f} decided by "
            f"the fast path, {metrics['num_math_verify']:.0f} sent to workers"
        )
        print(f"pool:     {pool_rate:8.1f} gradings/s on {args.num_workers} workers "
              f"(target ≥ {THROUGHPUT_TARGET:g})")

        sample = pairs[: args.baseline_items]
        baseline_rate, verdicts = math_verify_baseline(sample)
        disagreements = sum(g.is_correct != v for g, v in zip(grades, verdicts))
        print(
            f"baseline: {baseline_rate:8.1f} gradings/s "
            f"(single-process math-verify, {len(sample)} items)"
        )
        print(
            f"ratio:    {pool_rate / baseline_rate:8.1f}x; "
            f"disagreements with math-verify: {disagreements}/{len(sample)}"
        )

        solutions = solution_batch(args.solution_items)
        start = time.perf_counter()
        solution_grades = pool.grade_batch(solutions)
        solution_rate = len(solutions) / (time.perf_counter() - start)
        solution_sample = solutions[: args.baseline_items]
        solution_baseline_rate, solution_verdicts = math_verify_baseline(solution_sample)
        solution_disagreements = sum(g.is_correct != v for g, v in zip(solution_grades, solution_verdicts))
        num_solutions_correct = sum(g.is_correct for g in solution_grades)
        mean_chars = sum(len(response) for response, _, _ in solutions) / max(len(solutions), 1)
        print(f"full solutions: {len(solutions)} items (MATH-500 + GSM8K, mean {mean_chars:.0f} chars), "
              f"{num_solutions_correct} graded correct")
        print(f"pool:     {solution_rate:8.1f} gradings/s on {args.num_workers} workers")
        print(f"baseline: {solution_baseline_rate:8.1f} gradings/s "
              f"(single-process math-verify, {len(solution_sample)} items)")
        print(f"ratio:    {solution_rate / solution_baseline_rate:8.1f}x; "
              f"disagreements with math-verify: {solution_disagreements}/{len(solution_sample)}")

        adversarial = adversarial_batch()
        start = time.perf_counter()
        results = pool.grade_batch(adversarial)
        wall_s = time.perf_counter() - start
        num_timeouts = sum(result.reason is Reason.TIMEOUT for result in results)
        bound_s = math.ceil(num_timeouts / args.num_workers) * args.deadline_s + args.overhead_s
        print(
            f"adversarial batch: {len(adversarial)} items, {num_timeouts} timed out, "
            f"wall {wall_s:.2f} s, bound ceil({num_timeouts}/{args.num_workers}) x "
            f"{args.deadline_s:g} s + {args.overhead_s:g} s = {bound_s:.2f} s -> "
            f"{'OK' if wall_s <= bound_s else 'OVER'}"
        )
        print("  reasons: " + ", ".join(result.reason.value for result in results))
        worker_restarts = pool.metrics["num_worker_starts"] - args.num_workers
        print(f"  worker restarts: {worker_restarts:.0f}")

    summary = {
        "pool_startup_s": startup_s, "num_items": len(pairs), "num_fast_path": metrics["num_fast_path"],
        "num_math_verify": metrics["num_math_verify"], "pool_gradings_per_s": pool_rate,
        "pool_gradings_per_s_target": THROUGHPUT_TARGET, "baseline_items": len(sample),
        "baseline_gradings_per_s": baseline_rate, "ratio": pool_rate / baseline_rate,
        "disagreements": disagreements,
        "full_solutions": {"num_items": len(solutions), "mean_chars": mean_chars,
                           "num_correct": num_solutions_correct, "pool_gradings_per_s": solution_rate,
                           "baseline_items": len(solution_sample),
                           "baseline_gradings_per_s": solution_baseline_rate,
                           "ratio": solution_rate / solution_baseline_rate,
                           "disagreements": solution_disagreements},
        "adversarial": {"num_items": len(adversarial), "num_timeouts": num_timeouts, "wall_s": wall_s,
                        "bound_s": bound_s, "within_bound": wall_s <= bound_s,
                        "reasons": [result.reason.value for result in results],
                        "worker_restarts": worker_restarts},
    }
    panels = [
        Panel(title=f"typical batch ({len(pairs)} items; math-verify on the first {len(sample)})",
              xlabel="gradings per second",
              bars={f"GradingPool, {args.num_workers} workers": pool_rate,
                    "math-verify, one process": baseline_rate},
              lines={f"target ≥ {THROUGHPUT_TARGET:g}/s": THROUGHPUT_TARGET}),
        Panel(title=f"full reference solutions ({len(solutions)} items; math-verify on the first {len(solution_sample)})",
              xlabel="gradings per second", log_scale=True,
              bars={f"GradingPool, {args.num_workers} workers": solution_rate,
                    "math-verify, one process": solution_baseline_rate}),
        Panel(title=f"adversarial batch ({len(adversarial)} items, {num_timeouts} timed out)", xlabel="wall time (s)",
              bars={"GradingPool": wall_s}, lines={"bound: ⌈timeouts / workers⌉ × deadline + overhead": bound_s}),
    ]
    save(args.out, "grading", settings=vars(args), results=summary, panels=panels,
         title=f"Grading throughput and adversarial wall time ({args.num_workers} grading workers)")
    return summary


if __name__ == "__main__":
    main()
