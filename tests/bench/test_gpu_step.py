"""The one-GPU benchmark runs end to end on the CPU with a tiny config (the GPU's numbers: docs/benchmarks.md)."""

from __future__ import annotations

import json
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[2] / "pipeline" / "models" / "published" / "configs"


def test_gpu_step_measures_every_component_against_the_plan(tmp_path):
    from tools.bench import gpu_step

    config = json.loads((FIXTURES / "Qwen2.5-1.5B-Instruct.json").read_text())
    config.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=512, max_position_embeddings=256)
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert gpu_step.main(["--config", str(tmp_path / "config.json"), "--batch", "4", "--seq", "64", "--prompt", "16",
                          "--micro-batch-tokens", "128", "--steps", "2", "--gen-prompts", "3", "--gen-tokens", "5",
                          "--out", str(tmp_path / "out")]) == 0
    result = json.loads((tmp_path / "out" / "gpu_step.json").read_text())
    assert result["train"]["micro_batches"] == 2 and result["train"]["skipped"] == 0
    measured, predicted = result["memory"]["measured"], result["memory"]["predicted"]
    for component in ("weights", "gradients", "optimizer"):
        assert abs(predicted[component] - measured[component]) <= 0.01 * measured[component], component
    assert result["decode"]["generated_tokens"] == 3 * 5  # EOS ignored: every row decodes the full length
    assert result["sync"]["seconds"] and result["parameters"] > 0
