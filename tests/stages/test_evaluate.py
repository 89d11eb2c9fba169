"""`winnow evaluate` end to end on a tiny random HF Llama: shards, resume, aggregation, Megatron checkpoints."""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline import configlib
from pipeline.eval.report import derive_seed
from pipeline.stages.evaluate import (
    BenchmarkPlan,
    EvaluateConfig,
    EvaluateError,
    benchmark_directory,
    build_results,
    check_skipped_fraction,
    plan_benchmark,
    run_evaluate,
    shard_seed,
)
from tests.distributed_utils import run_distributed

D1, D3, D5 = "arith?difficulty=1&size=6", "arith?difficulty=3&size=6", "arith?difficulty=5&size=3"
MAX_NEW_TOKENS = 8
# Rendered with the raw template and the fixture's tokenizer, arith prompts are 9 (level 1),
# 11 (level 3) and 18 (level 5) tokens long: with 8 new tokens, level 5 exceeds 24 positions.
MAX_POSITIONS = 24


def brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    """Fraction of all k-subsets of n samples (c correct) holding a correct one."""
    outcomes = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(outcomes[i] for i in subset) for subset in subsets) / len(subsets)


@pytest.fixture(scope="module")
def hf_policy(tmp_path_factory) -> Path:
    """A random 2-layer Llama and a BPE tokenizer trained on arith problems, saved as an HF folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipeline.data import load_prompts
    from pipeline.models.tokenizer import train_tokenizer

    texts = []
    for difficulty in (1, 3, 5):
        prompts, _ = load_prompts(f"arith?difficulty={difficulty}&size=40", split="train")
        texts += [f"{p.problem} {p.metadata['solution']}" for p in prompts]
    tokenizer = train_tokenizer(texts, vocab_size=64)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=MAX_POSITIONS,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("policy")
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def pool():
    from pipeline.rewards import GradingPool

    with GradingPool(2, deadline_s=5.0) as grading_pool:
        yield grading_pool


def make_config(policy: Path, output_dir: Path, *extra: str) -> EvaluateConfig:
    # D5 is wholly too long on purpose (how a skipped benchmark is reported), so any fraction may be skipped.
    cfg = configlib.load(EvaluateConfig, overrides=[
        f"output_dir={output_dir}", "template=raw", "shard_size=4", "progress=false",
        f'eval.benchmarks=["{D1}", "{D3}", "{D5}"]', "eval.num_samples=4", "eval.ks=[1,2,4]",
        f"eval.max_new_tokens={MAX_NEW_TOKENS}", "eval.temperature=1.0", "eval.top_p=1.0",
        "eval.bootstrap_samples=200", "eval.max_skipped_fraction=1.0", *extra,
    ])
    return dataclasses.replace(cfg, policy=str(policy))


class CountingGenerate:
    """Stands in for ``LocalEngine.generate``: counts calls and can fail on a chosen one."""

    def __init__(self, original, *, fail_on_call: int | None = None) -> None:
        self.original = original
        self.fail_on_call = fail_on_call
        self.num_calls = 0

    def __get__(self, engine, owner=None):
        # A plain function attribute becomes a bound method; an instance needs this to.
        return lambda requests, params: self(engine, requests, params)

    def __call__(self, engine, requests, params):
        self.num_calls += 1
        if self.num_calls == self.fail_on_call:
            raise RuntimeError("simulated crash during generation")
        return self.original(engine, requests, params)


@pytest.fixture(scope="module")
def evaluated(hf_policy, pool, tmp_path_factory):
    """One uninterrupted evaluation: (output dir, results, number of engine calls)."""
    from pipeline.rollout.local import LocalEngine

    output_dir = tmp_path_factory.mktemp("uninterrupted")
    counter = CountingGenerate(LocalEngine.generate)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(LocalEngine, "generate", counter)
        results = run_evaluate(make_config(hf_policy, output_dir), pool=pool, out=lambda *_: None)
    return output_dir, results, counter.num_calls


def read_all_shards(output_dir: Path, spec: str) -> list[dict]:
    folder = output_dir / benchmark_directory(spec)
    return [json.loads(line) for path in sorted(folder.glob("shard_*.jsonl")) for line in path.read_text().splitlines()]


def iter_metric_entries(results: dict):
    for entry in results["benchmarks"].values():
        yield from entry["metrics"].values()
        for group in (entry["buckets"] or {"groups": {}})["groups"].values():
            yield from group["metrics"].values()
    for kind in ("macro", "weighted"):
        yield from results["aggregate"][kind].values()


# ----------------------------------------------------------------------------- end to end


def test_results_structure_and_files(evaluated):
    output_dir, results, num_calls = evaluated
    assert num_calls == 4  # 6 + 6 fitting problems in shards of 4; level 5 generates nothing
    assert list(results["benchmarks"]) == [D1, D3, D5]
    d1, d3, d5 = (results["benchmarks"][spec] for spec in (D1, D3, D5))
    assert (d1["num_problems"], d1["num_too_long"], d3["num_problems"], d3["num_too_long"]) == (6, 0, 6, 0)
    assert (d5["num_loaded"], d5["num_problems"], d5["num_too_long"], d5["metrics"]) == (3, 0, 3, {})
    assert list(d1["metrics"]) == ["pass@1", "pass@2", "pass@4", "avg@n"]
    assert d1["buckets"]["key"] == "difficulty" and list(d1["buckets"]["groups"]) == ["1"]
    assert results["aggregate"]["benchmarks"] == [D1, D3] and results["aggregate"]["num_problems"] == 12
    for spec in (D1, D3):
        shards = sorted((output_dir / benchmark_directory(spec)).glob("shard_*.jsonl"))
        assert [p.name for p in shards] == ["shard_00000.jsonl", "shard_00001.jsonl"]
    assert not (output_dir / benchmark_directory(D5)).exists()
    manifest = json.loads((output_dir / "manifest.json").read_text())
    assert manifest["status"] == "complete"
    assert manifest["fingerprint"]["num_samples"] == 4 and manifest["packages"]["torch"] == torch.__version__
    assert [s["status"] for s in manifest["benchmarks"][D1]["shards"]] == ["done", "done"]
    assert manifest["benchmarks"][D5]["shards"] == [] and manifest["benchmarks"][D5]["num_too_long"] == 3
    assert all(s["seconds"] > 0 for s in manifest["benchmarks"][D3]["shards"])
    assert json.loads((output_dir / "results.json").read_text())["benchmarks"] == results["benchmarks"]
    markdown = (output_dir / "results.md").read_text()
    assert f"| {D1} | 6 | 0 |" in markdown and f"| {D5} | 0 | 3 |" in markdown and "**macro**" in markdown
    assert (output_dir / "pass_at_k.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_shard_records_are_consistent(evaluated):
    output_dir, _, _ = evaluated
    for spec in (D1, D3):
        for record in read_all_shards(output_dir, spec):
            assert record["n"] == 4 and len(record["reasons"]) == 4
            assert record["c"] == record["reasons"].count("correct")
            assert record["difficulty"] == int(spec.split("difficulty=")[1][0]) and record["level"] is None
            assert len(record["responses"]) == 2


def test_pass_at_k_recomputed_from_shards_by_brute_force(evaluated):
    output_dir, results, _ = evaluated
    means = {}
    for spec in (D1, D3):
        records = read_all_shards(output_dir, spec)
        assert [r["id"] for r in records] == results["benchmarks"][spec]["problems"]["id"]
        for k in (1, 2, 4):
            expected = np.mean([brute_force_pass_at_k(r["n"], r["c"], k) for r in records])
            assert results["benchmarks"][spec]["metrics"][f"pass@{k}"]["value"] == pytest.approx(expected, abs=1e-12)
            means.setdefault(f"pass@{k}", []).append(expected)
        expected_avg = np.mean([r["c"] / r["n"] for r in records])
        assert results["benchmarks"][spec]["metrics"]["avg@n"]["value"] == pytest.approx(expected_avg, abs=1e-12)
    for metric, values in means.items():
        # Both benchmarks hold 6 problems, so macro and weighted coincide.
        assert results["aggregate"]["macro"][metric]["value"] == pytest.approx(np.mean(values), abs=1e-12)
        assert results["aggregate"]["weighted"][metric]["value"] == pytest.approx(np.mean(values), abs=1e-12)


def test_every_interval_contains_its_point_estimate(evaluated):
    _, results, _ = evaluated
    entries = list(iter_metric_entries(results))
    assert len(entries) == 2 * 4 + 2 * 4 + 2 * 4  # benchmarks, their buckets, macro and weighted
    for entry in entries:
        low, high = entry["ci"]
        assert 0.0 <= low <= entry["value"] + 1e-12 and entry["value"] - 1e-12 <= high <= 1.0


def test_resume_after_a_failed_shard_redoes_only_the_missing_shards(evaluated, hf_policy, pool, tmp_path, monkeypatch):
    from pipeline.rollout.local import LocalEngine

    reference_dir, reference, _ = evaluated
    original = LocalEngine.generate
    crashing = CountingGenerate(original, fail_on_call=2)
    monkeypatch.setattr(LocalEngine, "generate", crashing)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_evaluate(make_config(hf_policy, tmp_path), pool=pool, out=lambda *_: None)
    first = tmp_path / benchmark_directory(D1)
    assert sorted(p.name for p in first.iterdir()) == ["shard_00000.jsonl"]  # kept; no half-written file
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["status"] == "interrupted"
    assert [s["status"] for s in manifest["benchmarks"][D1]["shards"]] == ["done", "failed"]
    assert "simulated crash" in manifest["benchmarks"][D1]["shards"][1]["error"]

    resumed = CountingGenerate(original)
    monkeypatch.setattr(LocalEngine, "generate", resumed)
    results = run_evaluate(make_config(hf_policy, tmp_path), pool=pool, out=lambda *_: None)
    assert resumed.num_calls == 3  # D1 shard 1 and both D3 shards; D1 shard 0 is read back
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert [s["status"] for s in manifest["benchmarks"][D1]["shards"]] == ["reused", "done"]
    assert manifest["benchmarks"][D1]["shards"][0]["seconds"] > 0  # the original timing is kept
    assert results["benchmarks"] == reference["benchmarks"]
    assert results["aggregate"] == reference["aggregate"]
    for spec in (D1, D3):
        for path in sorted((reference_dir / benchmark_directory(spec)).glob("shard_*.jsonl")):
            assert (tmp_path / benchmark_directory(spec) / path.name).read_bytes() == path.read_bytes()

    finished = CountingGenerate(original)
    monkeypatch.setattr(LocalEngine, "generate", finished)
    # A finished evaluation re-aggregates (here with other k values) without generating anything.
    again = run_evaluate(make_config(hf_policy, tmp_path, "eval.ks=[1,4]"), out=lambda *_: None)
    assert finished.num_calls == 0
    assert list(again["benchmarks"][D1]["metrics"]) == ["pass@1", "pass@4", "avg@n"]


def test_a_benchmark_that_does_not_fit_the_context_is_refused_before_anything_generates(hf_policy, pool, tmp_path,
                                                                                       monkeypatch):
    from pipeline.rollout.local import LocalEngine

    counting = CountingGenerate(LocalEngine.generate)
    monkeypatch.setattr(LocalEngine, "generate", counting)
    cfg = make_config(hf_policy, tmp_path / "out", "eval.max_skipped_fraction=0.05")
    message = (rf"eval.max_skipped_fraction: {re.escape(D5)}: 3 of 3 problems \(100.0%\) do not fit the model's "
               rf"{MAX_POSITIONS} positions with eval.max_new_tokens={MAX_NEW_TOKENS}, above the allowed 5.0%")
    with pytest.raises(EvaluateError, match=message):
        run_evaluate(cfg, pool=pool, out=lambda *_: None)
    # D1 and D3 come first and fit, yet nothing generated and the output directory was not started.
    assert counting.num_calls == 0 and not (tmp_path / "out").exists()


def test_the_skipped_fraction_is_checked_per_benchmark_against_its_limit():
    cfg = configlib.load(EvaluateConfig, overrides=["eval.max_skipped_fraction=0.1"])
    check_skipped_fraction(BenchmarkPlan("math", "math", num_loaded=20, num_too_long=2, shards=[]), cfg=cfg,
                           max_positions=4096)  # exactly the limit
    with pytest.raises(EvaluateError, match=r"math: 3 of 20 problems \(15.0%\)"):
        check_skipped_fraction(BenchmarkPlan("math", "math", num_loaded=20, num_too_long=3, shards=[]), cfg=cfg,
                               max_positions=4096)
    assert EvaluateConfig().eval.max_skipped_fraction == 0.05
    with pytest.raises(configlib.ConfigError, match="eval.max_skipped_fraction"):
        configlib.load(EvaluateConfig, overrides=["eval.max_skipped_fraction=1.5"])


def test_a_changed_sampling_config_is_refused_in_the_same_output_dir(evaluated, hf_policy, pool, tmp_path):
    import shutil

    reference_dir, _, _ = evaluated
    shutil.copytree(reference_dir, tmp_path, dirs_exist_ok=True)
    with pytest.raises(EvaluateError, match=r"temperature: 1\.0 → 0\.5"):
        run_evaluate(make_config(hf_policy, tmp_path, "eval.temperature=0.5"), pool=pool, out=lambda *_: None)


def test_a_shard_holding_other_problems_is_refused(evaluated, hf_policy, pool, tmp_path):
    import shutil

    reference_dir, _, _ = evaluated
    shutil.copytree(reference_dir, tmp_path, dirs_exist_ok=True)
    shard = tmp_path / benchmark_directory(D3) / "shard_00001.jsonl"
    records = [json.loads(line) for line in shard.read_text().splitlines()]
    records[0]["id"] = "arith/somewhere-else"
    shard.write_text("".join(json.dumps(record) + "\n" for record in records))
    with pytest.raises(EvaluateError, match="holds other problems than shard 1"):
        run_evaluate(make_config(hf_policy, tmp_path), pool=pool, out=lambda *_: None)


def test_shard_seeds_depend_only_on_seed_benchmark_and_index():
    assert shard_seed(1234, D1, 3) == shard_seed(1234, D1, 3) == derive_seed("shard", 1234, D1, 3)
    seeds = {shard_seed(s, b, i) for s in (0, 1) for b in (D1, D3) for i in range(3)}
    assert len(seeds) == 12 and all(0 <= s < 2**63 for s in seeds)


# ----------------------------------------------------------------------------- units


def test_plan_sets_aside_prompts_longer_than_the_context(tmp_path, hf_policy):
    from transformers import AutoTokenizer

    from pipeline.data import render_prompt
    from pipeline.models.tokenizer import encode_prompt

    tokenizer = AutoTokenizer.from_pretrained(str(hf_policy), local_files_only=True)
    rows = [{"id": f"p{i}", "problem": "What is " + " + ".join(["1"] * (i + 1)) + "?", "answer": str(i + 1)} for i in range(9)]
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    cfg = make_config(hf_policy, tmp_path / "out", "shard_size=2", "eval.max_new_tokens=4")
    plan = plan_benchmark(str(data), cfg=cfg, tokenizer=tokenizer, max_positions=20)
    lengths = {row["id"]: len(encode_prompt(tokenizer, render_prompt(row["problem"], template="raw"))) for row in rows}
    expected = [row["id"] for row in rows if lengths[row["id"]] + 4 <= 20]
    assert 0 < len(expected) < len(rows)  # the cut falls inside the set
    assert [p.id for shard in plan.shards for p in shard.prompts] == expected
    assert [len(shard.prompts) for shard in plan.shards] == [2] * (len(expected) // 2) + [1] * (len(expected) % 2)
    assert [shard.seed for shard in plan.shards] == [
        shard_seed(cfg.eval.seed, str(data), index) for index in range(len(plan.shards))]
    assert plan.shards[1].path == tmp_path / "out" / benchmark_directory(str(data)) / "shard_00001.jsonl"
    assert (plan.num_loaded, plan.num_too_long) == (9, 9 - len(expected))
    assert plan_benchmark(str(data), cfg=cfg, tokenizer=tokenizer, max_positions=None).num_too_long == 0


def test_build_results_buckets_and_brute_force_on_hand_made_records():
    cfg = configlib.load(EvaluateConfig, overrides=["eval.num_samples=4", "eval.ks=[1,2,4]", "eval.bootstrap_samples=300"])
    counts = {"a": (4, 0, None), "b": (4, 1, 1), "c": (4, 3, 1), "d": (4, 2, 2), "e": (4, 4, 5)}
    records = [
        {"id": key, "n": n, "c": c, "level": level, "difficulty": None, "reasons": ["correct"] * c + ["wrong"] * (n - c),
         "num_generated_tokens": 10 * n}
        for key, (n, c, level) in counts.items()
    ]
    plan = BenchmarkPlan("math", "math", num_loaded=7, num_too_long=2, shards=[])
    results = build_results({"math": records}, plans={"math": plan}, cfg=cfg, policy_source="hf:/x")
    entry = results["benchmarks"]["math"]
    assert entry["reasons"] == {"correct": 10, "wrong": 10} and entry["mean_generated_tokens"] == 10.0
    for k in (1, 2, 4):
        expected = np.mean([brute_force_pass_at_k(n, c, k) for n, c, _ in counts.values()])
        assert entry["metrics"][f"pass@{k}"]["value"] == pytest.approx(expected, abs=1e-12)
    # pass@2 by hand: c=0 → 0; c=1 → 1 − C(3,2)/C(4,2) = 1/2; c≥2 → 1 − C(n−c,2)/6: c=2 → 5/6, c=3,4 → 1.
    assert entry["metrics"]["pass@2"]["value"] == pytest.approx((0 + 0.5 + 1 + 5 / 6 + 1) / 5)
    buckets = entry["buckets"]
    assert buckets["key"] == "level" and list(buckets["groups"]) == ["1", "2", "5", "unknown"]
    assert buckets["groups"]["1"]["num_problems"] == 2
    assert buckets["groups"]["1"]["metrics"]["avg@n"]["value"] == pytest.approx((1 / 4 + 3 / 4) / 2)
    assert buckets["groups"]["unknown"]["metrics"]["pass@4"] == {"value": 0.0, "ci": [0.0, 0.0]}
    for value in list(iter_metric_entries(results)):
        assert value["ci"][0] <= value["value"] <= value["ci"][1]


def test_benchmark_directories_are_file_system_safe():
    assert benchmark_directory("arith?difficulty=3&size=500") == "arith_difficulty=3_size=500"
    assert benchmark_directory("rg:gcd?difficulty=2") == "rg_gcd_difficulty=2"
    assert benchmark_directory("math500") == "math500"
    assert "/" not in benchmark_directory("/data/x/prompts.jsonl")


def test_missing_policy_is_a_config_error(tmp_path):
    from pipeline.configlib import ConfigError

    with pytest.raises(ConfigError, match="policy: required"):
        run_evaluate(configlib.load(EvaluateConfig, overrides=[f"output_dir={tmp_path}"]))


# ----------------------------------------------------------------------------- Megatron checkpoints

BOOTSTRAP_OVERRIDES = [
    'sources=["arith?difficulty=1&size=60"]', "vocab_size=64",
    "model.hidden_size=32", "model.ffn_hidden_size=64", "model.num_layers=2",
    "model.num_attention_heads=2", "model.num_query_groups=2", "model.max_position_embeddings=48",
    "optim.total_steps=3", "optim.warmup_steps=1", "batch_size=8", "progress=false",
]


def _bootstrap_worker(rank, world_size, cache_dir):
    """Bootstrap a tiny policy, then restore it the way the demo does; return its HF tensors."""
    from pipeline.config import BootstrapConfig
    from pipeline.models.spec import ModelSpec
    from pipeline.parallel.context import ParallelContext
    from pipeline.rollout.weight_sync import actor_hf_state
    from pipeline.stages.bootstrap import run_bootstrap
    from pipeline.trainer.actor import Actor
    from pipeline.checkpoint.manager import CheckpointManager

    cfg = configlib.load(BootstrapConfig, overrides=[*BOOTSTRAP_OVERRIDES, f"cache_dir={cache_dir}"])
    context = ParallelContext.initialize(tensor_parallel=1, pipeline_parallel=1, seed=cfg.seed)
    result = run_bootstrap(cfg, context=context)
    actor = Actor(spec=ModelSpec(**result.summary["model_spec"]), context=context, trainer=cfg.trainer,
                  optim=cfg.optim, seed=cfg.seed + 1)  # another init: the load must overwrite it
    manager = CheckpointManager(result.checkpoint_dir, keep_last=1)
    manager.load(manager.newest_valid(), actor=actor)
    reference = {name: tensor.clone() for name, tensor in actor_hf_state(actor)}
    context.destroy()
    return str(result.directory), reference


@pytest.mark.slow
def test_evaluates_a_megatron_checkpoint(tmp_path, pool):
    from pipeline.eval.policy import PolicyError, load_policy

    ((directory, reference),) = run_distributed(_bootstrap_worker, world_size=1, args=(str(tmp_path / "cache"),))
    directory = Path(directory)
    for path in (directory, directory / "checkpoints", directory / "checkpoints" / "step_00000003"):
        policy = load_policy(path)
        assert policy.kind == "megatron" and policy.source.endswith("step_00000003")
        state = policy.hf_model.state_dict()
        assert set(state) == set(reference)
        for name, tensor in reference.items():
            assert torch.equal(state[name], tensor), name
        assert policy.tokenizer.eos_token_id is not None and policy.max_position_embeddings == 48
    (directory / "tokenizer").rename(directory / "elsewhere")
    with pytest.raises(PolicyError, match="no tokenizer found"):
        load_policy(directory)
    cfg = make_config(directory, tmp_path / "eval", "tokenizer=" + str(directory / "elsewhere"),
                'eval.benchmarks=["arith?difficulty=1&size=4"]', "eval.num_samples=2", "eval.ks=[1,2]")
    results = run_evaluate(cfg, pool=pool, out=lambda *_: None)
    assert results["policy"].startswith("megatron:")
    assert results["benchmarks"]["arith?difficulty=1&size=4"]["num_problems"] == 4
    assert (tmp_path / "eval" / "results.md").is_file()


def test_unknown_policy_folder_is_a_clear_error(tmp_path):
    from pipeline.eval.policy import PolicyError, load_policy

    with pytest.raises(PolicyError, match="not a Hugging Face folder"):
        load_policy(tmp_path)
    with pytest.raises(PolicyError, match="does not exist"):
        load_policy(tmp_path / "missing")
