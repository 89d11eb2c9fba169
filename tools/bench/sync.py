"""Weight sync: the streamed export against the old gather onto rank 0, at TP=1, TP=2 and PP=2, and its share of a step.

Both paths push a Megatron actor's weights into the in-process Hugging Face engine on
global rank 0 (fp32, CPU, gloo):

* ``streamed``: what the RL loop runs (``pipeline.rollout.weight_sync.sync_actor_to_engine``
  with ``LocalSyncedEngine``): each TP group gathers one parameter at a time onto its TP
  rank 0, HF buckets of ``--bucket-mb``, later pipeline stages relay their buckets to rank 0;
* ``gather``: the path it replaced, kept here only as the baseline: every rank's whole state
  dict pickled to rank 0 with ``gather_object``, converted there.

Each (layout, path) runs in freshly spawned ranks with an actor that has no optimizer
(the sync reads only the weights), ``--repeats`` syncs, each started behind a barrier. A
sync's wall time is the slowest rank's. Memory: before each sync a rank resets its
resident-set high-water mark (``/proc/self/clear_refs``, Linux) and reports ``VmHWM − VmRSS``
afterwards: everything the sync added on that rank at its peak (tensors, pickles, gloo
buffers), the engine's model and the actor's weights excluded (they exist before). Both
paths must leave the engine with the same weights after their first sync, before any
train step (the SHA-256 of its state dict is compared).

Share of a step: a third TP=1 run gives the actor its optimizer and times a ``--batch`` ×
``--seq``-token train step before each streamed sync; the share is sync / (train step + sync)
— the RL step also generates, so the share of a whole RL step is smaller. ``--layouts`` picks
a subset (the share is measured when it includes TP=1).

Writes ``<out>/sync.json`` and ``<out>/sync.png``.

    .venv/bin/python -m tools.bench.sync [--hidden 768 --layers 12 --vocab 16384 --bucket-mb 64 --repeats 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import statistics
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from pipeline.checkpoint.hf_map import expected_hf_shapes
from pipeline.models.spec import ModelSpec
from pipeline.parallel.launch import run_ranks
from pipeline.parallel.rendezvous import reserved_port
from tools.bench.report import Panel, save

LAYOUTS = {"TP=1": (1, 1), "TP=2": (2, 1), "PP=2": (1, 2)}
PATHS = ("streamed", "gather")
MB = 1024**2


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Job:
    """What every rank of one run needs (picklable: it crosses the spawn)."""

    layout: str
    path: str  # "streamed", "gather" or "step" (streamed syncs after train steps, for the step share)
    spec: dict[str, Any]
    bucket_bytes: int
    repeats: int
    batch: int
    seq: int
    threads_per_rank: int
    port: int


def _memory_kb() -> dict[str, int]:
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0])
    return fields


def _reset_peak() -> int:
    """Reset the high-water mark to the current resident set; return that (kB)."""
    Path("/proc/self/clear_refs").write_text("5")
    return _memory_kb()["VmRSS"]


def _gather_sync(actor, engine, *, version: int) -> None:
    """The replaced path: whole state dicts pickled to global rank 0, converted there."""
    from pipeline.checkpoint.convert import megatron_to_hf_state
    from pipeline.checkpoint.hf_map import MegatronLayout
    from pipeline.parallel.rendezvous import gather_to_rank0

    context = actor.context
    local = {k: v.detach().cpu() for k, v in actor.module.state_dict().items() if not k.endswith("_extra_state")}
    layout = MegatronLayout.build(actor.spec, layer_spec=actor.layer_spec_choice.name,
                                  tp_size=context.tensor_parallel, pp_size=context.pipeline_parallel)
    payload = (context.pp_rank, context.tp_rank, local if context.dp_rank == 0 else None)
    gathered = gather_to_rank0(payload, rank=context.rank, world_size=context.world_size)
    if gathered is None:
        return
    grid: list[list] = [[None] * context.tensor_parallel for _ in range(context.pipeline_parallel)]
    for pp_rank, tp_rank, state in gathered:
        grid[pp_rank][tp_rank] = state
    engine.update_weights(megatron_to_hf_state(grid, spec=actor.spec, layout=layout), version=version)


def _rank_main(rank: int, result_dir: str, job: Job) -> None:
    warnings.filterwarnings("ignore", message=r"(Transformer Engine and Apex|Apex) (are|is) not installed")
    warnings.filterwarnings("ignore", message="full scope is deprecated")
    torch.set_num_threads(job.threads_per_rank)
    result = _run_rank(rank=rank, job=job)
    (Path(result_dir) / f"rank{rank}.json").write_text(json.dumps(result))


def _run_rank(*, rank: int, job: Job) -> dict[str, Any]:
    from pipeline.config import OptimConfig, TrainerConfig
    from pipeline.parallel.context import ParallelContext
    from pipeline.rollout.local import LocalEngine
    from pipeline.rollout.weight_sync import LocalSyncedEngine, build_hf_model, sync_actor_to_engine
    from pipeline.trainer.actor import Actor
    from pipeline.trainer.batch import TrainBatch
    from pipeline.trainer.losses import CrossEntropyLoss

    tp, pp = LAYOUTS[job.layout]
    context = ParallelContext.initialize(tensor_parallel=tp, pipeline_parallel=pp, seed=0, rank=rank,
                                         world_size=tp * pp, local_rank=rank, master_addr="127.0.0.1",
                                         master_port=job.port, backend="gloo")
    try:
        spec = ModelSpec(**job.spec)
        # Only the step-share run trains: an optimizer's state would change the others' memory.
        times_steps = job.path == "step"
        optim = OptimConfig(lr=1e-5) if times_steps else None
        actor = Actor(spec=spec, context=context, optim=optim,
                      trainer=TrainerConfig(micro_batch_tokens=job.batch * job.seq), seed=0)
        engine = LocalEngine(build_hf_model(spec), show_progress=False) if rank == 0 else None
        streamed = LocalSyncedEngine(engine, bucket_bytes=job.bucket_bytes) if rank == 0 else None

        def sync(version: int) -> None:
            if job.path == "gather":
                _gather_sync(actor, engine, version=version)
            else:
                sync_actor_to_engine(actor, streamed, version=version)

        sync(1)  # warm-up: first-touch page faults and lazy imports are not the sync's
        # Before any train step, both paths must have copied the same initial weights.
        digest = None
        if rank == 0:
            sha = hashlib.sha256()
            for name, tensor in sorted(engine.model.state_dict().items()):
                sha.update(name.encode())
                sha.update(tensor.detach().contiguous().numpy().tobytes())
            digest = sha.hexdigest()
        wall, peak_mb, step_wall = [], [], []
        tokens = torch.randint(0, spec.vocab_size, (job.batch, job.seq), generator=torch.Generator().manual_seed(0))
        mask = torch.ones_like(tokens, dtype=torch.bool)  # (B, T)
        mask[:, 0] = False
        for repeat in range(job.repeats):
            if times_steps:
                start = time.perf_counter()
                actor.train_step(TrainBatch(tokens=tokens, response_mask=mask), CrossEntropyLoss())
                step_wall.append(time.perf_counter() - start)
            context.barrier()
            before = _reset_peak()
            start = time.perf_counter()
            sync(repeat + 2)
            wall.append(time.perf_counter() - start)
            peak_mb.append((_memory_kb()["VmHWM"] - before) / 1024)
        return {"wall_s": wall, "peak_mb": peak_mb, "step_wall_s": step_wall, "digest": digest}
    finally:
        context.destroy()


def _run(job_fields: dict[str, Any], *, layout: str, path: str, threads: int, timeout_s: float) -> list[dict]:
    tp, pp = LAYOUTS[layout]
    with reserved_port() as port:
        job = Job(layout=layout, path=path, threads_per_rank=max(threads // (tp * pp), 1), port=port, **job_fields)
        with run_ranks(_rank_main, args=(job,), num_ranks=tp * pp, timeout_s=timeout_s,
                       description=f"{layout} {path}") as result_dir:
            return [json.loads((result_dir / f"rank{r}.json").read_text()) for r in range(tp * pp)]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--bucket-mb", type=float, default=64.0, help="streamed bucket size (MiB)")
    parser.add_argument("--repeats", type=int, default=3, help="timed syncs per layout and path")
    parser.add_argument("--batch", type=int, default=4, help="rows of the TP=1 train step (step share)")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads per run, split over its ranks")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="per run")
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--out", default="runs/bench/sync", help="output directory")
    args = parser.parse_args(argv)
    for name in ("hidden", "layers", "heads", "vocab", "repeats", "batch", "seq", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}: expected a positive integer")
    if args.bucket_mb <= 0:
        parser.error("--bucket-mb: expected a positive size")
    if args.layers % 2 or args.heads % 2 or args.vocab % 2:
        parser.error("--layers, --heads and --vocab must be even: TP=2 and PP=2 split them in two")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    spec = {"family": "llama", "vocab_size": args.vocab, "hidden_size": args.hidden,
            "ffn_hidden_size": args.hidden * 8 // 3 // 64 * 64 or args.hidden, "num_layers": args.layers,
            "num_attention_heads": args.heads, "num_query_groups": args.heads // 2,
            "max_position_embeddings": args.seq}
    job_fields = {"spec": spec, "bucket_bytes": int(args.bucket_mb * MB), "repeats": args.repeats,
                  "batch": args.batch, "seq": args.seq}
    load_before = os.getloadavg()
    runs: dict[str, dict[str, Any]] = {}
    step_rank = None
    for layout in args.layouts:
        for path in PATHS:
            ranks = _run(job_fields, layout=layout, path=path, threads=args.threads, timeout_s=args.timeout_s)
            wall = [max(times) for times in zip(*(rank["wall_s"] for rank in ranks))]
            runs[f"{layout} {path}"] = {
                "layout": layout, "path": path, "wall_s": wall, "median_s": statistics.median(wall),
                "fastest_s": min(wall), "peak_mb_per_rank": [max(rank["peak_mb"]) for rank in ranks],
                "peak_mb": max(max(rank["peak_mb"]) for rank in ranks), "digest": ranks[0]["digest"],
            }
    if "TP=1" in args.layouts:
        step_rank = _run(job_fields, layout="TP=1", path="step", threads=args.threads, timeout_s=args.timeout_s)[0]
    load_after = os.getloadavg()
    step = statistics.median(step_rank["step_wall_s"]) if step_rank else None
    step_sync = statistics.median(step_rank["wall_s"]) if step_rank else None
    num_parameters = sum(math.prod(shape) for shape in expected_hf_shapes(ModelSpec(**spec)).values())
    model_mb = num_parameters * 4 / MB
    for entry in runs.values():
        entry["peak_over_model"] = entry["peak_mb"] / model_mb
    result = {
        "num_parameters": num_parameters, "model_mb": model_mb, "bucket_mb": args.bucket_mb,
        "runs": runs,
        # TP=2 initializes its shards with other seeds than TP=1: compare the two paths within a layout.
        "same_weights": all(runs[f"{layout} streamed"]["digest"] == runs[f"{layout} gather"]["digest"]
                            for layout in args.layouts),
        "step_s": step, "step_sync_s": step_sync,
        "sync_share": step_sync / (step + step_sync) if step_rank else None,
        "load_average_before": load_before, "load_average_after": load_after,
    }
    print(f"model: {num_parameters:,} parameters ({model_mb:.0f} MiB fp32), bucket {args.bucket_mb:g} MiB, gloo, "
          f"{args.threads} threads per run; load average (1 min) before/after {load_before[0]:.2f} / "
          f"{load_after[0]:.2f}")
    print(f"{'run':14s} {'median s':>9s} {'fastest':>8s} {'peak MiB per rank':>24s} {'peak/model':>10s}")
    for name, entry in runs.items():
        per_rank = ", ".join(f"{mb:.0f}" for mb in entry["peak_mb_per_rank"])
        print(f"{name:14s} {entry['median_s']:9.2f} {entry['fastest_s']:8.2f} {per_rank:>24s} "
              f"{entry['peak_over_model']:9.2f}×")
    if step_rank:
        print(f"TP=1 train step ({args.batch} × {args.seq} tokens) {step:.2f} s, streamed sync {step_sync:.2f} s: "
              f"sync is {100 * result['sync_share']:.1f}% of train step + sync")
    print(f"both paths leave the engine with identical weights: {result['same_weights']}")
    panels = [
        Panel(title="sync time (median)", xlabel="seconds (slowest rank)",
              bars={name: entry["median_s"] for name, entry in runs.items()},
              markers={name: entry["fastest_s"] for name, entry in runs.items()}),
        Panel(title="peak extra resident memory, worst rank", xlabel="MiB",
              bars={name: entry["peak_mb"] for name, entry in runs.items()},
              marker_label="", lines={"one fp32 model copy": model_mb}),
    ]
    save(args.out, "sync", settings=vars(args) | {"spec": spec}, results=result, panels=panels,
         threads=args.threads, title=f"weight sync, streamed vs gather to rank 0 ({num_parameters:,} parameters)")
    if not result["same_weights"]:
        raise RuntimeError("the streamed and the gather path left the engine with different weights")
    return result


if __name__ == "__main__":
    main()
