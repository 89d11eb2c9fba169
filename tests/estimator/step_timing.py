"""Measure one online DEPO estimator step on this machine: score the candidates, then the replay updates.

    .venv/bin/python -m tests.estimator.step_timing --encoder minilm --question-tokens 64

One step at the staged H100 defaults (``recipes.campaigns.h100_staged_rl``: B = 128 prompts a step,
``depo.oversample`` 2, ``depo.minibatches`` 4 × ``depo.minibatch_size`` 32) scores 256 candidates
(``predict_heads``) and takes 4 AdamW updates on 32 questions each (``EstimatorTrainer.update``),
what ``pipeline.rl.sampling.DepoFilter`` does per step. Questions are ``arith`` problems joined
until they reach ``--question-tokens`` tokens of the encoder's own tokenizer. Prints the median
wall time of ``--repeats`` steps after one warm-up step, on ``--threads`` CPU threads (1: torchrun
sets ``OMP_NUM_THREADS=1`` for every rank), the step's tokens and FLOPs (``estimator_flops``), the
parameters with their AdamW state, and the activation bytes one update keeps for its backward.
The CPU time (``time.process_time``) is the step's cost to the rank; the wall time also counts
waiting for a core, so it is meaningful only on an otherwise idle machine.

Not a test (its name does not start with ``test_``): a measurement the DEPO docstring cites.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from pipeline.config import DEPO_ONLINE_LR, DepoConfig
from pipeline.estimator import DifficultyEstimator, EstimatorTrainer
from pipeline.stats.flops import ForwardCost, estimator_flops

STAGED_PROMPTS_PER_STEP = 128  # recipes.campaigns.h100_rl


def questions(model: DifficultyEstimator, count: int, *, tokens: int, seed: int = 0) -> list[str]:
    """``count`` texts of ``arith`` problems joined until each reaches ``tokens`` encoder tokens."""
    from pipeline.data.synthetic import generate_synthetic

    prompts, _ = generate_synthetic("arith", difficulty=3, size=count * 64, seed=seed)
    problems = iter(prompt.problem for prompt in prompts)
    texts = []
    for _ in range(count):
        text = next(problems)
        while int(model.tokenizer([text], max_length=model.max_length)[1].sum()) < min(tokens, model.max_length):
            text = f"{text} {next(problems)}"
        texts.append(text)
    return texts


def saved_activation_bytes(trainer: EstimatorTrainer, texts: list[str], rates: torch.Tensor) -> int:
    """Bytes of the tensors one ``update`` saves for its backward, parameters excluded (each storage once)."""
    parameters = {p.untyped_storage().data_ptr() for p in trainer.model.parameters()}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        trainer.update(texts, rates, torch.full_like(rates, -1.0, dtype=torch.float64),
                       torch.zeros_like(rates, dtype=torch.float64))
    return sum(storages.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--encoder", choices=["tiny", "minilm"], default="minilm")
    parser.add_argument("--question-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    depo = DepoConfig()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as cache:
        model = (DifficultyEstimator.from_pretrained_minilm(cache) if args.encoder == "minilm"
                 else DifficultyEstimator.tiny())
    trainer = EstimatorTrainer(model, group_size=8, lr=DEPO_ONLINE_LR[model.kind], w_distill=depo.w_distill,
                               w_rank=depo.w_rank, margin=depo.margin, w_zero_variance=depo.w_zero_variance)
    num_candidates = int(STAGED_PROMPTS_PER_STEP * depo.oversample)
    candidates = questions(model, num_candidates, tokens=args.question_tokens)
    minibatch_texts = [candidates[k * depo.minibatch_size : (k + 1) * depo.minibatch_size]
                       for k in range(depo.minibatches)]
    rates = torch.linspace(0.0, 1.0, depo.minibatch_size)
    logprobs = torch.full((depo.minibatch_size,), -1.0, dtype=torch.float64)
    targets = (rates == 0).double() + (rates == 1).double()

    def step() -> None:
        model.predict_heads(candidates)
        for texts in minibatch_texts:
            trainer.update(texts, rates, logprobs, targets)

    step()  # warm-up: allocator, first-call overheads
    before = dict(model.num_encoded_tokens)
    seconds, cpu_seconds = [], []
    for _ in range(args.repeats):
        start, cpu_start = time.perf_counter(), time.process_time()
        step()
        seconds.append(time.perf_counter() - start)
        cpu_seconds.append(time.process_time() - cpu_start)
    read = {kind: (model.num_encoded_tokens[kind] - before[kind]) // args.repeats for kind in before}
    flops = estimator_flops(ForwardCost.from_bert_config(model.describe()["bert_config"]), read)
    num_parameters = sum(p.numel() for p in model.parameters())
    activations = saved_activation_bytes(trainer, minibatch_texts[0], rates)
    print(f"encoder {args.encoder}: {num_parameters:,} parameters, {4 * num_parameters / 2**20:.0f} MiB fp32 weights, "
          f"{4 * num_parameters / 2**20:.0f} MiB gradients, {8 * num_parameters / 2**20:.0f} MiB AdamW state")
    print(f"step: {num_candidates} candidates scored, {depo.minibatches} updates of {depo.minibatch_size}; tokens "
          f"read {read} (mean {read['inference'] / num_candidates:.0f} a question); {flops:.3g} FLOPs")
    print(f"one update's saved activations: {activations / 2**20:.0f} MiB")
    # CPU time is what a step costs the rank; wall time also counts waiting for a core on a loaded machine.
    for name, values in (("CPU", cpu_seconds), ("wall", seconds)):
        print(f"{name} seconds per step on {args.threads} thread(s): median {statistics.median(values):.2f} "
              f"(each: {', '.join(f'{value:.2f}' for value in values)})")


if __name__ == "__main__":
    main()
