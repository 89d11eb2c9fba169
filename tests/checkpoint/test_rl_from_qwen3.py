"""RL from a Qwen3 Hugging Face folder: converted behind the logit gate, trained two steps, exported back.

The folder is the published Qwen3-4B ``config.json`` (``pipeline/models/published/configs``) with its
sizes scaled down to those of the other real-family fixtures (hidden 64, 2 layers) and its heads
kept wider than hidden / heads (as 4B's 128 > 2560 / 32), random fp32 weights with non-trivial
q/k norms, and the Qwen2.5 fixture tokenizer (Qwen3 keeps Qwen2.5's byte-level vocabulary).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.distributed_utils import run_distributed

PUBLISHED = Path(__file__).resolve().parents[2] / "pipeline" / "models" / "published" / "configs"
TOKENIZER = PUBLISHED.parent / "tokenizers" / "qwen2_5"


def qwen3_config() -> dict:
    """Qwen3-4B's published config with the sizes scaled down and special ids mapped to the fixture tokenizer."""
    published = json.loads((PUBLISHED / "Qwen3-4B.json").read_text())
    ids = {t["content"]: t["id"] for t in json.loads((TOKENIZER / "tokenizer.json").read_text())["added_tokens"]}
    return {**published, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_window_layers": 2,
            "vocab_size": 448, "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
            "torch_dtype": "float32"}


def write_qwen3_folder(folder: Path, *, seed: int = 0) -> Path:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**qwen3_config())
    config.initializer_range = 0.2  # logits of O(1)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():  # the q/k norms start at one; released ones are not
        for name, param in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.uniform_(0.5, 1.5)
    model.save_pretrained(str(folder), safe_serialization=True)
    (folder / "config.json").write_text(json.dumps(qwen3_config(), indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(TOKENIZER / name, folder / name)
    return folder


def _rl_from_hf(rank, world_size, tmp):
    from pipeline.checkpoint.convert import megatron_to_hf
    from pipeline.metrics import read_metrics
    from pipeline.parallel.context import ParallelContext
    from pipeline.stages.rl import run_rl
    from tests.rl.test_rl_loop import _config

    tmp = Path(tmp)
    hf = write_qwen3_folder(tmp / "hf")
    # A random model never writes a box, so every reward is equal and the advantages vanish; the
    # entropy bonus gives every step a gradient, so the trained weights differ from the source.
    cfg = _config(tmp, [f"policy={hf}", "data.template=chat", "prompts_per_step=2", "group_size=2",
                        "max_new_tokens=8", "steps=2", "optim.total_steps=2", "checkpoint.every_steps=2",
                        "eval_every=0", "algorithm.entropy_coef=0.1"])
    context = ParallelContext.initialize(tensor_parallel=1, pipeline_parallel=1, seed=cfg.seed)
    run_rl(cfg, context=context)
    megatron_to_hf(checkpoint=tmp / "ckpt", out=tmp / "export", verify=False)  # gated both ways in test_cli_convert
    return read_metrics(tmp / "run" / "metrics.jsonl")


@pytest.mark.slow
def test_rl_trains_a_converted_qwen3_checkpoint_and_exports_it(tmp_path):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    rows = run_distributed(_rl_from_hf, world_size=1, args=(str(tmp_path),), timeout_s=300)[0]
    assert [row["step"] for row in rows if "loss" in row] == [1, 2]
    assert all(row["grad_norm"] > 0 for row in rows if "loss" in row)
    manifest = json.loads((tmp_path / "run" / "initial_policy" / "step_00000000" / "manifest.json").read_text())
    assert manifest["hf_source"] == str((tmp_path / "hf").resolve())
    assert manifest["model_spec"]["family"] == "qwen3" and manifest["model_spec"]["head_dim"] == 32

    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "export"), local_files_only=True,
                                                    dtype=torch.float32)
    assert type(exported).__name__ == "Qwen3ForCausalLM"
    source = load_file(str(tmp_path / "hf" / "model.safetensors"))
    trained = exported.state_dict()
    assert set(source) <= set(trained)
    # Two optimizer steps moved the weights, the per-head norms included.
    for name in ("model.layers.0.self_attn.q_norm.weight", "model.layers.1.self_attn.k_norm.weight",
                 "model.layers.0.mlp.down_proj.weight"):
        assert not torch.equal(trained[name], source[name]), name
