"""The planner's DEPO estimator: its FLOPs, time and memory on rank 0, and where they enter the plan."""

from __future__ import annotations

import argparse
import json
import shutil
import zipfile
from pathlib import Path

import pytest

from pipeline.launch import plan as P

FIXTURES = Path(__file__).resolve().parents[2] / "pipeline" / "models" / "published" / "configs"
ARGS = argparse.Namespace(gpu="h100", nodes=None, rollout_nodes=None, servers_per_node=None, server_tp=None,
                          distributed_optimizer=None, recompute=None, prompt_tokens=1024, mfu=0.35,
                          rollout_mfu=0.10, response_fraction=None)
SERVERS = dict(trainer_nodes=2, gpus_per_node=8, rollout_nodes=1, servers_per_node=8)


def dims(name: str) -> P.ModelDims:
    return P.ModelDims.from_hf_config(FIXTURES / f"{name}.json")


def small_estimator() -> P.EstimatorWorkload:
    # One layer, h = 4, I = 8: N = 4·4² + 2·4·8 = 128 matmul weights.
    encoder = P.EstimatorEncoder(name="toy", hidden_size=4, intermediate_size=8, num_layers=1, vocab_size=10,
                                 max_position_embeddings=16, type_vocab_size=2, max_length=10)
    return P.EstimatorWorkload(encoder=encoder, source="hand", candidates=11, minibatches=2, minibatch_size=3,
                               question_tokens=10, question_tokens_source="hand")


def qwen_inputs(estimator: P.EstimatorWorkload | None, **workload) -> P.PlanInputs:
    return P.PlanInputs(
        dims=dims("Qwen2.5-Math-7B"), layout=P.Layout(tensor_parallel=4, data_parallel=4), trainer=P.TrainerSettings(),
        workload=P.Workload(prompts_per_step=128, trained_per_prompt=8, sampled_per_prompt=8, in_flight_per_prompt=8,
                            prompt_tokens=512, max_new_tokens=3072, steps=100, **workload),
        cluster=P.Cluster(gpu=P.GPUS["h100"], **SERVERS), estimator=estimator)


def test_a_hand_computed_step_of_the_estimator():
    estimator = small_estimator()
    assert estimator.encoder.forward_cost().matmul_parameters == 128
    # 2·N·T̄ = 2·128·10 = 2,560 FLOPs a question read once: 11 scored, 2 × 3 trained at 3 forwards each.
    assert P.estimator_step_flops(estimator) == (2560 * 11, 2560 * 18)
    # η·P = 0.3 × 67e12: 74,240 FLOPs take 74,240 / 2.01e13 s.
    time = P.time_plan(qwen_inputs(estimator))
    assert time.estimator_flops == 74_240
    assert time.estimator_score_s == pytest.approx(28_160 / 2.01e13, rel=1e-12)
    assert time.estimator_train_s == pytest.approx(46_080 / 2.01e13, rel=1e-12)


def test_the_staged_h100_default_costs_3_5_teraflops_and_0_17_s_a_step():
    """MiniLM at T̄ = 256: 2 × 10,616,832 × 256 × (3·4·32 + 256) FLOPs, at 30% of 67 TFLOPS."""
    encoder = P.ESTIMATOR_ENCODERS["minilm"]
    estimator = P.EstimatorWorkload(encoder=encoder, source="-", candidates=256, minibatches=4, minibatch_size=32,
                                    question_tokens=256, question_tokens_source="-")
    score, train = P.estimator_step_flops(estimator)
    assert score + train == 2 * 10_616_832 * 256 * (3 * 4 * 32 + 256) == pytest.approx(3.479e12, rel=1e-3)
    assert P.time_plan(qwen_inputs(estimator)).estimator_s == pytest.approx(0.173, abs=5e-4)
    assert P.GPUS["h100"].peak_fp32_tflops == P.GPUS["h200"].peak_fp32_tflops == 67.0


def test_the_estimator_adds_to_the_step_and_only_its_training_overlaps():
    base, depo = P.time_plan(qwen_inputs(None)), P.time_plan(qwen_inputs(small_estimator()))
    assert base.estimator_s == 0 and base.step_s == base.train_s + base.rollout_s + base.sync_s
    assert depo.step_s == pytest.approx(base.step_s + depo.estimator_s, rel=1e-12)
    assert depo.estimator_added_s == pytest.approx(depo.estimator_s, rel=1e-9)
    # One step off policy: scoring still precedes the launch; training is on the update's side of the max.
    ahead = P.time_plan(qwen_inputs(small_estimator(), max_staleness=1))
    assert ahead.overlapped and ahead.rollout_s > ahead.train_s + ahead.estimator_train_s
    assert ahead.step_s == pytest.approx(ahead.rollout_s + ahead.estimator_score_s + ahead.sync_s, rel=1e-12)
    assert ahead.estimator_added_s == pytest.approx(ahead.estimator_score_s, rel=1e-6)


def test_the_estimator_state_is_on_rank_0s_stage_only():
    estimator = small_estimator()
    inputs = P.replace(qwen_inputs(estimator), layout=P.Layout(tensor_parallel=4, pipeline_parallel=2, data_parallel=2))
    with_estimator, without = P.memory_plan(inputs), P.memory_plan(P.replace(inputs, estimator=None))
    assert [stage.estimator_state for stage in with_estimator] == [16 * estimator.encoder.num_parameters(), 0]
    assert with_estimator[0].total == without[0].total + 16 * estimator.encoder.num_parameters()
    assert with_estimator[1].total == without[1].total


def test_the_encoder_table_is_what_the_estimator_builds():
    """Dimensions, parameters and FLOP weights of the fresh encoders against the models themselves."""
    import torch

    from pipeline.estimator.model import DifficultyEstimator, minilm_zip_path

    tiny = DifficultyEstimator.tiny()
    described = P.EstimatorEncoder.from_description(tiny.describe(), name="tiny")
    assert described == P.ESTIMATOR_ENCODERS["tiny"]
    assert described.num_parameters() == sum(p.numel() for p in tiny.parameters())

    from transformers import BertConfig, BertModel

    with zipfile.ZipFile(minilm_zip_path()) as archive:
        config = json.loads(archive.read("config.json"))
    minilm = P.ESTIMATOR_ENCODERS["minilm"]
    assert P.EstimatorEncoder.from_description({"bert_config": config, "max_length": 256},
                                               name=minilm.name) == minilm
    with torch.device("meta"):
        encoder = BertModel(BertConfig(**config), add_pooling_layer=False)  # as from_pretrained_minilm builds it
    heads = 3 * (config["hidden_size"] + 1)
    assert minilm.num_parameters() == sum(p.numel() for p in encoder.parameters()) + heads == 22_566_531
    layers = sum(p.numel() for name, p in encoder.named_parameters() if name.startswith("encoder."))
    matmuls = sum(p.numel() for name, p in encoder.named_parameters()
                  if name.startswith("encoder.") and name.endswith(".weight") and p.dim() == 2)
    assert (layers, matmuls) == (10_646_784, 10_616_832) and minilm.forward_cost().matmul_parameters == matmuls
    state = P.EstimatorWorkload(encoder=minilm, source="-", candidates=1, minibatches=1, minibatch_size=2,
                                question_tokens=1, question_tokens_source="-").state_bytes
    assert state == 361_064_496  # 344 MiB


def test_the_estimator_comes_from_the_config_a_saved_folder_or_the_stage_that_trains_it(tmp_path):
    from pipeline.config import RLConfig
    from pipeline.estimator.model import DifficultyEstimator
    from pipeline.rl.sampling import DepoFilter
    from recipes.campaigns import qwen25_math_7b

    cfg = RLConfig(prompts_per_step=7)
    assert P.estimator_from_rl(cfg) is None
    cfg.algorithm.prompt_filter = "depo"
    cfg.algorithm.depo = P.replace(cfg.algorithm.depo, encoder="tiny", oversample=1.5, minibatches=2, minibatch_size=3)
    fresh = P.estimator_from_rl(cfg)
    assert (fresh.candidates, fresh.minibatches, fresh.minibatch_size, fresh.question_tokens) == (11, 2, 3, 128)
    assert fresh.candidates == DepoFilter.num_candidates(argparse.Namespace(cfg=cfg.algorithm.depo), 7)
    assert fresh.encoder == P.ESTIMATOR_ENCODERS["tiny"] and fresh.source == "fresh: algorithm.depo.encoder=tiny"

    saved = DifficultyEstimator.tiny(hidden=16, layers=3, max_length=64).save(tmp_path / "estimator")
    cfg.algorithm.depo = P.replace(cfg.algorithm.depo, estimator_dir=str(saved))
    loaded = P.estimator_from_rl(cfg)
    assert (loaded.encoder.hidden_size, loaded.encoder.num_layers, loaded.question_tokens) == (16, 3, 64)
    assert loaded.encoder.name == "tiny" and loaded.source == f"read from {saved}"

    cfg.algorithm.depo = P.replace(cfg.algorithm.depo, estimator_dir=str(tmp_path / "absent"))
    unread = P.estimator_from_rl(cfg)
    assert unread.encoder == P.ESTIMATOR_ENCODERS["tiny"] and "cannot be read here" in unread.source

    campaign = qwen25_math_7b(output_dir=tmp_path / "run")
    stages = {stage.name: stage for stage in campaign.stages}
    trained = P.estimator_from_rl(stages["rl-default"].config, campaign=campaign)
    assert trained.source == "trained by stage train-estimator"
    assert trained.encoder == P.replace(P.ESTIMATOR_ENCODERS["minilm"],
                                        max_length=stages["train-estimator"].config.max_length)
    assert P.estimator_from_rl(stages["rl-grpo"].config, campaign=campaign) is None


def _plan(preset: str, model: str, *overrides: str):
    from pipeline import configlib
    from pipeline.cli.plan import format_plan, stage_inputs
    from pipeline.config import Resources, RLConfig, RolloutServers
    from recipes import papers

    cfg = configlib.load(RLConfig, base=papers.build(preset), overrides=list(overrides))
    resources = Resources(nodes=2, ranks_per_node=8, gpus_per_node=8,
                          rollout=RolloutServers(nodes=1, servers_per_node=8))
    inputs = stage_inputs(cfg, dims(model), resources=resources, args=ARGS, num_runs=1, gpus_per_node=8)
    result = P.plan(inputs)
    return inputs, result, format_plan(result, title=preset)


def test_a_depo_presets_plan_prints_the_estimator_and_times_the_step_with_it():
    inputs, result, printed = _plan("depo_qwen25_7b_instruct", "Qwen2.5-7B-Instruct")
    time = result.time
    assert inputs.estimator is not None and time.estimator_s == pytest.approx(0.173, abs=5e-4)
    line = next(line for line in printed.splitlines() if line.startswith("DEPO estimator"))
    assert "all-MiniLM-L6-v2" in line and "rank 0's GPU" in line and "3.48e+12 FLOPs a step" in line
    assert "2·N·T̄·(3·4·32 trained + 256 scored)" in line and "N = 10,616,832" in line and "T̄ = 256" in line
    assert "0.17 s at 30% of 67 TFLOPS fp32 peak (assumed)" in line and "critical path" in line
    assert f"{time.estimator_s / time.step_s:.2%} of the step" in line
    assert "estimator (fp32)      0.34" in printed
    without = P.plan(P.replace(inputs, estimator=None))
    assert time.step_s == pytest.approx(without.time.step_s + time.estimator_s, rel=1e-12)
    assert result.gpu_hours == pytest.approx(without.gpu_hours * time.step_s / without.time.step_s, rel=1e-12)
    assert result.worst.total == without.worst.total + 361_064_496


def test_a_plan_without_depo_is_unchanged():
    inputs, result, printed = _plan("d3s_qwen25_math_7b", "Qwen2.5-Math-7B")
    assert inputs.estimator is None and "estimator" not in printed.lower()
    time = result.time
    assert time.estimator_flops == 0 and time.step_s == time.train_s + time.rollout_s + time.sync_s
    assert all(stage.estimator_state == 0 for stage in result.stages)
    table = printed.split("per GPU, GiB")[1].split("total")[0]
    assert [line[:16].strip() for line in table.strip().splitlines()[1:]] == [
        "weights", "gradients", "optimizer", "activations", "no recompute", "full recompute", "log-prob head",
        "reference", "generator (fp32)"]


def test_winnow_plan_and_the_launch_check_show_the_campaigns_trained_estimator(tmp_path, capsys):
    from pipeline.cli import main
    from pipeline.cli.plan import check_campaign_plan
    from recipes.campaigns import qwen25_math_7b

    assert main(["plan", "--model", str(FIXTURES / "Qwen2.5-Math-7B.json"), "--recipe", "qwen25-math-7b"]) == 0
    plans = capsys.readouterr().out.split("plan: ")
    default = next(plan for plan in plans if plan.startswith("rl-default"))
    grpo = next(plan for plan in plans if plan.startswith("rl-grpo"))
    assert "DEPO estimator (all-MiniLM-L6-v2, trained by stage train-estimator;" in default
    assert "estimator" not in grpo.lower()

    folder = tmp_path / "Qwen2.5-Math-7B"
    folder.mkdir()
    shutil.copy(FIXTURES / "Qwen2.5-Math-7B.json", folder / "config.json")
    printed: list[str] = []
    args = argparse.Namespace(**{**vars(ARGS), "force": False, "skip_plan_check": False})
    check_campaign_plan(qwen25_math_7b(output_dir=tmp_path / "run", model_dir=str(folder)), args, out=printed.append)
    assert sum("trained by stage train-estimator" in text for text in printed) == 1
