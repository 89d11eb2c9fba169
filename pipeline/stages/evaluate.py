"""`winnow evaluate`: unbiased pass@k of a policy on benchmarks, sharded, resumable, with intervals.

For each benchmark (``math500``, ``gsm8k``, ``minerva``, ``math``, or a synthetic spec
such as ``arith?difficulty=3&size=500``; its ``eval.split``, unless the spec names one):

1. load the problems (``pipeline.data.load_prompts``) and set aside those whose
   rendered prompt plus ``max_new_tokens`` exceeds the model's context (counted as
   ``num_too_long``, never generated). Every benchmark is planned before any generates:
   one that would skip more than ``eval.max_skipped_fraction`` of its problems is an
   ``EvaluateError``, since its score would describe a different (shorter) set;
2. cut the rest, in load order, into shards of ``shard_size`` problems. Shard ``i``
   samples ``n`` responses per problem in one call of the engine ``rollout`` names (the
   local engine, or SGLang servers that load the policy once), seeded by
   ``derive_seed(eval.seed, benchmark, i)``, so a shard's samples do not depend on
   which shards ran before it or in which process; the responses are graded in the
   bounded pool (``pipeline.eval.sharded``, the engine `winnow curate` runs too) and the
   shard is written atomically to
   ``<output_dir>/<benchmark dir>/shard_00003.jsonl`` (one line per problem: id,
   answer, n, c, difficulty/level/subject, every sample's grading reason, the first
   ``save_responses`` responses truncated);
3. on a rerun, shards already on disk are read back instead of generated (their problem
   ids are checked), so an interrupted evaluation resumes without redoing finished
   work and ends with the results an uninterrupted run gives.

``<output_dir>/manifest.json`` is written at the start and after every shard: the
resolved config, a fingerprint of everything that determines the samples (a rerun
with a different one is refused rather than mixing results), package versions, timings
and every shard's status (``done``, ``reused``, ``failed`` with its error, ``pending``).

Then everything is aggregated from the shard files (``pipeline.eval.report``):
pass@k for each k of ``eval.ks`` and avg@n with percentile-bootstrap intervals over
problems, per benchmark, per difficulty bucket (``level`` for MATH/MATH-500,
``difficulty`` for synthetic sources) and macro/weighted over benchmarks, written to
``results.json``, ``results.md`` and ``pass_at_k.png``. ``results.json`` counts the
generated tokens (``num_generated_tokens``) per benchmark and in total, for the
campaign's token ledger.
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pipeline import configlib
from pipeline.config import EvaluateConfig
from pipeline.configlib import ConfigError
from pipeline.errors import UserError
from pipeline.eval.sharded import (
    SamplingOptions,
    Shard,
    ShardSampler,
    fingerprint_changes,
    fits_context,
    plan_shards,
    policy_engine,
    resolve_device,
    run_shard,
    sampling_fingerprint,
)
from pipeline.eval.sharded import evaluation_shard_seed as shard_seed
from pipeline.io import atomic_write_text, package_versions
from pipeline.rollout.backends import rollout_backend

MANIFEST_FILE = "manifest.json"
MARKDOWN_FILE = "results.md"
PASS_AT_K_PLOT = "pass_at_k.png"
SAVED_RESPONSE_CHARS = 2000
_SHARD_NAME = "shard_{index:05d}.jsonl"
_UNSAFE_PATH_CHARS = re.compile(r"[^A-Za-z0-9._=-]+")
# Bucket keys, in order of preference: MATH's level, then a synthetic source's difficulty.
_BUCKET_KEYS = ("level", "difficulty")


class EvaluateError(UserError):
    """The output directory holds another evaluation's results, a shard on disk is stale, or a
    benchmark does not fit the model's context."""


@dataclass(frozen=True, slots=True)
class BenchmarkPlan:
    """One benchmark's problems that fit the model, cut into shards."""

    spec: str
    directory: str  # under output_dir
    num_loaded: int
    num_too_long: int
    shards: list[Shard]

    @property
    def num_problems(self) -> int:
        return sum(len(shard.prompts) for shard in self.shards)


def benchmark_directory(spec: str) -> str:
    """A file-system-safe folder name for a benchmark spec (``arith?difficulty=3`` → ``arith_difficulty=3``)."""
    name = _UNSAFE_PATH_CHARS.sub("_", spec).strip("._")
    if not name:
        raise ConfigError(f"eval.benchmarks: {spec!r} gives an empty folder name")
    return name


def _split_for(spec: str, split: str) -> str | None:
    """The spec's own split wins (``gsm8k?split=train``); files have none."""
    from pipeline.data import parse_spec

    parsed = parse_spec(spec)
    if parsed.kind == "file" or parsed.split is not None:
        return None
    return split


def plan_benchmark(spec: str, *, cfg: EvaluateConfig, tokenizer, max_positions: int | None) -> BenchmarkPlan:
    """Load ``spec``, set aside the problems too long for the model, and shard the rest."""
    from pipeline.data import load_prompts

    prompts, _ = load_prompts(spec, split=_split_for(spec, cfg.eval.split), limit=cfg.eval.limit)
    fits_mask = fits_context(prompts, tokenizer=tokenizer, template=cfg.template,  # (P,)
                             max_new_tokens=cfg.eval.max_new_tokens, max_positions=max_positions)
    kept = [prompt for prompt, fits in zip(prompts, fits_mask) if fits]
    directory = benchmark_directory(spec)
    shards = plan_shards(kept, shard_size=cfg.shard_size, seed_of=lambda index: shard_seed(cfg.eval.seed, spec, index),
                         path_of=lambda index: Path(cfg.output_dir) / directory / _SHARD_NAME.format(index=index))
    return BenchmarkPlan(spec, directory, len(prompts), len(prompts) - len(kept), shards)


def check_skipped_fraction(plan: BenchmarkPlan, *, cfg: EvaluateConfig, max_positions: int | None) -> None:
    """Refuse a benchmark that would skip more than ``eval.max_skipped_fraction`` of its problems for length."""
    limit = cfg.eval.max_skipped_fraction
    if plan.num_loaded and plan.num_too_long > limit * plan.num_loaded:
        raise EvaluateError(
            f"eval.max_skipped_fraction: {plan.spec}: {plan.num_too_long} of {plan.num_loaded} problems "
            f"({plan.num_too_long / plan.num_loaded:.1%}) do not fit the model's {max_positions} positions with "
            f"eval.max_new_tokens={cfg.eval.max_new_tokens}, above the allowed {limit:.1%}; lower "
            "eval.max_new_tokens, or raise eval.max_skipped_fraction to score only the problems that fit"
        )


# ----------------------------------------------------------------------------- shards


def problem_record(result, *, save_responses: int) -> dict[str, Any]:
    """One shard line for a ``pipeline.eval.runner.ProblemResult``."""
    metadata = result.prompt.metadata
    return {
        "id": result.prompt.id,
        "answer": result.prompt.answer,
        "n": result.num_samples,
        "c": result.num_correct,
        "difficulty": metadata.get("difficulty"),
        "level": metadata.get("level"),
        "subject": metadata.get("subject"),
        "num_generated_tokens": result.num_generated_tokens,
        "reasons": list(result.reasons),
        "responses": [text[:SAVED_RESPONSE_CHARS] for text in result.responses[:save_responses]],
    }


def write_shard(path: Path, records: list[dict[str, Any]]) -> None:
    atomic_write_text(path, "".join(json.dumps(record) + "\n" for record in records))


def read_shard(path: Path) -> list[dict[str, Any]]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except json.JSONDecodeError as error:
        raise EvaluateError(f"{path} is corrupt ({error}); delete it to regenerate that shard") from None


# ----------------------------------------------------------------------------- manifest


def _sampling_options(cfg: EvaluateConfig) -> SamplingOptions:
    return SamplingOptions(num_samples=cfg.eval.num_samples, max_new_tokens=cfg.eval.max_new_tokens,
                           temperature=cfg.eval.temperature, top_p=cfg.eval.top_p, template=cfg.template)


def fingerprint(cfg: EvaluateConfig, *, policy_source: str) -> dict[str, Any]:
    """What a shard measures (policy, problems, sampling distribution and seed, grading); a resume requires it unchanged.

    ``sharded.sampling_fingerprint`` plus the problems' split and limit and the format reward.
    """
    common = sampling_fingerprint(_sampling_options(cfg), policy_source=policy_source, tokenizer=cfg.tokenizer,
                                  dtype=cfg.dtype, shard_size=cfg.shard_size, seed=cfg.eval.seed, reward=cfg.reward)
    return {**common, "split": cfg.eval.split, "limit": cfg.eval.limit, "format_reward": cfg.reward.format_reward}


class Manifest:
    """``manifest.json``: config, fingerprint, versions, timings and shard statuses, rewritten atomically."""

    def __init__(self, directory: Path, *, cfg: EvaluateConfig, fingerprint: dict[str, Any]) -> None:
        self.path = directory / MANIFEST_FILE
        previous = self._read_previous(directory)
        old = (previous or {}).get("fingerprint", {})
        if previous is not None and old != fingerprint:
            raise EvaluateError(f"{directory} holds results of a different evaluation "
                                f"({fingerprint_changes(old, fingerprint)}); use another output_dir or delete it")
        self._previous_shards: dict[str, list[dict[str, Any]]] = {
            name: entry.get("shards", []) for name, entry in (previous or {}).get("benchmarks", {}).items()
        }
        self.data: dict[str, Any] = {
            "config": configlib.to_dict(cfg),
            "fingerprint": fingerprint,
            "packages": package_versions(),
            "started": _now(),
            "updated": _now(),
            "status": "running",
            "benchmarks": {},
            "timings": {},
        }

    @staticmethod
    def _read_previous(directory: Path) -> dict[str, Any] | None:
        path = directory / MANIFEST_FILE
        if path.is_file():
            try:
                return json.loads(path.read_text())
            except json.JSONDecodeError as error:
                raise EvaluateError(f"{path} is corrupt ({error}); delete the output directory to start over") from None
        if any(directory.glob(f"*/{_SHARD_NAME.format(index=0)}")):
            raise EvaluateError(f"{directory} holds shards but no {MANIFEST_FILE}; use another output_dir or delete it")
        return None

    def add_benchmark(self, plan: BenchmarkPlan) -> None:
        self.data["benchmarks"][plan.spec] = {
            "directory": plan.directory,
            "num_loaded": plan.num_loaded,
            "num_too_long": plan.num_too_long,
            "num_problems": plan.num_problems,
            "shards": [{"status": "pending", "num_problems": len(shard.prompts)} for shard in plan.shards],
        }

    def previous_seconds(self, spec: str, index: int) -> float | None:
        shards = self._previous_shards.get(spec, [])
        return shards[index].get("seconds") if index < len(shards) else None

    def set_shard(self, spec: str, index: int, **fields: Any) -> None:
        self.data["benchmarks"][spec]["shards"][index].update(fields)
        self.write()

    def write(self) -> None:
        self.data["updated"] = _now()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.path, json.dumps(self.data, indent=1) + "\n")


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


# ----------------------------------------------------------------------------- aggregation


def _bucket_rows(records: list[dict[str, Any]]) -> tuple[str, dict[str, list[int]]] | None:
    """Row indices grouped by the first bucket key any record carries (``unknown`` where missing)."""
    for key in _BUCKET_KEYS:
        if any(record.get(key) is not None for record in records):
            groups: dict[str, list[int]] = {}
            for row, record in enumerate(records):
                value = record.get(key)
                groups.setdefault("unknown" if value is None else str(value), []).append(row)
            ordered = sorted(groups, key=lambda v: (v == "unknown", int(v) if v.lstrip("-").isdigit() else 0, v))
            return key, {value: groups[value] for value in ordered}
    return None


def build_results(
    records_by_benchmark: dict[str, list[dict[str, Any]]],
    *,
    plans: dict[str, BenchmarkPlan],
    cfg: EvaluateConfig,
    policy_source: str,
    confidence: float = 0.95,
) -> dict[str, Any]:
    """``results.json`` from the shard records of every benchmark (see ``pipeline.eval.report``)."""
    from pipeline.eval.report import (
        RESULTS_FORMAT,
        average_over_benchmarks,
        derive_seed,
        per_problem_metrics,
        summarize_metrics,
    )

    ks, bootstrap_samples = cfg.eval.ks, cfg.eval.bootstrap_samples
    benchmarks: dict[str, Any] = {}
    parts = {}
    for spec, records in records_by_benchmark.items():
        plan = plans[spec]
        n = [record["n"] for record in records]
        c = [record["c"] for record in records]
        entry: dict[str, Any] = {
            "directory": plan.directory,
            "num_loaded": plan.num_loaded,
            "num_too_long": plan.num_too_long,
            "num_problems": len(records),
            "metrics": {},
            "buckets": None,
            "reasons": dict(Counter(reason for record in records for reason in record["reasons"]).most_common()),
            "num_generated_tokens": sum(record["num_generated_tokens"] for record in records),
            "mean_generated_tokens": (
                sum(record["num_generated_tokens"] for record in records) / max(1, sum(n))
            ),
            "problems": {"id": [record["id"] for record in records], "n": n, "c": c},
        }
        if records:
            names, values = per_problem_metrics(n, c, ks)  # (P, M)
            entry["metrics"], boot = summarize_metrics(
                names, values, bootstrap_samples=bootstrap_samples,
                seed=derive_seed("bootstrap", cfg.eval.seed, spec), confidence=confidence,
            )
            parts[spec] = (names, values, boot)
            grouped = _bucket_rows(records)
            if grouped is not None:
                key, groups = grouped
                entry["buckets"] = {"key": key, "groups": {}}
                for value, rows in groups.items():
                    group_metrics, _ = summarize_metrics(
                        names, values[rows], bootstrap_samples=bootstrap_samples,
                        seed=derive_seed("bootstrap", cfg.eval.seed, spec, key, value), confidence=confidence,
                    )
                    entry["buckets"]["groups"][value] = {"num_problems": len(rows), "metrics": group_metrics}
        benchmarks[spec] = entry
    return {
        "format": RESULTS_FORMAT,
        "policy": policy_source,
        "created": _now(),
        "num_samples": cfg.eval.num_samples,
        "ks": list(ks),
        "confidence": confidence,
        "bootstrap_samples": bootstrap_samples,
        "sampling": {
            "temperature": cfg.eval.temperature, "top_p": cfg.eval.top_p, "max_new_tokens": cfg.eval.max_new_tokens,
            "seed": cfg.eval.seed, "template": cfg.template, "split": cfg.eval.split,
        },
        "engine": cfg.rollout.engine,
        "num_generated_tokens": sum(entry["num_generated_tokens"] for entry in benchmarks.values()),
        "benchmarks": benchmarks,
        "aggregate": average_over_benchmarks(parts, confidence=confidence),
    }


# ----------------------------------------------------------------------------- the stage


def _shard_records(plan: BenchmarkPlan, shard: Shard, *, cfg: EvaluateConfig, sampler: ShardSampler,
                   manifest: Manifest) -> list[dict[str, Any]]:
    """One shard of ``plan``: read back when already on disk, else sampled, graded and written."""

    def read(path: Path):
        records = read_shard(path)
        return records, [record["id"] for record in records]

    def write(shard: Shard, results) -> list[dict[str, Any]]:
        records = [problem_record(result, save_responses=cfg.save_responses) for result in results]
        write_shard(shard.path, records)
        return records

    def failed(error: BaseException) -> None:
        manifest.set_shard(plan.spec, shard.index, status="failed", error=f"{type(error).__name__}: {error}")

    outcome = run_shard(shard, sampler=sampler, read=read, write=write, error=EvaluateError, plan_name=plan.spec,
                        on_failure=failed)
    if outcome.reused:
        manifest.set_shard(plan.spec, shard.index, status="reused",
                           seconds=manifest.previous_seconds(plan.spec, shard.index))
    else:
        manifest.set_shard(plan.spec, shard.index, status="done", seconds=outcome.seconds)
    return outcome.rows


def run_evaluate(cfg: EvaluateConfig, *, context=None, pool=None, engine=None, out=print) -> dict[str, Any]:
    """Evaluate ``cfg.policy`` (see the module docstring); return the ``results.json`` dict.

    ``context``: a one-rank ``ParallelContext`` to load a winnow checkpoint under when
    this process already runs one (``pipeline.eval.policy.load_policy``). ``pool``: a
    running ``GradingPool`` to grade in (a caller that evaluates repeatedly keeps one);
    without it, one is started from ``cfg.reward`` when the first shard needs grading,
    so re-aggregating a finished evaluation starts none. ``engine``: a ``RolloutEngine``
    already serving the policy, to generate with instead of the one ``cfg.rollout`` names
    (the caller closes it). The policy's weights are loaded here only when the backend's scoring
    engine needs them in this process (``scoring_loads_weights``).
    """
    from tqdm import tqdm

    from pipeline.eval.plots import plot_pass_at_k
    from pipeline.eval.policy import load_policy
    from pipeline.eval.report import RESULTS_FILE, format_results_markdown
    from pipeline.rewards import GradingPool

    if not cfg.policy:
        raise ConfigError("policy: required (a Hugging Face folder or a winnow checkpoint directory)")
    directories = [benchmark_directory(spec) for spec in cfg.eval.benchmarks]
    if len(set(directories)) != len(directories):
        raise ConfigError(f"eval.benchmarks: two benchmarks share an output folder: {directories}")
    started = time.perf_counter()
    output_dir = Path(cfg.output_dir)
    policy = load_policy(
        cfg.policy, tokenizer=cfg.tokenizer, dtype=cfg.dtype, device=resolve_device(cfg.device), context=context,
        weights=engine is None and rollout_backend(cfg.rollout.engine).scoring_loads_weights,
    )
    out(f"policy {policy.source} loaded in {time.perf_counter() - started:.1f} s")
    load_policy_s = time.perf_counter() - started
    # Every benchmark is loaded and checked before the output directory is touched or anything generates.
    plans: dict[str, BenchmarkPlan] = {}
    for spec in cfg.eval.benchmarks:
        plans[spec] = plan_benchmark(spec, cfg=cfg, tokenizer=policy.tokenizer,
                                     max_positions=policy.max_position_embeddings)
        check_skipped_fraction(plans[spec], cfg=cfg, max_positions=policy.max_position_embeddings)
    manifest = Manifest(output_dir, cfg=cfg, fingerprint=fingerprint(cfg, policy_source=policy.source))
    manifest.data["timings"]["load_policy_s"] = load_policy_s
    for plan in plans.values():
        manifest.add_benchmark(plan)
    manifest.write()

    records_by_benchmark: dict[str, list[dict[str, Any]]] = {}
    with ExitStack() as stack:
        pools = [pool] if pool is not None else []

        def grading_pool():
            if not pools:
                pools.append(stack.enter_context(GradingPool(**cfg.reward.pool_kwargs())))
            return pools[0]

        sampler = ShardSampler(
            policy, options=_sampling_options(cfg), grading_pool=grading_pool,
            build_engine=(lambda: engine) if engine is not None else (lambda: policy_engine(
                cfg.rollout, policy, dtype=cfg.dtype, max_batch_rows=cfg.max_batch_rows, show_progress=cfg.progress)),
        )
        if engine is None:
            stack.callback(sampler.close)

        try:
            for spec, plan in plans.items():
                if plan.num_too_long:
                    out(f"{spec}: {plan.num_too_long} of {plan.num_loaded} problems exceed the model's context "
                        f"with {cfg.eval.max_new_tokens} new tokens; skipped")
                benchmark_started = time.perf_counter()
                records: list[dict[str, Any]] = []
                with tqdm(
                    total=plan.num_problems, desc=spec, unit="problem", disable=not cfg.progress, file=sys.stderr
                ) as bar:
                    for shard in plan.shards:
                        records += _shard_records(plan, shard, cfg=cfg, sampler=sampler, manifest=manifest)
                        bar.update(len(shard.prompts))
                        num_samples = sum(record["n"] for record in records)
                        bar.set_postfix(avg=f"{sum(record['c'] for record in records) / max(1, num_samples):.3f}")
                records_by_benchmark[spec] = records
                manifest.data["benchmarks"][spec]["seconds"] = time.perf_counter() - benchmark_started
        except BaseException:
            manifest.data["status"] = "interrupted"
            manifest.write()
            raise

    aggregate_started = time.perf_counter()
    results = build_results(records_by_benchmark, plans=plans, cfg=cfg, policy_source=policy.source)
    atomic_write_text(output_dir / RESULTS_FILE, json.dumps(results, indent=1) + "\n")
    markdown = format_results_markdown(results)
    atomic_write_text(output_dir / MARKDOWN_FILE, markdown)
    plot_pass_at_k(results, output_dir / PASS_AT_K_PLOT)
    manifest.data["timings"]["aggregate_s"] = time.perf_counter() - aggregate_started
    manifest.data["timings"]["total_s"] = time.perf_counter() - started
    manifest.data["status"] = "complete"
    manifest.write()
    out(markdown)
    out(f"results: {output_dir / RESULTS_FILE}, {output_dir / MARKDOWN_FILE}, {output_dir / PASS_AT_K_PLOT}")
    return results
