"""Megatron actor train-step time vs an equivalent Hugging Face model, and weight-sync share.

Both sides train the same Llama-style architecture (same dims, same token batch, fp32,
Adam, cross-entropy on every token) in this process, timed alternately; the script
prints the median step time of each and their ratio (target: Megatron ≤ 1.0× HF).
It then times one Megatron → HF weight sync into the local rollout engine and prints
it as a share of the Megatron step (target ≤ 10%).

    .venv/bin/python tools/bench/actor.py [--hidden 512 --layers 4 --batch 8 --seq 256 --repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from pipeline.config import OptimConfig, TrainerConfig
    from pipeline.models.spec import ModelSpec
    from pipeline.parallel.context import ParallelContext
    from pipeline.rollout.local import LocalEngine
    from pipeline.rollout.weight_sync import build_hf_model, sync_actor_to_engine
    from pipeline.stages.bootstrap import _single_process_rendezvous
    from pipeline.trainer.actor import Actor
    from pipeline.trainer.batch import TrainBatch
    from pipeline.trainer.losses import CrossEntropyLoss

    spec = ModelSpec(family="llama", vocab_size=args.vocab, hidden_size=args.hidden, ffn_hidden_size=args.hidden * 11 // 4,
                     num_layers=args.layers, num_attention_heads=args.heads, num_query_groups=args.heads,
                     max_position_embeddings=args.seq)
    context = ParallelContext.initialize(tensor_parallel=1, pipeline_parallel=1, seed=0, **_single_process_rendezvous())
    actor = Actor(spec=spec, context=context, optim=OptimConfig(lr=1e-4),
                  trainer=TrainerConfig(micro_batch_tokens=args.batch * args.seq, logprob_chunk_size=1024), seed=0)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    response_mask = torch.ones_like(tokens, dtype=torch.bool)
    response_mask[:, 0] = False
    batch = TrainBatch(tokens=tokens, response_mask=response_mask)
    loss = CrossEntropyLoss()

    hf_model = build_hf_model(spec).train()
    hf_optimizer = torch.optim.Adam(hf_model.parameters(), lr=1e-4)

    def megatron_step() -> None:
        actor.train_step(batch, loss)

    def hf_step() -> None:
        hf_optimizer.zero_grad(set_to_none=True)
        logits = hf_model(input_ids=tokens).logits[:, :-1]  # (B, T-1, V)
        value = torch.nn.functional.cross_entropy(logits.reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))
        value.backward()
        torch.nn.utils.clip_grad_norm_(hf_model.parameters(), 1.0)
        hf_optimizer.step()

    times: dict[str, list[float]] = {"megatron": [], "hf": []}
    megatron_step(), hf_step()  # warm-up
    for _ in range(args.repeats):
        for name, fn in (("megatron", megatron_step), ("hf", hf_step)):
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    megatron, hf = statistics.median(times["megatron"]), statistics.median(times["hf"])

    engine = LocalEngine(build_hf_model(spec), show_progress=False)
    sync_times = []
    for version in range(1, args.repeats + 1):
        start = time.perf_counter()
        sync_actor_to_engine(actor, engine, version=version)
        sync_times.append(time.perf_counter() - start)
    sync = statistics.median(sync_times)

    num_parameters = sum(p.numel() for p in actor.module.parameters())
    print(f"model: {num_parameters / 1e6:.1f}M parameters, batch {args.batch} × {args.seq}, fp32, {args.threads} threads")
    print(f"megatron actor step   : {megatron * 1e3:8.1f} ms")
    print(f"HF LlamaForCausalLM   : {hf * 1e3:8.1f} ms")
    print(f"ratio megatron / HF   : {megatron / hf:8.3f}  (target ≤ 1.0)")
    print(f"weight sync to engine : {sync * 1e3:8.1f} ms = {100 * sync / megatron:.1f}% of a train step (target ≤ 10%)")


if __name__ == "__main__":
    main()
