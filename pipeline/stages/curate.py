"""`winnow curate`: measure every prompt's difficulty under the base policy and keep the useful ones.

Reinforce-Ada ("Reinforce-Ada: An Adaptive Sampling Framework under Non-linear RL Objectives", §4.1 "Data Curation and
Verifier", App. C.1) curates its training set before RL; this stage does the same, in the
rule order of ``pipeline.stages.curate_rules`` (read its docstring for the rules and the
choices the paper leaves open):

1. load every source (``load_prompts``; ids must be unique across sources);
2. screen without generating: the reference answer must verify against itself, and
   normalized problem texts are deduplicated;
3. load the policy (``pipeline.eval.policy.load_policy``: a Hugging Face folder or a winnow
   checkpoint) and drop prompts that do not fit its context with ``max_new_tokens``;
4. sample k = ``num_samples`` responses per remaining prompt with the engine ``rollout``
   names (the local engine, or SGLang servers that load the policy once) and grade them in
   the bounded pool, shard by shard (``pipeline.eval.sharded``, the engine `winnow evaluate`
   runs too). Each shard is written atomically
   (``shards/shard_00003.parquet``) and samples with a seed derived from
   ``(seed, shard index)``, so a restarted run skips the completed shards and ends with
   exactly the files of an uninterrupted one;
5. drop trivial, impossible and (optionally) outside-hard-subset prompts by pass rate and
   write the results.

A curation that keeps no prompt (in step 3 or 5) is a ``CurationError`` saying how many
prompts each rule took and which options to change (``nothing_kept_error``), never an empty
``kept.jsonl``.

Outputs under ``output_dir`` (``pipeline.stats.curation`` owns their names and formats):
the shards (``shards/shard_XXXXX.parquet``, one row per sampled prompt, with the policy's mean
log-prob of the question tokens: DEPO's distillation target, and each response's generated
tokens: the lengths `winnow plan` times rl steps from), ``pass_rates.parquet`` (every
loaded prompt), ``kept.jsonl`` (the kept prompts, read back by ``load_prompts(path)``),
``report.md`` and ``difficulty.png``, and ``manifest.json``, written last, so its presence
marks a complete curation.

A shard records a fingerprint of what determines its samples: the policy's exact weights
(``LoadedPolicy.source``), tokenizer, sampling options, shard size, template, dtype, the
grading limits (``sharded.sampling_fingerprint``) and the whole list of prompts to sample.
A shard with another fingerprint is an error, never silently mixed in. The rules'
thresholds are not part of it: rerunning with other thresholds re-applies the rules to the
stored shards without generating.
Samples are reproducible on one device type (CPU and GPU kernels differ in the last bits).

``pipeline.stats.curation.load_curation(output_dir)`` reads a finished curation back as a
``CurationResult``: the per-prompt ``(n, c)`` that seed the statistics store, E3 ranks, Ada-Est
priors and the difficulty estimator's first training set.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pipeline import configlib
from pipeline.config import CurateConfig
from pipeline.configlib import ConfigError
from pipeline.eval.sharded import (
    SamplingOptions,
    Shard,
    ShardSampler,
    check_shard_fingerprints,
    fingerprint_digest,
    fits_context,
    plan_shards,
    policy_engine,
    resolve_device,
    run_shard,
    sampling_fingerprint,
)
from pipeline.eval.sharded import curation_shard_seed as shard_seed
from pipeline.io import atomic_write, atomic_write_text, package_versions
from pipeline.stats.curation import (
    FORMAT_VERSION,
    KEPT_FILE,
    MANIFEST_FILE,
    PASS_RATES_FILE,
    PLOT_FILE,
    REPORT_FILE,
    RESPONSE_LENGTHS_COLUMN,
    SHARDS_DIR,
    CurationError,
    CurationResult,
    pass_rates,
    write_kept,
    write_manifest,
    write_pass_rates,
)

_SHARD_METADATA_KEY = b"winnow.curate"
_RESERVED_KEYS = ("id", "problem", "answer")  # kept.jsonl's own fields; metadata may not shadow them


# ================================================================ the stage


def run_curate(cfg: CurateConfig, *, context=None, engine=None, out: Callable[[str], Any] = print) -> CurationResult:
    """Run the curation described by ``cfg`` (see the module docstring); resumes from completed shards.

    ``context``: an existing one-rank ``ParallelContext`` for loading a winnow checkpoint in
    a process that already runs ``torch.distributed`` (see ``load_policy``). ``engine``: a
    ``RolloutEngine`` already serving the policy, to generate with instead of the one
    ``cfg.rollout`` names (the caller closes it).
    """
    from pipeline.eval.policy import load_policy
    from pipeline.rewards import GradingPool
    from pipeline.stages import curate_rules as rules

    if cfg.policy is None:
        raise ConfigError("policy: required; a Hugging Face folder or a winnow checkpoint directory")
    started = time.perf_counter()
    timings: dict[str, float] = {}
    output_dir = Path(cfg.output_dir)
    (output_dir / SHARDS_DIR).mkdir(parents=True, exist_ok=True)
    # The manifest marks a complete curation; outputs are about to be rewritten. A failed run
    # leaves no kept prompts behind for an RL run to train on.
    (output_dir / MANIFEST_FILE).unlink(missing_ok=True)
    (output_dir / KEPT_FILE).unlink(missing_ok=True)

    out(f"[1/5] load {len(cfg.sources)} source(s)")
    phase = time.perf_counter()
    prompts, specs, source_reports = _load_sources(cfg)
    out(f"      {len(prompts):,} prompts")
    timings["load_s"] = time.perf_counter() - phase

    with GradingPool(**cfg.reward.pool_kwargs()) as pool:
        out("[2/5] screen: reference answers verify, duplicates")
        phase = time.perf_counter()
        drop_reasons, screen_metrics = rules.screen_prompts(
            problems=[p.problem for p in prompts], answers=[p.answer for p in prompts],
            verify_reference=cfg.rules.verify_reference, deduplicate=cfg.rules.dedup, grade_batch=pool.grade_batch,
        )
        timings["screen_s"] = time.perf_counter() - phase

        out(f"[3/5] load the policy {cfg.policy}")
        phase = time.perf_counter()
        policy = load_policy(cfg.policy, tokenizer=cfg.tokenizer, dtype=cfg.dtype, device=resolve_device(cfg.device),
                             context=context)
        alive_index = np.flatnonzero(drop_reasons == rules.KEPT)  # (A,)
        fits_mask = fits_context([prompts[i] for i in alive_index], tokenizer=policy.tokenizer,  # (A,)
                                 template=cfg.template, max_new_tokens=cfg.max_new_tokens,
                                 max_positions=policy.max_position_embeddings)
        drop_reasons, _ = rules.apply_rule(drop_reasons, fits_mask, rule=rules.TOO_LONG)
        to_sample_index = np.flatnonzero(drop_reasons == rules.KEPT)  # (S,)
        timings["policy_s"] = time.perf_counter() - phase
        screened = rules.count_reasons(drop_reasons)
        out(f"      {policy.source}; dropped {screened[rules.REFERENCE_FAILS]:,} failing references, "
            f"{screened[rules.DUPLICATE]:,} duplicates, {screened[rules.TOO_LONG]:,} too long")
        if not len(to_sample_index):
            raise nothing_kept_error(cfg, screened, max_positions=policy.max_position_embeddings)

        to_sample = [prompts[i] for i in to_sample_index]
        fingerprint = _fingerprint(cfg, policy_source=policy.source, prompts=to_sample)
        shards = _plan_shards(to_sample, cfg=cfg, output_dir=output_dir)
        _check_existing_shards(output_dir / SHARDS_DIR, fingerprint=fingerprint)
        out(f"[4/5] sample k={cfg.num_samples} for {len(to_sample):,} prompts in {len(shards)} shard(s) "
            f"(T={cfg.temperature}, top_p={cfg.top_p}, {cfg.max_new_tokens} new tokens)")
        phase = time.perf_counter()
        tables, shard_status = _sample_shards(shards, policy=policy, pool=pool, cfg=cfg, fingerprint=fingerprint,
                                              engine=engine)
        timings["sampling_s"] = time.perf_counter() - phase
    num_reused = sum(status["status"] == "reused" for status in shard_status)
    out(f"      {len(shards) - num_reused} shard(s) generated, {num_reused} reused")

    out("[5/5] apply the rules, write the results")
    phase = time.perf_counter()
    num_samples = np.zeros(len(prompts), dtype=np.int64)  # (P,)
    num_correct = np.zeros(len(prompts), dtype=np.int64)  # (P,)
    num_tokens = np.zeros(len(prompts), dtype=np.int64)  # (P,)
    if tables:
        import pyarrow as pa

        # Shards an older version wrote lack the per-response lengths; their rows get nulls here
        # (load_response_lengths then reads per-prompt means), rather than a schema mismatch.
        sampled = pa.concat_tables(tables, promote_options="default")
        assert sampled.column("id").to_pylist() == [p.id for p in to_sample]
        num_samples[to_sample_index] = sampled.column("n").to_numpy()
        num_correct[to_sample_index] = sampled.column("c").to_numpy()
        num_tokens[to_sample_index] = sampled.column("num_generated_tokens").to_numpy()
    drop_reasons, select_metrics = rules.select_by_pass_rate(
        drop_reasons, num_samples=num_samples, num_correct=num_correct,
        trivial_threshold=cfg.rules.trivial_threshold, drop_impossible_prompts=cfg.rules.drop_impossible,
        hard_subset_range=cfg.rules.hard_subset,
    )
    result = CurationResult(
        output_dir=output_dir, prompt_ids=[p.id for p in prompts], specs=specs, sources=[p.source for p in prompts],
        num_samples=num_samples, num_correct=num_correct, pass_rates=pass_rates(num_samples, num_correct),
        kept_mask=drop_reasons == rules.KEPT, drop_reasons=drop_reasons.tolist(),
        samples_per_prompt=cfg.num_samples, counts=rules.count_reasons(drop_reasons),
    )
    write_pass_rates(output_dir / PASS_RATES_FILE, result, difficulty=_difficulty_names(result))
    histograms = _difficulty_histograms(result)
    report = _report(cfg, result, histograms=histograms, policy_source=policy.source)
    atomic_write_text(output_dir / REPORT_FILE, report)
    _plot_pass_rates(output_dir / PLOT_FILE, result, trivial_threshold=cfg.rules.trivial_threshold)
    if not result.counts["kept"]:
        # The pass rates, report and plot stay to show why; the shards stay too, so a rerun with
        # other rules re-applies them without generating.
        raise nothing_kept_error(cfg, result.counts, max_positions=policy.max_position_embeddings,
                                 report=output_dir / REPORT_FILE)
    write_kept(output_dir / KEPT_FILE, [p for p, kept in zip(prompts, result.kept_mask) if kept])
    timings["outputs_s"] = time.perf_counter() - phase
    timings["total_s"] = time.perf_counter() - started
    manifest = {
        "config": configlib.to_dict(cfg),
        "versions": package_versions(),
        "policy": policy.source,
        "fingerprint": fingerprint,
        "timings": timings,
        "counts": result.counts,
        "rule_metrics": {**screen_metrics, **select_metrics},
        "difficulty": histograms,
        "num_generated_tokens": int(num_tokens.sum()),
        "engine": cfg.rollout.engine,
        "sources": source_reports,
        "shards": shard_status,
        "outputs": {"pass_rates": PASS_RATES_FILE, "kept": KEPT_FILE, "report": REPORT_FILE, "plot": PLOT_FILE,
                    "shards": SHARDS_DIR},
    }
    write_manifest(output_dir, manifest)
    out(f"done in {timings['total_s']:.1f} s: {result.counts['kept']:,} of {result.counts['total']:,} prompts kept")
    return result


def nothing_kept_error(cfg: CurateConfig, counts: dict[str, int], *, max_positions: int | None,
                       report: Path | None = None) -> CurationError:
    """The error of a curation that keeps no prompt: where the prompts went, and which options to change.

    An empty ``kept.jsonl`` would only fail later, in the RL stage that trains on it (or, worse,
    in a campaign whose later stages run for hours first).
    """
    from pipeline.stages import curate_rules as rules

    screen = counts[rules.REFERENCE_FAILS] + counts[rules.DUPLICATE]
    difficulty_rules = (rules.TRIVIAL, rules.IMPOSSIBLE, rules.OUTSIDE_HARD_SUBSET)
    by_difficulty = sum(counts[rule] for rule in difficulty_rules)
    sampled = counts["total"] - screen - counts[rules.TOO_LONG]
    context = f"the model's {max_positions:,} positions" if max_positions is not None else "the model's context"
    fixes = []
    if counts[rules.TOO_LONG]:
        fixes.append("lower max_new_tokens or give shorter prompts")
    if by_difficulty:
        fixes.append("loosen rules.trivial_threshold, rules.drop_impossible or rules.hard_subset (a rerun with "
                     "other rules reuses the sampled shards), or raise num_samples")
    if not fixes:
        fixes.append("check the sources' reference answers and duplicates (rules.verify_reference, rules.dedup)")
    details = ", ".join(f"{rule} {counts[rule]:,}" for rule in difficulty_rules)
    where = f"; counts per rule in {report}" if report is not None else ""
    return CurationError(
        f"curation kept 0 of {counts['total']:,} prompts: {sampled:,} sampled, {counts[rules.TOO_LONG]:,} dropped "
        f"as too long for the context (prompt + max_new_tokens={cfg.max_new_tokens} > {context}), "
        f"{by_difficulty:,} by the difficulty rules ({details}), {screen:,} by the screen (reference_fails "
        f"{counts[rules.REFERENCE_FAILS]:,}, duplicate {counts[rules.DUPLICATE]:,}); {'; '.join(fixes)}{where}"
    )


# ================================================================ steps


def _load_sources(cfg: CurateConfig) -> tuple[list, list[str], list[dict[str, Any]]]:
    """All prompts in source order, the spec each came from, and each source's load report.

    Ids must be unique across sources: they key every per-prompt record downstream.
    """
    from pipeline.data import load_prompts, parse_spec

    prompts: list = []
    specs: list[str] = []
    reports: list[dict[str, Any]] = []
    source_of_id: dict[str, str] = {}
    for spec in cfg.sources:
        split = None if parse_spec(spec).kind == "file" else cfg.split
        loaded, report = load_prompts(spec, split=split, limit=cfg.limit, seed=cfg.seed, on_bad_row=cfg.on_bad_row)
        for prompt in loaded:
            if prompt.id in source_of_id:
                raise CurationError(f"prompt id {prompt.id!r} appears in {source_of_id[prompt.id]!r} and in {spec!r}; "
                                    "ids must be unique across sources")
            source_of_id[prompt.id] = spec
            shadowed = [key for key in _RESERVED_KEYS if key in prompt.metadata]
            if shadowed:
                raise CurationError(f"{spec}: prompt {prompt.id!r} has metadata key {shadowed[0]!r}, "
                                    f"which kept.jsonl uses for the prompt itself")
            try:
                json.dumps(prompt.metadata)
            except (TypeError, ValueError) as error:
                raise CurationError(f"{spec}: prompt {prompt.id!r} has metadata that is not JSON: {error}") from None
        prompts.extend(loaded)
        specs.extend([spec] * len(loaded))
        reports.append({"spec": spec, "num_prompts": len(loaded), "report": report.as_dict()})
    return prompts, specs, reports


def _sampling_options(cfg: CurateConfig) -> SamplingOptions:
    return SamplingOptions(num_samples=cfg.num_samples, max_new_tokens=cfg.max_new_tokens,
                           temperature=cfg.temperature, top_p=cfg.top_p, template=cfg.template)


def _fingerprint(cfg: CurateConfig, *, policy_source: str, prompts: Sequence) -> str:
    """What determines the shards' samples: the exact weights, sampling and grading options, the prompts."""
    options = sampling_fingerprint(_sampling_options(cfg), policy_source=policy_source, tokenizer=cfg.tokenizer,
                                   dtype=cfg.dtype, shard_size=cfg.shard_size, seed=cfg.seed, reward=cfg.reward)
    return fingerprint_digest(options, prompts)


def _plan_shards(prompts: Sequence, *, cfg: CurateConfig, output_dir: Path) -> list[Shard]:
    return plan_shards(prompts, shard_size=cfg.shard_size, seed_of=lambda index: shard_seed(cfg.seed, index),
                       path_of=lambda index: output_dir / SHARDS_DIR / f"shard_{index:05d}.parquet")


def _shard_metadata(path: Path) -> dict[str, Any]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        metadata = pq.read_schema(path).metadata or {}
    except (pa.ArrowException, OSError) as error:
        raise CurationError(f"{path}: not a readable shard ({error}); delete it to regenerate it") from None
    if _SHARD_METADATA_KEY not in metadata:
        raise CurationError(f"{path}: not a curation shard (no {_SHARD_METADATA_KEY.decode()} metadata)")
    return json.loads(metadata[_SHARD_METADATA_KEY])


def _check_existing_shards(shards_dir: Path, *, fingerprint: str) -> None:
    """Refuse to mix in shards another curation (other policy, options or prompts) wrote."""
    check_shard_fingerprints(sorted(shards_dir.glob("shard_*.parquet")), expected=fingerprint, error=CurationError,
                             fingerprint_of=lambda path: _shard_metadata(path).get("fingerprint"),
                             output_dir=shards_dir, run_name="curation")


def _sample_shards(shards: list[Shard], *, policy, pool, cfg: CurateConfig, fingerprint: str, engine=None):
    """Each shard's table (read back when complete, else generated and written), and its status."""
    sampler = ShardSampler(
        policy, options=_sampling_options(cfg), grading_pool=lambda: pool, show_progress=cfg.progress,
        build_engine=(lambda: engine) if engine is not None else (
            lambda: policy_engine(cfg.rollout, policy, dtype=cfg.dtype, show_progress=cfg.progress)),
    )
    try:
        return _sample_with(sampler, shards, policy=policy, cfg=cfg, fingerprint=fingerprint)
    finally:
        if engine is None:
            sampler.close()


def _sample_with(sampler: ShardSampler, shards: list[Shard], *, policy, cfg: CurateConfig, fingerprint: str):
    import pyarrow.parquet as pq
    from tqdm.auto import tqdm

    from pipeline.data.templates import prompt_token_ids

    def read(path: Path):
        table = pq.read_table(path)
        return table, table.column("id").to_pylist()

    def write(shard: Shard, results):
        question_logprobs = question_mean_logprobs(
            policy.hf_model, [prompt_token_ids(policy.tokenizer, p, template=cfg.template) for p in shard.prompts],
            pad_id=policy.tokenizer.pad_token_id or 0)
        table = _shard_table(results, shard=shard, fingerprint=fingerprint, question_logprobs=question_logprobs)
        _atomic_write_parquet(shard.path, table)
        return table

    tables, status = [], []
    for shard in tqdm(shards, desc="curate shards", unit="shard", disable=not cfg.progress, leave=False):
        outcome = run_shard(shard, sampler=sampler, read=read, write=write, error=CurationError,
                            plan_name="this curation")
        tables.append(outcome.rows)
        status.append({"index": shard.index, "file": f"{SHARDS_DIR}/{shard.path.name}",
                       "num_prompts": len(shard.prompts), "seed": shard.seed,
                       "status": "reused" if outcome.reused else "generated", "seconds": round(outcome.seconds, 3),
                       "num_generated_tokens": int(np.sum(outcome.rows.column("num_generated_tokens").to_numpy()))})
    return tables, status


def question_mean_logprobs(model, prompts: list[list[int]], *, pad_id: int, batch_rows: int = 64,
                           batch_tokens: int = 8192, head_tokens: int = 1024) -> np.ndarray:
    """``(B,)`` the policy's mean log-prob of each prompt's tokens after the first: the
    inverse-perplexity target of DEPO's L_distill (``depo.perplexity_targets``).

    ``model`` is a Hugging Face causal LM (``get_decoder``, ``get_output_embeddings``), on its own
    device (the head node's GPU in a campaign). A batch holds at most ``batch_rows`` prompts and
    ``batch_tokens`` padded positions through the decoder; the vocabulary head then runs on at
    most ``head_tokens`` of its real positions at a time, so the float32 logits of a chunk and
    their exp are 2 × 1,024 × V × 4 bytes: 1.2 GB at Qwen2.5's 151,936-token vocabulary, beside the
    15.2 GB of a 7B policy in bf16 (the whole batch's logits and log-softmax would be 9.9 GB).
    The batch's hidden states, 8,192 × 3,584 × 2 bytes at 7B, are 59 MB.
    """
    import torch

    device = next(model.parameters()).device
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    means = np.zeros(len(prompts), dtype=np.float64)
    with torch.no_grad():
        start = 0
        while start < len(prompts):
            longest = len(prompts[start])
            end = start + 1
            while end < len(prompts) and end - start < batch_rows and \
                    (end - start + 1) * max(longest, len(prompts[end])) <= batch_tokens:
                longest = max(longest, len(prompts[end]))
                end += 1
            rows = prompts[start:end]
            tokens = torch.full((len(rows), longest), pad_id, dtype=torch.long)  # (B, T)
            mask = torch.zeros(tokens.shape, dtype=torch.bool)  # (B, T) real tokens
            for i, ids in enumerate(rows):
                tokens[i, : len(ids)] = torch.tensor(ids)
                mask[i, : len(ids)] = True
            tokens, mask = tokens.to(device), mask.to(device)
            hidden = decoder(input_ids=tokens, attention_mask=mask.long()).last_hidden_state  # (B, T, H)
            counted = mask[:, 1:]  # (B, T-1): every token with a prefix
            row_of, position = counted.nonzero(as_tuple=True)  # (N,) each: the counted tokens' predictors
            sums = torch.zeros(len(rows), dtype=torch.float64, device=device)
            for first in range(0, row_of.numel(), head_tokens):
                rows_here, at = row_of[first:first + head_tokens], position[first:first + head_tokens]
                logits = head(hidden[rows_here, at]).float()  # (n, V): position t predicts token t + 1
                targets = tokens[rows_here, at + 1]
                logprobs = logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
                sums.index_add_(0, rows_here, logprobs.double())
            means[start:end] = (sums / counted.sum(dim=1).clamp(min=1)).cpu().numpy()
            start = end
    return means


def _shard_table(results, *, shard: Shard, fingerprint: str, question_logprobs: np.ndarray):
    import pyarrow as pa

    from pipeline.stages.curate_rules import difficulty_names

    n = np.array([r.num_samples for r in results], dtype=np.int64)  # (B,)
    c = np.array([r.num_correct for r in results], dtype=np.int64)  # (B,)
    assert [r.prompt.id for r in results] == [p.id for p in shard.prompts]
    table = pa.table({
        "id": [r.prompt.id for r in results],
        "source": [r.prompt.source for r in results],
        "problem": [r.prompt.problem for r in results],
        "answer": [r.prompt.answer for r in results],
        "metadata": [json.dumps(r.prompt.metadata, ensure_ascii=False) for r in results],
        "n": pa.array(n, pa.int64()),
        "c": pa.array(c, pa.int64()),
        "pass_rate": pa.array(c / n, pa.float64()),
        "difficulty": difficulty_names(n, c),
        "num_generated_tokens": pa.array([r.num_generated_tokens for r in results], pa.int64()),
        "question_logprob": pa.array(question_logprobs, pa.float64()),
        # The planner times rl steps from these (pipeline.stats.curation.load_response_lengths): the
        # longest response of a batch sets its time, which per-prompt means understate.
        RESPONSE_LENGTHS_COLUMN: pa.array([r.response_lengths for r in results], pa.list_(pa.int64())),
    })
    metadata = {"format": FORMAT_VERSION, "fingerprint": fingerprint, "shard_index": shard.index, "seed": shard.seed}
    return table.replace_schema_metadata({_SHARD_METADATA_KEY: json.dumps(metadata).encode()})


# ================================================================ writing


def _atomic_write_parquet(path: Path, table) -> None:
    import pyarrow.parquet as pq

    atomic_write(path, lambda tmp: pq.write_table(table, tmp))


def _difficulty_names(result: CurationResult) -> list[str | None]:
    """``(P,)`` each prompt's difficulty bucket name (``pass_rates.parquet``'s column); ``None`` where not sampled."""
    from pipeline.stages.curate_rules import DIFFICULTY_BUCKETS, difficulty_bucket

    sampled = result.sampled_mask
    difficulty: list[str | None] = [None] * len(result.prompt_ids)
    if sampled.any():
        buckets = difficulty_bucket(result.num_samples[sampled], result.num_correct[sampled])
        for index, bucket in zip(np.flatnonzero(sampled), buckets):
            difficulty[index] = DIFFICULTY_BUCKETS[bucket]
    return difficulty


# ================================================================ report


def _difficulty_histograms(result: CurationResult) -> dict[str, dict[str, dict[str, int]]]:
    """Prompts per difficulty bucket and per number correct, over all sampled prompts and over the kept ones."""
    from pipeline.stages.curate_rules import DIFFICULTY_BUCKETS, difficulty_bucket

    histograms: dict[str, dict[str, dict[str, int]]] = {}
    for name, mask in (("before", result.sampled_mask), ("after", result.kept_mask & result.sampled_mask)):
        n, c = result.num_samples[mask], result.num_correct[mask]
        buckets = Counter(difficulty_bucket(n, c).tolist()) if mask.any() else Counter()
        correct = Counter(c.tolist())
        histograms[name] = {
            "buckets": {bucket: buckets.get(i, 0) for i, bucket in enumerate(DIFFICULTY_BUCKETS)},
            "num_correct": {str(j): correct.get(j, 0) for j in range(result.samples_per_prompt + 1)},
        }
    return histograms


def _report(cfg: CurateConfig, result: CurationResult, *, histograms, policy_source: str) -> str:
    """report.md; holds no timings, so a resumed run writes the same bytes as an uninterrupted one."""
    from pipeline.stages.curate_rules import RULE_ORDER

    counts = result.counts
    lines = [
        "# Curation report",
        "",
        f"- policy: `{policy_source}`",
        f"- sampling: k = {cfg.num_samples}, temperature {cfg.temperature}, top_p {cfg.top_p}, "
        f"max_new_tokens {cfg.max_new_tokens}, template `{cfg.template}`, seed {cfg.seed}",
        f"- rules: verify_reference {cfg.rules.verify_reference}, dedup {cfg.rules.dedup}, trivial_threshold "
        f"{cfg.rules.trivial_threshold}, drop_impossible {cfg.rules.drop_impossible}, hard_subset "
        f"{list(cfg.rules.hard_subset) if cfg.rules.hard_subset else None}",
        "- method: Reinforce-Ada §4.1 \"Data Curation and Verifier\" and App. C.1 "
        "(reinforce-ada-adaptive-sampling.txt)",
        "",
        "## Counts per rule",
        "",
        "Rules apply in this order; a dropped prompt is counted under the first rule that dropped it.",
        "",
        "| rule | dropped | remaining |",
        "|---|---:|---:|",
        f"| loaded | | {counts['total']:,} |",
    ]
    remaining = counts["total"]
    for rule in RULE_ORDER:
        remaining -= counts[rule]
        lines.append(f"| {rule} | {counts[rule]:,} | {remaining:,} |")
    lines += [f"| **kept** | | **{counts['kept']:,}** |", "", "## Per source", "",
              "| source | loaded | sampled | mean pass rate | kept |", "|---|---:|---:|---:|---:|"]
    specs = np.array(result.specs, dtype=object)
    for spec in dict.fromkeys(result.specs):
        mask = specs == spec
        sampled = mask & result.sampled_mask
        mean = f"{np.mean(result.pass_rates[sampled]):.3f}" if sampled.any() else "-"
        lines.append(f"| `{spec}` | {int(mask.sum()):,} | {int(sampled.sum()):,} | {mean} | "
                     f"{int((mask & result.kept_mask).sum()):,} |")
    before, after = histograms["before"], histograms["after"]
    lines += [
        "", "## Difficulty (Reinforce-Ada App. C.1 levels by pass rate p)", "",
        "Before: every sampled prompt. After: the kept prompts.", "",
        "| level | p | before | after |", "|---|---|---:|---:|",
    ]
    ranges = {"extremely_hard": "0", "hard": "(0, 0.2]", "medium": "(0.2, 0.5]", "easy": "(0.5, 1]"}
    for bucket, count in before["buckets"].items():
        lines.append(f"| {bucket} | {ranges[bucket]} | {count:,} | {after['buckets'][bucket]:,} |")
    lines += ["", f"## Correct samples out of k = {result.samples_per_prompt}", "",
              "| correct | before | after |", "|---:|---:|---:|"]
    for correct, count in before["num_correct"].items():
        lines.append(f"| {correct} | {count:,} | {after['num_correct'][correct]:,} |")
    lines += ["", f"![pass-rate histograms]({PLOT_FILE})", ""]
    return "\n".join(lines)


def _plot_pass_rates(path: Path, result: CurationResult, *, trivial_threshold: float | None) -> None:
    # The object-oriented API with the Agg canvas: no pyplot global state, no display needed.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    k = result.samples_per_prompt
    edges = (np.arange(k + 2) - 0.5) / k  # one bin per number correct, centred on c / k
    figure = Figure(figsize=(10, 3.6), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, 2, sharex=True)
    panels = (("before: every sampled prompt", result.sampled_mask),
              ("after: kept prompts", result.kept_mask & result.sampled_mask))
    for ax, (title, mask) in zip(axes, panels):
        ax.hist(result.pass_rates[mask], bins=edges, color="tab:blue", edgecolor="white")
        if trivial_threshold is not None:
            ax.axvline(trivial_threshold, color="tab:red", linestyle="--", label=f"trivial > {trivial_threshold}")
            ax.legend(loc="upper right")
        ax.set_title(f"{title} ({int(mask.sum()):,})")
        ax.set_xlabel(f"pass rate (correct of k = {k})")
        ax.set_ylabel("prompts")
    atomic_write(path, lambda tmp: figure.savefig(tmp, format="png", dpi=110))
