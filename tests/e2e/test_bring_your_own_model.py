"""A downloaded chat model through every stage: curate → RL (2 steps) → evaluate → export.

The user's path with a Hugging Face folder (``tests/fixtures/real_models``: Llama 3.x and
Qwen2.5 configs scaled down, random weights, the families' real tokenizer settings and chat
templates): `winnow curate policy=HF`, `winnow rl policy=HF` (converted once into the run
folder behind the logit gate, reused on resume; a held-out file scored at every step),
`winnow evaluate` of the run's checkpoints and `winnow convert megatron-to-hf`, whose folder
reloads in plain ``transformers`` with the model's stop ids in its ``generation_config.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed_utils import run_distributed
from tests.fixtures.real_models.families import FAMILIES, write_hf_model


def _campaign(rank, world_size, tmp, family):
    from pipeline import configlib
    from pipeline.checkpoint.convert import megatron_to_hf
    from pipeline.config import CurateConfig, EvaluateConfig, RLConfig
    from pipeline.data import load_prompts
    from pipeline.metrics import read_metrics
    from pipeline.parallel.context import ParallelContext
    from pipeline.stages.curate import run_curate
    from pipeline.stages.evaluate import run_evaluate
    from pipeline.stages.rl import initial_policy, run_rl

    tmp = Path(tmp)
    hf = write_hf_model(family, tmp / "hf")
    held_out = tmp / "held_out.jsonl"
    held_out.write_text("".join(json.dumps({"id": p.id, "problem": p.problem, "answer": p.answer}) + "\n"
                                for p in load_prompts("gsm8k", split="test", limit=5)[0]))
    quiet = ["reward.num_workers=1", "progress=false"]
    curate = configlib.load(CurateConfig, overrides=[
        "sources=[gsm8k]", "split=train", "limit=4", f"policy={hf}", "num_samples=2", "max_new_tokens=8",
        "template=chat", "device=cpu", "rules.drop_impossible=false", "rules.trivial_threshold=null",
        f"output_dir={tmp}/curate", *quiet])
    curation = run_curate(curate, out=lambda line: None)

    rl = configlib.load(RLConfig, overrides=[
        f"policy={hf}", f"data.train=[{curation.kept_path}]", "data.template=chat", f"curation_dir={tmp}/curate",
        f"eval_set={held_out}", "eval_limit=2", "eval_every=1", "eval_samples=1",
        "prompts_per_step=2", "group_size=2", "max_new_tokens=8", "steps=2", "optim.total_steps=2",
        "reward.num_workers=1", "logging.progress=false", "logging.trackers=[]",
        f"checkpoint.directory={tmp}/rl/checkpoints", f"logging.output_dir={tmp}/rl"])
    context = ParallelContext.initialize(tensor_parallel=1, pipeline_parallel=1, seed=rl.seed)
    run_rl(rl, context=context)
    converted = tmp / "rl" / "initial_policy" / "latest"
    written = converted.stat().st_mtime_ns
    initial_policy(rl, context=context)  # a resumed run reuses the conversion
    assert converted.stat().st_mtime_ns == written

    evaluate = configlib.load(EvaluateConfig, overrides=[
        f"policy={tmp}/rl/checkpoints", f"output_dir={tmp}/eval", "template=chat", "device=cpu",
        "eval.benchmarks=[gsm8k]", "eval.num_samples=2", "eval.ks=[1,2]", "eval.max_new_tokens=8", "eval.limit=2",
        "eval.bootstrap_samples=10", *quiet])
    results = run_evaluate(evaluate, context=context, out=lambda line: None)
    megatron_to_hf(checkpoint=tmp / "rl" / "checkpoints", out=tmp / "export")
    return {"kept": curation.kept_path.read_text().count("\n"), "rows": read_metrics(tmp / "rl" / "metrics.jsonl"),
            "results": results}


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_a_hugging_face_chat_model_runs_every_stage(tmp_path, family):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    outcome = run_distributed(_campaign, world_size=1, args=(str(tmp_path), family), timeout_s=300)[0]
    assert outcome["kept"] == 4
    rows = outcome["rows"]
    assert [row["step"] for row in rows] == [0, 1, 2]
    assert all("eval/pass@1" in row for row in rows)  # the held-out file, at the start and every step
    manifest = json.loads((tmp_path / "rl" / "initial_policy" / "step_00000000" / "manifest.json").read_text())
    assert manifest["hf_source"] == str((tmp_path / "hf").resolve())
    assert manifest["layout"] == {"tensor_parallel": 1, "pipeline_parallel": 1, "data_parallel": 1}
    assert "gsm8k" in json.dumps(outcome["results"])

    export = tmp_path / "export"
    source = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    generation = GenerationConfig.from_pretrained(str(export), local_files_only=True)
    assert generation.eos_token_id == source["eos_token_id"]  # the model's list of stop ids, carried through
    model = AutoModelForCausalLM.from_pretrained(str(export), local_files_only=True, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(export), local_files_only=True)
    assert tokenizer.chat_template is not None
    input_ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}],
                                              add_generation_prompt=True, return_tensors="pt")["input_ids"]
    output = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                            max_new_tokens=4)
    assert output.shape[1] > input_ids.shape[1]
