"""`winnow rl`: the RL loop, read top to bottom like the algorithm box of a paper.

select prompts → filter (DEPO) → allocate budgets (uniform, E3, Ada-Est) → generate
and grade (one round, Reinforce-Ada-Seq rounds, DAPO top-ups) → advantages → select
samples → weight/select tokens → update the actor → sync weights to the engine →
update the estimator, statistics and schedules → log → checkpoint.

Methods come from the registries through ``pipeline/rl/methods.py`` (advantage, loss,
sample and token selection, temperature) and ``pipeline/rl/sampling.py`` (prompt
filter, budget, sampler); the loop never branches on a method name. Everything a step changes is in the checkpoint,
and sampling seeds derive from (seed, step), so a resumed run reproduces an
uninterrupted one bit for bit on CPU.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import torch

from pipeline.algorithms.depo import observed_zero_variance
from pipeline.config import RLConfig
from pipeline.errors import NonFiniteTrainingError
from pipeline.eval.runner import sample_and_grade, score
from pipeline.rl.methods import token_weights
from pipeline.rl.rollouts import RolloutBatch, to_train_batch
from pipeline.parallel.rendezvous import broadcast_from_rank0
from pipeline.rl.setup import Run, StopRequest, setup_run
from pipeline.rollout.mismatch import logprob_mismatch
from pipeline.rollout.types import GenerationRequest, SamplingParams
from pipeline.rollout.weight_sync import sync_actor_to_engine
from pipeline.trainer.batch import TrainBatch


class PhaseTimer:
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
    payload = None
    if run.engine is not None:
        # Request ids carry the position: a step may draw one prompt twice (epoch wrap, DAPO top-ups).
        requests = [GenerationRequest(prompt_id=f"{run.prompts[i].id}#{g}", prompt_token_ids=run.prompt_token_ids[i],
                                      num_samples=int(n))
                    for g, (i, n) in enumerate(zip(indices.tolist(), budgets.tolist()))]
        params = SamplingParams(max_new_tokens=run.cfg.max_new_tokens, temperature=temperature,
                                top_p=run.cfg.top_p, seed=seed)
        completions = run.engine.generate(requests, params)
        texts = [run.tokenizer.decode(c.token_ids.tolist(), skip_special_tokens=True) for c in completions]
        position = {request.prompt_id: g for g, request in enumerate(requests)}
        group_ids = torch.tensor([position[c.prompt_id] for c in completions], dtype=torch.long)  # (S,)
        graded_prompts = [run.prompts[int(indices[g])] for g in group_ids]
        grades = run.pool.grade_batch([(t, p.answer, p.problem) for t, p in zip(texts, graded_prompts)])
        rewards = torch.tensor([g.score for g in grades], dtype=torch.float32)  # (S,)
        payload = (group_ids, completions, texts, rewards)
    group_ids, completions, texts, rewards = broadcast_from_rank0(payload, world_size=run.context.world_size)
    return RolloutBatch(indices, [run.prompt_token_ids[i] for i in indices.tolist()], group_ids, completions,
                        texts, rewards)


def question_logprobs(run: Run, rollouts: RolloutBatch) -> torch.Tensor:
    """(P,) the actor's mean log-prob of each prompt's question tokens: DEPO's perplexity target."""
    prompts = rollouts.prompt_token_ids
    tokens = torch.full((len(prompts), max(len(ids) for ids in prompts)), run.tokenizer.pad_token_id)  # (P, T)
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
                                                     temperature=temperature, seed=run.cfg.seed))
    return {f"eval/{k}": v for k, v in score(results, [1]).items()}


def run_rl(cfg: RLConfig, *, context=None, max_steps: int | None = None) -> dict[str, float]:
    """Train; returns the last logged metrics. ``max_steps`` stops early (the run stays resumable)."""
    from tqdm import tqdm

    run = setup_run(cfg, context=context)
    actor, methods, sampling, ledger = run.actor, run.methods, run.sampling, run.ledger
    sync_actor_to_engine(actor, run.engine, version=run.start_step + 1)
    last: dict[str, float] = {}
    if run.start_step == 0 and run.writer is not None:
        run.writer.log(0, evaluate(run, temperature=cfg.temperature))
    end_step = cfg.steps if max_steps is None else min(cfg.steps, run.start_step + max_steps)
    bar = tqdm(range(run.start_step, end_step), initial=run.start_step, total=cfg.steps, desc="rl",
               disable=not cfg.logging.progress, unit="step")
    with StopRequest() as stop:
        for step in bar:
            timer, seed, metrics = PhaseTimer(), step_seed(cfg.seed, step), {}
            temperature = run.extras["temperature"]
            epochs_ended = []

            def draw(count: int) -> torch.Tensor:
                indices, ended = run.stream.next(count)
                epochs_ended.append(ended)
                return indices

            def generate(indices: torch.Tensor, budgets: torch.Tensor, round_index: int) -> RolloutBatch:
                return generate_and_grade(run, indices, budgets, temperature=temperature,
                                          seed=step_seed(seed, round_index))

            with timer("filter"):
                candidates = draw(sampling.prompt_filter.num_candidates(cfg.prompts_per_step))
                selected, filter_metrics = sampling.prompt_filter.select(
                    candidates, batch_size=cfg.prompts_per_step, step=step, group_size=cfg.group_size)
                budgets, budget_metrics = sampling.budget.allocate(selected.indices)
            with timer("generate_and_grade"):
                sampled = sampling.sampler.sample(selected.indices, budgets, generate=generate, draw=draw, seed=seed)
                pool, rollouts, baseline = sampled.pool, sampled.train, sampled.baseline
            metrics.update(filter_metrics | budget_metrics | sampled.metrics)
            with timer("advantage"):
                advantages, advantage_metrics = methods.advantage(
                    rewards=rollouts.rewards, group_ids=rollouts.group_ids, pool_rewards=baseline.rewards,
                    pool_group_ids=baseline.group_ids)
                metrics.update(advantage_metrics)
                keep_mask = torch.ones(rollouts.num_samples, dtype=torch.bool)
                num_keep, keep_ratio = methods.d3s_schedule.current() if methods.d3s_schedule else (None, None)
                if methods.select_samples is not None:
                    (keep_mask, advantages), selection_metrics = methods.select_samples(
                        advantages=advantages, rewards=rollouts.rewards, group_ids=rollouts.group_ids,
                        num_keep=num_keep or cfg.group_size, generator=torch.Generator().manual_seed(seed))
                    metrics.update(selection_metrics)
            with timer("logprobs"):
                batch, engine_logprobs = to_train_batch(rollouts.prompt_token_ids, rollouts.completions,
                                                        rollouts.group_ids, pad_id=run.tokenizer.pad_token_id)
                old_logprobs, entropy = None, None  # trainer.old_logprobs=update_forward: the update's own pass
                if methods.needs_token_stats or cfg.trainer.old_logprobs == "recompute":
                    old_logprobs, entropy = actor.compute_token_stats(batch, temperature=temperature)
                weights, token_mask, weight_metrics = token_weights(
                    methods, advantages=advantages, entropy=entropy, logprobs=old_logprobs,
                    response_mask=batch.response_mask, group_ids=rollouts.group_ids, keep_mask=keep_mask,
                    keep_ratio=keep_ratio)
                metrics.update(weight_metrics)
                batch.advantages = advantages[:, None] * weights  # (S, T)
                batch.old_logprobs, batch.token_mask = old_logprobs, token_mask
                if run.reference is not None:
                    batch.ref_logprobs = run.reference.compute_logprobs(batch, temperature=temperature)
                kept_rows = keep_mask.nonzero().squeeze(1)
            with timer("update"):
                update = actor.train_step(batch.select(kept_rows), methods.loss, temperature=temperature)
                run.extras["consecutive_skipped"] = run.extras["consecutive_skipped"] + 1 if update.skipped else 0
                if run.extras["consecutive_skipped"] > cfg.trainer.max_skipped_steps:
                    run.pool.close()
                    raise NonFiniteTrainingError(
                        f"{run.extras['consecutive_skipped']} consecutive non-finite steps up to step {step + 1} "
                        f"(trainer.max_skipped_steps={cfg.trainer.max_skipped_steps}); stopping before the policy "
                        f"is damaged. The last checkpoint holds finite weights; lower optim.lr or check the data")
            with timer("sync"):
                sync_actor_to_engine(actor, run.engine, version=step + 2)

            with timer("estimator"):
                logprobs = question_logprobs(run, pool) if sampling.prompt_filter.needs_question_logprobs else None
                metrics.update(sampling.prompt_filter.observe(pool, question_logprobs=logprobs, selected=selected))
            record_statistics(run, pool=pool, filtered=selected.dropped, step=step)
            if any(epochs_ended):
                metrics.update(sampling.budget.end_pass())
            mean_entropy = float(entropy[batch.response_mask].mean()) if entropy is not None else update.metrics["entropy"]
            if methods.d3s_schedule is not None:
                methods.d3s_schedule.update()
            if methods.temperature is not None:
                run.extras["temperature"], temperature_metrics = methods.temperature.update(entropy=mean_entropy, step=step)
                metrics.update(temperature_metrics)
            tokens = sum(c.token_ids.numel() for c in pool.completions)
            gradient_tokens = int((token_mask & (batch.advantages != 0)).sum())
            zero_variance = int(observed_zero_variance(rewards=pool.rewards, group_ids=pool.group_ids,
                                                       num_groups=pool.num_prompts).sum())
            ledger.tokens_generated += tokens
            ledger.tokens_with_gradient += gradient_tokens
            ledger.prompts_filtered += selected.dropped.numel()
            ledger.samples_discarded += pool.num_samples - kept_rows.numel()
            ledger.zero_variance_groups += zero_variance
            ledger.groups += pool.num_prompts
            mismatch = {}
            if old_logprobs is not None:
                _, mismatch = logprob_mismatch(engine_logprobs, old_logprobs, mask=batch.response_mask)
            budget_counts = pool.num_samples_per_prompt().double()
            last = {
                "reward_mean": float(pool.rewards.mean()), "pass_rate": float((pool.rewards > 0).float().mean()),
                "entropy": mean_entropy, "temperature": temperature, "loss": update.loss, "grad_norm": update.grad_norm,
                "skipped_step": update.skipped, "lr": update.learning_rate,
                "usefulness": 1.0 - zero_variance / pool.num_prompts, "kept_token_ratio": gradient_tokens / max(tokens, 1),
                "filter_ratio": selected.dropped.numel() / max(candidates.numel(), 1),
                "budget/samples_per_prompt_mean": float(budget_counts.mean()),
                "budget/samples_per_prompt_max": float(budget_counts.max()),
                **{f"mismatch/{k}": float(mismatch[f"{k}_diff"]) for k in ("mean_abs", "max_abs") if mismatch},
                **{f"update/{k}": v for k, v in update.metrics.items()},
                **{k: float(v) for k, v in metrics.items()},
                **{f"ledger/{k}": v for k, v in ledger.state_dict().items()},
                **{f"time/{k}": v for k, v in timer.seconds.items()},
            }
            final = step + 1 == cfg.steps
            if final:
                last.update(evaluate(run, temperature=cfg.temperature))
            if run.writer is not None:
                run.writer.log(step + 1, last)
            bar.set_postfix(reward=f"{last['reward_mean']:.3f}", tok_s=f"{tokens / sum(timer.seconds.values()):,.0f}")
            if final or (step + 1) % cfg.checkpoint.every_steps == 0 or stop.received or step + 1 == end_step:
                state, tensors = run.state()
                run.checkpoints.save(step + 1, actor=actor, state=state, tensors=tensors)
            if stop.received:
                break
    finish(run)
    return last


def record_statistics(run: Run, *, pool: RolloutBatch, filtered: torch.Tensor, step: int) -> None:
    """Every sampled prompt's counts, and the filtered ones with zero samples (their EMA decays)."""
    zeros = torch.zeros(filtered.numel(), dtype=torch.int64)
    run.stats.record_rollouts(
        prompt_ids=torch.cat([pool.prompt_indices, filtered]),
        num_samples=torch.cat([pool.num_samples_per_prompt(), zeros]),
        num_correct=torch.cat([pool.num_correct_per_prompt(), zeros]),
        reward_sum=torch.cat([pool.reward_sum_per_prompt(), zeros.double()]), step=step)


def finish(run: Run) -> None:
    from pipeline.rl.plots import plot_run

    run.pool.close()
    if run.writer is not None:
        run.writer.close()
        run.stats.to_parquet(run.output_dir / "stats.parquet")
        plot_run(run.output_dir / "metrics.jsonl", run.output_dir / "plots")
