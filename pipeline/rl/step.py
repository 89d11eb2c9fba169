"""The pieces of one RL step that the loop (``pipeline/stages/rl.py``) calls by name.

Generation and grading on global rank 0 with the result broadcast to every rank, the
actor's question log-probs for DEPO, the held-out score, the statistics store's
bookkeeping, the step's FLOPs (``count_step_flops``), the per-step metrics row, and the end
of a run. None of them names a method.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch

from pipeline.eval.runner import sample_and_grade, score
from pipeline.parallel.rendezvous import broadcast_from_rank0
from pipeline.rl.rollouts import RolloutBatch
from pipeline.rl.sampling import SelectedPrompts
from pipeline.rl.setup import PreparedStep, Run
from pipeline.rollout.types import GenerationRequest, SamplingParams
from pipeline.stats.flops import (
    FlopCounter,
    ForwardCost,
    StepFlops,
    estimator_flops,
    generation_flops,
    mfu,
    peak_bf16_flops,
    prefill_flops,
    sequence_forward_flops,
    update_flops,
)
from pipeline.trainer.batch import TrainBatch


class PhaseTimer:
    """Wall seconds per phase of a step (``time/<phase>`` in the metrics)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        yield
        self.seconds[phase] += time.perf_counter() - start


def step_seed(seed: int, step: int) -> int:
    return (seed * 1_000_003 + step) % 2**31


def generate_and_grade(run: Run, indices: torch.Tensor, budgets: torch.Tensor, *, temperature: float,
                       seed: int) -> RolloutBatch:
    """Rank 0 generates and grades; every rank receives the same graded samples."""
    payload = _generate_and_grade_here(run, indices, budgets, temperature=temperature, seed=seed)
    group_ids, completions, texts, rewards = broadcast_from_rank0(payload, world_size=run.context.world_size)
    return RolloutBatch(indices, [run.prompt_token_ids[i] for i in indices.tolist()], group_ids, completions,
                        texts, rewards)


def generate_and_grade_on_rank0(run: Run, indices: torch.Tensor, budgets: torch.Tensor, *, temperature: float,
                                 seed: int) -> RolloutBatch:
    """``generate_and_grade`` without the broadcast: global rank 0's worker thread, generating ahead
    (``pipeline/rl/batches.py``)."""
    group_ids, completions, texts, rewards = _generate_and_grade_here(run, indices, budgets, temperature=temperature,
                                                                      seed=seed)
    return RolloutBatch(indices, [run.prompt_token_ids[i] for i in indices.tolist()], group_ids, completions,
                        texts, rewards)


def _generate_and_grade_here(run: Run, indices: torch.Tensor, budgets: torch.Tensor, *, temperature: float,
                             seed: int) -> tuple | None:
    """(group ids (S,), completions, texts, rewards (S,)) on the rank holding the engine; None elsewhere."""
    payload = None
    if run.engine is not None:
        # Request ids carry the position: a step may draw one prompt twice (epoch wrap, DAPO top-ups).
        requests = [GenerationRequest(prompt_id=f"{run.prompts[i].id}#{g}", prompt_token_ids=run.prompt_token_ids[i],
                                      num_samples=int(n))
                    for g, (i, n) in enumerate(zip(indices.tolist(), budgets.tolist()))]
        params = SamplingParams(max_new_tokens=run.cfg.max_new_tokens, temperature=temperature,
                                top_p=run.cfg.top_p, stop_token_ids=run.stop_token_ids, seed=seed)
        completions = run.engine.generate(requests, params)
        texts = [run.tokenizer.decode(c.token_ids.tolist(), skip_special_tokens=True) for c in completions]
        position = {request.prompt_id: g for g, request in enumerate(requests)}
        group_ids = torch.tensor([position[c.prompt_id] for c in completions], dtype=torch.long)  # (S,)
        graded_prompts = [run.prompts[int(indices[g])] for g in group_ids]
        grades = run.pool.grade_batch([(t, p.answer, p.problem) for t, p in zip(texts, graded_prompts)])
        rewards = torch.tensor([g.score for g in grades], dtype=torch.float32)  # (S,)
        payload = (group_ids, completions, texts, rewards)
    return payload


@dataclass(slots=True)
class StepPlan:
    """What a step rolls out, decided before generation: its prompts, budgets, seed and temperature."""

    step: int
    seed: int
    temperature: float
    num_candidates: int
    selected: SelectedPrompts
    budgets: torch.Tensor  # (P,) samples per selected prompt
    metrics: dict[str, float]  # the filter's and the budget's
    epochs_ended: list[bool]  # one per draw from the stream


def plan_step(run: Run, step: int) -> StepPlan:
    """Draw the step's candidates, filter them and give each kept prompt its budget.

    Collective: every rank calls it on its main thread at the same point of the loop
    (``pipeline/rl/batches.py``), since a filter that runs a model of its own (DEPO) decides on the
    rank that samples and broadcasts the decision to the others here.
    """
    candidates, ended = run.stream.next(run.sampling.prompt_filter.num_candidates(run.cfg.prompts_per_step))
    selected, filter_metrics = run.sampling.prompt_filter(candidates, batch_size=run.cfg.prompts_per_step, step=step)
    budgets, budget_metrics = run.sampling.budget(selected.indices)
    return StepPlan(step=step, seed=step_seed(run.cfg.seed, step), temperature=run.methods.temperature.value,
                    num_candidates=candidates.numel(), selected=selected, budgets=budgets,
                    metrics=filter_metrics | budget_metrics, epochs_ended=[ended])


def sample_step(run: Run, plan: StepPlan, *, generate: Callable[..., RolloutBatch] = generate_and_grade
                ) -> PreparedStep:
    """Spend the plan's budgets with the run's sampler (one round, Ada-Seq rounds, DAPO top-ups)."""
    start = time.perf_counter()

    def draw(count: int) -> torch.Tensor:
        indices, ended = run.stream.next(count)
        plan.epochs_ended.append(ended)
        return indices

    def generate_round(indices: torch.Tensor, budgets: torch.Tensor, round_index: int) -> RolloutBatch:
        return generate(run, indices, budgets, temperature=plan.temperature, seed=step_seed(plan.seed, round_index))

    sampled = run.sampling.sampler(plan.selected.indices, plan.budgets, generate=generate_round, draw=draw,
                                   seed=plan.seed)
    return PreparedStep(step=plan.step, seed=plan.seed, temperature=plan.temperature,
                        num_candidates=plan.num_candidates, selected=plan.selected, sampled=sampled,
                        metrics=plan.metrics | sampled.metrics, epoch_ended=any(plan.epochs_ended),
                        generate_seconds=time.perf_counter() - start)


def staleness_metrics(pool: RolloutBatch, *, version: int) -> dict[str, float]:
    """How many updates behind ``version`` (the policy being trained) the step's samples were generated."""
    if pool.num_samples == 0:
        return {"rollout/staleness_mean": 0.0, "rollout/staleness_max": 0.0}
    staleness = (version - pool.weight_versions()).double()  # (S,)
    return {"rollout/staleness_mean": float(staleness.mean()), "rollout/staleness_max": float(staleness.max())}


def question_logprobs(run: Run, rollouts: RolloutBatch) -> torch.Tensor:
    """(P,) the actor's mean log-prob of each prompt's question tokens: DEPO's perplexity target."""
    prompts = rollouts.prompt_token_ids
    tokens = torch.full((len(prompts), max(len(ids) for ids in prompts)), run.pad_token_id)  # (P, T)
    mask = torch.zeros(tokens.shape, dtype=torch.bool)  # (P, T): every question token with a prefix
    for row, ids in enumerate(prompts):
        tokens[row, : len(ids)] = torch.tensor(ids)
        mask[row, 1 : len(ids)] = True
    logprobs = run.actor.compute_logprobs(TrainBatch(tokens=tokens, response_mask=mask))  # (P, T)
    return logprobs.sum(dim=1) / mask.sum(dim=1).clamp(min=1)


def evaluate(run: Run, *, temperature: float) -> dict[str, float]:
    """Sampled pass@1 on the held-out set (rank 0, which drives the engine; {} elsewhere)."""
    if run.engine is None:
        return {}
    results = sample_and_grade(engine=run.engine, tokenizer=run.tokenizer, prompts=run.eval_prompts,
                               num_samples=run.cfg.eval_samples, pool=run.pool, template=run.cfg.data.template,
                               params=SamplingParams(max_new_tokens=run.cfg.max_new_tokens,
                                                     temperature=temperature, stop_token_ids=run.stop_token_ids,
                                                     seed=run.cfg.seed))
    return {f"eval/{k}": v for k, v in score(results, [1]).items()}


def record_statistics(run: Run, *, pool: RolloutBatch, filtered: torch.Tensor, step: int) -> None:
    """Every sampled prompt's counts, and the filtered ones with zero samples (their EMA decays)."""
    zeros = torch.zeros(filtered.numel(), dtype=torch.int64)
    run.stats.record_rollouts(
        prompt_ids=torch.cat([pool.prompt_indices, filtered]),
        num_samples=torch.cat([pool.num_samples_per_prompt(), zeros]),
        num_correct=torch.cat([pool.num_correct_per_prompt(), zeros]),
        reward_sum=torch.cat([pool.reward_sum_per_prompt(), zeros.double()]), step=step)


def policy_step_flops(cost: ForwardCost, *, pool: RolloutBatch, train: RolloutBatch, kept_rows: torch.Tensor,
                      logprob_forwards: int, question_forward: bool,
                      recompute: Literal["none", "selective", "full"] = "none") -> StepFlops:
    """The policy's FLOPs of one step (``pipeline.stats.flops``), estimator not included.

    ``pool``: every sample generated; each prompt with a sample was prefilled once (both engines prefill
    a prompt once for all the samples of a request; later Ada-Seq rounds of the same prompt, which
    SGLang's prefix cache may serve, are not charged again), and the actor reads every pool prompt
    once more when ``question_forward`` (DEPO's distillation target). ``train``: the rows the trainer
    received, ``kept_rows`` those the update trained on; ``logprob_forwards`` forwards of every row ran
    before the update (π_old recomputed, the reference policy). Padding is not counted.
    """
    counted = StepFlops()
    prompt_lengths = [len(ids) for ids in pool.prompt_token_ids]
    sampled = pool.num_samples_per_prompt().tolist()
    prefilled = [length for length, n in zip(prompt_lengths, sampled) if n > 0]
    questions = prompt_lengths if question_forward else []
    counted.flops["prefill"] = sum(prefill_flops(cost, length) for length in prefilled + questions)
    counted.tokens["prefill"] = sum(prefilled) + sum(questions)
    for group, completion in zip(pool.group_ids.tolist(), pool.completions):
        counted.flops["generation"] += generation_flops(cost, prompt_tokens=prompt_lengths[group],
                                                        generated_tokens=completion.num_tokens)
        counted.tokens["generation"] += completion.num_tokens
    rows = [len(train.prompt_token_ids[group]) + completion.num_tokens
            for group, completion in zip(train.group_ids.tolist(), train.completions)]
    trained = [rows[i] for i in kept_rows.tolist()]
    counted.flops["update"] = (sum(update_flops(cost, length, recompute=recompute) for length in trained)
                               + logprob_forwards * sum(sequence_forward_flops(cost, length) for length in rows))
    counted.tokens["update"] = sum(trained)
    return counted


def estimator_model(run: Run) -> Any | None:
    """The difficulty estimator the run's filter, budget or sampler reads prompts with, if any: the model
    whose ``num_encoded_tokens`` (train, inference) the ledger charges. A method names it ``estimator``,
    or holds it as its ``trainer``'s ``model`` (DEPO's ``EstimatorTrainer``). Only the rank that samples
    holds one (``MethodSetting.is_sampling_rank``), global rank 0, whose FLOP count is the one logged and
    checkpointed: the estimator is charged once a step; the other ranks' counts leave it out."""
    for method in (run.sampling.prompt_filter, run.sampling.budget, run.sampling.sampler):
        model = getattr(method, "estimator", None) or getattr(getattr(method, "trainer", None), "model", None)
        if model is not None and hasattr(model, "num_encoded_tokens") and hasattr(model, "describe"):
            return model
    return None


def count_step_flops(run: Run, counter: FlopCounter, *, step: int, pool: RolloutBatch, train: RolloutBatch,
                     kept_rows: torch.Tensor, logprob_forwards: int, seconds: Mapping[str, float],
                     device_name: str | None = None) -> dict[str, float]:
    """Count completed step ``step``'s FLOPs into ``counter``; its ``flops/*``, ``tokens/*`` and, on CUDA,
    ``perf/mfu`` metrics.

    ``perf/mfu``: the update's FLOPs (``flops/update``) over the seconds of the ``logprobs`` and
    ``update`` phases on all ``world_size`` GPUs at the card's dense bf16 peak (the trainer's MFU, as
    Megatron-LM and veRL log it); none on the CPU or on a card ``pipeline.stats.flops`` does not list.
    ``device_name``: the card's CUDA name (read from the actor's device when None).
    """
    counted = policy_step_flops(ForwardCost.from_spec(run.actor.spec), pool=pool, train=train, kept_rows=kept_rows,
                                logprob_forwards=logprob_forwards,
                                question_forward=run.sampling.needs_question_logprobs,
                                recompute=run.cfg.trainer.recompute)
    model = estimator_model(run)
    if model is not None:
        read = counter.estimator_step_tokens(model.num_encoded_tokens)
        counted.flops["estimator"] = estimator_flops(ForwardCost.from_bert_config(model.describe()["bert_config"]),
                                                     read)
        counted.tokens["estimator"] = sum(read.values())
    counter.add(step, counted)
    row = counter.metrics(counted)
    if device_name is None and run.actor.device.type == "cuda":
        device_name = torch.cuda.get_device_name(run.actor.device)
    peak = peak_bf16_flops(device_name) if device_name else None
    update_seconds = seconds.get("logprobs", 0.0) + seconds.get("update", 0.0)
    if peak is not None and update_seconds > 0:
        row["perf/mfu"] = mfu(counted.flops["update"], seconds=update_seconds, num_gpus=run.context.world_size,
                              peak_flops=peak)
    return row


def step_metrics(*, pool: RolloutBatch, update, temperature: float, mean_entropy: float, tokens: int,
                 gradient_tokens: int, zero_variance: int, num_filtered: int, num_candidates: int,
                 mismatch: dict[str, Any], method_metrics: dict[str, Any], ledger: dict[str, int],
                 rollout: dict[str, float], seconds: dict[str, float],
                 flops: Mapping[str, float] | None = None) -> dict[str, float]:
    """One row of ``metrics.jsonl``: the step's rewards, update, budgets, methods, ledger, FLOPs
    (``count_step_flops``) and phase times."""
    budget_counts = pool.num_samples_per_prompt().double()
    return {
        "reward_mean": float(pool.rewards.mean()), "pass_rate": float((pool.rewards > 0).float().mean()),
        "entropy": mean_entropy, "temperature": temperature, "loss": update.loss, "grad_norm": update.grad_norm,
        "skipped_step": update.skipped, "lr": update.learning_rate,
        "usefulness": 1.0 - zero_variance / pool.num_prompts, "kept_token_ratio": gradient_tokens / max(tokens, 1),
        "filter_ratio": num_filtered / max(num_candidates, 1),
        "budget/samples_per_prompt_mean": float(budget_counts.mean()),
        "budget/samples_per_prompt_max": float(budget_counts.max()),
        **{f"mismatch/{k}": float(mismatch[f"{k}_diff"]) for k in ("mean_abs", "max_abs") if mismatch},
        **{f"update/{k}": v for k, v in update.metrics.items()},
        **{k: float(v) for k, v in method_metrics.items()},
        **{f"ledger/{k}": v for k, v in ledger.items()},
        **(flops or {}),
        **rollout,
        **{f"time/{k}": v for k, v in seconds.items()},
    }


def finish(run: Run) -> None:
    from pipeline.rl.plots import plot_run

    if run.pool is not None:
        run.pool.close()
    if run.writer is not None:
        # The statistics and plots are written first: closing the writer uploads them to the trackers.
        run.stats.to_parquet(run.output_dir / "stats.parquet")
        plot_run(run.output_dir / "metrics.jsonl", run.output_dir / "plots")
        run.writer.close()
