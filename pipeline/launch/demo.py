"""`winnow demo`: the whole campaign on a CPU, then a results table.

The campaign is ``recipes.campaigns.demo_campaign`` (``cpu_campaign`` with the demo's
evaluation settings), built by the CLI and run in this process
(``pipeline.launch.campaign.run_campaign_inprocess``), the same plan that
``winnow launch campaign --recipe cpu`` runs as separate jobs:

1. bootstrap the base policy (tokenizer + supervised Megatron actor; cached by config hash);
2. curate: k samples per training prompt, keep those of useful difficulty;
3. train the DEPO difficulty estimator on the curation's pass rates;
4. RL three times from the same base and budget of steps: the default (plain GRPO on the
   uncurated prompts, the best combination the default race measured on total campaign
   tokens), GRPO on the curated prompts, and the staged pipeline (DEPO, its estimator
   trained on the curation, + Ada-Seq-BALANCE + D³S + CW-GRPO) on the uncurated prompts;
5. evaluate each: unbiased pass@1…pass@32 on held-out synthetic sets, GSM8K and MATH-500
   (reported honestly: a model this small scores ~0 there, and most of their problems
   do not fit its context);
6. export each to a Hugging Face folder, reload the default one with ``transformers``
   and let it answer a question.

The report states the base policy's held-out pass@1 against the band the bootstrap seed
study found, and counts every token and FLOP each variant cost, curation and estimator included
(``pipeline.launch.ledger``; the estimator charged at its own size, a few percent of a policy token).

Stages already done are skipped on a rerun, so a second ``winnow demo`` only prints.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from pipeline.config import DemoConfig

VARIANTS = ("default", "grpo", "methods")  # the token table's rows
# Each comparison table: (baseline, variant); its differences are variant − baseline.
COMPARISONS = (("default", "methods"), ("default", "grpo"))
TITLES = {"default": "default (GRPO, uncurated)", "grpo": "GRPO on curated prompts",
          "methods": "methods (staged pipeline: DEPO + Ada-Seq-BALANCE + D³S + CW-GRPO, uncurated; estimator trained on the curation)"}

# Why the default is plain GRPO on the uncurated prompts (docs/benchmarks.md): printed with the table.
DEFAULT_REASON = (
    "Why plain GRPO is the default: on total campaign cost it beat every candidate stack in the default race, "
    "and at a FLOPs budget with 6 paired seeds no method beat it beyond noise in the per-mechanism benchmarks "
    "(DEPO's filter, its oracle included; D³S, which matches it per FLOP at 0.60x the update FLOPs per step). "
    "DAPO's dynamic sampling did (+0.37 points of area on DEPO's mixed d3+d5 pool); the demo does not run it "
    "(docs/benchmarks.md, 'Per-mechanism benchmarks').")

# Held-out pass@1 of the demo's base policy: the range over bootstrap seeds 0-4 and torch's
# default and fused Adam kernels (docs/benchmarks.md, "The base policy"), widened for the
# start evaluation's sampling noise. A policy outside it did not come from the recipe's usual
# trajectory, and the table's numbers are not comparable with the published ones.
BASE_PASS_AT_1_BAND = (0.50, 0.70)


def run_demo(cfg: DemoConfig, *, plan, context=None, out=print) -> dict:
    """Run ``plan`` (``recipes.campaigns.demo_campaign(cfg)``) in this process, then print the table."""
    from pipeline.eval.plots import plot_comparison
    from pipeline.eval.report import compare, format_comparison, load_results
    from pipeline.launch.campaign import run_campaign_inprocess
    from pipeline.launch.ledger import read_ledger

    started = time.perf_counter()
    out(f"campaign {plan.name}: {' → '.join(stage.name for stage in plan.order())}")
    result = run_campaign_inprocess(plan, context=context, out=out)
    if not result.ok:
        failed = [name for name, state in result.states.items() if state != "done"]
        raise RuntimeError(f"the campaign did not finish: {', '.join(failed)} (see {plan.output_dir}/status.json)")

    root = Path(cfg.output_dir)
    results = {variant: load_results(root / "eval" / variant / "results.json") for variant in VARIANTS}
    runs = {variant: _rl_summary(plan.stage(f"rl-{variant}").config) for variant in VARIANTS}
    ledger = read_ledger(plan)
    out("")
    out(describe_base_policy(runs["default"]["pass@1_start"], eval_set=plan.stage("rl-default").config.eval_set,
                             tiny=cfg.tiny))
    out(DEFAULT_REASON)
    for baseline, variant in COMPARISONS:
        out("")
        out(f"## {TITLES[variant]} vs {TITLES[baseline]}, {cfg.steps} RL steps each")
        out("")
        out(format_comparison(compare(results[baseline], results[variant], seed=0), label_a=baseline,
                              label_b=variant).rstrip())
    out("")
    for line in cost_table(ledger, runs):
        out(line)
    out("")
    out("Tokens are generated (sampled) tokens, plus the difficulty estimator's encoded tokens; a variant pays "
        "in full for the shared stages it depends on (curation for grpo and methods, and the estimator for "
        "methods; the default trains on the uncurated prompts and pays no tokens before RL). FLOPs count what "
        "the tokens cost (pipeline.stats.flops): generation, prefill, update and the estimator at its own size; "
        "before RL they include the bootstrap's supervised update, which every variant paid; ~ marks a count "
        "estimated from tokens or missing a part the stage did not record. The whole campaign: "
        f"{ledger.total:,} tokens, {ledger.flops.total_cell()} FLOPs (`winnow launch status {root}` prints the "
        "ledger per stage).")
    plot = plot_comparison({variant: results[variant] for variant in VARIANTS}, root / "pass_at_k.png")
    export = root / "export" / "default"
    answer = reload_and_answer(export, cfg.question, max_new_tokens=cfg.max_new_tokens)
    out("")
    out(f"exported Hugging Face model: {export}")
    out(f"reloaded with transformers; {cfg.question!r} → {answer!r}")
    out(f"plots: {plot}, {root}/rl/<variant>/plots/, {root}/curate/difficulty.png, "
        f"{root}/estimator/calibration.png")
    out(f"done in {time.perf_counter() - started:.0f} s")
    return {"results": results, "runs": runs, "answer": answer, "plot": str(plot)}


COST_HEADER = ("| run | paid before RL | rollout tokens | evaluation tokens | campaign tokens | tokens with gradient | "
               "zero-variance groups | prompts filtered | RL FLOPs | estimator FLOPs | campaign FLOPs | RL wall time |")


def cost_table(ledger, runs: dict[str, dict]) -> list[str]:
    """The variants' costs in tokens and FLOPs (the ledger's), beside each run's summary (``_rl_summary``);
    fills each run's ``campaign_tokens``, ``tokens_before_rl``, ``campaign_flops`` and ``estimator_flops``."""
    lines = [COST_HEADER, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for variant, run in runs.items():
        cost, rl = ledger.variant_cost(variant), ledger.stages[f"rl-{variant}"]
        flops = cost.flops
        run["campaign_tokens"], run["tokens_before_rl"] = cost.total, cost.before_rl
        run["campaign_flops"], run["estimator_flops"] = flops.total, flops.flops["estimator"]
        zero_share = f"{rl.zero_variance_groups / rl.groups:.0%}" if rl.groups else "—"
        lines.append(f"| {variant} | {cost.before_rl:,} | {run['tokens_generated']:,} | {cost.evaluation or 0:,} | "
                     f"{cost.total:,} | {run['tokens_with_gradient']:,} | {zero_share} | {run['prompts_filtered']:,} | "
                     f"{cost.flops_rl.total_cell()} | {flops.cell('estimator')} | {flops.total_cell()} | "
                     f"{run['seconds']:.0f} s |")
    return lines


def describe_base_policy(pass_at_1: float | None, *, eval_set: str, tiny: bool) -> str:
    """One line on the base policy's held-out score, and plainly what it means when outside the expected band."""
    if pass_at_1 is None:
        return "base policy: no held-out score recorded (the RL run's start evaluation is missing)"
    low, high = BASE_PASS_AT_1_BAND
    line = f"base policy: held-out pass@1 {pass_at_1:.3f} on {eval_set}"
    if tiny:
        return line + " (tiny demo: toy sizes, no expected band)"
    if low <= pass_at_1 <= high:
        return line + f", inside the expected {low:.2f}–{high:.2f}"
    return (line + f": OUTSIDE the expected {low:.2f}–{high:.2f} of the bootstrap seed study. The bootstrap took "
            "an unusual trajectory on this machine (its float rounding differs); the RL numbers below start from "
            "another base policy and are not comparable with the published demo table.")


def _rl_summary(cfg) -> dict:
    from pipeline.metrics import read_metrics

    rows = read_metrics(Path(cfg.logging.output_dir) / "metrics.jsonl")
    last = rows[-1]
    return {
        "tokens_generated": int(last["ledger/tokens_generated"]),
        "tokens_with_gradient": int(last["ledger/tokens_with_gradient"]),
        "prompts_filtered": int(last["ledger/prompts_filtered"]),
        "seconds": sum(v for row in rows[1:] for k, v in row.items() if k.startswith("time/")),
        "pass@1_start": rows[0].get("eval/pass@1"),
        "pass@1_end": last.get("eval/pass@1"),
    }


def reload_and_answer(folder: Path, question: str, *, max_new_tokens: int) -> str:
    """Load an exported folder with plain ``transformers`` (no winnow code) and answer greedily."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, trust_remote_code=False).eval()
    # The policy was trained on [bos] + question (``pipeline.models.tokenizer.encode_prompt``).
    ids = [tokenizer.bos_token_id, *tokenizer.encode(question, add_special_tokens=False)]
    input_ids = torch.tensor([ids])  # (1, T)
    output = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                            max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(output[0, len(ids):], skip_special_tokens=True)
