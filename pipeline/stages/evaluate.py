"""`winnow evaluate`: unbiased pass@k of a policy on benchmarks, sharded, resumable, with intervals.

For each benchmark (``math500``, ``gsm8k``, ``minerva``, ``math``, or a synthetic spec
such as ``arith?difficulty=3&size=500``; its ``eval.split``, unless the spec names one):

1. load the problems (``pipeline.data.load_prompts``) and set aside those whose
   rendered prompt plus ``max_new_tokens`` exceeds the model's context (counted as
   ``num_too_long``, never generated);
2. cut the rest, in load order, into shards of ``shard_size`` problems. Shard ``i``
   samples ``n`` responses per problem in one engine call seeded by
   ``derive_seed(eval.seed, benchmark, i)``, so a shard's samples do not depend on
   which shards ran before it or in which process; the responses are graded in the
   bounded pool and the shard is written atomically to
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
``results.json``, ``results.md`` and ``pass_at_k.png``.
"""

from __future__ import annotations

import dataclasses
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
from pipeline.data.records import Prompt
from pipeline.errors import UserError
from pipeline.io import atomic_write_text, package_versions

MANIFEST_FILE = "manifest.json"
MARKDOWN_FILE = "results.md"
PASS_AT_K_PLOT = "pass_at_k.png"
SAVED_RESPONSE_CHARS = 2000
_SHARD_NAME = "shard_{index:05d}.jsonl"
_UNSAFE_PATH_CHARS = re.compile(r"[^A-Za-z0-9._=-]+")
# Bucket keys, in order of preference: MATH's level, then a synthetic source's difficulty.
_BUCKET_KEYS = ("level", "difficulty")


class EvaluateError(UserError):
    """The output directory holds another evaluation's results, or a shard on disk is stale."""


@dataclass(frozen=True, slots=True)
class BenchmarkPlan:
    """One benchmark's problems that fit the model, cut into shards."""

    spec: str
    directory: str  # under output_dir
    num_loaded: int
    num_too_long: int
    shards: list[list[Prompt]]

    @property
    def num_problems(self) -> int:
        return sum(len(shard) for shard in self.shards)


def benchmark_directory(spec: str) -> str:
    """A file-system-safe folder name for a benchmark spec (``arith?difficulty=3`` → ``arith_difficulty=3``)."""
    name = _UNSAFE_PATH_CHARS.sub("_", spec).strip("._")
    if not name:
        raise ConfigError(f"eval.benchmarks: {spec!r} gives an empty folder name")
    return name


def shard_seed(seed: int, benchmark: str, shard_index: int) -> int:
    from pipeline.eval.report import derive_seed

    return derive_seed("shard", seed, benchmark, shard_index)


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
    from pipeline.models.tokenizer import prompt_token_ids

    prompts, _ = load_prompts(spec, split=_split_for(spec, cfg.eval.split), limit=cfg.eval.limit)
    kept = prompts
    if max_positions is not None:
        budget = max_positions - cfg.eval.max_new_tokens
        kept = [
            p for p in prompts
            if len(prompt_token_ids(tokenizer, p, template=cfg.template)) <= budget
        ]
    shards = [kept[start : start + cfg.shard_size] for start in range(0, len(kept), cfg.shard_size)]
    return BenchmarkPlan(spec, benchmark_directory(spec), len(prompts), len(prompts) - len(kept), shards)


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


def fingerprint(cfg: EvaluateConfig, *, policy_source: str) -> dict[str, Any]:
    """What a shard measures (policy, problems, sampling distribution and seed, grading); a resume requires it unchanged.

    ``device`` and ``max_batch_rows`` are left out: they change which random draws a
    shard gets, not what it measures, so a run may resume on another machine.
    """
    return {
        "policy": policy_source,
        "tokenizer": cfg.tokenizer,
        "dtype": cfg.dtype,
        "template": cfg.template,
        "shard_size": cfg.shard_size,
        "split": cfg.eval.split,
        "limit": cfg.eval.limit,
        "num_samples": cfg.eval.num_samples,
        "temperature": cfg.eval.temperature,
        "top_p": cfg.eval.top_p,
        "max_new_tokens": cfg.eval.max_new_tokens,
        "seed": cfg.eval.seed,
        "format_reward": cfg.reward.format_reward,
        "max_response_chars": cfg.reward.max_response_chars,
        "max_answer_chars": cfg.reward.max_answer_chars,
    }


class Manifest:
    """``manifest.json``: config, fingerprint, versions, timings and shard statuses, rewritten atomically."""

    def __init__(self, directory: Path, *, cfg: EvaluateConfig, fingerprint: dict[str, Any]) -> None:
        self.path = directory / MANIFEST_FILE
        previous = self._read_previous(directory)
        old = (previous or {}).get("fingerprint", {})
        if previous is not None and old != fingerprint:
            changed = sorted(key for key in set(fingerprint) | set(old) if old.get(key) != fingerprint.get(key))
            details = ", ".join(f"{key}: {old.get(key)!r} → {fingerprint.get(key)!r}" for key in changed)
            raise EvaluateError(
                f"{directory} holds results of a different evaluation ({details}); use another output_dir or delete it"
            )
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
            "shards": [{"status": "pending", "num_problems": len(shard)} for shard in plan.shards],
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
        "benchmarks": benchmarks,
        "aggregate": average_over_benchmarks(parts, confidence=confidence),
    }


# ----------------------------------------------------------------------------- the stage


def _device(choice: str) -> str:
    import torch

    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device: 'cuda' requested but CUDA is not available")
    return choice


def _stop_token_ids(model, tokenizer) -> list[int]:
    """The model's EOS ids plus the tokenizer's (chat models end turns on a token the config may omit)."""
    ids: list[int] = []
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None)
        if value is not None:
            ids += [value] if isinstance(value, int) else list(value)
            break
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted(set(ids))


def _shard_records(
    plan: BenchmarkPlan,
    index: int,
    *,
    cfg: EvaluateConfig,
    engine,
    tokenizer,
    grading_pool,
    manifest: Manifest,
) -> list[dict[str, Any]]:
    """Shard ``index`` of ``plan``: read back when already on disk, else sampled, graded and written."""
    from pipeline.eval.runner import sample_and_grade
    from pipeline.rollout.types import SamplingParams

    shard = plan.shards[index]
    path = Path(cfg.output_dir) / plan.directory / _SHARD_NAME.format(index=index)
    if path.is_file():
        records = read_shard(path)
        if [record["id"] for record in records] != [prompt.id for prompt in shard]:
            raise EvaluateError(
                f"{path} holds other problems than shard {index} of {plan.spec}; delete it to regenerate it"
            )
        manifest.set_shard(plan.spec, index, status="reused", seconds=manifest.previous_seconds(plan.spec, index))
        return records
    started = time.perf_counter()
    params = SamplingParams(
        max_new_tokens=cfg.eval.max_new_tokens, temperature=cfg.eval.temperature, top_p=cfg.eval.top_p,
        seed=shard_seed(cfg.eval.seed, plan.spec, index),
    )
    try:
        results = sample_and_grade(
            engine=engine, tokenizer=tokenizer, prompts=shard, num_samples=cfg.eval.num_samples,
            params=params, pool=grading_pool(), template=cfg.template,
        )
    except BaseException as error:
        manifest.set_shard(plan.spec, index, status="failed", error=f"{type(error).__name__}: {error}")
        raise
    records = [problem_record(result, save_responses=cfg.save_responses) for result in results]
    write_shard(path, records)
    manifest.set_shard(plan.spec, index, status="done", seconds=time.perf_counter() - started)
    return records


def run_evaluate(cfg: EvaluateConfig, *, context=None, pool=None, out=print) -> dict[str, Any]:
    """Evaluate ``cfg.policy`` (see the module docstring); return the ``results.json`` dict.

    ``context``: a one-rank ``ParallelContext`` to load a winnow checkpoint under when
    this process already runs one (``pipeline.eval.policy.load_policy``). ``pool``: a
    running ``GradingPool`` to grade in (a caller that evaluates repeatedly keeps one);
    without it, one is started from ``cfg.reward`` when the first shard needs grading,
    so re-aggregating a finished evaluation starts none.
    """
    from tqdm import tqdm

    from pipeline.eval.plots import plot_pass_at_k
    from pipeline.eval.policy import load_policy
    from pipeline.eval.report import RESULTS_FILE, format_results_markdown
    from pipeline.rewards import GradingPool
    from pipeline.rollout.local import LocalEngine

    if not cfg.policy:
        raise ConfigError("policy: required (a Hugging Face folder or a winnow checkpoint directory)")
    directories = [benchmark_directory(spec) for spec in cfg.eval.benchmarks]
    if len(set(directories)) != len(directories):
        raise ConfigError(f"eval.benchmarks: two benchmarks share an output folder: {directories}")
    started = time.perf_counter()
    output_dir = Path(cfg.output_dir)
    policy = load_policy(
        cfg.policy, tokenizer=cfg.tokenizer, dtype=cfg.dtype, device=_device(cfg.device), context=context
    )
    out(f"policy {policy.source} loaded in {time.perf_counter() - started:.1f} s")
    manifest = Manifest(output_dir, cfg=cfg, fingerprint=fingerprint(cfg, policy_source=policy.source))
    manifest.data["timings"]["load_policy_s"] = time.perf_counter() - started
    manifest.write()
    tokenizer = policy.tokenizer
    engine = LocalEngine(
        policy.hf_model, eos_token_ids=_stop_token_ids(policy.hf_model, tokenizer),
        pad_token_id=tokenizer.pad_token_id, max_batch_rows=cfg.max_batch_rows, show_progress=cfg.progress,
    )

    plans: dict[str, BenchmarkPlan] = {}
    records_by_benchmark: dict[str, list[dict[str, Any]]] = {}
    with ExitStack() as stack:
        pools = [pool] if pool is not None else []

        def grading_pool():
            if not pools:
                pools.append(stack.enter_context(GradingPool(**cfg.reward.pool_kwargs())))
            return pools[0]

        try:
            for spec in cfg.eval.benchmarks:
                plan = plan_benchmark(spec, cfg=cfg, tokenizer=tokenizer, max_positions=policy.max_position_embeddings)
                plans[spec] = plan
                manifest.add_benchmark(plan)
                manifest.write()
                if plan.num_too_long:
                    out(f"{spec}: {plan.num_too_long} of {plan.num_loaded} problems exceed the model's context "
                        f"with {cfg.eval.max_new_tokens} new tokens; skipped")
                benchmark_started = time.perf_counter()
                records: list[dict[str, Any]] = []
                with tqdm(
                    total=plan.num_problems, desc=spec, unit="problem", disable=not cfg.progress, file=sys.stderr
                ) as bar:
                    for index in range(len(plan.shards)):
                        records += _shard_records(
                            plan, index, cfg=cfg, engine=engine, tokenizer=tokenizer,
                            grading_pool=grading_pool, manifest=manifest,
                        )
                        bar.update(len(plan.shards[index]))
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


# ----------------------------------------------------------------------------- CLI


def _add_config_arguments(parser) -> None:
    parser.add_argument("--config", metavar="YAML", help="a YAML file of options to load first")
    parser.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides applied last, e.g. eval.num_samples=8"
    )


def add_evaluate_arguments(parser) -> None:
    """``winnow evaluate POLICY [--tokenizer DIR] [--config YAML] [key=value ...]``."""
    parser.add_argument(
        "policy", help="a Hugging Face folder, a winnow run/checkpoint directory, or a bootstrap cache entry"
    )
    parser.add_argument(
        "--tokenizer", metavar="DIR", default=None, help="tokenizer folder (default: found next to the policy)"
    )
    _add_config_arguments(parser)


def run_evaluate_command(args) -> int:
    cfg = configlib.load(EvaluateConfig, yaml_path=args.config, overrides=args.overrides)
    # Set after loading: a path is not YAML (`a: b` or `[x]` would parse as data).
    cfg = dataclasses.replace(cfg, policy=args.policy, tokenizer=args.tokenizer or cfg.tokenizer)
    run_evaluate(cfg)
    return 0


def add_compare_arguments(parser) -> None:
    """``winnow evaluate-compare RUN_A RUN_B [--bootstrap-samples N] [--seed S] [--plot PNG]``."""
    parser.add_argument("run_a", help="the baseline: an evaluation output directory or its results.json")
    parser.add_argument("run_b", help="the candidate; differences are B − A")
    parser.add_argument("--bootstrap-samples", type=int, default=1000, help="resamples for the intervals (0: none)")
    parser.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    parser.add_argument("--plot", metavar="PNG", default=None, help="also draw both runs' pass@k curves here")


def run_compare_command(args) -> int:
    from pipeline.eval.plots import plot_comparison
    from pipeline.eval.report import compare, format_comparison, load_results

    if args.bootstrap_samples < 0:
        raise UserError(f"--bootstrap-samples must be ≥ 0, got {args.bootstrap_samples}")
    results_a, results_b = load_results(args.run_a), load_results(args.run_b)
    rows = compare(results_a, results_b, bootstrap_samples=args.bootstrap_samples, seed=args.seed)
    if not rows:
        raise UserError(f"{args.run_a} and {args.run_b} share no evaluated benchmark")
    print(f"A = {args.run_a}\nB = {args.run_b}\n")
    print(format_comparison(rows), end="")
    if args.plot:
        print(f"\nplot: {plot_comparison({'A': results_a, 'B': results_b}, args.plot)}")
    return 0
