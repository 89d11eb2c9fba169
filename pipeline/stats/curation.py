"""The curation artifact: the files `winnow curate` leaves in its output folder, written and read here.

``pipeline.stages.curate`` measures the prompts and writes through this module; the stages
that consume a curation (the RL stage seeds its statistics store from the measured pass
rates, the difficulty estimator trains on them) read it back with ``load_curation``, so
the file names and formats have one owner below the stages.

Files under a curation's ``output_dir``:

    shards/shard_XXXXX.parquet  one row per sampled prompt: id, source, problem, answer, metadata (JSON),
                                n, c, pass_rate, difficulty, num_generated_tokens (over its n responses),
                                question_logprob; optionally response_lengths (list<int64>: each
                                response's tokens), which ``load_response_lengths`` prefers when present
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
``load_response_lengths`` (the planner's measured response lengths) also reads the shards'
``id``, ``n``, ``num_generated_tokens`` and, when stored, ``response_lengths`` columns: 16 bytes a
prompt plus 8 a response (100k prompts × 16 responses: 14 MB).
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
    "RESPONSE_LENGTHS_COLUMN",
    "SHARDS_DIR",
    "CurationError",
    "CurationResult",
    "MeasuredLengths",
    "load_curation",
    "load_response_lengths",
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
RESPONSE_LENGTHS_COLUMN = "response_lengths"  # optional shard column: each response's generated tokens


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


@dataclass(frozen=True, slots=True)
class MeasuredLengths:
    """Generated tokens the curation measured for the prompts RL trains on (the kept ones; every
    sampled prompt when none was kept).

    ``per_response``: ``lengths`` holds one value per response (the shards' optional
    ``response_lengths`` column); otherwise one per prompt, the mean of its ``n`` responses
    (``num_generated_tokens / n``), which has the responses' mean but a narrower spread.
    """

    lengths: np.ndarray  # (M,) float64 generated tokens
    per_response: bool
    num_prompts: int
    kept_only: bool  # True: the kept prompts' lengths; False: no prompt was kept, every sampled one's
    max_new_tokens: int  # the curation's generation cap


def load_response_lengths(output_dir: str | Path) -> MeasuredLengths:
    """The response lengths a finished curation measured (``CurationError`` when it is missing or
    incomplete, or sampled nothing). Per-response lengths when every shard stores them, else
    each prompt's mean."""
    import pyarrow.parquet as pq

    curation = load_curation(output_dir)
    output_dir = Path(output_dir)
    manifest = json.loads((output_dir / MANIFEST_FILE).read_text())
    ids: list[str] = []
    means: list[np.ndarray] = []  # per shard, (R,) each prompt's mean response length
    responses: list[list[list[int]]] | None = []  # per shard, each prompt's response lengths; None: not stored
    for path in sorted((output_dir / SHARDS_DIR).glob("shard_*.parquet")):
        stored = RESPONSE_LENGTHS_COLUMN in pq.read_schema(path).names
        columns = ["id", "n", "num_generated_tokens"] + ([RESPONSE_LENGTHS_COLUMN] if stored else [])
        table = pq.read_table(path, columns=columns)
        ids += table.column("id").to_pylist()
        n = table.column("n").to_numpy().astype(np.float64)  # (R,)
        means.append(table.column("num_generated_tokens").to_numpy().astype(np.float64) / np.maximum(n, 1))
        if responses is not None and stored:
            responses.append(table.column(RESPONSE_LENGTHS_COLUMN).to_pylist())
        else:  # one shard without them: per-prompt means throughout, so every prompt weighs the same
            responses = None
    kept = set(curation.kept_ids)
    kept_only = any(prompt_id in kept for prompt_id in ids)
    rows = np.array([prompt_id in kept or not kept_only for prompt_id in ids], dtype=bool)  # (P_sampled,)
    if not rows.any():
        raise CurationError(f"{output_dir}: the curation sampled no prompt, so it measured no response length")
    if responses is not None:
        flat = [lengths for shard in responses for lengths in shard]
        lengths = np.array([length for row, per_prompt in zip(rows, flat) if row for length in per_prompt],
                           dtype=np.float64)
    else:
        lengths = np.concatenate(means)[rows]
    return MeasuredLengths(lengths=lengths, per_response=responses is not None, num_prompts=int(rows.sum()),
                           kept_only=kept_only, max_new_tokens=int(manifest["config"]["max_new_tokens"]))
