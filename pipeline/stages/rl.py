"""`winnow rl`: the RL loop, read top to bottom like the algorithm box of a paper.

select prompts → (filter) → allocate budgets → generate → grade → advantages →
select samples → weight/select tokens → update the actor → sync weights to the
engine → update statistics and schedules → log → checkpoint.

Methods come from the registries through ``pipeline/rl/methods.py``; the loop
never branches on a method name. Everything a step changes is in the checkpoint,
and sampling seeds derive from (seed, step), so a resumed run reproduces an
uninterrupted one bit for bit on CPU.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import torch

from pipeline.config import RLConfig
from pipeline.eval.runner import sample_and_grade, score
from pipeline.rl.methods import token_weights
from pipeline.rl.rollouts import RolloutBatch, to_train_batch
from pipeline.rl.setup import Run, StopRequest, setup_run
from pipeline.rollout.mismatch import logprob_mismatch
from pipeline.rollout.types import GenerationRequest, SamplingParams
from pipeline.rollout.weight_sync import sync_actor_to_engine


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
    requests = [GenerationRequest(prompt_id=run.prompts[i].id, prompt_token_ids=run.prompt_token_ids[i],
                                  num_samples=int(n)) for i, n in zip(indices.tolist(), budgets.tolist())]
    params = SamplingParams(max_new_tokens=run.cfg.max_new_tokens, temperature=temperature,
                            top_p=run.cfg.top_p, seed=seed)
    completions = run.engine.generate(requests, params)
    texts = [run.tokenizer.decode(c.token_ids.tolist(), skip_special_tokens=True) for c in completions]
    position = {run.prompts[i].id: g for g, i in enumerate(indices.tolist())}
    group_ids = torch.tensor([position[c.prompt_id] for c in completions], dtype=torch.long)  # (S,)
    grades = run.pool.grade_batch([(t, run.prompts[int(indices[g])].answer) for t, g in zip(texts, group_ids)])
    rewards = torch.tensor([g.score for g in grades], dtype=torch.float32)  # (S,)
    return RolloutBatch(indices, [run.prompt_token_ids[i] for i in indices.tolist()], group_ids, completions,
                        texts, rewards)


def evaluate(run: Run, *, temperature: float) -> dict[str, float]:
    results = sample_and_grade(engine=run.engine, tokenizer=run.tokenizer, prompts=run.eval_prompts,
                               num_samples=run.cfg.eval_samples, pool=run.pool, template=run.cfg.data.template,
                               params=SamplingParams(max_new_tokens=run.cfg.max_new_tokens,
                                                     temperature=temperature, seed=run.cfg.seed))
    return {f"eval/{k}": v for k, v in score(results, [1]).items()}


def run_rl(cfg: RLConfig, *, context=None, max_steps: int | None = None) -> dict[str, float]:
    """Train; returns the last logged metrics. ``max_steps`` stops early (the run stays resumable)."""
    from tqdm import tqdm

    run = setup_run(cfg, context=context)
    actor, methods, ledger = run.actor, run.methods, run.ledger
    sync_actor_to_engine(actor, run.engine, version=run.start_step + 1)
    last: dict[str, float] = {}
    if run.start_step == 0 and run.writer is not None:
        run.writer.log(0, evaluate(run, temperature=cfg.temperature))
    end_step = cfg.steps if max_steps is None else min(cfg.steps, run.start_step + max_steps)
    bar = tqdm(range(run.start_step, end_step), initial=run.start_step, total=cfg.steps, desc="rl",
               disable=not cfg.logging.progress, unit="step")
    with StopRequest() as stop:
        for step in bar:
            timer, seed = PhaseTimer(), step_seed(cfg.seed, step)
            temperature = run.extras["temperature"]
            with timer("select"):
                indices, epoch_ended = run.stream.next(cfg.prompts_per_step)
                budgets = torch.full((len(indices),), cfg.group_size)  # uniform G
            with timer("generate_and_grade"):
                rollouts = generate_and_grade(run, indices, budgets, temperature=temperature, seed=seed)
            with timer("advantage"):
                advantages, metrics = methods.advantage(rewards=rollouts.rewards, group_ids=rollouts.group_ids)
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
                if actor.num_skipped_steps > cfg.trainer.max_skipped_steps:
                    raise RuntimeError(f"{actor.num_skipped_steps} non-finite steps (trainer.max_skipped_steps="
                                       f"{cfg.trainer.max_skipped_steps}); stopping before the policy is damaged")
            with timer("sync"):
                sync_actor_to_engine(actor, run.engine, version=step + 2)

            num_correct, num_samples = rollouts.num_correct_per_prompt(), rollouts.num_samples_per_prompt()
            reward_sum = torch.zeros(len(indices), dtype=torch.float64).index_add_(
                0, rollouts.group_ids, rollouts.rewards.double())
            run.stats.record_rollouts(prompt_ids=indices, num_samples=num_samples, num_correct=num_correct,
                                      reward_sum=reward_sum, step=step)
            mean_entropy = float(entropy[batch.response_mask].mean())
            if methods.d3s_schedule is not None:
                methods.d3s_schedule.update()
            if methods.temperature is not None:
                run.extras["temperature"], temperature_metrics = methods.temperature.update(entropy=mean_entropy, step=step)
                metrics.update(temperature_metrics)
            tokens = int(batch.response_mask.sum())
            gradient_tokens = int((token_mask & (batch.advantages != 0)).sum())
            zero_variance = int(((num_correct == 0) | (num_correct == num_samples)).sum())
            ledger.tokens_generated += tokens
            ledger.tokens_with_gradient += gradient_tokens
            ledger.samples_discarded += int((~keep_mask).sum())
            ledger.zero_variance_groups += zero_variance
            ledger.groups += len(indices)
            _, mismatch = logprob_mismatch(engine_logprobs, old_logprobs, mask=batch.response_mask)
            last = {
                "reward_mean": float(rollouts.rewards.mean()), "pass_rate": float((rollouts.rewards > 0).float().mean()),
                "entropy": mean_entropy, "temperature": temperature, "loss": update.loss, "grad_norm": update.grad_norm,
                "skipped_step": update.skipped, "lr": update.learning_rate,
                "usefulness": 1.0 - zero_variance / len(indices), "kept_token_ratio": gradient_tokens / max(tokens, 1),
                "mismatch/mean_abs": float(mismatch["mean_abs_diff"]), "mismatch/max_abs": float(mismatch["max_abs_diff"]),
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


def finish(run: Run) -> None:
    from pipeline.rl.plots import plot_run

    run.pool.close()
    if run.writer is not None:
        run.writer.close()
        run.stats.to_parquet(run.output_dir / "stats.parquet")
        plot_run(run.output_dir / "metrics.jsonl", run.output_dir / "plots")
