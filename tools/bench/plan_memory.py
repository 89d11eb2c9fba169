"""The planner's per-GPU memory against what the Megatron actor holds, per component and layout.

    .venv/bin/python -m tools.bench.plan_memory                 # five models × layouts, ~2 min on 2 cores
    .venv/bin/python -m tools.bench.plan_memory --cases tiny     # one case (what the smoke test runs)

Each case builds winnow's ``Actor`` (bf16, megatron's local modules: the CPU path) on
spawned gloo ranks (``pipeline.parallel.launch.run_ranks``), runs one ``train_step`` of
random tokens and measures on every rank:

* **weights**: bytes of the rank's parameters (megatron's DDP keeps them in its param buffer);
* **gradients**: bytes of megatron DDP's ``grad_data`` buffers (``main_grad``);
* **optimizer**: bytes of every tensor in the Adam state (``exp_avg``, ``exp_avg_sq``) and of
  the fp32 master copies (``fp32_from_float16_groups``), after the step created them;
* **activations**: the peak, over the whole step, of the bytes autograd keeps for backward,
  counted with torch's ``saved_tensors_hooks``: every saved tensor's storage is counted
  once while any saved reference to it is alive (so 1F1B's in-flight micro-batches add
  up), parameters excluded. It does not count the head's working block (a context
  attribute, not a saved tensor) or transient buffers freed within one op;
* **head buffer**: the chunked log-prob head (``token_logprobs_and_entropy``) run alone,
  forward and backward, at the last stage's shapes under torch's memory profiler
  (``torch.profiler`` with ``profile_memory``; its ``_memory_profile().timeline`` lists every
  allocation's creation and destruction): the peak of the live bytes allocated inside the
  profiled region, minus the gradients and outputs it returns (results, not its buffer).

The planner (``pipeline.launch.plan``) predicts each with ``backend="local"``; the table
prints predicted, measured and the error of every rank and component. Writes
``<out>/plan_memory.json``.
"""

from __future__ import annotations

import argparse
import json
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pipeline.launch.plan import (
    GPUS,
    Cluster,
    Layout,
    ModelDims,
    PlanInputs,
    TrainerSettings,
    Workload,
    memory_plan,
    micro_batch_tokens,
)
from pipeline.models.families import model_family
from pipeline.models.spec import ModelSpec
from pipeline.parallel.launch import run_ranks
from pipeline.parallel.rendezvous import reserved_port

COMPONENTS = ("weights", "gradients", "optimizer", "activations", "head_buffer")
TOLERANCE = 0.20


@dataclass(frozen=True, slots=True, kw_only=True)
class Case:
    name: str
    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tp: int
    pp: int
    batch: int  # rows of the step
    seq: int
    rows_per_micro: int
    family: str = "qwen2"  # qwen3: per-head q/k RMSNorm, with its own head_dim
    head_dim: int | None = None  # None: hidden / heads

    @property
    def num_ranks(self) -> int:
        return self.tp * self.pp

    def spec(self) -> ModelSpec:
        """The model the ranks build; its family's row sets the q/k/v bias and the q/k norms."""
        return ModelSpec(family=self.family, vocab_size=self.vocab, hidden_size=self.hidden, ffn_hidden_size=self.ffn,
                         num_layers=self.layers, num_attention_heads=self.heads, num_query_groups=self.kv_heads,
                         max_position_embeddings=self.seq, head_dim=self.head_dim,
                         qkv_bias=model_family(self.family).qkv_bias)

    def dims(self) -> ModelDims:
        return ModelDims.from_spec(self.spec(), name=self.name)


CASES = {
    case.name: case for case in (
        Case(name="tiny", hidden=128, ffn=352, layers=4, heads=4, kv_heads=2, vocab=1024, tp=1, pp=1, batch=4,
             seq=128, rows_per_micro=2),
        Case(name="small-tp2", hidden=256, ffn=704, layers=4, heads=8, kv_heads=4, vocab=4096, tp=2, pp=1, batch=4,
             seq=256, rows_per_micro=2),
        # Qwen3-4B's shape in small: q/k norms and heads wider than hidden / heads (q = 2h).
        Case(name="qwen3-tiny", hidden=128, ffn=352, layers=4, heads=4, kv_heads=2, vocab=1024, tp=1, pp=1, batch=4,
             seq=128, rows_per_micro=2, family="qwen3", head_dim=64),
        Case(name="qwen3-tp2", hidden=256, ffn=704, layers=4, heads=8, kv_heads=4, vocab=4096, tp=2, pp=1,
             batch=4, seq=256, rows_per_micro=2, family="qwen3", head_dim=64),
        Case(name="medium-pp2", hidden=512, ffn=1408, layers=8, heads=8, kv_heads=4, vocab=8192, tp=1, pp=2,
             batch=8, seq=128, rows_per_micro=2),
    )
}


def plan_inputs(case: Case) -> PlanInputs:
    """The planner's view of a case: CPU backend, bf16, one data-parallel rank."""
    return PlanInputs(
        dims=case.dims(),
        layout=Layout(tensor_parallel=case.tp, pipeline_parallel=case.pp, data_parallel=1),
        trainer=TrainerSettings(precision="bf16", backend="local", micro_batch_tokens=case.rows_per_micro * case.seq,
                                old_logprob_forward=False),
        workload=Workload(prompts_per_step=case.batch, trained_per_prompt=1, sampled_per_prompt=1,
                          in_flight_per_prompt=1, prompt_tokens=0, max_new_tokens=case.seq, steps=1),
        cluster=Cluster(gpu=GPUS["h100"], trainer_nodes=1, gpus_per_node=case.num_ranks),
    )


def _storage_bytes(tensors) -> int:
    seen: dict[int, int] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def model_state_bytes(actor) -> dict[str, int]:
    """Bytes of the actor's weights, megatron DDP's gradient buffers and the Adam state with its fp32
    master copies (after a step created them), each storage counted once."""
    import torch

    optimizer_tensors = []
    for optimizer in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer]):
        for state in optimizer.optimizer.state.values():
            optimizer_tensors += [value for value in state.values() if torch.is_tensor(value) and value.dim()]
        for group in getattr(optimizer, "fp32_from_float16_groups", []):
            optimizer_tensors += list(group)
    return {
        "weights": sum(p.numel() * p.element_size() for p in actor.module.parameters()),
        "gradients": sum(buffer.grad_data.numel() * buffer.grad_data.element_size() for buffer in actor.model.buffers),
        "optimizer": _storage_bytes(optimizer_tensors),
    }


def _rank_main(rank: int, result_dir: str, case: Case, port: int) -> None:
    warnings.filterwarnings("ignore")
    import torch

    from pipeline.config import OptimConfig, TrainerConfig
    from pipeline.parallel.context import ParallelContext
    from pipeline.trainer.actor import Actor
    from pipeline.trainer.batch import TrainBatch
    from pipeline.trainer.losses import CrossEntropyLoss

    torch.set_num_threads(1)
    context = ParallelContext.initialize(
        tensor_parallel=case.tp, pipeline_parallel=case.pp, seed=0, rank=rank, world_size=case.num_ranks,
        local_rank=rank, master_addr="127.0.0.1", master_port=port, backend="gloo")
    try:
        actor = Actor(spec=case.spec(), context=context, optim=OptimConfig(lr=1e-4), seed=0,
                      trainer=TrainerConfig(precision="bf16", micro_batch_tokens=case.rows_per_micro * case.seq))
        parameters = list(actor.module.parameters())
        parameter_storages = {p.untyped_storage().data_ptr() for p in parameters}
        live: dict[int, list[int]] = {}  # storage → [bytes, saved references alive]
        usage = {"now": 0, "peak": 0}

        class Saved:
            """Holds a saved tensor; its death (autograd freeing the saved variable) releases the count."""

            __slots__ = ("pointer", "tensor")

            def __init__(self, pointer: int | None, tensor: torch.Tensor):
                self.pointer, self.tensor = pointer, tensor

            def __del__(self):
                if self.pointer is None:
                    return
                entry = live[self.pointer]
                entry[1] -= 1
                if entry[1] == 0:
                    usage["now"] -= entry[0]
                    del live[self.pointer]

        def pack(tensor: torch.Tensor) -> Saved:
            storage = tensor.untyped_storage()
            pointer = storage.data_ptr()
            if pointer in parameter_storages or storage.nbytes() == 0:
                return Saved(None, tensor)
            entry = live.setdefault(pointer, [storage.nbytes(), 0])
            if entry[1] == 0:
                usage["now"] += entry[0]
                usage["peak"] = max(usage["peak"], usage["now"])
            entry[1] += 1
            return Saved(pointer, tensor)

        tokens = torch.randint(0, case.vocab, (case.batch, case.seq), generator=torch.Generator().manual_seed(0))
        response_mask = torch.ones_like(tokens, dtype=torch.bool)  # (B, T)
        response_mask[:, 0] = False
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda saved: saved.tensor):
            actor.train_step(TrainBatch(tokens=tokens, response_mask=response_mask), CrossEntropyLoss())
        result = {"rank": rank, "pp_rank": context.pp_rank, **model_state_bytes(actor), "activations": usage["peak"]}
    finally:
        context.destroy()
    (Path(result_dir) / f"rank{rank}.json").write_text(json.dumps(result))


def measure_head(case: Case) -> int:
    """Allocator peak of the chunked head alone (forward + backward) above its inputs, minus its gradients."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action

    from pipeline.algorithms.logprobs import token_logprobs_and_entropy
    from pipeline.config import TrainerConfig

    vocab_local = case.vocab // case.tp
    num_tokens = micro_batch_tokens(plan_inputs(case)) - case.rows_per_micro  # the head drops each row's last
    chunk = max(2, TrainerConfig().logprob_buffer_mib * 2**20 // (4 * vocab_local))  # the actor's default chunk
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(num_tokens, case.hidden, generator=generator).to(torch.bfloat16).requires_grad_()
    weight = torch.randn(vocab_local, case.hidden, generator=generator).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, vocab_local, (num_tokens,), generator=generator)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        result = token_logprobs_and_entropy(hidden=hidden, output_weight=weight, targets=targets, chunk_size=chunk)
        (result.logprobs.sum() + result.entropy.sum()).backward()
    # torch's memory profiler: every allocation's creation and destruction, timestamped.
    now = peak = 0
    for _, action, _, size in sorted(prof._memory_profile().timeline, key=lambda row: row[0]):
        if action == Action.CREATE:
            now += size
        elif action == Action.DESTROY:
            now -= size
        peak = max(peak, now)
    outputs = hidden.grad.nbytes + weight.grad.nbytes + result.logprobs.nbytes + result.entropy.nbytes
    return max(0, peak - outputs)


def run_case(case: Case, *, timeout_s: float) -> dict[str, Any]:
    with reserved_port() as port, run_ranks(_rank_main, args=(case, port), num_ranks=case.num_ranks,
                                            timeout_s=timeout_s, description=case.name) as result_dir:
        ranks = [json.loads((result_dir / f"rank{rank}.json").read_text()) for rank in range(case.num_ranks)]
    inputs = plan_inputs(case)
    stages = memory_plan(inputs)
    head_measured = measure_head(case)
    rows = []
    for rank in ranks:
        stage = stages[rank["pp_rank"]]
        last = rank["pp_rank"] == case.pp - 1
        predicted = {"weights": stage.weights, "gradients": stage.gradients, "optimizer": stage.optimizer,
                     "activations": stage.activations, "head_buffer": stage.head_buffer}
        measured = {key: rank[key] for key in COMPONENTS[:4]} | {"head_buffer": head_measured if last else 0}
        rows.append({"rank": rank["rank"], "pp_rank": rank["pp_rank"], "predicted": predicted, "measured": measured})
    for row in rows:
        row["errors"] = {key: (row["predicted"][key] - row["measured"][key]) / row["measured"][key]
                         for key in COMPONENTS if row["measured"][key]}
    return {"case": asdict(case), "ranks": rows}


def format_table(results: list[dict[str, Any]]) -> str:
    lines = [f"{'case':12s} {'layout':9s} {'rank':>4s} {'component':12s} {'predicted':>11s} {'measured':>11s} "
             f"{'error':>7s}"]
    for result in results:
        case = result["case"]
        for row in result["ranks"]:
            for key in COMPONENTS:
                predicted, measured = row["predicted"][key], row["measured"][key]
                if not (predicted or measured):
                    continue
                error = f"{100 * row['errors'][key]:+.1f}%" if measured else "—"
                lines.append(f"{case['name']:12s} TP{case['tp']}×PP{case['pp']:<3d} {row['rank']:4d} {key:12s} "
                             f"{predicted / 2**20:9.2f}Mi {measured / 2**20:9.2f}Mi {error:>7s}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--out", default="runs/bench/plan_memory")
    args = parser.parse_args(argv)
    results = [run_case(CASES[name], timeout_s=args.timeout_s) for name in args.cases]
    print(format_table(results))
    within = all(abs(error) <= TOLERANCE for result in results for row in result["ranks"]
                 for error in row["errors"].values())
    print(f"every measured component within ±{TOLERANCE:.0%}: {within}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan_memory.json").write_text(json.dumps({"results": results, "within_tolerance": within}, indent=1))
    return results


if __name__ == "__main__":
    main()
