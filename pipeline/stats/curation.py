"""The curation artifact: the files `winnow curate` leaves in its output folder, written and read here.

``pipeline.stages.curate`` measures the prompts and writes through this module; the stages
that consume a curation (the RL stage seeds its statistics store from the measured pass
rates, the difficulty estimator trains on them) read it back with ``load_curation``, so
the file names and formats have one owner below the stages.

Files under a curation's ``output_dir``:

    shards/shard_XXXXX.parquet  one row per sampled prompt: id, source, problem, answer, metadata (JSON),
                                n, c, pass_rate, difficulty, num_generated_tokens, question_logprob
    pass_rates.parquet          every loaded prompt: id, spec (its entry of ``sources``), source, n, c,
                                pass_rate (null when not sampled), difficulty, kept, drop_reason
                                (null when kept)
    kept.jsonl                  the kept prompts in the loaders' JSONL format: ``{"id", "problem",
                                "answer", **metadata}``, read back by ``pipeline.data.load_prompts(path)``
    report.md, difficulty.png   counts per rule, difficulty histograms before/after
    manifest.json               ``format``, config (its ``num_samples`` is k), counts, timings, shard status;
                                written last, so its presence marks a complete curation

Sizes: ``pass_rates.parquet`` holds a few tens of bytes per prompt (a 100k-prompt curation:
a few MB); ``load_curation`` reads only it and the manifest, into ``(P,)`` arrays.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.errors import UserError
from pipeline.io import atomic_write, atomic_write_text

__all__ = [
    "FORMAT_VERSION",
    "KEPT_FILE",
    "MANIFEST_FILE",
    "PASS_RATES_FILE",
    "PLOT_FILE",
    "REPORT_FILE",
    "SHARDS_DIR",
    "CurationError",
    "CurationResult",
    "load_curation",
    "pass_rates",
    "write_kept",
    "write_manifest",
    "write_pass_rates",
]

SHARDS_DIR = "shards"
PASS_RATES_FILE = "pass_rates.parquet"
KEPT_FILE = "kept.jsonl"
MANIFEST_FILE = "manifest.json"
REPORT_FILE = "report.md"
PLOT_FILE = "difficulty.png"
FORMAT_VERSION = 2  # 2: shards carry question_logprob


class CurationError(UserError):
    """An output directory that does not fit this run, or a curation that is missing or incomplete."""


@dataclass(frozen=True, slots=True)
class CurationResult:
    """Per-prompt curation outcome, every loaded prompt in load order (P of them).

    ``num_samples``/``num_correct`` are 0 and ``pass_rates`` NaN for prompts dropped before
    sampling (``drop_reasons`` says why); ``drop_reasons`` is ``""`` for kept prompts.
    """

    output_dir: Path
    prompt_ids: list[str]
    specs: list[str]  # the entry of ``CurateConfig.sources`` each prompt came from
    sources: list[str]  # ``Prompt.source``
    num_samples: np.ndarray  # (P,) int64: n
    num_correct: np.ndarray  # (P,) int64: c
    pass_rates: np.ndarray  # (P,) float64: c / n, NaN where n == 0
    kept_mask: np.ndarray  # (P,) bool
    drop_reasons: list[str]
    samples_per_prompt: int  # k of the run
    counts: dict[str, int]  # total, each rule, kept

    @property
    def sampled_mask(self) -> np.ndarray:
        return self.num_samples > 0  # (P,)

    @property
    def kept_ids(self) -> list[str]:
        return [prompt_id for prompt_id, kept in zip(self.prompt_ids, self.kept_mask) if kept]

    @property
    def kept_path(self) -> Path:
        return self.output_dir / KEPT_FILE


def pass_rates(num_samples: np.ndarray, num_correct: np.ndarray) -> np.ndarray:
    """``(P,)`` c / n, NaN where nothing was sampled."""
    rates = np.full(num_samples.shape, np.nan)
    sampled = num_samples > 0
    rates[sampled] = num_correct[sampled] / num_samples[sampled]
    return rates


# ================================================================ writing


def write_pass_rates(path: Path, result: CurationResult, *, difficulty: Sequence[str | None]) -> None:
    """``pass_rates.parquet`` for ``result``, atomically; ``difficulty``: each prompt's bucket name, ``None``
    where it was not sampled (the curation rules name the buckets)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if len(difficulty) != len(result.prompt_ids):
        raise ValueError(f"difficulty: {len(difficulty)} names for {len(result.prompt_ids)} prompts")
    table = pa.table({
        "id": result.prompt_ids,
        "spec": result.specs,
        "source": result.sources,
        "n": pa.array(result.num_samples, pa.int64()),
        "c": pa.array(result.num_correct, pa.int64()),
        "pass_rate": pa.array(result.pass_rates, pa.float64(), mask=~result.sampled_mask),
        "difficulty": pa.array(list(difficulty), pa.string()),
        "kept": pa.array(result.kept_mask, pa.bool_()),
        "drop_reason": pa.array([reason or None for reason in result.drop_reasons], pa.string()),
    })
    atomic_write(path, lambda tmp: pq.write_table(table, tmp))


def write_kept(path: Path, prompts: Sequence) -> None:
    """``kept.jsonl``: each prompt (``id``, ``problem``, ``answer``, ``metadata``) as one flat row, atomically."""
    # Flat rows in the loaders' JSONL format: id/problem/answer are read as such and every
    # other key comes back as metadata, so load_prompts(path) restores the records.
    lines = [json.dumps({"id": p.id, "problem": p.problem, "answer": p.answer, **p.metadata}, ensure_ascii=False)
             for p in prompts]
    atomic_write_text(path, "".join(line + "\n" for line in lines))


def write_manifest(output_dir: Path, manifest: dict[str, Any]) -> None:
    """``manifest.json`` with this ``FORMAT_VERSION``: the last file a curation writes (it marks it complete)."""
    atomic_write_text(output_dir / MANIFEST_FILE, json.dumps({"format": FORMAT_VERSION, **manifest}, indent=1) + "\n")


# ================================================================ reading


def load_curation(output_dir: str | Path) -> CurationResult:
    """Read a finished curation (``manifest.json`` present) back from ``output_dir``."""
    import pyarrow.parquet as pq

    output_dir = Path(output_dir)
    manifest_path = output_dir / MANIFEST_FILE
    if not manifest_path.is_file():
        raise CurationError(f"{output_dir}: no complete curation here ({MANIFEST_FILE} is missing; "
                            "run `winnow curate` to finish it)")
    manifest = json.loads(manifest_path.read_text())
    if manifest.get("format") != FORMAT_VERSION:
        raise CurationError(f"{manifest_path}: format {manifest.get('format')!r}, this version reads {FORMAT_VERSION}")
    table = pq.read_table(output_dir / PASS_RATES_FILE)
    num_samples = table.column("n").to_numpy().astype(np.int64)
    num_correct = table.column("c").to_numpy().astype(np.int64)
    reasons = [reason or "" for reason in table.column("drop_reason").to_pylist()]
    return CurationResult(
        output_dir=output_dir,
        prompt_ids=table.column("id").to_pylist(),
        specs=table.column("spec").to_pylist(),
        sources=table.column("source").to_pylist(),
        num_samples=num_samples,
        num_correct=num_correct,
        pass_rates=pass_rates(num_samples, num_correct),
        kept_mask=table.column("kept").to_numpy(zero_copy_only=False).astype(bool),
        drop_reasons=reasons,
        samples_per_prompt=int(manifest["config"]["num_samples"]),
        counts={key: int(value) for key, value in manifest["counts"].items()},
    )
