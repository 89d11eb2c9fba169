"""`winnow demo` end to end on the tiny campaign: every stage runs, the table and the reload work."""

from __future__ import annotations

import pytest

from tests.distributed_utils import run_distributed


def _demo_worker(rank, world_size, tmp):
    from pipeline import configlib
    from pipeline.config import DemoConfig
    from pipeline.launch.demo import run_demo
    from pipeline.parallel.context import ParallelContext
    from recipes.campaigns import demo_campaign

    cfg = configlib.load(DemoConfig, overrides=[
        f"output_dir={tmp}/demo", "tiny=true", "steps=2", 'benchmarks=["arith?difficulty=3&size=40", "gsm8k"]',
        "eval_limit=4", "eval_samples=2", "ks=[1, 2]", "max_new_tokens=8",
    ])
    context = ParallelContext.initialize(tensor_parallel=1, pipeline_parallel=1, seed=0)
    first: list[str] = []
    result = run_demo(cfg, plan=demo_campaign(cfg), context=context, out=first.append)
    again: list[str] = []
    run_demo(cfg, plan=demo_campaign(cfg), context=context, out=again.append)  # everything done: only the report
    return result, first, again


@pytest.mark.slow
def test_demo_runs_the_campaign_and_reports(tmp_path):
    result, first, again = run_distributed(_demo_worker, world_size=1, args=(str(tmp_path),))[0]
    text = "\n".join(first)
    for stage in ("bootstrap", "curate", "train-estimator", "rl-default", "rl-grpo", "rl-methods", "evaluate-default",
                  "export-default"):
        assert f"] {stage} (" in text, text
    assert "| benchmark | metric | default | methods | methods − default |" in text
    assert "| benchmark | metric | default | grpo | grpo − default |" in text
    assert ("| run | paid before RL | rollout tokens | evaluation tokens | campaign tokens | tokens with gradient | "
            "zero-variance groups | prompts filtered | RL FLOPs | estimator FLOPs | campaign FLOPs | "
            "RL wall time |") in text
    assert "base policy: held-out pass@1" in text and "tiny demo" in text
    assert "Why plain GRPO is the default" in text  # the demo states why its default is what it is
    assert "reloaded with transformers" in text
    assert isinstance(result["answer"], str)
    assert set(result["runs"]) == {"default", "grpo", "methods"}
    assert all(run["tokens_generated"] > 0 for run in result["runs"].values())
    # The default trains on the uncurated prompts and pays nothing before RL; GRPO pays the curation,
    # the methods stack (DEPO) also the estimator.
    runs = result["runs"]
    assert runs["methods"]["tokens_before_rl"] > runs["grpo"]["tokens_before_rl"] > runs["default"]["tokens_before_rl"]
    assert runs["default"]["tokens_before_rl"] == 0
    assert all(run["campaign_tokens"] > run["tokens_before_rl"] + run["tokens_generated"] for run in runs.values())
    # Every RL run counted its FLOPs; the methods stack's estimator (DEPO) cost FLOPs, the others' none.
    assert all(run["campaign_flops"] > 0 for run in runs.values())
    assert runs["methods"]["estimator_flops"] > 0 and runs["default"]["estimator_flops"] == 0
    gsm8k = result["results"]["default"]["benchmarks"]["gsm8k"]
    assert gsm8k["num_problems"] + gsm8k["num_too_long"] == 4  # honestly counted, not silently dropped
    assert (tmp_path / "demo" / "pass_at_k.png").is_file()
    assert sum("done before, skipped" in line for line in again) == 12


def test_base_policy_line_says_plainly_when_outside_the_band():
    from pipeline.launch.demo import BASE_PASS_AT_1_BAND, describe_base_policy

    low, high = BASE_PASS_AT_1_BAND
    inside = describe_base_policy((low + high) / 2, eval_set="arith", tiny=False)
    assert "inside the expected" in inside and "OUTSIDE" not in inside
    for score in (low - 0.01, high + 0.01):
        assert "OUTSIDE the expected" in describe_base_policy(score, eval_set="arith", tiny=False)
        assert "not comparable" in describe_base_policy(score, eval_set="arith", tiny=False)
    assert "OUTSIDE" not in describe_base_policy(0.0, eval_set="arith", tiny=True)
    assert "no held-out score" in describe_base_policy(None, eval_set="arith", tiny=False)


def test_the_cost_table_shows_flops_per_variant_beside_tokens(tmp_path, monkeypatch):
    import json

    from pipeline.launch.demo import COST_HEADER, cost_table
    from pipeline.launch.ledger import read_ledger
    from recipes.campaigns import cpu_campaign
    from tests.launch.test_ledger import _flops_row, _ledger_row, _write_campaign_outputs, _write_estimator

    monkeypatch.setenv("WINNOW_CACHE", str(tmp_path / "cache"))
    root = tmp_path / "campaign"
    plan = cpu_campaign(output_dir=root, tiny=False)
    root.mkdir()
    _write_campaign_outputs(plan, root)
    _write_estimator(root)
    (root / "rl" / "default").mkdir(parents=True)
    (root / "rl" / "default" / "metrics.jsonl").write_text(json.dumps(
        {**_ledger_row(2, generated=600, gradient=300, zero_variance=1, groups=8),
         **_flops_row(2, flops={"generation": 1e9, "prefill": 1e8, "update": 4e9, "estimator": 0.0},
                      tokens={"generation": 600, "prefill": 90, "update": 700, "estimator": 0})}) + "\n")
    ledger = read_ledger(plan)
    summary = {"tokens_generated": 10, "tokens_with_gradient": 5, "prompts_filtered": 0, "seconds": 3.0}
    runs = {variant: dict(summary) for variant in ("default", "grpo", "methods")}
    lines = cost_table(ledger, runs)
    assert lines[0] == COST_HEADER and "RL FLOPs" in COST_HEADER and "campaign tokens" in COST_HEADER
    default = next(line for line in lines if line.startswith("| default |"))
    # The default's RL run counted its own FLOPs (exact); before RL it paid the bootstrap's update, estimated.
    bootstrap = ledger.stages["bootstrap"].flops.total
    assert "| 5.10e9 | 0 | ~" in default and runs["default"]["campaign_flops"] == bootstrap + 5.1e9
    methods = next(line for line in lines if line.startswith("| methods |"))
    assert runs["methods"]["estimator_flops"] == ledger.stages["train-estimator"].flops.flops["estimator"]
    assert "n/a" not in methods.split("|")[10]  # the estimator's FLOPs, at its own size
