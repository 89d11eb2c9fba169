"""The policy `winnow rl` starts from (``pipeline.stages.rl.initial_policy``) and its held-out set."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from pipeline.config import RLConfig
from pipeline.errors import UserError
from pipeline.rl.setup import load_eval_prompts
from tests.checkpoint.tiny_models import tiny_spec


def _hf_folder(path):
    path.mkdir()
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(b"")
    return path


def test_a_multi_rank_run_prints_the_conversion_command_for_a_hugging_face_policy(tmp_path):
    from pipeline.stages.rl import initial_policy

    hf = _hf_folder(tmp_path / "hf")
    cfg = RLConfig(policy=str(hf))
    cfg.logging.output_dir = str(tmp_path / "run")
    cfg.parallel.tensor_parallel = 2
    with pytest.raises(ValueError, match=rf"winnow convert hf-to-megatron --hf {hf} --out {tmp_path}/run/initial_policy "
                                         r"--tp 2 --pp 1"):
        initial_policy(cfg, context=SimpleNamespace(world_size=2, rank=0))


def test_a_conversion_of_another_folder_is_not_reused(tmp_path):
    from pipeline.stages.rl import initial_policy

    hf = _hf_folder(tmp_path / "hf")
    step = tmp_path / "run" / "initial_policy" / "step_00000000"
    step.mkdir(parents=True)
    (step.parent / "latest").write_text("step_00000000")
    (step / "manifest.json").write_text(json.dumps({
        "files": {}, "model_spec": tiny_spec().to_dict(), "hf_source": "/models/other",
        "layout": {"tensor_parallel": 1, "pipeline_parallel": 1}}))
    cfg = RLConfig(policy=str(hf))
    cfg.logging.output_dir = str(tmp_path / "run")
    with pytest.raises(UserError, match="holds a conversion of /models/other"):  # exit 2, never requeued
        initial_policy(cfg, context=SimpleNamespace(world_size=1, rank=0))


def test_the_held_out_set_may_be_a_file_read_whole(tmp_path):
    path = tmp_path / "held_out.jsonl"
    path.write_text("".join(json.dumps({"id": f"q{i}", "problem": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n"
                            for i in range(7)))
    assert [p.id for p in load_eval_prompts(RLConfig(eval_set=str(path)))] == [f"q{i}" for i in range(7)]


def test_benchmarks_and_synthetic_sets_use_their_test_split():
    assert {p.id.split("/")[1] for p in load_eval_prompts(RLConfig(eval_set="gsm8k"))} == {"test"}
    assert len(load_eval_prompts(RLConfig(eval_set="gsm8k"))) == 1319
    synthetic = load_eval_prompts(RLConfig(eval_set="arith?difficulty=3&size=40"))
    from pipeline.data import load_prompts

    assert synthetic == load_prompts("arith?difficulty=3&size=40", split="test")[0]


def test_eval_limit_keeps_a_seeded_random_subset():
    full = load_eval_prompts(RLConfig(eval_set="gsm8k"))
    subset = load_eval_prompts(RLConfig(eval_set="gsm8k", eval_limit=20))
    assert len(subset) == 20 and set(p.id for p in subset) <= set(p.id for p in full)
    assert subset != full[:20]  # random, not the first ones
    assert subset == load_eval_prompts(RLConfig(eval_set="gsm8k", eval_limit=20))
    assert subset != load_eval_prompts(RLConfig(eval_set="gsm8k", eval_limit=20, seed=1))
