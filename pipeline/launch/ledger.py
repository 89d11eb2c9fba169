"""The campaign ledger: every token a campaign spent, read back from its stages' outputs.

The sample-efficiency methods claim to save tokens; a fair account counts all of them,
including what a variant paid before its first RL step. Per stage (``read_ledger(plan)``):

- ``generated``: tokens sampled by the policy: curation's k samples per prompt
  (``manifest.json`` ``num_generated_tokens``), an RL run's rollouts (``metrics.jsonl``
  ``ledger/tokens_generated``), evaluation's samples (``results.json``);
- ``encoded``: tokens the difficulty estimator read while training and scoring prompts
  (``calibration.json`` ``num_encoded_tokens``, padding excluded);
- ``with_gradient``: tokens an update trained on: the bootstrap's supervised tokens
  (``summary.json`` ``trained_tokens``), an RL run's ``ledger/tokens_with_gradient``. They are
  tokens already generated (RL) or given (SFT), so they are reported beside the total, not in it.

A stage's total is generated + encoded. A stage that has not written its outputs yet, or whose
outputs predate a count, reports ``None`` for it and says why in ``note``. Not counted anywhere:
prompt tokens read by the policy (curation's question log-probs, the prefill of every sample).
An RL run's ``encoded`` is its DEPO estimator's reading (``depo/encoded_tokens``, cumulative).

A variant's account (``variant_costs``): *before RL* sums the stages its rl stage depends on,
directly or not (curation, the estimator when it filters with DEPO); shared stages are charged
in full to every variant that needed them, since each would have paid them alone. The
campaign total counts each stage once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

COUNTED_KINDS = ("bootstrap", "curate", "train-estimator", "rl", "evaluate")


@dataclass(frozen=True, slots=True)
class StageTokens:
    stage: str
    kind: str
    generated: int | None = None
    encoded: int | None = None
    with_gradient: int | None = None
    zero_variance_groups: int | None = None  # rl: groups whose rewards were all equal (no gradient signal)
    groups: int | None = None
    note: str = ""  # where a missing count went, or how a count was derived

    @property
    def total(self) -> int:
        return (self.generated or 0) + (self.encoded or 0)


@dataclass(frozen=True, slots=True)
class VariantCost:
    variant: str
    before_rl: int  # tokens of the stages its rl stage depends on
    rl: int  # rollout tokens
    evaluation: int | None
    with_gradient: int | None

    @property
    def total(self) -> int:
        return self.before_rl + self.rl + (self.evaluation or 0)


@dataclass(frozen=True, slots=True)
class CampaignLedger:
    stages: dict[str, StageTokens]  # in the plan's run order
    dependencies: dict[str, tuple[str, ...]]  # stage -> every stage it waits for, transitively

    @property
    def total(self) -> int:
        return sum(stage.total for stage in self.stages.values())

    def variants(self) -> list[str]:
        """Variant names: an rl stage's name without its ``rl-`` prefix (a one-stage plan's rl stage keeps its name)."""
        return [name.removeprefix("rl-") for name, stage in self.stages.items() if stage.kind == "rl"]

    def variant_cost(self, variant: str) -> VariantCost:
        rl = self.stages.get(f"rl-{variant}") or self.stages[variant]
        evaluation = self.stages.get(f"evaluate-{variant}")
        before = sum(self.stages[name].total for name in self.dependencies[rl.stage] if name in self.stages)
        return VariantCost(variant=variant, before_rl=before, rl=rl.total,
                           evaluation=None if evaluation is None else evaluation.generated,
                           with_gradient=rl.with_gradient)

    def format(self) -> str:
        """The per-stage table, the campaign total and each variant's account, as plain text."""
        def number(value: int | None) -> str:
            return "—" if value is None else f"{value:,}"

        lines = [f"{'tokens':<22} {'generated':>12} {'encoded':>12} {'with gradient':>14}  note"]
        for stage in self.stages.values():
            lines.append(f"{stage.stage:<22} {number(stage.generated):>12} {number(stage.encoded):>12} "
                         f"{number(stage.with_gradient):>14}  {stage.note}".rstrip())
        lines.append(f"{'campaign total':<22} {self.total:>12,}  (generated + encoded)")
        for variant in self.variants():
            cost = self.variant_cost(variant)
            lines.append(f"variant {variant}: before RL {cost.before_rl:,} + RL {cost.rl:,} + evaluation "
                         f"{number(cost.evaluation)} = {cost.total:,}")
        return "\n".join(lines)


# ================================================================ reading the stages' outputs


def _read_json(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _read_rows(path: Path) -> list[dict[str, Any]]:
    """JSON lines of a metrics file; a running stage may be mid-way through appending its last line."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def bootstrap_tokens(name: str, cfg) -> StageTokens:
    from pipeline.io import resolve_cache_dir
    from pipeline.stages.bootstrap import config_hash

    summary = _read_json(resolve_cache_dir(cfg.cache_dir) / config_hash(cfg) / "summary.json")
    if summary is None:
        return StageTokens(stage=name, kind="bootstrap", note="not run yet")
    return StageTokens(stage=name, kind="bootstrap", generated=0, encoded=0,
                       with_gradient=int(summary["trained_tokens"]), note="supervised tokens only")


def curate_tokens(name: str, cfg) -> StageTokens:
    from pipeline.stats.curation import MANIFEST_FILE

    manifest = _read_json(Path(cfg.output_dir) / MANIFEST_FILE)
    if manifest is None:
        return StageTokens(stage=name, kind="curate", note="not run yet")
    return StageTokens(stage=name, kind="curate", generated=int(manifest["num_generated_tokens"]), encoded=0)


def estimator_tokens(name: str, cfg) -> StageTokens:
    from pipeline.stages.train_estimator import CALIBRATION_FILE

    report = _read_json(Path(cfg.output_dir) / CALIBRATION_FILE)
    if report is None:
        return StageTokens(stage=name, kind="train-estimator", note="not run yet")
    encoded = report.get("num_encoded_tokens")
    if encoded is None:
        return StageTokens(stage=name, kind="train-estimator", generated=0,
                           note="trained before the estimator counted its tokens")
    return StageTokens(stage=name, kind="train-estimator", generated=0, encoded=int(sum(encoded.values())),
                       note=f"train {encoded['train']:,}, inference {encoded['inference']:,}")


def rl_tokens(name: str, cfg) -> StageTokens:
    path = Path(cfg.logging.output_dir) / "metrics.jsonl"
    rows = [row for row in _read_rows(path) if "ledger/tokens_generated" in row]
    if not rows:
        return StageTokens(stage=name, kind="rl", note="not run yet")
    last = max(rows, key=lambda row: row["step"])  # the counts are cumulative
    # DEPO's online estimator reports what it read, cumulatively (depo/encoded_tokens); older runs did not.
    depo_unrecorded = cfg.algorithm.prompt_filter == "depo" and "depo/encoded_tokens" not in last
    note = "the estimator's scoring during RL is not recorded" if depo_unrecorded else ""
    return StageTokens(stage=name, kind="rl", generated=int(last["ledger/tokens_generated"]),
                       encoded=int(last.get("depo/encoded_tokens", 0)),
                       with_gradient=int(last["ledger/tokens_with_gradient"]),
                       zero_variance_groups=int(last["ledger/zero_variance_groups"]),
                       groups=int(last["ledger/groups"]), note=note)


def evaluate_tokens(name: str, cfg) -> StageTokens:
    """``num_generated_tokens`` of each benchmark when results.json records it; older results record
    only ``mean_generated_tokens`` per sample, which times the samples gives the same count."""
    from pipeline.eval.report import RESULTS_FILE

    results = _read_json(Path(cfg.output_dir) / RESULTS_FILE)
    if results is None:
        return StageTokens(stage=name, kind="evaluate", note="not run yet")
    generated, derived = 0, False
    for entry in results["benchmarks"].values():
        if "num_generated_tokens" in entry:
            generated += int(entry["num_generated_tokens"])
        else:
            derived = True
            generated += round(entry["mean_generated_tokens"] * sum(entry["problems"]["n"]))
    note = "results.json has no num_generated_tokens: mean per sample × samples" if derived else ""
    return StageTokens(stage=name, kind="evaluate", generated=generated, encoded=0, note=note)


_READERS = {"bootstrap": bootstrap_tokens, "curate": curate_tokens, "train-estimator": estimator_tokens,
            "rl": rl_tokens, "evaluate": evaluate_tokens}


def read_ledger(plan) -> CampaignLedger:
    """The ledger of ``plan`` (a ``CampaignPlan``) from whatever its stages have written so far."""
    stages = {stage.name: _READERS[stage.kind](stage.name, stage.config)
              for stage in plan.order() if stage.kind in COUNTED_KINDS}
    by_name = {stage.name: stage for stage in plan.stages}

    def upstream(name: str) -> set[str]:
        found: set[str] = set()
        for parent in by_name[name].depends_on:
            found |= {parent, *upstream(parent)}
        return found

    dependencies = {name: tuple(sorted(upstream(name))) for name in stages}
    return CampaignLedger(stages=stages, dependencies=dependencies)
