"""The planner: its formulas against the papers, the published parameter counts, and every H100 preset."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import pytest

from pipeline.launch import plan as P

FIXTURES = Path(__file__).resolve().parents[2] / "pipeline" / "models" / "published" / "configs"
# The model each preset's backbone shares an architecture with (pipeline/models/published/README.md).
PRESET_FIXTURES = {
    "qwen25_math_7b": "Qwen2.5-Math-7B", "qwen25_math_7b_instruct": "Qwen2.5-Math-7B",
    "qwen25_math_1p5b": "Qwen2.5-Math-1.5B", "llama31_8b_instruct": "Llama-3.1-8B",
    "openmath2_llama31_8b": "Llama-3.1-8B", "qwen3_4b_instruct": "Qwen3-4B",
    "llama32_3b_instruct": "Llama-3.2-3B-Instruct", "r1_distill_qwen_1p5b": "DeepSeek-R1-Distill-Qwen-1.5B",
    "r1_distill_qwen_7b": "DeepSeek-R1-Distill-Qwen-7B", "qwen25_1p5b_instruct": "Qwen2.5-1.5B-Instruct",
    "qwen25_7b_instruct": "Qwen2.5-7B-Instruct",
}
CAMPAIGN_FIXTURES = {"qwen25-math-7b": "Qwen2.5-Math-7B", "qwen25-math-1.5b": "Qwen2.5-Math-1.5B",
                     "llama31-8b": "Llama-3.1-8B"}
ARGS = argparse.Namespace(gpu="h100", nodes=None, rollout_nodes=None, servers_per_node=None, server_tp=None,
                          distributed_optimizer="off", recompute="none", prompt_tokens=1024, mfu=0.35,
                          rollout_mfu=0.10, response_fraction=1.0)


def dims(name: str) -> P.ModelDims:
    return P.ModelDims.from_hf_config(FIXTURES / f"{name}.json")


@pytest.mark.parametrize(("name", "published"), [
    ("Qwen2.5-Math-1.5B", 1_543_714_304), ("Qwen2.5-Math-7B", 7_615_616_512), ("Llama-3.1-8B", 8_030_261_248),
    ("Qwen3-4B", 4_022_468_096), ("Qwen3-8B", 8_190_735_360),
    # The sizes the model cards state, to their three significant figures.
    ("DeepSeek-R1-Distill-Qwen-1.5B", 1.78e9), ("DeepSeek-R1-Distill-Qwen-7B", 7.62e9),
    ("Qwen2.5-1.5B-Instruct", 1.54e9), ("Qwen2.5-7B-Instruct", 7.62e9), ("Llama-3.2-3B-Instruct", 3.21e9),
])
def test_parameter_counts_match_the_published_models(name, published):
    if isinstance(published, int):
        assert dims(name).num_parameters() == published
    else:
        assert dims(name).num_parameters() == pytest.approx(published, rel=0.005)


def test_qwen3_counts_its_per_head_q_and_k_norms():
    qwen3 = dims("Qwen3-8B")
    without = P.ModelDims(**{**{f: getattr(qwen3, f) for f in qwen3.__slots__}, "qk_norm": False})
    assert qwen3.num_parameters() - without.num_parameters() == qwen3.num_layers * 2 * qwen3.head_dim


def test_model_states_reproduce_the_zero_papers_7_5b_figure():
    # ZeRO (Rajbhandari et al.) Fig. 1: Ψ = 7.5B, N_d = 64, fp16 grads, K = 12: 120 GB without
    # partitioning, 31.4 GB with P_os.
    psi = 7_500_000_000
    zero = P.TrainerSettings(grad_bytes=2, distributed_optimizer=False)
    assert sum(P.model_state_bytes(psi, trainer=zero, data_parallel=64)) == 120e9
    sharded = P.TrainerSettings(grad_bytes=2, distributed_optimizer=True)
    assert sum(P.model_state_bytes(psi, trainer=sharded, data_parallel=64)) / 1e9 == pytest.approx(31.4, abs=0.05)


def test_korthikanti_equations():
    s, b, h, a = 2048, 1, 12288, 96  # GPT-3 175B's layer
    assert P.korthikanti_gpt_layer_bytes(s=s, b=b, h=h, a=a) == int(s * b * h * (34 + 5 * a * s / h))
    assert P.korthikanti_gpt_layer_bytes(s=s, b=b, h=h, a=a, t=8) == int(s * b * h * (10 + 24 / 8 + 5 * a * s / (h * 8)))
    assert P.korthikanti_gpt_layer_bytes(s=s, b=b, h=h, a=a, t=8, sequence_parallel=True,
                                         recompute="selective") == int(s * b * h * 34 / 8)
    assert P.korthikanti_gpt_layer_bytes(s=s, b=b, h=h, a=a, recompute="full") == 2 * s * b * h


def test_bubble_and_kv_bytes_per_token():
    assert P.pipeline_bubble(4, 12) == pytest.approx(3 / 15)
    assert P.pipeline_bubble(1, 5) == 0
    inputs = P.PlanInputs(
        dims=dims("Qwen2.5-Math-7B"), layout=P.Layout(data_parallel=8), trainer=P.TrainerSettings(),
        workload=P.Workload(prompts_per_step=8, trained_per_prompt=8, sampled_per_prompt=8, in_flight_per_prompt=8,
                            prompt_tokens=512, max_new_tokens=1024, steps=1),
        cluster=P.Cluster(gpu=P.GPUS["h100"], trainer_nodes=1, gpus_per_node=8, rollout_nodes=1, servers_per_node=8))
    assert P.kv_cache_plan(inputs).bytes_per_token == 2 * 28 * 4 * 128 * 2


def test_one_step_off_policy_overlaps_generation_with_the_update_only_on_servers_of_their_own():
    workload = P.Workload(prompts_per_step=128, trained_per_prompt=8, sampled_per_prompt=8, in_flight_per_prompt=8,
                          prompt_tokens=512, max_new_tokens=3072, steps=100)
    separate = P.PlanInputs(
        dims=dims("Qwen2.5-Math-7B"), layout=P.Layout(tensor_parallel=4, data_parallel=4), trainer=P.TrainerSettings(),
        workload=workload, cluster=P.Cluster(gpu=P.GPUS["h100"], trainer_nodes=2, gpus_per_node=8, rollout_nodes=1,
                                             servers_per_node=8))
    synchronous = P.plan(separate)
    ahead = P.plan(P.replace(separate, workload=P.replace(workload, max_staleness=1)))
    time = ahead.time
    assert not synchronous.time.overlapped
    assert synchronous.time.step_s == time.train_s + time.rollout_s + time.sync_s
    # The push waits for the batch in flight: never overlapped.
    assert time.overlapped and time.step_s == max(time.train_s, time.rollout_s) + time.sync_s < synchronous.time.step_s
    assert ahead.gpu_hours / synchronous.gpu_hours == pytest.approx(time.step_s / synchronous.time.step_s)
    # Generation on the trainer's own GPUs has nothing to overlap with.
    colocated = P.replace(separate, cluster=P.replace(separate.cluster, rollout_nodes=0),
                          workload=P.replace(workload, max_staleness=1))
    assert not P.plan(colocated).time.overlapped


def test_the_weight_push_costs_a_broadcast_or_a_write_and_a_load():
    base = P.PlanInputs(
        dims=dims("Qwen2.5-Math-7B"), layout=P.Layout(tensor_parallel=4, data_parallel=4), trainer=P.TrainerSettings(),
        workload=P.Workload(prompts_per_step=128, trained_per_prompt=8, sampled_per_prompt=8, in_flight_per_prompt=8,
                            prompt_tokens=512, max_new_tokens=3072, steps=100),
        cluster=P.Cluster(gpu=P.GPUS["h100"], trainer_nodes=2, gpus_per_node=8, rollout_nodes=1, servers_per_node=8))
    gb = 7_615_616_512 * 2 / 1e9  # Qwen2.5-Math-7B in bf16
    assert P.sync_seconds(base) == pytest.approx(gb / 20.0)
    disk = P.replace(base, workload=P.replace(base.workload, sync="disk"))
    assert P.sync_seconds(disk) == pytest.approx(gb / 1.0 + gb / 2.0)
    two_stages = P.replace(disk, layout=P.Layout(tensor_parallel=4, pipeline_parallel=2, data_parallel=2))
    assert P.sync_seconds(two_stages) == pytest.approx(gb / 2 / 1.0 + gb / 2.0)  # stages write their halves at once
    colocated = P.replace(base, cluster=P.replace(base.cluster, rollout_nodes=0))
    assert P.sync_seconds(colocated) == 0.0
    assert P.time_plan(base).step_s == pytest.approx(P.time_plan(colocated).train_s + P.time_plan(base).rollout_s
                                                     + gb / 20.0)


def test_context_and_memory_refusals_name_the_fix():
    inputs = P.PlanInputs(
        dims=dims("Qwen2.5-Math-7B"), layout=P.Layout(data_parallel=16), trainer=P.TrainerSettings(),
        workload=P.Workload(prompts_per_step=128, trained_per_prompt=8, sampled_per_prompt=8, in_flight_per_prompt=8,
                            prompt_tokens=1024, max_new_tokens=4096, steps=10),
        cluster=P.Cluster(gpu=P.GPUS["h100"], trainer_nodes=2, gpus_per_node=8))
    result = P.plan(inputs)
    assert not result.fits and result.margin_bytes < 0
    assert any("max_new_tokens ≤ 3072" in problem for problem in result.problems)
    layout = result.smallest_layout
    assert layout is not None and layout.model_parallel > 1
    assert P.plan(P.replace(inputs, layout=layout)).margin_bytes >= 0


def _preset_cases():
    from recipes.papers import PAPER_PRESETS

    return sorted(PAPER_PRESETS)


def test_every_paper_model_has_its_published_config():
    # A preset whose model has no fixture would get no verdict; this names it.
    from recipes.papers import MODELS, PAPER_PRESETS

    assert {preset.options["backbone"] for preset in PAPER_PRESETS.values()} <= set(MODELS)
    assert sorted(set(MODELS) - set(PRESET_FIXTURES)) == []
    assert all((FIXTURES / f"{name}.json").is_file() for name in PRESET_FIXTURES.values())


@pytest.mark.parametrize("name", _preset_cases())
def test_every_h100_paper_preset_fits_its_campaign_cluster(name):
    from pipeline.cli.plan import stage_inputs
    from pipeline.config import Resources, RolloutServers
    from recipes.papers import PAPER_PRESETS

    preset = PAPER_PRESETS[name]
    key = preset.options["backbone"]
    model = dims(PRESET_FIXTURES[key])
    # The trainer nodes of the campaigns that run these models (recipes/campaigns.py): 1 for the
    # 1.5B models, else 2.
    resources = Resources(nodes=1 if model.num_parameters() < 2e9 else 2, ranks_per_node=8, gpus_per_node=8,
                          rollout=RolloutServers(nodes=1, servers_per_node=8))
    result = P.plan(stage_inputs(preset(), model, resources=resources, args=ARGS, num_runs=1, gpus_per_node=8))
    assert result.fits, result.problems


@pytest.mark.parametrize("recipe", sorted(CAMPAIGN_FIXTURES))
def test_every_h100_campaign_fits(recipe, tmp_path):
    from pipeline.cli.plan import stage_inputs
    from recipes.campaigns import CAMPAIGNS

    campaign = CAMPAIGNS[recipe](output_dir=tmp_path)
    model = dims(CAMPAIGN_FIXTURES[recipe])
    for stage in (stage for stage in campaign.stages if stage.kind == "rl"):
        result = P.plan(stage_inputs(stage.config, model, resources=stage.resources, args=ARGS, num_runs=1,
                                     gpus_per_node=8))
        assert result.fits, result.problems


# ------------------------------------------------------------------ context of every generating stage


def _hf_folder(tmp_path: Path, model: str) -> Path:
    """A folder holding only the published config.json of ``model``: all the planner reads."""
    folder = tmp_path / model
    folder.mkdir(parents=True)
    shutil.copy(FIXTURES / f"{model}.json", folder / "config.json")
    return folder


def test_the_prompt_allowance_is_1024_tokens_or_a_quarter_of_a_short_context():
    qwen = dims("Qwen2.5-Math-7B")
    assert P.prompt_allowance(qwen) == 1024 and P.prompt_allowance(qwen, 300) == 300
    bootstrap = P.replace(qwen, max_position_embeddings=128)
    assert P.prompt_allowance(bootstrap) == 32


def test_a_context_refusal_names_the_option_the_numbers_and_the_length_that_fits():
    qwen = dims("Qwen2.5-Math-7B")
    assert P.context_problem(qwen, max_new_tokens=3072, prompt_tokens=1024) is None
    assert P.context_problem(qwen, max_new_tokens=4096, prompt_tokens=1024, field="curate.max_new_tokens") == (
        "curate.max_new_tokens: 4096 new tokens + a ~1024-token prompt exceed Qwen2.5-Math-7B's 4096 positions "
        "(curate.max_new_tokens ≤ 3072 fits)")
    assert "the prompt alone fills the context" in P.context_problem(qwen, max_new_tokens=1, prompt_tokens=4096)


def test_each_stage_generates_with_the_model_the_campaign_gives_it(tmp_path):
    """No servers: evaluation reads the rl run's checkpoints, rl trains from the convert stage's run; neither
    exists before the campaign runs, so both resolve through those stages to the Hugging Face folder."""
    from pipeline.config import (CheckpointConfig, ConvertConfig, CurateConfig, EvalConfig, EvaluateConfig,
                                 ExportConfig, RLConfig)
    from pipeline.launch.campaign import CampaignPlan, Stage

    folder = _hf_folder(tmp_path, "Qwen2.5-Math-7B")
    root = tmp_path / "run"
    stages = [
        Stage(name="convert", kind="convert", config=ConvertConfig(hf=str(folder), out=str(root / "base"))),
        Stage(name="curate", kind="curate", config=CurateConfig(policy=str(folder), max_new_tokens=4096)),
        Stage(name="rl", kind="rl", depends_on=("convert",), config=RLConfig(
            policy=str(root / "base"), max_new_tokens=3072,
            checkpoint=CheckpointConfig(directory=str(root / "rl" / "checkpoints")))),
        Stage(name="export", kind="export", depends_on=("rl",),
              config=ExportConfig(checkpoint=str(root / "rl" / "checkpoints"), out=str(root / "export"))),
        Stage(name="evaluate", kind="evaluate", depends_on=("rl",), config=EvaluateConfig(
            policy=str(root / "rl" / "checkpoints"), eval=EvalConfig(max_new_tokens=2048))),
        Stage(name="evaluate-export", kind="evaluate", depends_on=("export",), config=EvaluateConfig(
            policy=str(root / "export"), eval=EvalConfig(max_new_tokens=4000))),
    ]
    contexts = {context.stage: context for context in P.stage_contexts(CampaignPlan(name="c", output_dir=root,
                                                                                    stages=stages))}
    assert set(contexts) == {"curate", "rl", "evaluate", "evaluate-export"}
    for context in contexts.values():
        assert context.unreadable is None and context.source == str(folder)
        assert context.dims.max_position_embeddings == 4096
    assert [contexts[name].option for name in ("curate", "evaluate")] == ["curate.max_new_tokens",
                                                                          "evaluate.eval.max_new_tokens"]
    assert {name for name, context in contexts.items() if context.problem() is not None} == {
        "curate", "evaluate-export"}
    assert contexts["rl"].problem() is None and contexts["evaluate"].problem() is None


def test_servers_bound_the_context_and_an_unreadable_model_says_so(tmp_path):
    from recipes.campaigns import qwen25_math_7b

    folder = _hf_folder(tmp_path, "Qwen2.5-Math-7B")
    # The servers of curation and evaluation start from model_path; rl's trainer trains the converted copy.
    contexts = P.stage_contexts(qwen25_math_7b(output_dir=tmp_path / "run", model_dir=str(folder)))
    assert {context.kind for context in contexts} == {"rl", "curate", "evaluate"}
    assert all(context.source == str(folder) and context.dims is not None for context in contexts)
    missing = P.stage_contexts(qwen25_math_7b(output_dir=tmp_path / "run", model_dir=str(tmp_path / "absent")))
    assert all(context.dims is None and "absent does not exist" in context.unreadable for context in missing)


def test_a_bootstrap_policy_is_checked_from_its_model_section_before_it_exists(tmp_path):
    from recipes.campaigns import cpu_tiny_campaign

    contexts = P.stage_contexts(cpu_tiny_campaign(output_dir=tmp_path))
    assert {context.kind for context in contexts} == {"rl", "curate", "evaluate"}
    assert all(context.dims.max_position_embeddings == 128 for context in contexts)
    curate = next(context for context in contexts if context.stage == "curate")
    assert curate.source == "bootstrap.model" and curate.problem() is None
    assert not (tmp_path / "cache").exists()  # nothing was built or read


def test_step_flops_are_pipeline_stats_flops_count():
    """The planner prices a step with the RL metrics' own FLOPs formula (one owner: pipeline.stats.flops)."""
    from pipeline.stats import flops as F

    qwen = dims("Qwen2.5-Math-7B")
    cost = qwen.forward_cost()
    # The matmul weights: every parameter but the input embedding, the RMSNorms and the q/k/v biases.
    norms_and_biases = ((2 * qwen.num_layers + 1) * qwen.hidden_size
                        + qwen.num_layers * (qwen.q_width + 2 * qwen.kv_width))
    assert cost.matmul_parameters == qwen.num_parameters() - qwen.vocab_size * qwen.hidden_size - norms_and_biases
    assert (cost.num_layers, cost.attention_width) == (28, 28 * 128)
    workload = P.Workload(prompts_per_step=4, trained_per_prompt=8, sampled_per_prompt=16, in_flight_per_prompt=4,
                          prompt_tokens=512, max_new_tokens=2048, steps=1)
    inputs = P.PlanInputs(dims=qwen, layout=P.Layout(data_parallel=8),
                          trainer=P.TrainerSettings(reference_model=True, recompute="full"), workload=workload,
                          cluster=P.Cluster(gpu=P.GPUS["h100"], trainer_nodes=1, gpus_per_node=8),
                          assumptions=P.Assumptions(response_fraction=0.5))
    train, rollout = P.step_flops(inputs)
    # 32 trained rows of 512 + 1024 tokens: the update with full recompute, π_old's and the reference's forwards.
    row = 512 + 1024
    assert train == pytest.approx(32 * (F.update_flops(cost, row, recompute="full")
                                        + 2 * F.sequence_forward_flops(cost, row)), rel=1e-12)
    # 16 samples per prompt in rounds of 4: each prompt prefilled 4 times, 64 responses decoded.
    assert rollout == pytest.approx(4 * 4 * F.prefill_flops(cost, 512)
                                    + 64 * F.generation_flops(cost, prompt_tokens=512, generated_tokens=1024),
                                    rel=1e-12)
    assert P.GPUS["h100"].peak_tflops * 1e12 == F.peak_bf16_flops("NVIDIA H100 80GB HBM3")


def test_activations_are_planned_for_the_largest_micro_batch_the_trainer_packs():
    """Rows shorter than the longest possible pack past whole rows of ``seq_length``: the planner must
    plan what ``plan_micro_batches`` can really build (up to ``micro_batch_tokens``)."""
    import torch

    from pipeline.trainer.batch import plan_micro_batches

    inputs = P.PlanInputs(
        dims=dims("Qwen2.5-Math-7B"), layout=P.Layout(tensor_parallel=4, data_parallel=4),
        trainer=P.TrainerSettings(micro_batch_tokens=8192),
        workload=P.Workload(prompts_per_step=64, trained_per_prompt=8, sampled_per_prompt=8, in_flight_per_prompt=8,
                            prompt_tokens=1024, max_new_tokens=4096, steps=10),
        cluster=P.Cluster(gpu=P.GPUS["h100"], trainer_nodes=2, gpus_per_node=8))
    seq = inputs.seq_length
    assert seq == 5120 and inputs.trainer.micro_batch_tokens == 8192
    lengths = torch.full((64,), 2700)  # responses of ~1,700 tokens after 1,024-token prompts
    packed = max(len(rows) * int(lengths[rows].max()) for rows in plan_micro_batches(lengths, max_tokens=8192))
    assert packed == 8100 > seq  # three rows: more than one full-length row
    assert P.micro_batch_tokens(inputs) >= packed
    longer = P.replace(inputs, trainer=P.replace(inputs.trainer, micro_batch_tokens=4096))
    assert P.micro_batch_tokens(longer) == seq  # a row longer than the budget is a micro-batch of its own


def test_without_rollout_nodes_rank_0_holds_an_fp32_generator_and_generates_alone():
    """The real path with no server nodes: rank 0's in-process engine (float32 HF weights) generates every
    rollout on its one GPU; the plan carries that copy on stage 0 and times generation on one GPU."""
    workload = P.Workload(prompts_per_step=64, trained_per_prompt=8, sampled_per_prompt=8, in_flight_per_prompt=8,
                          prompt_tokens=1024, max_new_tokens=3072, steps=10)
    # Every response at the cap: generation time is then the FLOPs of every response at full length.
    servers = P.PlanInputs(
        dims=dims("Qwen2.5-Math-7B"), layout=P.Layout(tensor_parallel=4, pipeline_parallel=2, data_parallel=2),
        trainer=P.TrainerSettings(), workload=workload,
        cluster=P.Cluster(gpu=P.GPUS["h100"], trainer_nodes=2, gpus_per_node=8, rollout_nodes=1, servers_per_node=8),
        assumptions=P.Assumptions(response_fraction=1.0))
    alone = P.replace(servers, cluster=P.replace(servers.cluster, rollout_nodes=0))
    with_servers, without = P.memory_plan(servers), P.memory_plan(alone)
    assert [stage.generator_weights for stage in with_servers] == [0, 0]
    assert [stage.generator_weights for stage in without] == [4 * 7_615_616_512, 0]
    assert without[0].total == with_servers[0].total + 4 * 7_615_616_512
    rollout_flops = P.time_plan(alone).rollout_flops
    peak = P.GPUS["h100"].peak_tflops * 1e12
    assert P.time_plan(alone).rollout_s == pytest.approx(rollout_flops / (peak * alone.assumptions.rollout_mfu))
    assert P.time_plan(servers).rollout_s == pytest.approx(P.time_plan(alone).rollout_s / 8)
