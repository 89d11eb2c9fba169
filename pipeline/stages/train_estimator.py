"""`winnow train-estimator`: pre-train the DEPO difficulty estimator on a curation's pass rates.

Paper: "Difficulty-Estimated Policy Optimization", §3.1 (estimator and loss) and §3.2 (the
cold-start problem). DEPO warms the estimator up online for its first 100 RL steps; a
finished ``winnow curate`` already holds k graded samples for every sampled prompt, so
this stage gives the estimator that warm-up offline, before any RL step, and reports how
well it is calibrated on prompts it never saw.

Inputs: ``curation_dir`` (``load_curation`` for n, c; the shards for the problem texts and the
policy's mean question log-probs, whose exp is the L_distill target of §3.1.2).
Every sampled prompt is used, including those the curation rules dropped as trivial or
impossible: those are exactly the zero-variance prompts the filter must learn to spot.
The zero-variance head learns P(all G rewards equal) at ``group_size`` (the RL run's G; null:
the curation's k) from each prompt's counts (``zero_variance_targets_from_counts``: the share
of G-subsets of its k samples that are all equal); G above k cannot be observed and is refused.
The held-out split hashes each prompt id (not the seed), so runs with other seeds or
settings are evaluated on the same prompts. `winnow rl` warm-starts from ``estimator/``
(``algorithm.depo.estimator_dir``) and keeps training it online.

Outputs under ``output_dir``:

    estimator/         model.safetensors, estimator.json, tokenizer files (``DifficultyEstimator.load``)
    calibration.json   held-out and train calibration (Brier, Spearman, zero-variance Brier of the head
                       and of the point estimate p̂^G + (1 − p̂)^G, the drop rule's ratio, precision and
                       recall, reliability bins), per-epoch history, split sizes, config, package versions,
                       timings, tokens read (``num_encoded_tokens``: train, inference) — the
                       stage's manifest, written last: a rerun with the same config finds it
                       and returns without retraining
    calibration.png    reliability diagram: mean observed vs mean predicted pass rate per bin
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline import configlib
from pipeline.config import TrainEstimatorConfig
from pipeline.configlib import ConfigError
from pipeline.io import atomic_write, atomic_write_text, package_versions

# ================================================================ the stage

ESTIMATOR_DIR = "estimator"
CALIBRATION_FILE = "calibration.json"
PLOT_FILE = "calibration.png"


def holdout_mask(prompt_ids: list[str], *, fraction: float) -> np.ndarray:
    """``(P,)`` bool: a prompt is held out when the hash of its id falls below ``fraction``."""
    hashes = np.array([int.from_bytes(hashlib.sha256(f"winnow.estimator|{pid}".encode()).digest()[:8], "big")
                       for pid in prompt_ids], dtype=np.uint64)
    return hashes.astype(np.float64) / 2.0**64 < fraction


@dataclass(frozen=True, slots=True)
class TrainingSet:
    """Every sampled prompt of a curation, ``(P,)`` arrays in one order."""

    ids: list[str]
    texts: list[str]
    pass_rates: np.ndarray  # float64 c/n
    question_logprobs: np.ndarray  # float64: the policy's mean question log-prob (DEPO's distillation target)
    num_samples: np.ndarray  # int64 n
    num_correct: np.ndarray  # int64 c
    samples_per_prompt: int  # the curation's k


def load_training_set(curation_dir: str | Path) -> TrainingSet:
    """Every sampled prompt of a curation, with its problem text, counts and question log-prob."""
    import pyarrow.parquet as pq

    from pipeline.stats.curation import SHARDS_DIR, CurationError, load_curation

    curation = load_curation(curation_dir)
    problem_of: dict[str, str] = {}
    logprob_of: dict[str, float] = {}
    for path in sorted((Path(curation_dir) / SHARDS_DIR).glob("shard_*.parquet")):
        table = pq.read_table(path, columns=["id", "problem", "question_logprob"])
        ids_in_shard = table.column("id").to_pylist()
        problem_of.update(zip(ids_in_shard, table.column("problem").to_pylist()))
        logprob_of.update(zip(ids_in_shard, table.column("question_logprob").to_pylist()))
    sampled = np.flatnonzero(curation.sampled_mask)
    ids = [curation.prompt_ids[i] for i in sampled]
    missing = [pid for pid in ids if pid not in problem_of]
    if missing:
        raise CurationError(f"{curation_dir}: {len(missing)} sampled prompt(s) have no shard row "
                            f"(first {missing[0]!r}); the curation is incomplete")
    question_logprobs = np.array([logprob_of[pid] for pid in ids], dtype=np.float64)
    return TrainingSet(ids=ids, texts=[problem_of[pid] for pid in ids], pass_rates=curation.pass_rates[sampled],
                       question_logprobs=question_logprobs, num_samples=curation.num_samples[sampled],
                       num_correct=curation.num_correct[sampled], samples_per_prompt=curation.samples_per_prompt)


def build_estimator(cfg: TrainEstimatorConfig):
    from pipeline.estimator.model import DifficultyEstimator

    if cfg.encoder == "tiny":
        return DifficultyEstimator.tiny(max_length=cfg.max_length)
    return DifficultyEstimator.from_pretrained_minilm(cfg.cache_dir, max_length=cfg.max_length)


def run_train_estimator(cfg: TrainEstimatorConfig, *, out: Callable[[str], Any] = print) -> dict[str, Any]:
    """Train on the curation's sampled prompts, write the outputs, return the calibration report."""
    import torch
    from tqdm.auto import tqdm

    from pipeline.algorithms.depo import zero_variance_targets_from_counts
    from pipeline.estimator.train import EstimatorTrainer

    if cfg.curation_dir is None:
        raise ConfigError("curation_dir: required; the output_dir of a finished `winnow curate`")
    started = time.perf_counter()
    output_dir = Path(cfg.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    finished = output_dir / CALIBRATION_FILE
    if finished.is_file() and (output_dir / ESTIMATOR_DIR).is_dir():
        previous = json.loads(finished.read_text())
        if previous.get("config") == configlib.to_dict(cfg):
            # calibration.json is written last: its presence with this config marks a finished run.
            out(f"already trained with this config: {output_dir} (delete {finished.name} to retrain)")
            return previous

    data = load_training_set(cfg.curation_dir)
    ids, texts, pass_rates, question_logprobs = data.ids, data.texts, data.pass_rates, data.question_logprobs
    group_size = cfg.group_size if cfg.group_size is not None else data.samples_per_prompt
    if group_size > int(data.num_samples.min()):
        raise ConfigError(f"group_size: {group_size} exceeds the {int(data.num_samples.min())} samples the curation "
                          "graded for some prompts; whether G rewards are all equal cannot be observed from fewer")
    zero_variance = zero_variance_targets_from_counts(num_samples=torch.from_numpy(data.num_samples),
                                                      num_correct=torch.from_numpy(data.num_correct),
                                                      group_size=group_size).numpy()  # (P,)
    held_out = holdout_mask(ids, fraction=cfg.holdout_fraction)  # (P,)
    train_index, holdout_index = np.flatnonzero(~held_out), np.flatnonzero(held_out)
    if train_index.size < 2 or holdout_index.size < 2:
        raise ConfigError(f"holdout_fraction: {len(ids)} sampled prompts split into {train_index.size} train and "
                          f"{holdout_index.size} held out; each side needs at least 2")
    out(f"[1/3] {len(ids):,} sampled prompts from {cfg.curation_dir}: {train_index.size:,} train, "
        f"{holdout_index.size:,} held out")

    torch.manual_seed(cfg.seed)
    model = build_estimator(cfg)
    trainer = EstimatorTrainer(model, group_size=group_size, lr=cfg.lr, weight_decay=cfg.weight_decay,
                               w_distill=cfg.w_distill, w_rank=cfg.w_rank, margin=cfg.margin,
                               w_zero_variance=cfg.w_zero_variance)
    out(f"[2/3] train the {cfg.encoder} estimator: {cfg.epochs} epoch(s), batch {cfg.batch_size}, lr {cfg.lr}")
    holdout_texts = [texts[i] for i in holdout_index]

    def evaluate(index: np.ndarray, eval_texts: list[str]) -> dict[str, Any]:
        return trainer.calibration(eval_texts, pass_rates[index], zero_variance_targets=zero_variance[index],
                                   filter_ratio=cfg.filter_ratio,
                                   threshold=cfg.filter_threshold, batch_size=max(cfg.batch_size, 64))

    generator = torch.Generator().manual_seed(cfg.seed)
    history: list[dict[str, float]] = []
    train_phase = time.perf_counter()
    for epoch in range(cfg.epochs):
        order = train_index[torch.randperm(train_index.size, generator=generator).numpy()]
        batches = [order[start : start + cfg.batch_size] for start in range(0, order.size, cfg.batch_size)]
        losses = []
        for batch in tqdm(batches, desc=f"estimator epoch {epoch + 1}", unit="batch", disable=not cfg.progress,
                          leave=False):
            metrics = trainer.update([texts[i] for i in batch], torch.from_numpy(pass_rates[batch]).float(),
                                     torch.from_numpy(question_logprobs[batch]),
                                     torch.from_numpy(zero_variance[batch]))
            losses.append(metrics["depo/loss"])
        held = evaluate(holdout_index, holdout_texts)
        history.append({"epoch": epoch + 1, "train_loss": float(np.mean(losses)), "holdout_brier": held["brier"],
                        "holdout_spearman": held["spearman"],
                        "holdout_zero_variance_brier": held["zero_variance_brier"]})
        out(f"      epoch {epoch + 1}: loss {np.mean(losses):.4f}, held-out Brier {held['brier']:.4f}, "
            f"Spearman {held['spearman']:.3f}, zero-variance Brier {_fmt(held['zero_variance_brier'])}")
    train_seconds = time.perf_counter() - train_phase

    out("[3/3] calibrate and write the outputs")
    holdout = evaluate(holdout_index, holdout_texts)
    train = evaluate(train_index, [texts[i] for i in train_index])
    model.save(output_dir / ESTIMATOR_DIR)
    report = {
        "curation_dir": str(cfg.curation_dir),
        "num_prompts": {"train": int(train_index.size), "holdout": int(holdout_index.size)},
        "samples_per_prompt": data.samples_per_prompt,
        "holdout": holdout,
        "train": train,
        "history": history,
        "config": configlib.to_dict(cfg),
        "versions": package_versions(),
        "timings": {"train_s": train_seconds, "total_s": time.perf_counter() - started},
        "num_updates": trainer.num_updates,
        # What the estimator read (padding excluded): its updates, and the scoring of prompts for
        # the per-epoch and final calibrations. It generates nothing. The campaign ledger sums these.
        "num_encoded_tokens": dict(model.num_encoded_tokens),
    }
    atomic_write_text(output_dir / CALIBRATION_FILE, json.dumps(report, indent=1) + "\n")
    _plot_reliability(output_dir / PLOT_FILE, holdout=holdout, train=train)
    out(f"held-out ({holdout['num_prompts']:,} prompts): Brier {holdout['brier']:.4f} "
        f"(constant {holdout['brier_constant']:.4f}), Spearman {holdout['spearman']:.3f}, "
        f"zero-variance Brier {_fmt(holdout['zero_variance_brier'])} (point estimate "
        f"{_fmt(holdout['zero_variance_brier_point_estimate'])}); drops (G={group_size}, ≤ {cfg.filter_ratio:.0%} "
        f"above {cfg.filter_threshold}) precision {_fmt(holdout['filter_precision'])}, "
        f"recall {_fmt(holdout['filter_recall'])}, filter ratio {holdout['filter_ratio']:.3f}")
    return report


def _fmt(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.3f}"


def _plot_reliability(path: Path, *, holdout: dict[str, Any], train: dict[str, Any]) -> None:
    # The object-oriented API with the Agg canvas: no pyplot global state, no display needed.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(5.2, 4.8), layout="constrained")
    FigureCanvasAgg(figure)
    ax = figure.subplots()
    ax.plot([0, 1], [0, 1], color="grey", linestyle="--", linewidth=1, label="perfect calibration")
    for name, report, color in (("held out", holdout, "tab:blue"), ("train", train, "tab:orange")):
        bins = report["bins"]
        predicted, observed = np.array(bins["mean_predicted"]), np.array(bins["mean_observed"])
        counts = np.array(bins["count"])
        filled = counts > 0
        ax.plot(predicted[filled], observed[filled], marker="o", color=color,
                label=f"{name} (n={report['num_prompts']}, Brier {report['brier']:.3f}, ρ {report['spearman']:.2f})")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_xlabel("predicted pass rate (bin mean)")
    ax.set_ylabel("observed pass rate (bin mean)")
    ax.set_title("difficulty estimator reliability")
    ax.legend(loc="upper left", fontsize=8)
    atomic_write(path, lambda tmp: figure.savefig(tmp, format="png", dpi=110))
