"""The campaign ledger on hand-made stage outputs: exact counts per stage, per variant and in total."""

from __future__ import annotations

import json

from pipeline.launch.ledger import read_ledger
from recipes.campaigns import cpu_campaign


def _write_rl_metrics(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def _ledger_row(step, *, generated, gradient, zero_variance, groups):
    return {"step": step, "ledger/tokens_generated": generated, "ledger/tokens_with_gradient": gradient,
            "ledger/prompts_filtered": 0, "ledger/samples_discarded": 0,
            "ledger/zero_variance_groups": zero_variance, "ledger/groups": groups}


def _write_campaign_outputs(plan, root):
    from pipeline.io import resolve_cache_dir
    from pipeline.stages.bootstrap import config_hash

    boot = plan.stage("bootstrap").config
    entry = resolve_cache_dir(boot.cache_dir) / config_hash(boot)
    entry.mkdir(parents=True)
    (entry / "summary.json").write_text(json.dumps({"trained_tokens": 12_345, "final_loss": 0.1}))
    (root / "curate").mkdir()
    (root / "curate" / "manifest.json").write_text(json.dumps({"num_generated_tokens": 100_000}))
    (root / "estimator").mkdir()
    (root / "estimator" / "calibration.json").write_text(
        json.dumps({"num_encoded_tokens": {"train": 3_000, "inference": 700}}))
    # Row 0 is the initial evaluation (no ledger); the counts are cumulative, the last step holds the run's.
    _write_rl_metrics(root / "rl" / "methods" / "metrics.jsonl", [
        {"step": 0, "eval/pass@1": 0.4},
        _ledger_row(1, generated=500, gradient=100, zero_variance=1, groups=4),
        {**_ledger_row(2, generated=1_100, gradient=210, zero_variance=1, groups=8), "depo/encoded_tokens": 40}])
    _write_rl_metrics(root / "rl" / "grpo" / "metrics.jsonl", [
        _ledger_row(1, generated=400, gradient=400, zero_variance=2, groups=4),
        _ledger_row(2, generated=800, gradient=800, zero_variance=5, groups=8)])
    with open(root / "rl" / "grpo" / "metrics.jsonl", "a") as file:
        file.write('{"step": 3, "ledger/tokens_gen')  # a running stage mid-way through appending a row
    # evaluate-methods records its count; evaluate-grpo only the mean per sample (older results.json).
    (root / "eval" / "methods").mkdir(parents=True)
    (root / "eval" / "methods" / "results.json").write_text(json.dumps({"benchmarks": {
        "a": {"num_generated_tokens": 64, "mean_generated_tokens": 8.0, "problems": {"n": [4, 4]}},
        "b": {"num_generated_tokens": 30, "mean_generated_tokens": 7.5, "problems": {"n": [2, 2]}}}}))
    (root / "eval" / "grpo").mkdir(parents=True)
    (root / "eval" / "grpo" / "results.json").write_text(json.dumps({"benchmarks": {
        "a": {"mean_generated_tokens": 6.25, "problems": {"n": [4, 4]}}}}))


def test_ledger_counts_every_stage_exactly(tmp_path):
    root = tmp_path / "campaign"
    plan = cpu_campaign(output_dir=root, tiny=True)
    _write_campaign_outputs(plan, root)
    ledger = read_ledger(plan)

    stages = ledger.stages
    assert list(stages) == [s.name for s in plan.order() if s.kind != "export"]
    assert (stages["bootstrap"].total, stages["bootstrap"].with_gradient) == (0, 12_345)
    assert stages["curate"].generated == 100_000
    assert stages["train-estimator"].encoded == 3_700 and stages["train-estimator"].generated == 0
    assert (stages["rl-methods"].generated, stages["rl-methods"].with_gradient) == (1_100, 210)
    assert (stages["rl-methods"].encoded, stages["rl-methods"].note) == (40, "")  # DEPO's online estimator
    assert (stages["rl-grpo"].zero_variance_groups, stages["rl-grpo"].groups) == (5, 8)
    assert stages["evaluate-methods"].generated == 94 and stages["evaluate-methods"].note == ""
    assert stages["evaluate-grpo"].generated == 50 and "no num_generated_tokens" in stages["evaluate-grpo"].note
    assert ledger.total == 100_000 + 3_700 + 1_100 + 40 + 800 + 94 + 50  # shared stages once

    # The methods variant filters with DEPO, so it paid for the estimator before RL; GRPO did not, and
    # the default, trained on the uncurated prompts, paid for neither (the bootstrap generates nothing).
    methods, grpo = ledger.variant_cost("methods"), ledger.variant_cost("grpo")
    assert (methods.before_rl, methods.rl, methods.evaluation, methods.total) == (103_700, 1_140, 94, 104_934)
    assert ledger.variant_cost("default").before_rl == 0
    assert (grpo.before_rl, grpo.rl, grpo.evaluation, grpo.total) == (100_000, 800, 50, 100_850)
    text = ledger.format()
    assert "campaign total" in text and "105,784" in text
    assert "variant methods: before RL 103,700 + RL 1,140 + evaluation 94 = 104,934" in text


def test_stages_not_run_yet_count_nothing_and_say_so(tmp_path):
    root = tmp_path / "campaign"
    plan = cpu_campaign(output_dir=root, tiny=True)
    (root / "curate").mkdir(parents=True)
    (root / "curate" / "manifest.json").write_text(json.dumps({"num_generated_tokens": 7}))
    (root / "estimator").mkdir()
    (root / "estimator" / "calibration.json").write_text(json.dumps({"history": []}))  # written before the count
    ledger = read_ledger(plan)
    assert ledger.stages["rl-grpo"].generated is None and ledger.stages["rl-grpo"].note == "not run yet"
    assert ledger.stages["train-estimator"].encoded is None
    assert "counted" in ledger.stages["train-estimator"].note
    assert ledger.total == 7 and ledger.variant_cost("grpo").total == 7
    assert "not run yet" in ledger.format()


def test_campaign_status_prints_the_ledger(tmp_path):
    from pipeline.launch.campaign import CampaignStatus

    plan = cpu_campaign(output_dir=tmp_path / "campaign", tiny=True)
    status = CampaignStatus(plan.output_dir)
    status.initialize(plan)
    text = status.format(plan)
    assert text.splitlines()[0].startswith("stage") and "pending" in text
    assert "campaign total" in text and "rl-grpo" in text.split("campaign total")[0].split("tokens")[-1]
