"""`winnow demo`: the whole campaign on a CPU, then a results table.

The campaign is ``recipes.campaigns.demo_campaign`` (``cpu_campaign`` with the demo's
evaluation settings), built by the CLI and run in this process
(``pipeline.launch.campaign.run_campaign_inprocess``), the same plan that
``winnow launch campaign --recipe cpu`` runs as separate jobs:

1. bootstrap the base policy (tokenizer + supervised Megatron actor; cached by config hash);
2. curate: k samples per training prompt, keep those of useful difficulty;
3. train the DEPO difficulty estimator on the curation's pass rates;
4. RL twice from the same base and budget: the combined default (DEPO + Ada-Seq-BALANCE +
   D³S + CW-GRPO + E3 temperature) and plain GRPO;
5. evaluate both: unbiased pass@1…pass@32 on held-out synthetic sets, GSM8K and MATH-500
   (reported honestly: a model this small scores ~0 there, and most of their problems
   do not fit its context);
6. export both to Hugging Face folders, reload the default one with ``transformers``
   and let it answer a question.

Stages already done are skipped on a rerun, so a second ``winnow demo`` only prints.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from pipeline.config import DemoConfig

VARIANTS = ("grpo", "default")  # baseline first: the table's differences are default − grpo


def run_demo(cfg: DemoConfig, *, plan, context=None, out=print) -> dict:
    """Run ``plan`` (``recipes.campaigns.demo_campaign(cfg)``) in this process, then print the table."""
    from pipeline.eval.plots import plot_comparison
    from pipeline.eval.report import compare, format_comparison, load_results
    from pipeline.launch.campaign import run_campaign_inprocess

    started = time.perf_counter()
    out(f"campaign {plan.name}: {' → '.join(stage.name for stage in plan.order())}")
    result = run_campaign_inprocess(plan, context=context, out=out)
    if not result.ok:
        failed = [name for name, state in result.states.items() if state != "done"]
        raise RuntimeError(f"the campaign did not finish: {', '.join(failed)} (see {plan.output_dir}/status.json)")

    root = Path(cfg.output_dir)
    results = {variant: load_results(root / "eval" / variant / "results.json") for variant in VARIANTS}
    runs = {variant: _rl_summary(plan.stage(f"rl-{variant}").config) for variant in VARIANTS}
    out("")
    out(f"## default (DEPO + Ada-Seq-BALANCE + D³S + CW-GRPO + E3) vs GRPO, {cfg.steps} RL steps each")
    out("")
    out(format_comparison(compare(results["grpo"], results["default"], seed=0), label_a="grpo",
                          label_b="default").rstrip())
    out("")
    out("| run | rollout tokens | tokens with gradient | prompts filtered | RL wall time |")
    out("|---|---:|---:|---:|---:|")
    for variant, run in runs.items():
        out(f"| {variant} | {run['tokens_generated']:,} | {run['tokens_with_gradient']:,} | "
            f"{run['prompts_filtered']:,} | {run['seconds']:.0f} s |")
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
