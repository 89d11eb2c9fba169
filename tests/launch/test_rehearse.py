"""The rehearsal's pieces: the scaled model keeps what every check reads, the plan changes only what it states."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.errors import UserError
from pipeline.launch.rehearsal_model import CONFIGS_DIR, build_rehearsal_model, published_config, scaled_config
from pipeline.launch.rehearse import (
    RehearsalScale,
    metric_rows,
    model_dir_of,
    rebased,
    rehearsal_plan,
    unread_artifacts,
    with_model,
)
from recipes.campaigns import llama31_8b, qwen25_math_7b

KEPT = ("max_position_embeddings", "vocab_size", "rope_theta", "rope_scaling", "tie_word_embeddings", "model_type",
        "architectures", "rms_norm_eps")


@pytest.mark.parametrize("name", ["Qwen2.5-Math-7B", "Llama-3.1-8B", "Qwen3-4B"])
def test_the_scaled_config_keeps_positions_rope_vocabulary_and_family(name: str) -> None:
    config = json.loads((CONFIGS_DIR / f"{name}.json").read_text())
    scaled, changes = scaled_config(config, tensor_parallel=4)
    assert {key: scaled.get(key) for key in KEPT} == {key: config.get(key) for key in KEPT}
    assert scaled["num_key_value_heads"] % 4 == 0 and scaled["num_attention_heads"] % 4 == 0
    assert scaled["hidden_size"] < config["hidden_size"] and scaled["num_hidden_layers"] == 2
    assert any(change.startswith("hidden_size") for change in changes)


def test_a_model_folder_that_is_not_here_uses_the_published_config_of_its_name(tmp_path: Path) -> None:
    config, source = published_config("/cluster/models/Llama-3.1-8B-Instruct")
    assert config["max_position_embeddings"] == 131072 and "Llama-3.1-8B" in source
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 7}))
    assert published_config(str(tmp_path / "mine"))[0]["vocab_size"] == 7  # a readable folder wins
    with pytest.raises(UserError, match="no published config is shipped for 'Mystery-9B'"):
        published_config("/models/Mystery-9B")


def test_the_rehearsal_model_keeps_the_family_tokens_and_loads_in_transformers(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = build_rehearsal_model("/models/Qwen2.5-Math-7B", tmp_path / "m", tensor_parallel=4)
    loaded = AutoModelForCausalLM.from_pretrained(str(model.folder), local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(str(model.folder), local_files_only=True)
    assert type(loaded).__name__ == "Qwen2ForCausalLM" and loaded.config.vocab_size == 152064
    assert loaded.config.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert "<|im_start|>" in tokenizer.apply_chat_template([{"role": "user", "content": "1+1?"}], tokenize=False)
    assert any("ids differ" in change for change in model.changes)


def test_the_rehearsal_plan_changes_only_hardware_servers_and_volumes(tmp_path: Path) -> None:
    plan = llama31_8b(output_dir=tmp_path / "cluster")
    source = model_dir_of(plan)
    assert source == "/models/Llama-3.1-8B-Instruct"
    moved = with_model(rebased(plan, tmp_path / "campaign"), model_dir=source, folder=tmp_path / "model")
    assert source not in json.dumps(moved.to_dict()) and str(tmp_path / "cluster") not in json.dumps(moved.to_dict())
    rehearsed, changes = rehearsal_plan(moved, scale=RehearsalScale(), request_logs=tmp_path / "requests",
                                        first_port=12000, killed="rl-grpo")
    served = [stage.resources.rollout for stage in rehearsed.stages if stage.resources.rollout is not None]
    ports = [server.port + i for server in served for i in range(server.servers_per_node)]
    assert len(ports) == len(set(ports))  # stages the cluster runs at once share this one node
    # One stand-in a stage, two where one is killed (the other serves while it restarts).
    assert {stage.name: stage.resources.rollout.servers_per_node for stage in rehearsed.stages
            if stage.resources.rollout is not None} == {"curate": 1, "rl-default": 1, "rl-grpo": 2,
                                                         "evaluate-default": 1, "evaluate-grpo": 1}
    assert rehearsed.stage("rl-grpo").config.rollout.min_servers <= 2
    curate = moved.stage("curate").config
    for before, after in zip(moved.stages, rehearsed.stages):
        assert (after.name, after.kind) == (before.name, before.kind)
        if after.kind == "rl" and before.config.data.train == curate.sources:
            # A raw stream of the fitted prompts trains on the ones the rehearsal model answers sometimes.
            assert after.depends_on == (*before.depends_on, "curate")
            assert after.config.data.train == [str(Path(curate.output_dir) / "kept.jsonl")]
            assert any(note.startswith("data.train") for note in changes[after.name])
        else:
            assert after.depends_on == before.depends_on
        assert after.resources.gpus_per_node == 0 and after.resources.nodes == 1
        if after.kind == "rl":
            assert after.config.parallel == before.config.parallel or after.config.parallel.backend == "gloo"
            assert after.config.parallel.tensor_parallel == 4 and after.resources.num_ranks == 4
            assert after.config.max_new_tokens == before.config.max_new_tokens  # context is never scaled
            assert after.config.rollout.sync == "distributed"  # the cluster's transport
            assert any(note.startswith("DP 4 -> 1") for note in changes[after.name])
            # The online DEPO estimator's volume, like the policy's: one small update a step.
            depo = after.config.algorithm.depo
            assert (depo.minibatches, depo.minibatch_size) == (1, 8), changes[after.name]
            assert "algorithm.depo.minibatches 4 -> 1" in changes[after.name]
        if after.kind in ("curate", "evaluate"):
            budget = after.config.max_new_tokens if after.kind == "curate" else after.config.eval.max_new_tokens
            before_budget = (before.config.max_new_tokens if after.kind == "curate"
                             else before.config.eval.max_new_tokens)
            assert budget == before_budget and after.config.device == "cpu"
        servers = after.resources.rollout
        if servers is not None:
            assert (servers.server, servers.colocated, servers.tensor_parallel) == ("standin", True, 1)
            assert servers.extra_args[-2:] == ["--request-log", str(tmp_path / "requests" / f"{after.name}.jsonl")]
            assert any("CPU stand-ins" in note for note in changes[after.name])


def test_a_trained_artifact_nobody_reads_is_found(tmp_path: Path) -> None:
    from pipeline.launch.campaign import CampaignPlan

    plan = qwen25_math_7b(output_dir=tmp_path)
    assert unread_artifacts(plan) == []
    without_readers = CampaignPlan(name="x", output_dir=tmp_path, stages=[
        s for s in plan.stages if s.name not in ("evaluate-grpo", "export-grpo")])
    assert unread_artifacts(without_readers) == [
        f"rl-grpo writes {tmp_path}/rl/grpo/checkpoints, which no later stage reads"]


def test_metric_rows_drop_timing_and_keep_the_last_row_of_each_step(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 1, "grad_norm": 1.0, "time/update": 3.0}, {"step": 2, "grad_norm": 0.5, "time/update": 1.0},
            {"step": 2, "grad_norm": 0.5, "time/update": 9.0}, {"step": 0, "eval/pass@1": 0.1}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert metric_rows(path) == [{"step": 1, "grad_norm": 1.0}, {"step": 2, "grad_norm": 0.5}]


def _rl_stage_logging_to(tmp_path: Path, rows: list[dict]):
    from pipeline.launch.rehearse import check_stage

    plan = rebased(qwen25_math_7b(output_dir=tmp_path / "cluster"), tmp_path / "campaign")
    stage = plan.stage("rl-grpo")
    metrics = Path(stage.config.logging.output_dir) / "metrics.jsonl"
    metrics.parent.mkdir(parents=True, exist_ok=True)
    metrics.write_text("".join(json.dumps(row) + "\n" for row in [{"step": 0}, *rows]))
    return lambda: check_stage(stage, plan)


def _step(step: int, *, grad_norm: float, uniform: float, reward_mean: float = 0.25) -> dict:
    return {"step": step, "grad_norm": grad_norm, "zero_signal_group_fraction": uniform, "reward_mean": reward_mean,
            "budget/samples_per_prompt_mean": 4.0}


def test_an_rl_stage_needs_a_gradient_wherever_a_group_had_signal(tmp_path: Path) -> None:
    check = _rl_stage_logging_to(tmp_path, [_step(1, grad_norm=2.0, uniform=0.5), _step(2, grad_norm=1.0, uniform=0.0)])
    assert check() == []
    # Every group of step 1 got equal rewards: its zero gradient is the math, and the report says so.
    check = _rl_stage_logging_to(tmp_path, [_step(1, grad_norm=0.0, uniform=1.0, reward_mean=0.0),
                                            _step(2, grad_norm=1.5, uniform=0.5)])
    assert check() == ["rl-grpo: every group of step 1 got equal rewards (reward_mean 0.0), so its gradient is "
                       "zero; step 2 is the first with signal, and its gradient is not"]
    # A group had signal and the gradient is still zero: a break (a masked loss, dropped advantages).
    check = _rl_stage_logging_to(tmp_path, [_step(1, grad_norm=0.0, uniform=0.75)])
    with pytest.raises(AssertionError, match="step 1 has a zero gradient although 25% of its groups"):
        check()
    check = _rl_stage_logging_to(tmp_path, [_step(1, grad_norm=0.0, uniform=1.0), _step(2, grad_norm=0.0, uniform=1.0)])
    with pytest.raises(AssertionError, match="no step had a group with unequal rewards in 2 steps"):
        check()
    empty = _step(1, grad_norm=1.0, uniform=0.0)
    empty["budget/samples_per_prompt_mean"] = 0.0
    with pytest.raises(AssertionError, match="step 1 trained on an empty stream"):
        _rl_stage_logging_to(tmp_path, [empty])()


def test_the_rehearsal_model_fit_is_bitwise_reproducible_on_several_threads(tmp_path: Path) -> None:
    import hashlib

    import torch

    from pipeline.launch.rehearsal_model import fit_answers
    from pipeline.launch.rehearse import prompt_sources

    _, _, template = prompt_sources(qwen25_math_7b(output_dir=tmp_path / "cluster"))
    # Long enough prompts (about 300 tokens) that the backward's accumulation runs on several threads.
    padding = " ".join(f"Note {i}: the numbers below are integers." for i in range(30))
    problems = [(f"{padding} What is {a} + {b}?", str(a + b)) for a, b in [(2, 3), (11, 4), (7, 9), (20, 22)]]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the suite's workers run one thread, where accumulation order cannot vary
    try:
        digests = []
        for copy in range(2):
            model = build_rehearsal_model("/models/Qwen2.5-Math-7B", tmp_path / f"m{copy}", tensor_parallel=4)
            fit_answers(model.folder, problems=problems, template=template, steps=12)
            digests.append(hashlib.sha256((model.folder / "model.safetensors").read_bytes()).hexdigest())
    finally:
        torch.set_num_threads(threads)
    assert digests[0] == digests[1]
    assert not torch.are_deterministic_algorithms_enabled()  # the fit restores the process's setting
