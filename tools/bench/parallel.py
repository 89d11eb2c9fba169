"""Megatron actor train step under TP=2, PP=2 and DP=2 vs TP=1, on the same cores, model and global batch.

Times ``Actor.train_step`` (the step the RL loop and the bootstrap run: fp32, CPU,
gloo, megatron's DDP, optimizer and schedules, the chunked log-prob head and
``CrossEntropyLoss``) under three layouts and prints the median step time of each
and its ratio to TP=1:

* TP=1: one process with 2 intra-op threads (the baseline);
* TP=2: two processes, 1 intra-op thread each (tensor parallelism over gloo);
* PP=2: two processes, 1 intra-op thread each (megatron's non-interleaved 1F1B
  schedule over gloo);
* DP=2: two processes, 1 intra-op thread each, each training its half of the rows
  (``Actor.data_parallel_share``, balanced by tokens) with one gradient all-reduce.

Thread budget: every layout gets the same ``--threads`` intra-op threads in total
(default 2, the machine's two cores): all of them in the one TP=1 process, an equal
share per rank in the two-rank layouts. The global batch (``--batch`` × ``--seq``
tokens) is cut into the same micro-batches of ``--micro-batch-rows`` rows in every
layout (default 1 row: 8 micro-batches, so PP=2's 1F1B pipeline is full for 7 of
its 9 slots; the ideal bubble, (PP − 1) / (micro-batches + PP − 1), is printed), so
the layouts differ only in how the model is split.

Same weights: the TP=1 run saves its freshly initialized full state dict and the
TP=2 and PP=2 runs load their shards of it (``Actor.load_full_state_dict``, as
``tests/parallel/test_tp_pp_parity.py`` loads the reference), and every rank builds
the same batch. The loss of each layout's first step (its warm-up, not timed) is
printed; a relative difference from TP=1 above 1e-4 fails the run (PP=2 repeats
TP=1's arithmetic and agrees exactly; TP=2 within fp32 rounding).

Timing: each layout runs in freshly spawned ranks (``torch.multiprocessing``,
spawn), one warm-up step, then ``--repeats`` steps, each started behind a barrier.
A step's wall time is the slowest rank's; its CPU time is summed over ranks (the
core-seconds the step costs: on a shared machine this and the fastest repeat are
the load-robust numbers, the median is the headline). ``--rounds`` runs the three
layouts in turn that many times and pools the steps, so load drift is shared.
What to expect on 2 cores: TP and PP slower than TP=1 — the cores are already busy
with one process, and gloo adds all-reduces (TP: 2 per layer forward, 2 backward)
or point-to-point sends plus a bubble (PP). Writes ``<out>/parallel.json`` and
``<out>/parallel.png``.

    .venv/bin/python -m tools.bench.parallel [--hidden 512 --layers 4 --batch 8 --seq 256 --repeats 5 --rounds 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from pipeline.parallel.launch import run_ranks
from pipeline.parallel.rendezvous import reserved_port

from tools.bench.report import Panel, save

LOSS_RTOL = 1e-4


class LossMismatch(RuntimeError):
    """A layout's first-step loss differs from TP=1's: the layouts did not train the same model."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Layout:
    name: str
    tensor_parallel: int
    pipeline_parallel: int
    data_parallel: int = 1

    @property
    def num_ranks(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel * self.data_parallel


LAYOUTS = (
    Layout(name="TP=1", tensor_parallel=1, pipeline_parallel=1),
    Layout(name="TP=2", tensor_parallel=2, pipeline_parallel=1),
    Layout(name="PP=2", tensor_parallel=1, pipeline_parallel=2),
    Layout(name="DP=2", tensor_parallel=1, pipeline_parallel=1, data_parallel=2),
)
BASELINE = LAYOUTS[0]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Job:
    """What every rank of one layout run needs (picklable: it crosses the spawn)."""

    layout: Layout
    spec: dict[str, Any]  # ModelSpec fields
    batch: int
    seq: int
    micro_batch_rows: int
    repeats: int
    threads_per_rank: int
    seed: int
    port: int
    weights_path: str  # the TP=1 initial full state dict, written by the first TP=1 run


def _rank_main(rank: int, result_dir: str, job: Job) -> None:
    """One spawned rank; ``run_ranks`` passes ``rank`` and ``result_dir`` first."""
    # megatron warns once per process about missing TE/Apex kernels: once per rank per run buries the table.
    warnings.filterwarnings("ignore", message=r"(Transformer Engine and Apex|Apex) (are|is) not installed")
    warnings.filterwarnings("ignore", message="full scope is deprecated")
    # Advice for CUDA streams; there are none on CPU.
    warnings.filterwarnings("ignore", message="When using async grad allreduce")
    torch.set_num_threads(job.threads_per_rank)
    result = _time_rank(rank=rank, job=job)
    (Path(result_dir) / f"rank{rank}.json").write_text(json.dumps(result))


def _time_rank(*, rank: int, job: Job) -> dict[str, Any]:
    from pipeline.config import OptimConfig, TrainerConfig
    from pipeline.models.spec import ModelSpec
    from pipeline.parallel.context import ParallelContext
    from pipeline.trainer.actor import Actor
    from pipeline.trainer.batch import TrainBatch
    from pipeline.trainer.losses import CrossEntropyLoss

    context = ParallelContext.initialize(
        tensor_parallel=job.layout.tensor_parallel, pipeline_parallel=job.layout.pipeline_parallel, seed=job.seed,
        rank=rank, world_size=job.layout.num_ranks, local_rank=rank, master_addr="127.0.0.1", master_port=job.port,
        backend="gloo",
    )
    try:
        # The default logprob_buffer_mib holds a whole micro-batch here: one head chunk, no recompute,
        # as in the RL loop's defaults.
        actor = Actor(spec=ModelSpec(**job.spec), context=context, optim=OptimConfig(lr=1e-4),
                      trainer=TrainerConfig(micro_batch_tokens=job.micro_batch_rows * job.seq), seed=job.seed)
        weights = Path(job.weights_path)
        if job.layout == BASELINE and not weights.exists():
            # At TP=1, PP=1 the local names are the full model's names.
            torch.save({name: p.detach() for name, p in actor.module.named_parameters()}, weights)
        else:
            actor.load_full_state_dict(torch.load(weights, weights_only=True))
        tokens = torch.randint(0, job.spec["vocab_size"], (job.batch, job.seq),
                               generator=torch.Generator().manual_seed(job.seed))  # (B, T)
        response_mask = torch.ones_like(tokens, dtype=torch.bool)  # (B, T)
        response_mask[:, 0] = False  # the first token has no prediction
        batch = TrainBatch(tokens=tokens, response_mask=response_mask)
        loss = CrossEntropyLoss()

        first = actor.train_step(batch, loss)  # warm-up; from the shared weights, so its loss is comparable
        wall, cpu = [], []
        for _ in range(job.repeats):
            context.barrier()  # every rank starts the step together: its wall time is the slowest rank's
            start, start_cpu = time.perf_counter(), time.process_time()
            actor.train_step(batch, loss)
            wall.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
        return {
            "first_step_loss": first.loss,
            "first_step_grad_norm": first.grad_norm,
            "num_micro_batches": first.num_micro_batches,
            "num_local_parameters": sum(p.numel() for p in actor.module.parameters()),
            "wall_s": wall,
            "cpu_s": cpu,
        }
    finally:
        context.destroy()


def run_layout(job_fields: dict[str, Any], *, layout: Layout, threads: int, timeout_s: float) -> list[dict[str, Any]]:
    """Spawn ``layout``'s ranks, wait for them, and return each rank's result (rank order)."""
    if threads % layout.num_ranks:
        raise ValueError(f"threads: {threads} do not split evenly over {layout.name}'s {layout.num_ranks} ranks")
    with reserved_port() as port:
        job = Job(layout=layout, threads_per_rank=threads // layout.num_ranks, port=port, **job_fields)
        with run_ranks(_rank_main, args=(job,), num_ranks=layout.num_ranks, timeout_s=timeout_s,
                       description=layout.name) as result_dir:
            return [json.loads((result_dir / f"rank{rank}.json").read_text()) for rank in range(layout.num_ranks)]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--micro-batch-rows", type=int, default=1, help="rows per micro-batch, in every layout")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per layout and round")
    parser.add_argument("--rounds", type=int, default=2, help="times the three layouts run in turn")
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads per layout, split over its ranks")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=900.0, help="per layout run")
    parser.add_argument("--out", default="runs/bench/parallel", help="output directory")
    args = parser.parse_args(argv)
    for name in ("hidden", "layers", "heads", "vocab", "batch", "seq", "micro_batch_rows", "repeats", "rounds",
                 "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: expected a positive integer")
    if args.layers % 2 or args.vocab % 2 or args.heads % 2:
        parser.error("--layers, --vocab and --heads must be even: TP=2 and PP=2 split them in two")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    spec = {"family": "llama", "vocab_size": args.vocab, "hidden_size": args.hidden,
            "ffn_hidden_size": args.hidden * 11 // 4, "num_layers": args.layers,
            "num_attention_heads": args.heads, "num_query_groups": args.heads, "max_position_embeddings": args.seq}
    load_before = os.getloadavg()
    runs: dict[str, list[list[dict[str, Any]]]] = {layout.name: [] for layout in LAYOUTS}
    with tempfile.TemporaryDirectory(prefix="winnow-bench-parallel-weights-") as weights_dir:
        job_fields = {"spec": spec, "batch": args.batch, "seq": args.seq, "micro_batch_rows": args.micro_batch_rows,
                      "repeats": args.repeats, "seed": args.seed,
                      "weights_path": str(Path(weights_dir) / "initial.pt")}
        for _ in range(args.rounds):
            for layout in LAYOUTS:  # TP=1 first: it writes the shared initial weights
                runs[layout.name].append(run_layout(job_fields, layout=layout, threads=args.threads,
                                                    timeout_s=args.timeout_s))
    load_after = os.getloadavg()

    layouts: dict[str, dict[str, Any]] = {}
    for layout in LAYOUTS:
        wall, cpu, first_losses = [], [], []
        for ranks in runs[layout.name]:
            # A step lasts until its slowest rank finishes; it costs the CPU time of all ranks.
            wall += [max(times) for times in zip(*(rank["wall_s"] for rank in ranks))]
            cpu += [sum(times) for times in zip(*(rank["cpu_s"] for rank in ranks))]
            first_losses += [rank["first_step_loss"] for rank in ranks]
        first = runs[layout.name][0][0]
        layouts[layout.name] = {
            "tensor_parallel": layout.tensor_parallel, "pipeline_parallel": layout.pipeline_parallel,
            "data_parallel": layout.data_parallel, "num_ranks": layout.num_ranks, "threads_per_rank": args.threads // layout.num_ranks,
            # StepResult counts the micro-batches whose loss a rank saw: 0 off the last pipeline stage.
            "num_micro_batches": max(rank["num_micro_batches"] for rank in runs[layout.name][0]),
            "step_wall_s": wall, "step_cpu_s": cpu,
            "median_s": statistics.median(wall), "fastest_s": min(wall), "fastest_cpu_s": min(cpu),
            "first_step_loss": first["first_step_loss"], "first_step_grad_norm": first["first_step_grad_norm"],
            "first_step_losses": first_losses,
        }
    reference = layouts[BASELINE.name]
    for entry in layouts.values():
        for key in ("median_s", "fastest_s", "fastest_cpu_s"):
            entry[f"ratio_{key.removesuffix('_s')}"] = entry[key] / reference[key]
        # Every rank and round of a layout must agree with TP=1's first step, not just one of them.
        entry["loss_rel_diff"] = max(abs(loss - reference["first_step_loss"]) / abs(reference["first_step_loss"])
                                     for loss in entry["first_step_losses"])
    num_micro = reference["num_micro_batches"]
    result = {
        "num_parameters": runs[BASELINE.name][0][0]["num_local_parameters"],
        "pp2_ideal_bubble": (2 - 1) / (num_micro + 2 - 1),
        "load_average_before": load_before, "load_average_after": load_after,
        "layouts": layouts,
        "loss_agreement": all(entry["loss_rel_diff"] <= LOSS_RTOL for entry in layouts.values()),
    }
    print(f"model: {result['num_parameters']:,} parameters, batch {args.batch} × {args.seq} in {num_micro} "
          f"micro-batches of {args.micro_batch_rows} row(s), fp32, gloo, {args.threads} threads per layout, "
          f"{args.rounds} round(s) × {args.repeats} steps")
    print(f"load average (1 min) before/after: {load_before[0]:.2f} / {load_after[0]:.2f}; "
          f"PP=2 ideal 1F1B bubble {100 * result['pp2_ideal_bubble']:.0f}%")
    print(f"{'layout':6s} {'ranks×threads':>13s} {'median ms':>10s} {'fastest':>8s} {'core-s':>7s} "
          f"{'median/TP=1':>11s} {'fastest':>8s} {'core-s':>7s}   first-step loss (rel. diff)")
    for name, entry in layouts.items():
        print(f"{name:6s} {entry['num_ranks']:>7d} × {entry['threads_per_rank']:<3d} {entry['median_s'] * 1e3:10.1f} "
              f"{entry['fastest_s'] * 1e3:8.1f} {entry['fastest_cpu_s']:7.2f} {entry['ratio_median']:10.3f}× "
              f"{entry['ratio_fastest']:7.3f}× {entry['ratio_fastest_cpu']:6.3f}×   "
              f"{entry['first_step_loss']:.6f} ({entry['loss_rel_diff']:.1e})")
    panels = [
        Panel(title="train step time (median over rounds × repeats)", xlabel="ms per step (slowest rank)",
              bars={name: entry["median_s"] * 1e3 for name, entry in layouts.items()},
              markers={name: entry["fastest_s"] * 1e3 for name, entry in layouts.items()}),
        Panel(title="step time / TP=1's", xlabel="ratio (lower is faster)",
              bars={name: entry["ratio_median"] for name, entry in layouts.items()},
              markers={name: entry["ratio_fastest"] for name, entry in layouts.items()},
              marker_label="fastest steps' ratio", lines={"TP=1 (no target: measured)": 1.0}),
    ]
    save(args.out, "parallel", settings=vars(args) | {"spec": spec}, results=result, panels=panels,
         threads=args.threads, title=f"TP=2, PP=2 and DP=2 vs TP=1, Megatron actor train step "
                                     f"({result['num_parameters']:,} parameters, batch {args.batch} × {args.seq}, "
                                     f"{args.threads} threads split over the ranks)")
    if not result["loss_agreement"]:
        bad = {name: entry["loss_rel_diff"] for name, entry in layouts.items() if entry["loss_rel_diff"] > LOSS_RTOL}
        raise LossMismatch(f"first-step losses differ from TP=1's by more than {LOSS_RTOL:g} relative: {bad}")
    return result


if __name__ == "__main__":
    main()
