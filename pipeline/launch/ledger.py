"""The campaign ledger: every token a campaign spent, and its FLOPs, read back from its stages' outputs.

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
outputs predate a count, reports ``None`` for it and says why in ``note``. Not in the token counts:
prompt tokens read by the policy (curation's question log-probs, the prefill of every sample); an RL
run's FLOPs count its prefill, with those tokens beside them.
An RL run's ``encoded`` is its DEPO estimator's reading (``depo/encoded_tokens``, cumulative).

Tokens are not a cost: an estimator token costs a few percent of a policy token, and prefill and
update cost FLOPs no token count shows. Each stage also carries its FLOPs by category
(``StageFlops``: generation, prefill, update, estimator; ``pipeline.stats.flops``' count, with the
tokens each category counted beside it where recorded):

- rl: the run's own count (``flops/cumulative/*``, ``tokens/cumulative/*`` in ``metrics.jsonl``).
  A run from before the count: generation estimated from its generated tokens (``2·N`` each,
  attention not counted); prefill, update and a DEPO estimator's reading n/a;
- bootstrap: its supervised update estimated from ``trained_tokens`` (``3 × 2·N`` each; the prompts'
  tokens and attention are not recorded);
- curate and evaluate: generation estimated from their generated tokens; prefill n/a;
- train-estimator: the estimator's own cost per token read, from its ``estimator.json``
  (``bert_config``): a forward per scoring token, forward + backward per training token.

``N`` is the stage's policy (``pipeline.launch.plan.stage_contexts``: its servers', bootstrap's or
policy's config); a category whose count or model cannot be read is n/a (``None``). A value
estimated from tokens, or a sum over stages that misses a stage's unrecorded part, is printed with
``~`` (the stage's FLOPs note says what is left out).

A variant's account (``variant_costs``): *before RL* sums the stages its rl stage depends on,
directly or not (curation, the estimator when it filters with DEPO; for FLOPs also the bootstrap's
update); shared stages are charged in full to every variant that needed them, since each would have
paid them alone. The campaign total counts each stage once.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.stats.flops import CATEGORIES, ForwardCost, estimator_flops, format_flops, forward_flops

@dataclass(frozen=True, slots=True)
class StageFlops:
    """FLOPs by category (``pipeline.stats.flops.CATEGORIES``); None: not recorded (n/a).

    ``approximate``: the categories whose value is not an exact count: estimated from tokens (attention
    and prompts unrecorded), or a sum over stages one of which has no count for it.
    ``tokens``: the tokens each category counted, where recorded. ``pending``: the stage has not
    written its outputs yet, so it has spent nothing so far (zeros, printed ``—``).
    """

    flops: Mapping[str, float | None] = field(default_factory=lambda: dict.fromkeys(CATEGORIES))
    approximate: frozenset[str] = frozenset()
    tokens: Mapping[str, int] = field(default_factory=dict)
    pending: bool = False

    @classmethod
    def of(cls, *, approximate: Iterable[str] = (), tokens: Mapping[str, int] | None = None,
           **flops: float | None) -> StageFlops:
        """Categories not named are 0 (the stage does no such work)."""
        unknown = set(flops) - set(CATEGORIES)
        if unknown:
            raise ValueError(f"unknown FLOP categories {sorted(unknown)}")
        return cls(flops={category: flops.get(category, 0.0) for category in CATEGORIES},
                   approximate=frozenset(approximate), tokens=dict(tokens or {}))

    @property
    def total(self) -> float | None:
        """The known categories' sum; None when nothing is known but zeros beside an unknown category."""
        known = [value for value in self.flops.values() if value is not None]
        if not any(known) and len(known) < len(self.flops):
            return None
        return sum(known)

    @property
    def total_is_approximate(self) -> bool:
        return bool(self.approximate) or any(value is None for value in self.flops.values())

    def __add__(self, other: StageFlops) -> StageFlops:
        flops: dict[str, float | None] = {}
        approximate = set(self.approximate | other.approximate)
        for category in CATEGORIES:
            mine, theirs = self.flops[category], other.flops[category]
            if (mine is None and not theirs) or (theirs is None and not mine):  # unknown beside nothing known
                flops[category] = None
            else:
                flops[category] = (mine or 0.0) + (theirs or 0.0)
                if mine is None or theirs is None:
                    approximate.add(category)
        tokens = {category: self.tokens.get(category, 0) + other.tokens.get(category, 0)
                  for category in CATEGORIES if category in self.tokens or category in other.tokens}
        return StageFlops(flops=flops, approximate=frozenset(approximate), tokens=tokens,
                          pending=self.pending and other.pending)

    def cell(self, category: str) -> str:
        """One category as the ledger prints it: ``1.23e12``, ``~1.23e12`` (approximate) or ``n/a``."""
        value = self.flops[category]
        if self.pending:
            return "—"
        return format_flops(value) if value is None or category not in self.approximate else f"~{format_flops(value)}"

    def total_cell(self) -> str:
        total = self.total
        if self.pending:
            return "—"
        return format_flops(total) if total is None or not self.total_is_approximate else f"~{format_flops(total)}"


NOT_RUN = StageFlops(flops=dict.fromkeys(CATEGORIES, 0.0), pending=True)


def sum_stage_flops(parts: Iterable[StageFlops]) -> StageFlops:
    """Category-wise sum; zero for no parts."""
    total = StageFlops.of()
    for part in parts:
        total = total + part
    return total


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
    flops: StageFlops = NOT_RUN  # what the stage's outputs say it spent; nothing before it has written them
    flops_note: str = ""  # how the FLOPs were counted, where not from the stage's own count

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
    flops_before_rl: StageFlops = field(default_factory=StageFlops.of)  # the bootstrap's update included
    flops_rl: StageFlops = field(default_factory=StageFlops)
    flops_evaluation: StageFlops | None = None

    @property
    def total(self) -> int:
        return self.before_rl + self.rl + (self.evaluation or 0)

    @property
    def flops(self) -> StageFlops:
        """Everything the variant cost in FLOPs: before RL, its RL run and its evaluation."""
        parts = [self.flops_before_rl, self.flops_rl]
        return sum_stage_flops(parts if self.flops_evaluation is None else [*parts, self.flops_evaluation])


@dataclass(frozen=True, slots=True)
class CampaignLedger:
    stages: dict[str, StageTokens]  # in the plan's run order
    dependencies: dict[str, tuple[str, ...]]  # stage -> every stage it waits for, transitively

    @property
    def total(self) -> int:
        return sum(stage.total for stage in self.stages.values())

    @property
    def flops(self) -> StageFlops:
        """The campaign's FLOPs by category, each stage once."""
        return sum_stage_flops(stage.flops for stage in self.stages.values())

    def variants(self) -> list[str]:
        """Variant names: an rl stage's name without its ``rl-`` prefix (a one-stage plan's rl stage keeps its name)."""
        return [name.removeprefix("rl-") for name, stage in self.stages.items() if stage.kind == "rl"]

    def variant_cost(self, variant: str) -> VariantCost:
        rl = self.stages.get(f"rl-{variant}") or self.stages[variant]
        evaluation = self.stages.get(f"evaluate-{variant}")
        upstream = [self.stages[name] for name in self.dependencies[rl.stage] if name in self.stages]
        return VariantCost(variant=variant, before_rl=sum(stage.total for stage in upstream), rl=rl.total,
                           evaluation=None if evaluation is None else evaluation.generated,
                           with_gradient=rl.with_gradient,
                           flops_before_rl=sum_stage_flops(stage.flops for stage in upstream), flops_rl=rl.flops,
                           flops_evaluation=None if evaluation is None else evaluation.flops)

    def format(self) -> str:
        """The per-stage tables (tokens, then FLOPs by category), the campaign totals and each variant's
        account, as plain text."""
        def number(value: int | None) -> str:
            return "—" if value is None else f"{value:,}"

        lines = [f"{'tokens':<22} {'generated':>12} {'encoded':>12} {'with gradient':>14}  note"]
        for stage in self.stages.values():
            lines.append(f"{stage.stage:<22} {number(stage.generated):>12} {number(stage.encoded):>12} "
                         f"{number(stage.with_gradient):>14}  {stage.note}".rstrip())
        lines.append(f"{'campaign total':<22} {self.total:>12,}  (generated + encoded)")
        lines += ["", f"{'FLOPs':<22} " + " ".join(f"{name:>11}" for name in (*CATEGORIES, "total")) + "  note"]
        for stage in self.stages.values():
            cells = " ".join(f"{stage.flops.cell(category):>11}" for category in CATEGORIES)
            counted = ", ".join(f"{category} {count:,}" for category, count in stage.flops.tokens.items())
            note = "; ".join(part for part in (f"tokens: {counted}" if counted else "", stage.flops_note) if part)
            lines.append(f"{stage.stage:<22} {cells} {stage.flops.total_cell():>11}  {note}".rstrip())
        campaign = self.flops
        cells = " ".join(f"{campaign.cell(category):>11}" for category in CATEGORIES)
        lines.append(f"{'campaign total':<22} {cells} {campaign.total_cell():>11}")
        for variant in self.variants():
            cost = self.variant_cost(variant)
            lines.append(f"variant {variant}: before RL {cost.before_rl:,} + RL {cost.rl:,} + evaluation "
                         f"{number(cost.evaluation)} = {cost.total:,} tokens")
            evaluation = "n/a" if cost.flops_evaluation is None else cost.flops_evaluation.total_cell()
            everything = cost.flops
            lines.append(f"  FLOPs: before RL {cost.flops_before_rl.total_cell()} + RL {cost.flops_rl.total_cell()} "
                         f"+ evaluation {evaluation} = {everything.total_cell()} ("
                         + ", ".join(f"{category} {everything.cell(category)}" for category in CATEGORIES) + ")")
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


def _policy_flops_note(why: str) -> str:
    return f"policy dimensions unreadable ({why}): FLOPs n/a" if why else ""


def bootstrap_tokens(name: str, cfg, policy: ForwardCost | None = None, why: str = "") -> StageTokens:
    """The supervised update, estimated from ``trained_tokens`` with the dimensions the summary records."""
    from pipeline.io import resolve_cache_dir
    from pipeline.models.spec import ModelSpec
    from pipeline.stages.bootstrap import config_hash

    summary = _read_json(resolve_cache_dir(cfg.cache_dir) / config_hash(cfg) / "summary.json")
    if summary is None:
        return StageTokens(stage=name, kind="bootstrap", note="not run yet")
    trained = int(summary["trained_tokens"])
    if "model_spec" in summary:
        policy = ForwardCost.from_spec(ModelSpec(**summary["model_spec"]))
    update = None if policy is None else 3 * forward_flops(policy, tokens=trained, attended=0)
    return StageTokens(stage=name, kind="bootstrap", generated=0, encoded=0, with_gradient=trained,
                       note="supervised tokens only",
                       flops=StageFlops.of(update=update, approximate={"update"}, tokens={"update": trained}),
                       flops_note=_policy_flops_note(why) if policy is None else
                       "update from the supervised tokens (3 × 2·N each; prompts and attention not recorded)")


def generated_tokens_flops(generated: int, policy: ForwardCost | None, why: str = "") -> tuple[StageFlops, str]:
    """A stage that recorded only its generated tokens (curation, evaluation): generation at ``2·N`` each,
    prefill n/a."""
    if policy is None:
        return StageFlops.of(generation=None, prefill=None), _policy_flops_note(why)
    flops = StageFlops.of(generation=forward_flops(policy, tokens=generated, attended=0), prefill=None,
                          approximate={"generation"}, tokens={"generation": generated})
    return flops, "generation from its tokens (2·N each, attention not counted); prompts not recorded: prefill n/a"


def curate_tokens(name: str, cfg, policy: ForwardCost | None = None, why: str = "") -> StageTokens:
    from pipeline.stats.curation import MANIFEST_FILE

    manifest = _read_json(Path(cfg.output_dir) / MANIFEST_FILE)
    if manifest is None:
        return StageTokens(stage=name, kind="curate", note="not run yet")
    generated = int(manifest["num_generated_tokens"])
    flops, flops_note = generated_tokens_flops(generated, policy, why)
    return StageTokens(stage=name, kind="curate", generated=generated, encoded=0, flops=flops, flops_note=flops_note)


def estimator_cost(directory: str | Path) -> ForwardCost | None:
    """A saved estimator's per-token cost from its ``estimator.json`` (``bert_config``); None without one."""
    described = _read_json(Path(directory) / "estimator.json")
    if described is None or "bert_config" not in described:
        return None
    return ForwardCost.from_bert_config(described["bert_config"])


def estimator_tokens(name: str, cfg, policy: ForwardCost | None = None, why: str = "") -> StageTokens:
    """The estimator's reading, charged at its own dimensions (``estimator/estimator.json``)."""
    from pipeline.stages.train_estimator import CALIBRATION_FILE, ESTIMATOR_DIR

    report = _read_json(Path(cfg.output_dir) / CALIBRATION_FILE)
    if report is None:
        return StageTokens(stage=name, kind="train-estimator", note="not run yet")
    encoded = report.get("num_encoded_tokens")
    if encoded is None:
        return StageTokens(stage=name, kind="train-estimator", generated=0,
                           note="trained before the estimator counted its tokens",
                           flops=StageFlops.of(estimator=None), flops_note="no token count: estimator FLOPs n/a")
    cost = estimator_cost(Path(cfg.output_dir) / ESTIMATOR_DIR)
    flops = StageFlops.of(estimator=None if cost is None else estimator_flops(cost, encoded),
                          tokens={"estimator": int(sum(encoded.values()))})
    return StageTokens(stage=name, kind="train-estimator", generated=0, encoded=int(sum(encoded.values())),
                       note=f"train {encoded['train']:,}, inference {encoded['inference']:,}", flops=flops,
                       flops_note="" if cost is not None else f"no {ESTIMATOR_DIR}/estimator.json: estimator FLOPs n/a")


def rl_tokens(name: str, cfg, policy: ForwardCost | None = None, why: str = "") -> StageTokens:
    path = Path(cfg.logging.output_dir) / "metrics.jsonl"
    rows = [row for row in _read_rows(path) if "ledger/tokens_generated" in row]
    if not rows:
        return StageTokens(stage=name, kind="rl", note="not run yet")
    last = max(rows, key=lambda row: row["step"])  # the counts are cumulative
    # DEPO's online estimator reports what it read, cumulatively (depo/encoded_tokens); older runs did not.
    depo = cfg.algorithm.prompt_filter == "depo"
    depo_unrecorded = depo and "depo/encoded_tokens" not in last
    note = "the estimator's scoring during RL is not recorded" if depo_unrecorded else ""
    generated = int(last["ledger/tokens_generated"])
    if "flops/cumulative/total" in last:  # the run's own count (pipeline.rl.step.count_step_flops)
        counted_from = int(last.get("flops/counted_from_step", 1))
        flops = StageFlops(flops={category: float(last[f"flops/cumulative/{category}"]) for category in CATEGORIES},
                           approximate=frozenset(CATEGORIES if counted_from > 1 else ()),
                           tokens={category: int(last[f"tokens/cumulative/{category}"]) for category in CATEGORIES})
        flops_note = (f"counted from step {counted_from} (resumed from a checkpoint saved before the count)"
                      if counted_from > 1 else "")
    elif policy is None:
        flops = StageFlops.of(generation=None, prefill=None, update=None, estimator=None if depo else 0.0)
        flops_note = _policy_flops_note(why)
    else:  # a run from before the count: its generated tokens are all it recorded
        flops = StageFlops.of(generation=forward_flops(policy, tokens=generated, attended=0), prefill=None,
                              update=None, estimator=None if depo else 0.0, approximate={"generation"},
                              tokens={"generation": generated})
        flops_note = ("run before the FLOP count: generation from its tokens (2·N each, attention not counted); "
                      f"prefill, update{', estimator' if depo else ''} n/a")
    return StageTokens(stage=name, kind="rl", generated=generated,
                       encoded=int(last.get("depo/encoded_tokens", 0)),
                       with_gradient=int(last["ledger/tokens_with_gradient"]),
                       zero_variance_groups=int(last["ledger/zero_variance_groups"]),
                       groups=int(last["ledger/groups"]), note=note, flops=flops, flops_note=flops_note)


def evaluate_tokens(name: str, cfg, policy: ForwardCost | None = None, why: str = "") -> StageTokens:
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
    flops, flops_note = generated_tokens_flops(generated, policy, why)
    return StageTokens(stage=name, kind="evaluate", generated=generated, encoded=0, note=note, flops=flops,
                       flops_note=flops_note)


# The stage kinds whose costs the ledger counts, each with the reader of what its stage wrote
# (conversions spend no tokens: export and convert have none).
_READERS = {"bootstrap": bootstrap_tokens, "curate": curate_tokens, "train-estimator": estimator_tokens,
            "rl": rl_tokens, "evaluate": evaluate_tokens}


def _policy_costs(plan) -> dict[str, tuple[ForwardCost | None, str]]:
    """(per-token cost, why unreadable) of each generating stage's policy; a bootstrap's from its config."""
    from pipeline.launch.plan import bootstrap_model_dims, stage_contexts

    costs: dict[str, tuple[ForwardCost | None, str]] = {}
    for context in stage_contexts(plan):
        costs[context.stage] = ((context.dims.forward_cost(), "") if context.dims is not None
                                else (None, context.unreadable or "unknown"))
    for stage in plan.stages:
        if stage.kind == "bootstrap":
            costs[stage.name] = (bootstrap_model_dims(stage.config).forward_cost(), "")
    return costs


def read_ledger(plan) -> CampaignLedger:
    """The ledger of ``plan`` (a ``CampaignPlan``) from whatever its stages have written so far."""
    costs = _policy_costs(plan)
    stages = {stage.name: _READERS[stage.kind](stage.name, stage.config, *costs.get(stage.name, (None, "")))
              for stage in plan.order() if stage.kind in _READERS}
    dependencies = {name: tuple(sorted(plan.dependencies(name))) for name in stages}
    return CampaignLedger(stages=stages, dependencies=dependencies)
