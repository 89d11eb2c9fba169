"""`winnow rl`: the RL loop, read top to bottom like the algorithm box of a paper.

select prompts → filter (DEPO) → allocate budgets (uniform, E3, Ada-Est) → generate
and grade (one round, Reinforce-Ada-Seq rounds, DAPO top-ups) → advantages → select
samples → weight/select tokens → update the actor → sync weights to the engine →
every method's end-of-step hook (estimator, budgets, schedules, temperature) → log →
checkpoint.

Methods come from the registries of ``pipeline/rl/methods.py`` (advantage, sample and
token selection, loss, temperature) and ``pipeline/rl/sampling.py`` (prompt filter,
budget, sampler); the loop never branches on a method name. Everything a step changes is
in the checkpoint, and sampling seeds derive from (seed, step), so a resumed run
reproduces an uninterrupted one bit for bit on CPU.

Where the batch comes from is chosen once, by ``rollout.max_staleness``, from the
``BATCH_SOURCES`` of ``pipeline/rl/batches.py``: ``now`` generates it at the step's start and
pushes the weights after the update; ``ahead`` swaps the first two lines with the update: the
step takes the batch generated during the previous step, pushes the weights, and starts
generating the next batch before its own update (docs/rl.md, One-step-off-policy rollouts).
The loop is the same for both.

A stop (SIGTERM, or SLURM's SIGUSR1 before the time limit) heard by the end of a step's update
skips that step's weight push and held-out score: the step is checkpointed and the loop ends. The
resumed run pushes the checkpoint's weights before it generates, then scores the held-out set if
the stopped step was due to (docs/rl.md, Stopping on a signal).
"""

from __future__ import annotations

from pathlib import Path

from pipeline.algorithms.depo import observed_zero_variance
from pipeline.config import RLConfig
from pipeline.errors import NonFiniteTrainingError, UserError
from pipeline.models.spec import ModelSpec
from pipeline.rl.batches import build_batch_source
from pipeline.rl.registry import StepEnd
from pipeline.rl.rollouts import to_train_batch
from pipeline.rl.setup import InitialPolicy, StopRequest, setup_run
from pipeline.rl.step import (
    PhaseTimer,
    evaluate,
    finish,
    question_logprobs,
    record_statistics,
    staleness_metrics,
    count_step_flops,
    step_metrics,
)
from pipeline.rollout.mismatch import logprob_mismatch
from pipeline.rollout.weight_sync import sync_actor_to_engine

CONVERTED_POLICY_DIR = "initial_policy"  # under logging.output_dir: a Hugging Face policy, converted


def convert_hf_policy(cfg: RLConfig, *, context) -> Path:
    """``cfg.policy`` (a Hugging Face folder) as a winnow checkpoint in the run folder, converted once.

    ``pipeline.checkpoint.convert.hf_to_megatron`` writes it to
    ``<logging.output_dir>/initial_policy/`` with the run's TP/PP layout recorded, and only
    after its logit gate passed; starting from unverified weights is not offered. A resumed
    run finds it there and reuses it (it must come from the same folder and layout). The
    conversion needs a one-rank process: a multi-rank run without it says which
    ``winnow convert`` command writes it. Its tokenizer (with the model's
    ``generation_config.json``) is also copied to ``<logging.output_dir>/tokenizer/``, where
    `winnow evaluate` and `winnow convert megatron-to-hf` look for the tokenizer of the run's
    checkpoints (``<logging.output_dir>/checkpoints`` by default).
    """
    import shutil

    from pipeline.checkpoint.artifact import TOKENIZER_DIR, read_manifest, resolve_checkpoint
    from pipeline.checkpoint.convert import hf_to_megatron
    from pipeline.io import staged_directory

    hf_dir = Path(cfg.policy).resolve()
    out = Path(cfg.logging.output_dir) / CONVERTED_POLICY_DIR
    layout = {"tensor_parallel": cfg.parallel.tensor_parallel, "pipeline_parallel": cfg.parallel.pipeline_parallel}
    command = (f"winnow convert hf-to-megatron --hf {cfg.policy} --out {out} "
               f"--tp {layout['tensor_parallel']} --pp {layout['pipeline_parallel']}")
    if out.exists():
        manifest = read_manifest(resolve_checkpoint(out))
        recorded = {key: manifest.get("layout", {}).get(key) for key in layout}
        if manifest.get("hf_source") != str(hf_dir) or recorded != layout:
            raise UserError(f"policy: {out} holds a conversion of {manifest.get('hf_source')} for {recorded}, not of "
                             f"{hf_dir} for {layout}; use another logging.output_dir or delete it")
    elif context.world_size != 1:
        raise UserError(f"policy: {cfg.policy} is a Hugging Face folder and converting it needs a one-rank process; "
                         f"run `{command}` once (it verifies logit parity), then start this run again: it uses {out}")
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        hf_to_megatron(hf=hf_dir, out=out, tensor_parallel=layout["tensor_parallel"],
                       pipeline_parallel=layout["pipeline_parallel"])
    run_tokenizer = Path(cfg.logging.output_dir) / TOKENIZER_DIR
    if context.rank == 0 and (out / TOKENIZER_DIR).is_dir() and not run_tokenizer.exists():
        with staged_directory(run_tokenizer, overwrite=False) as staging:
            shutil.copytree(out / TOKENIZER_DIR, staging, dirs_exist_ok=True)
    return out


def initial_policy(cfg: RLConfig, *, context) -> InitialPolicy:
    """The policy RL starts from: ``cfg.policy`` (a winnow checkpoint, or a Hugging Face folder
    converted into the run folder by ``convert_hf_policy``) or the bootstrap policy."""
    from pipeline.checkpoint.artifact import (
        checkpoint_spec,
        find_tokenizer_dir,
        is_hf_folder,
        resolve_checkpoint,
        tokenizer_candidates,
    )
    from pipeline.checkpoint.manager import CheckpointManager
    from pipeline.stages.bootstrap import run_bootstrap

    if cfg.policy is None:
        base = run_bootstrap(cfg.bootstrap, context=context)
        weights = CheckpointManager(base.checkpoint_dir, keep_last=1, rank=context.rank,
                                    world_size=context.world_size).newest_valid()
        if weights is None:
            raise FileNotFoundError(f"no valid checkpoint under {base.checkpoint_dir}")
        return InitialPolicy(ModelSpec(**base.summary["model_spec"]), weights, Path(cfg.tokenizer or base.tokenizer_dir))
    policy = convert_hf_policy(cfg, context=context) if is_hf_folder(Path(cfg.policy)) else Path(cfg.policy)
    step_dir = resolve_checkpoint(policy)
    candidates = tokenizer_candidates(step_dir)
    tokenizer_dir = find_tokenizer_dir(cfg.tokenizer, candidates=candidates)
    if tokenizer_dir is None:
        raise ValueError(f"tokenizer: no tokenizer files in {', '.join(map(str, candidates))}; set tokenizer=DIR")
    return InitialPolicy(checkpoint_spec(step_dir), step_dir, tokenizer_dir)


def run_rl(cfg: RLConfig, *, context=None, max_steps: int | None = None) -> dict[str, float]:
    """Train; returns the last logged metrics. ``max_steps`` stops early (the run stays resumable)."""
    from tqdm import tqdm

    from pipeline.config import collective_timeout_minutes
    from pipeline.parallel.rendezvous import initialize_process_context
    from pipeline.stats.curation import load_curation

    if context is None:
        context = initialize_process_context(
            tensor_parallel=cfg.parallel.tensor_parallel, pipeline_parallel=cfg.parallel.pipeline_parallel,
            seed=cfg.seed, backend=None if cfg.parallel.backend == "auto" else cfg.parallel.backend,
            timeout_minutes=collective_timeout_minutes(parallel=cfg.parallel, rollout=cfg.rollout))
    curation = load_curation(cfg.curation_dir) if cfg.curation_dir is not None else None
    run = setup_run(cfg, policy=initial_policy(cfg, context=context), context=context,
                    batch_source=build_batch_source, curation=curation)
    actor, methods, sampling, ledger, batches = run.actor, run.methods, run.sampling, run.ledger, run.batches
    # A resumed run's engine gets the checkpoint's weights before anything is generated: the push a stop
    # skipped (docs/rl.md, Stopping on a signal), or the servers' restart weights.
    sync_actor_to_engine(actor, run.engine, version=run.start_step + 1)
    last: dict[str, float] = {}
    if run.start_step == 0 and run.writer is not None:
        run.writer.log(0, evaluate(run, temperature=cfg.temperature))
    if run.row_awaiting_eval is not None:  # the stopped step was a scored one: its score, at these weights
        last = run.row_awaiting_eval | evaluate(run, temperature=cfg.temperature)
        run.row_awaiting_eval = None
        if run.writer is not None:
            run.writer.log(run.start_step, last)
    end_step = cfg.steps if max_steps is None else min(cfg.steps, run.start_step + max_steps)
    bar = tqdm(range(run.start_step, end_step), initial=run.start_step, total=cfg.steps, desc="rl",
               disable=not cfg.logging.progress, unit="step")
    batches.start()
    try:
        with StopRequest() as stop:
            for step in bar:
                timer, metrics = PhaseTimer(), {}
                prepared = batches.prepare(step, timer)
                seed, temperature, selected = prepared.seed, prepared.temperature, prepared.selected
                pool, rollouts, baseline = prepared.sampled.pool, prepared.sampled.train, prepared.sampled.baseline
                metrics.update(prepared.metrics)
                with timer("advantage"):
                    advantages, advantage_metrics = methods.advantage(
                        rewards=rollouts.rewards, group_ids=rollouts.group_ids, pool_rewards=baseline.rewards,
                        pool_group_ids=baseline.group_ids)
                    (keep_mask, advantages), selection_metrics = methods.sample_selector(
                        advantages=advantages, rewards=rollouts.rewards, group_ids=rollouts.group_ids, seed=seed)
                    metrics.update(advantage_metrics | selection_metrics)
                with timer("logprobs"):
                    batch, engine_logprobs = to_train_batch(rollouts.prompt_token_ids, rollouts.completions,
                                                            rollouts.group_ids, pad_id=run.pad_token_id)
                    old_logprobs, entropy = None, None  # trainer.old_logprobs=update_forward: the update's own pass
                    if methods.needs_token_stats or cfg.trainer.old_logprobs == "recompute":
                        old_logprobs, entropy = actor.compute_token_stats(batch, temperature=temperature)
                    weights, token_mask, weight_metrics = methods.token_weights(
                        advantages=advantages, entropy=entropy, logprobs=old_logprobs,
                        engine_logprobs=engine_logprobs, response_mask=batch.response_mask,
                        group_ids=rollouts.group_ids, keep_mask=keep_mask)
                    metrics.update(weight_metrics)
                    batch.advantages = advantages[:, None] * weights  # (S, T)
                    batch.old_logprobs, batch.token_mask = old_logprobs, token_mask
                    if run.reference is not None:
                        batch.ref_logprobs = run.reference.compute_logprobs(batch, temperature=temperature)
                    kept_rows = keep_mask.nonzero().squeeze(1)
                with timer("update"):
                    update = actor.train_step(batch.select(kept_rows), methods.loss, temperature=temperature)
                    run.consecutive_skipped = run.consecutive_skipped + 1 if update.skipped else 0
                    if run.consecutive_skipped > cfg.trainer.max_skipped_steps:
                        if run.pool is not None:
                            run.pool.close()
                        raise NonFiniteTrainingError(
                            f"{run.consecutive_skipped} consecutive non-finite steps up to step {step + 1} "
                            f"(trainer.max_skipped_steps={cfg.trainer.max_skipped_steps}); stopping before the "
                            f"policy is damaged. The last checkpoint holds finite weights; lower optim.lr or check "
                            f"the data")
                final = step + 1 == cfg.steps
                scored = final or (cfg.eval_every > 0 and (step + 1) % cfg.eval_every == 0)
                # A stop asked for by now is answered before the new weights go anywhere: checkpoint, leave.
                # Their push (a 7B broadcast, or an export every server reads) would spend the signal's lead
                # time, and fail or hang on servers that SIGTERM ends; the resumed run pushes the
                # checkpoint's weights before it generates. The final step finishes as usual.
                stopping = not final and stop.requested(world_size=run.context.world_size)
                if not stopping:  # now: pushed here; ahead: at the next step's start, after its batch is done
                    batches.updated(version=step + 2, timer=timer)

                mean_entropy = (float(entropy[batch.response_mask].mean()) if entropy is not None
                                else update.metrics["entropy"])
                with timer("estimator"):
                    end = StepEnd(step=step, mean_entropy=mean_entropy, epoch_ended=prepared.epoch_ended, pool=pool,
                                  selected=selected, question_logprobs=question_logprobs(run, pool)
                                  if sampling.needs_question_logprobs else None)
                    record_statistics(run, pool=pool, filtered=selected.dropped, step=step)
                    metrics.update(sampling.end_step(end) | methods.end_step(end))
                tokens = sum(c.token_ids.numel() for c in pool.completions)
                gradient_tokens = int((token_mask & (batch.advantages != 0)).sum())
                zero_variance = int(observed_zero_variance(rewards=pool.rewards, group_ids=pool.group_ids,
                                                           num_groups=pool.num_prompts).sum())
                ledger.record(tokens_generated=tokens, tokens_with_gradient=gradient_tokens,
                              prompts_filtered=selected.dropped.numel(),
                              samples_discarded=pool.num_samples - kept_rows.numel(),
                              zero_variance_groups=zero_variance, groups=pool.num_prompts)
                mismatch = {} if old_logprobs is None else logprob_mismatch(engine_logprobs, old_logprobs,
                                                                              mask=batch.response_mask)[1]
                rollout = staleness_metrics(pool, version=step + 1)
                if run.engine is not None:  # rank 0: the servers' states and recoveries (SGLang), {} locally
                    rollout.update(run.engine.metrics())
                rollout.update(batches.metrics(prepared))
                flops = count_step_flops(
                    run, run.flops, step=step + 1, pool=pool, train=rollouts, kept_rows=kept_rows,
                    logprob_forwards=int(old_logprobs is not None) + int(run.reference is not None),
                    seconds=timer.seconds)
                last = step_metrics(pool=pool, update=update, temperature=temperature, mean_entropy=mean_entropy,
                                    tokens=tokens, gradient_tokens=gradient_tokens, zero_variance=zero_variance,
                                    num_filtered=selected.dropped.numel(), num_candidates=prepared.num_candidates,
                                    mismatch=mismatch, method_metrics=metrics, ledger=ledger.state_dict(),
                                    rollout=rollout, seconds=timer.seconds, flops=flops)
                if scored and stopping:
                    # Scoring needs these weights on the engine: the resumed run scores and logs the row.
                    run.row_awaiting_eval = {key: value.item() if hasattr(value, "item") else value
                                             for key, value in last.items()}
                elif scored:
                    batches.before_scoring(version=step + 2)
                    last.update(evaluate(run, temperature=cfg.temperature))
                if run.writer is not None and run.row_awaiting_eval is None and \
                        (scored or (step + 1) % cfg.logging.log_every == 0):
                    run.writer.log(step + 1, last)
                bar.set_postfix(reward=f"{last['reward_mean']:.3f}", tok_s=f"{tokens / sum(timer.seconds.values()):,.0f}")
                # A signal heard after the push still stops the run here, after this step's checkpoint.
                stopping = stopping or (not final and stop.requested(world_size=run.context.world_size))
                if final or (step + 1) % cfg.checkpoint.every_steps == 0 or stopping or step + 1 == end_step:
                    batches.complete()
                    state, tensors = run.state()
                    run.checkpoints.save(step + 1, actor=actor, state=state, tensors=tensors)
                if stopping:
                    break
    finally:
        batches.close()
    finish(run)
    return last
