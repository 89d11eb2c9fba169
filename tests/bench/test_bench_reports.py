"""Each benchmark, at toy sizes, writes ``<out>/<name>.json`` and ``<out>/<name>.png`` holding what it printed.

Runtime on 2 idle cores: algorithms < 1 s, rollout ~2 s, grading (worker processes, adversarial
timeouts) and logprobs_memory (two child processes) ~3 s each; actor ~6 s (slow): it runs as
``python -m tools.bench.actor`` in a fresh process, as the docs run it, so megatron's global state
does not leak into the suite.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
REPO = Path(__file__).resolve().parents[2]


def _numbers(value):
    """Every number in a JSON value (booleans are not measurements)."""
    if isinstance(value, dict):
        for item in value.values():
            yield from _numbers(item)
    elif isinstance(value, list):
        for item in value:
            yield from _numbers(item)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield value


def _written(out: Path, name: str) -> dict:
    """The results of ``<out>/<name>.json``, after checking both files and the report's frame."""
    assert (out / f"{name}.png").read_bytes()[:8] == PNG_SIGNATURE
    report = json.loads((out / f"{name}.json").read_text())
    assert report["benchmark"] == name
    assert report["settings"]["out"] == str(out)
    assert {"torch", "threads", "cpu_count", "platform"} <= set(report["machine"])
    numbers = list(_numbers(report["results"]))
    assert numbers and all(math.isfinite(x) for x in numbers), name
    return report["results"]


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_algorithms(tmp_path, capsys):
    from tools.bench import algorithms

    algorithms.main(["--prompts", "2", "--group", "16", "--tokens", "32", "--repeats", "2", "--out", str(tmp_path)])

    results = _written(tmp_path, "algorithms")
    paths = results["paths"]
    base = paths["GRPO loss, all rows"]["median_s"]
    kept = paths["D³S + CW-GRPO, kept rows (RL loop)"]
    assert results["ratio_kept_rows"] == pytest.approx(kept["median_s"] / base)
    assert results["ratio_kept_rows_target"] == 1.10
    assert all(len(path["times_s"]) == 2 and path["fastest_s"] == min(path["times_s"]) for path in paths.values())
    assert len(results["extras_median_s"]) == 3
    printed = capsys.readouterr().out
    assert f"ratio {results['ratio_kept_rows']:6.3f}  (target ≤ 1.10)" in printed  # the table is still printed
    assert printed.rstrip().endswith(f"wrote {tmp_path / 'algorithms.json'} and {tmp_path / 'algorithms.png'}")


def test_rollout(tmp_path):
    from tools.bench import rollout

    rollout.main(["--prompts", "2", "--samples", "2", "--new-tokens", "4", "--min-prompt-len", "2",
                  "--max-prompt-len", "4", "--layers", "1", "--hidden", "32", "--vocab", "20", "--repeats", "1",
                  "--out", str(tmp_path)])

    results = _written(tmp_path, "rollout")
    assert results["num_tokens"] == 2 * 2 * 4
    sides = results["sides"]
    assert set(sides) == {"generate", "engine"}
    assert sides["engine"]["tokens_per_s"] == pytest.approx(16 / sides["engine"]["best_s"])
    assert results["ratio"] == pytest.approx(sides["engine"]["tokens_per_s"] / sides["generate"]["tokens_per_s"])
    assert results["ratio_target"] == 0.90


@pytest.mark.slow
def test_actor_as_a_module(tmp_path):
    # As the docs run it, from the repository root: `python -m tools.bench.actor`.
    completed = subprocess.run(
        [sys.executable, "-m", "tools.bench.actor", "--hidden", "32", "--layers", "2", "--heads", "4", "--vocab", "64",
         "--batch", "2", "--seq", "16", "--repeats", "1", "--threads", "1", "--logprob-chunk", "16",
         "--out", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]

    results = _written(tmp_path, "actor")
    steps = results["steps"]
    assert set(steps) == {"one chunk", "16-token chunks", "hf", "hf fused"}
    assert results["ratio_megatron_hf"] == pytest.approx(steps["one chunk"]["median_s"] / steps["hf"]["median_s"])
    assert results["sync_share"] == pytest.approx(results["sync_s"] / steps["one chunk"]["median_s"])
    assert (results["ratio_megatron_hf_target"], results["sync_share_target"]) == (1.0, 0.10)
    assert completed.stdout.rstrip().endswith(f"wrote {tmp_path / 'actor.json'} and {tmp_path / 'actor.png'}")


def test_grading(tmp_path):
    from tools.bench import grading

    grading.main(["--num-items", "40", "--baseline-items", "10", "--num-workers", "2", "--deadline-s", "0.5",
                  "--overhead-s", "3", "--out", str(tmp_path)])

    results = _written(tmp_path, "grading")
    assert results["num_items"] == 40 and results["baseline_items"] == 10
    assert results["ratio"] == pytest.approx(results["pool_gradings_per_s"] / results["baseline_gradings_per_s"])
    adversarial = results["adversarial"]
    assert len(adversarial["reasons"]) == adversarial["num_items"] == len(grading.adversarial_batch())
    assert adversarial["within_bound"] == (adversarial["wall_s"] <= adversarial["bound_s"])


def test_logprobs_memory(tmp_path):
    from tools.bench import logprobs_memory

    logprobs_memory.main(["--tokens", "256", "--hidden", "16", "--vocab", "512", "--chunk-size", "64",
                          "--threads", "1", "--out", str(tmp_path)])

    results = _written(tmp_path, "logprobs_memory")
    variants = results["variants"]
    assert set(variants) == {"chunked", "materialized"}
    assert results["time_ratio"] == pytest.approx(variants["chunked"]["total_s"] / variants["materialized"]["total_s"])
    assert results["block_mib"] == pytest.approx(64 * 512 * 4 / 2**20)
    assert results["variants_agree"] is True
    assert (results["time_ratio_target"], results["excess_blocks_target"]) == (1.2, 1.0)
