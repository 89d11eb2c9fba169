"""One GPU, a real model's shape: the actor's train step, its old-policy pass, a weight sync and decoding.

The planner (``pipeline.launch.plan``) sizes every preset from two things this measures on a
real card: memory per component and model-FLOP utilisation (it assumes 0.35 for training and
0.10 for generation). This builds winnow's ``Actor`` from a published ``config.json`` (random
weights, bf16, one rank, the layer spec the actor selects: Transformer Engine when it imports,
megatron's local modules otherwise), then:

* **train step**: ``--steps`` timed steps (after one warm-up) on ``--batch`` rows of ``--seq``
  random tokens, the first ``--prompt`` of each row masked out as the prompt; tokens/s and
  model TFLOP/s by the planner's own FLOP count (``step_flops``: 6·N per trained token plus
  attention), MFU against the card's dense bf16 peak;
* **old-policy pass**: ``compute_token_stats`` of the same batch (log-probs and entropies);
* **memory**: the allocator's peak over the steps (``torch.cuda.max_memory_allocated``) and the
  bytes of weights, gradient buffer and optimizer state, each against the planner's prediction
  for this layout (TP=PP=DP=1, no distributed optimizer: one rank has nothing to shard over);
* **weight sync**: the actor's weights into an HF copy in the in-process engine on the same
  device, as the rl loop does it (``LocalSyncedEngine``, ``rollout.sync_bucket_mb`` buckets:
  device to device), and through CPU copies of every tensor (``actor_hf_state``: the path
  before the engine took GPU buckets, and the process engine's), each against the step;
* **decoding**: ``LocalEngine.generate`` of ``--gen-prompts`` × ``--gen-tokens`` (EOS ignored,
  so every row decodes the full length): generated tokens/s, and its MFU (2·N per token).

    python -m tools.bench.gpu_step --config pipeline/models/published/configs/Qwen2.5-1.5B-Instruct.json --out runs/bench/gpu

Writes ``<out>/gpu_step.json``. On a machine without CUDA it runs on the CPU (use a tiny config).
Each phase prints one ``phase`` line with the seconds since the start as it ends, so a run cut
off by a time limit still says how far it got.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path

import torch

from pipeline.launch.plan import (
    GPUS,
    Cluster,
    Layout,
    ModelDims,
    PlanInputs,
    TrainerSettings,
    Workload,
    memory_plan,
    step_flops,
)
from tools.bench.plan_memory import model_state_bytes

GIB = 1024**3


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn: Callable[[], object], repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        _sync()
        start = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - start)
    return times


class _Phases:
    """Seconds since the start at the end of each phase, printed as it happens and kept for the JSON."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.ends: dict[str, float] = {}

    def done(self, name: str) -> None:
        _sync()
        self.ends[name] = round(time.perf_counter() - self.start, 2)
        print(f"phase {name}: done at {self.ends[name]:.1f} s", flush=True)


def _gpu_spec():
    """The planner's card for this GPU (by name), else the H100's figures with the name recorded."""
    if not torch.cuda.is_available():
        return None, "cpu"
    name = torch.cuda.get_device_name()
    key = "h200" if "H200" in name else "h100"
    return GPUS[key], name


def plan_inputs(dims: ModelDims, args: argparse.Namespace, *, backend: str, gpu) -> PlanInputs:
    return PlanInputs(
        dims=dims,
        layout=Layout(tensor_parallel=1, pipeline_parallel=1, data_parallel=1),
        trainer=TrainerSettings(precision="bf16", backend=backend, distributed_optimizer=False,
                                micro_batch_tokens=args.micro_batch_tokens, old_logprob_forward=False),
        workload=Workload(prompts_per_step=args.batch, trained_per_prompt=1, sampled_per_prompt=1,
                          in_flight_per_prompt=1, prompt_tokens=args.prompt, max_new_tokens=args.seq - args.prompt,
                          steps=1),
        cluster=Cluster(gpu=gpu or GPUS["h100"], trainer_nodes=1, gpus_per_node=1),
    )


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "absent"


def run(args: argparse.Namespace) -> dict:
    phases = _Phases()
    from pipeline.config import OptimConfig, TrainerConfig
    from pipeline.models.spec import ModelSpec
    from pipeline.parallel.rendezvous import initialize_process_context
    from pipeline.rollout.local import LocalEngine
    from pipeline.rollout.types import GenerationRequest, SamplingParams
    from pipeline.rollout.weight_sync import LocalSyncedEngine, actor_hf_state, build_hf_model, sync_actor_to_engine
    from pipeline.trainer.actor import Actor
    from pipeline.trainer.batch import TrainBatch
    from pipeline.trainer.losses import CrossEntropyLoss

    warnings.filterwarnings("ignore")
    spec = ModelSpec.from_hf_config(args.config)
    dims = ModelDims.from_hf_config(args.config)
    gpu, device_name = _gpu_spec()
    context = initialize_process_context(seed=0)
    phases.done("imports and process group")
    result: dict = {"device": device_name, "torch": torch.__version__, "megatron_core": _version("megatron-core"),
                    "transformer_engine": _version("transformer-engine"), "config": Path(args.config).name,
                    "parameters": dims.num_parameters(), "batch": args.batch, "seq": args.seq, "prompt": args.prompt,
                    "micro_batch_tokens": args.micro_batch_tokens}
    try:
        actor = Actor(spec=spec, context=context, optim=OptimConfig(lr=1e-6), seed=0,
                      trainer=TrainerConfig(precision="bf16", micro_batch_tokens=args.micro_batch_tokens))
        backend = actor.layer_spec_choice.name
        result["layer_spec"] = backend
        phases.done(f"actor built ({backend} spec)")
        generator = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, spec.vocab_size, (args.batch, args.seq), generator=generator)  # (B, T)
        response_mask = (torch.arange(args.seq) >= args.prompt).expand(args.batch, args.seq).clone()  # (B, T)
        batch = TrainBatch(tokens=tokens, response_mask=response_mask)
        loss = CrossEntropyLoss()

        steps: list = []
        actor.train_step(batch, loss)  # warm-up: allocator, kernels, optimizer state
        phases.done("warm-up step")
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        train_times = _timed(lambda: steps.append(actor.train_step(batch, loss)), args.steps)
        peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
        stats_times = _timed(lambda: actor.compute_token_stats(batch), args.steps)
        phases.done("train steps and old-policy passes")

        measured = model_state_bytes(actor)
        inputs = plan_inputs(dims, args, backend="te" if backend == "te" else "local", gpu=gpu)
        (stage,) = memory_plan(inputs)
        predicted = {"weights": stage.weights, "gradients": stage.gradients, "optimizer": stage.optimizer,
                     "activations": stage.activations, "head_buffer": stage.head_buffer, "total": stage.total}
        train_flops, _ = step_flops(inputs)
        step_s = statistics.median(train_times)
        trained_tokens = args.batch * args.seq
        peak_flops = (gpu.peak_tflops if gpu else float("nan")) * 1e12
        result["train"] = {
            "step_s": train_times, "median_step_s": step_s, "tokens_per_s": trained_tokens / step_s,
            "model_tflops": train_flops / step_s / 1e12, "mfu": train_flops / step_s / peak_flops,
            "losses": [s.loss for s in steps], "skipped": sum(s.skipped for s in steps),
            "micro_batches": steps[-1].num_micro_batches,
            "old_policy_pass_s": statistics.median(stats_times),
        }
        result["memory"] = {"measured": measured, "allocator_peak": peak, "predicted": predicted,
                            "predicted_total_vs_peak": (predicted["total"] / peak) if peak else None}

        hf = build_hf_model(spec, dtype=torch.bfloat16, device=context.device)
        engine = LocalEngine(hf, eos_token_ids=[], pad_token_id=0, show_progress=False,
                             max_batch_rows=args.gen_prompts)
        phases.done("engine built")
        synced = LocalSyncedEngine(engine, bucket_bytes=args.sync_bucket_mb * 1024**2)
        versions = iter(range(1, 100))
        sync_times = _timed(lambda: sync_actor_to_engine(actor, synced, version=next(versions)), 2)
        host_times = _timed(lambda: engine.update_weights(actor_hf_state(actor, bucket_bytes=synced.bucket_bytes),
                                                          version=next(versions)), 2)
        phases.done("weight syncs")
        prompt_ids = torch.randint(0, spec.vocab_size, (args.gen_prompts, args.prompt), generator=generator)
        requests = [GenerationRequest(prompt_id=str(i), prompt_token_ids=tuple(row.tolist()), num_samples=1)
                    for i, row in enumerate(prompt_ids)]
        params = SamplingParams(max_new_tokens=args.gen_tokens, temperature=1.0, seed=0, ignore_eos=True)
        completions: list = []
        engine.generate(requests[:2], SamplingParams(max_new_tokens=4, temperature=1.0, seed=0, ignore_eos=True))
        gen_times = _timed(lambda: completions.append(engine.generate(requests, params)), 1)
        generated = sum(len(c.token_ids) for c in completions[-1])
        phases.done("decoding")
        result["sync"] = {"seconds": sync_times, "share_of_train_step": min(sync_times) / step_s,
                          "staging": str(synced.staging_device()), "bucket_mb": args.sync_bucket_mb,
                          "host_seconds": host_times, "host_share_of_train_step": min(host_times) / step_s}
        result["decode"] = {"prompts": args.gen_prompts, "new_tokens": args.gen_tokens, "seconds": gen_times[0],
                            "generated_tokens": generated, "tokens_per_s": generated / gen_times[0],
                            "mfu": 2 * dims.num_parameters() * generated / gen_times[0] / peak_flops}
    finally:
        context.destroy()
    result["phases_s"] = phases.ends
    return result


def _print(result: dict) -> None:
    train, memory = result["train"], result["memory"]
    print(f"{result['device']} · {result['config']} ({result['parameters'] / 1e9:.2f}B) · spec {result['layer_spec']}"
          f" · torch {result['torch']} · megatron-core {result['megatron_core']}")
    print(f"train step ({result['batch']} × {result['seq']} tokens, {train['micro_batches']} micro-batches): "
          f"{train['median_step_s']:.3f} s, {train['tokens_per_s']:,.0f} tokens/s, "
          f"{train['model_tflops']:.1f} model TFLOP/s, MFU {train['mfu']:.3f}; loss "
          f"{train['losses'][0]:.3f} → {train['losses'][-1]:.3f}, skipped {train['skipped']}")
    print(f"old-policy pass: {train['old_policy_pass_s']:.3f} s")
    for name, value in memory["measured"].items():
        predicted = memory["predicted"][name]
        print(f"  {name:<10} measured {value / GIB:7.2f} GiB, planned {predicted / GIB:7.2f} GiB "
              f"({(predicted - value) / value:+.1%})")
    if memory["allocator_peak"]:
        print(f"  allocator peak {memory['allocator_peak'] / GIB:.2f} GiB, planned total "
              f"{memory['predicted']['total'] / GIB:.2f} GiB (planned / peak {memory['predicted_total_vs_peak']:.3f})")
    sync, decode = result["sync"], result["decode"]
    print(f"weight sync into the local engine (buckets staged on {sync['staging']}): {min(sync['seconds']):.3f} s "
          f"({sync['share_of_train_step']:.1%} of a train step); through CPU copies: "
          f"{min(sync['host_seconds']):.3f} s ({sync['host_share_of_train_step']:.1%})")
    print(f"decode {decode['prompts']} × {decode['new_tokens']}: {decode['seconds']:.2f} s, "
          f"{decode['tokens_per_s']:,.0f} tokens/s, MFU {decode['mfu']:.4f}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="a published config.json (pipeline/models/published/configs)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--micro-batch-tokens", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--gen-prompts", type=int, default=64)
    parser.add_argument("--gen-tokens", type=int, default=256)
    parser.add_argument("--sync-bucket-mb", type=int, default=512, help="rollout.sync_bucket_mb's default")
    parser.add_argument("--out", default="runs/bench/gpu_step")
    args = parser.parse_args(argv)
    result = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_step.json").write_text(json.dumps(result, indent=1))
    _print(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
