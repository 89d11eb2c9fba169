"""The campaign ledger on hand-made stage outputs: exact counts per stage, per variant and in total, in
tokens and in FLOPs."""

from __future__ import annotations

import json

import pytest

from pipeline.launch.ledger import read_ledger
from pipeline.launch.plan import bootstrap_model_dims
from pipeline.stats import flops as F
from recipes.campaigns import cpu_campaign

# The estimator's tiny encoder (DifficultyEstimator.tiny): BERT, 2 layers of width 32, FFN 128.
TINY_BERT = {"hidden_size": 32, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2}


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


def _flops_row(step, *, flops, tokens, counted_from=1):
    """The cumulative FLOP count an RL run's row carries (``pipeline.rl.step.count_step_flops``)."""
    row = {f"flops/cumulative/{category}": flops[category] for category in F.CATEGORIES}
    row |= {f"tokens/cumulative/{category}": tokens[category] for category in F.CATEGORIES}
    return {**row, "step": step, "flops/cumulative/total": sum(flops.values()), "flops/counted_from_step": counted_from}


def _write_estimator(root):
    (root / "estimator" / "estimator").mkdir()
    (root / "estimator" / "estimator" / "estimator.json").write_text(json.dumps(
        {"format": 1, "kind": "tiny", "max_length": 128, "tokenizer": "bytes", "bert_config": TINY_BERT}))


def test_ledger_counts_flops_by_category_and_the_estimator_at_its_own_size(tmp_path, monkeypatch):
    monkeypatch.setenv("WINNOW_CACHE", str(tmp_path / "cache"))  # the hand-made bootstrap entry stays here
    root = tmp_path / "campaign"
    plan = cpu_campaign(output_dir=root, tiny=False)  # the demo's policy: 843,776 matmul weights
    root.mkdir()
    _write_campaign_outputs(plan, root)
    _write_estimator(root)
    methods_flops = {"generation": 4e9, "prefill": 5e8, "update": 2e10, "estimator": 3e6}
    methods_tokens = {"generation": 1_100, "prefill": 300, "update": 900, "estimator": 40}
    _write_rl_metrics(root / "rl" / "methods" / "metrics.jsonl", [
        {**_ledger_row(2, generated=1_100, gradient=210, zero_variance=1, groups=8), "depo/encoded_tokens": 40,
         **_flops_row(2, flops=methods_flops, tokens=methods_tokens)}])
    ledger = read_ledger(plan)
    stages = ledger.stages
    policy = bootstrap_model_dims(plan.stage("bootstrap").config).forward_cost()
    assert policy.matmul_parameters == 843_776

    # The estimator read 3,000 tokens training (forward + backward) and 700 scoring, at its own 49,152 FLOPs
    # a forward per token: about 3% of what a generated policy token costs here, not 100%.
    estimator = stages["train-estimator"].flops
    assert estimator.flops == {"generation": 0, "prefill": 0, "update": 0, "estimator": 49_152 * (3 * 3_000 + 700)}
    assert estimator.tokens == {"estimator": 3_700} and not estimator.total_is_approximate
    per_policy_token = stages["curate"].flops.flops["generation"] / stages["curate"].generated
    assert per_policy_token == 2 * 843_776
    assert F.estimator_flops(F.ForwardCost.from_bert_config(TINY_BERT), {"inference": 1}) / per_policy_token == \
        pytest.approx(0.029, abs=0.001)

    # Stages that recorded only tokens: estimated (~), prefill n/a; the run with its own count: exact.
    curate = stages["curate"].flops
    assert curate.flops["prefill"] is None and curate.approximate == {"generation"}
    assert stages["bootstrap"].flops.flops["update"] == 3 * 2 * 843_776 * 12_345
    assert stages["rl-methods"].flops.flops == methods_flops and stages["rl-methods"].flops.tokens == methods_tokens
    assert not stages["rl-methods"].flops.total_is_approximate and stages["rl-methods"].flops_note == ""
    grpo = stages["rl-grpo"].flops  # a run from before the count
    assert grpo.flops == {"generation": 2 * 843_776 * 800, "prefill": None, "update": None, "estimator": 0}
    assert "before the FLOP count" in stages["rl-grpo"].flops_note

    # A variant pays the bootstrap's update, and what its rl stage depended on, in full.
    methods = ledger.variant_cost("methods")
    before = sum(stages[name].flops.total for name in ("bootstrap", "curate", "train-estimator"))
    assert methods.flops_before_rl.total == pytest.approx(before, rel=1e-12)
    assert methods.flops.flops["estimator"] == estimator.flops["estimator"] + 3e6
    assert methods.flops.flops["prefill"] == 5e8 and "prefill" in methods.flops.approximate  # curation's is n/a
    assert ledger.variant_cost("default").flops_before_rl.total == stages["bootstrap"].flops.total
    text = ledger.format()
    assert "FLOPs" in text and "campaign total" in text.split("FLOPs")[1]
    assert f"{'rl-methods':<22} {'4.00e9':>11} {'5.00e8':>11} {'2.00e10':>11} {'3.00e6':>11} {'2.45e10':>11}" in text
    assert "tokens: generation 1,100, prefill 300, update 900, estimator 40" in text  # beside the FLOPs
    assert "  FLOPs: before RL ~" in text and "estimator" in text


def test_a_run_resumed_without_a_count_says_from_when_it_counted(tmp_path):
    root = tmp_path / "campaign"
    plan = cpu_campaign(output_dir=root, tiny=True)
    flops = dict.fromkeys(F.CATEGORIES, 1e6)
    _write_rl_metrics(root / "rl" / "grpo" / "metrics.jsonl", [
        {**_ledger_row(9, generated=900, gradient=90, zero_variance=0, groups=8),
         **_flops_row(9, flops=flops, tokens=dict.fromkeys(F.CATEGORIES, 10), counted_from=5)}])
    stage = read_ledger(plan).stages["rl-grpo"]
    assert stage.flops.total == 4e6 and stage.flops.total_is_approximate
    assert "counted from step 5" in stage.flops_note and stage.flops.cell("update") == "~1.00e6"


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
    # FLOPs: a stage not run has spent nothing yet (—); one that ran without a count is n/a, never a crash.
    assert ledger.stages["rl-grpo"].flops.pending and ledger.stages["rl-grpo"].flops.cell("update") == "—"
    assert ledger.stages["train-estimator"].flops.total is None
    assert ledger.stages["train-estimator"].flops.cell("estimator") == "n/a"
    assert ledger.variant_cost("grpo").flops.total_cell().startswith("~")
    assert "n/a" in ledger.format().split("FLOPs")[1]


def test_campaign_status_prints_the_ledger(tmp_path):
    from pipeline.launch.campaign import CampaignStatus

    plan = cpu_campaign(output_dir=tmp_path / "campaign", tiny=True)
    status = CampaignStatus(plan.output_dir)
    status.initialize(plan)
    text = status.format(plan)
    assert text.splitlines()[0].startswith("stage") and "pending" in text
    assert "campaign total" in text and "rl-grpo" in text.split("campaign total")[0].split("tokens")[-1]
