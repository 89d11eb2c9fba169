"""`winnow demo`: the furthest the campaign goes today, end to end on a CPU.

1. bootstrap the base policy (tokenizer + supervised Megatron actor; cached by config hash);
2. restore the actor from its checkpoint and sync its weights into the local rollout engine
   through the Megatron→HF map (timed);
3. sample n answers per held-out problem, grade them in the bounded pool, and report
   unbiased pass@k per difficulty and on GSM8K (honestly near zero for a model this size);
4. check train/rollout agreement: the actor's recomputed log-probs of the sampled tokens
   against the engine's (mean and max |Δ|).

Curation, estimator training, RL and export join this command as their stages land.
"""

from __future__ import annotations

import time

import torch

from pipeline.config import DemoConfig


def run_demo(cfg: DemoConfig, *, context=None, out=print) -> dict:
    from pipeline.data import load_prompts
    from pipeline.eval.runner import sample_and_grade, score
    from pipeline.models.spec import ModelSpec
    from pipeline.models.tokenizer import load_tokenizer, prompt_token_ids
    from pipeline.parallel.context import ParallelContext
    from pipeline.rewards import GradingPool
    from pipeline.rollout.local import LocalEngine
    from pipeline.rollout.mismatch import logprob_mismatch
    from pipeline.rl.rollouts import to_train_batch
    from pipeline.rollout.types import GenerationRequest, SamplingParams
    from pipeline.rollout.weight_sync import build_hf_model, sync_actor_to_engine
    from pipeline.stages.bootstrap import TEMPLATE, _single_process_rendezvous, run_bootstrap
    from pipeline.trainer.actor import Actor
    from pipeline.trainer.checkpoint import CheckpointManager

    started = time.perf_counter()
    if context is None:
        context = ParallelContext.initialize(tensor_parallel=1, pipeline_parallel=1, seed=cfg.rl.bootstrap.seed,
                                             **_single_process_rendezvous())
    out("[1/5] base policy (bootstrap)")
    boot = run_bootstrap(cfg.rl.bootstrap, context=context)
    summary = boot.summary
    out(f"      {'reused' if boot.cached else 'trained'}: {summary['num_parameters']:,} parameters, "
        f"final SFT loss {summary['final_loss']:.3f}  ({boot.directory})")

    out("[2/5] restore the Megatron actor and sync its weights into the local engine")
    spec = ModelSpec(**summary["model_spec"])
    actor = Actor(spec=spec, context=context, trainer=cfg.rl.bootstrap.trainer, optim=cfg.rl.bootstrap.optim, seed=cfg.rl.bootstrap.seed)
    manager = CheckpointManager(boot.checkpoint_dir, keep_last=1, rank=context.rank, world_size=context.world_size)
    checkpoint = manager.newest_valid()
    if checkpoint is None:
        raise FileNotFoundError(f"no valid checkpoint under {boot.checkpoint_dir}")
    manager.load(checkpoint, actor=actor)
    tokenizer = load_tokenizer(boot.tokenizer_dir)
    engine = LocalEngine(build_hf_model(spec), eos_token_ids=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, show_progress=False)
    sync_started = time.perf_counter()
    sync_actor_to_engine(actor, engine, version=1)
    out(f"      weights v1 synced in {time.perf_counter() - sync_started:.3f} s")

    out(f"[3/5] pass@k with n={cfg.num_samples}, T={cfg.temperature}, {cfg.max_new_tokens} new tokens")
    params = SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, seed=cfg.seed)
    table: dict[str, dict[str, float]] = {}
    sampled: dict[str, object] = {}  # a few results per set, by prompt id (sets may share problems)
    with GradingPool(**cfg.reward.pool_kwargs()) as pool:
        for spec_text in cfg.eval_sets:
            prompts, _ = load_prompts(spec_text, split="test", limit=cfg.limit)
            prompts, num_too_long = _fitting(prompts, tokenizer, budget=spec.max_position_embeddings - cfg.max_new_tokens)
            if not prompts:
                out(f"      {spec_text}: all {num_too_long} problems are longer than the model's context; skipped")
                continue
            if num_too_long:
                out(f"      {spec_text}: {num_too_long} problems longer than the model's context skipped")
            results = sample_and_grade(engine=engine, tokenizer=tokenizer, prompts=prompts,
                                       num_samples=cfg.num_samples, params=params, pool=pool, template=TEMPLATE)
            table[spec_text] = score(results, cfg.ks)
            sampled.update((r.prompt.id, r) for r in results[:4])
    header = f"      {'set':<28} {'problems':>8} " + " ".join(f"{'pass@' + str(k):>8}" for k in cfg.ks)
    out(header)
    for name, row in table.items():
        cells = " ".join(f"{row.get(f'pass@{k}', float('nan')):8.3f}" for k in cfg.ks)
        out(f"      {name:<28} {int(row['num_problems']):>8} {cells}")

    out("[4/5] train/rollout log-prob agreement on sampled tokens")
    checked = list(sampled.values())
    prompt_ids = [prompt_token_ids(tokenizer, r.prompt, template=TEMPLATE) for r in checked]
    completions = engine.generate(
        [GenerationRequest(prompt_id=r.prompt.id, prompt_token_ids=ids, num_samples=1) for r, ids in zip(checked, prompt_ids)],
        params,
    )
    batch, engine_logprobs = to_train_batch(prompt_ids, completions, torch.arange(len(checked)),
                                            pad_id=tokenizer.pad_token_id)
    trainer_logprobs = actor.compute_logprobs(batch, temperature=cfg.temperature)
    _, mismatch = logprob_mismatch(engine_logprobs, trainer_logprobs, mask=batch.response_mask)
    out(f"      mean |Δ| = {float(mismatch['mean_abs_diff']):.2e}, max |Δ| = {float(mismatch['max_abs_diff']):.2e} "
        f"over {int(mismatch['num_tokens'])} tokens")
    out(f"[5/5] GRPO from the base policy: {cfg.rl.steps} steps of {cfg.rl.prompts_per_step} prompts × "
        f"{cfg.rl.group_size} samples on {', '.join(cfg.rl.data.train)}")
    from pipeline.metrics import read_metrics
    from pipeline.stages.rl import run_rl

    last = run_rl(cfg.rl, context=context)
    before = read_metrics(f"{cfg.rl.logging.output_dir}/metrics.jsonl")[0]
    out(f"      held-out sampled pass@1 on {cfg.rl.eval_set}: {before['eval/pass@1']:.3f} → {last['eval/pass@1']:.3f} "
        f"({int(last['eval/num_problems'])} problems × {cfg.rl.eval_samples} samples)")
    out(f"      tokens generated {last['ledger/tokens_generated']:,}, with gradient {last['ledger/tokens_with_gradient']:,}; "
        f"plots in {cfg.rl.logging.output_dir}/plots")
    out(f"done in {time.perf_counter() - started:.0f} s")
    return {"pass_at_k": table, "mismatch": {k: float(v) for k, v in mismatch.items()},
            "rl": {"pass@1_before": before["eval/pass@1"], "pass@1_after": last["eval/pass@1"]}}


def _fitting(prompts, tokenizer, *, budget: int):
    """Prompts whose encoding fits ``budget`` tokens, and how many did not."""
    from pipeline.models.tokenizer import prompt_token_ids
    from pipeline.stages.bootstrap import TEMPLATE

    kept = [p for p in prompts if len(prompt_token_ids(tokenizer, p, template=TEMPLATE)) <= budget]
    return kept, len(prompts) - len(kept)
