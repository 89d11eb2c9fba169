"""Curation and evaluation through the SGLang engine, on fake SGLang servers (``tests.rollout.fake_sglang``).

The fake servers' tokens are a function of (prompt ids, sampling seed, weight version), so
``_ReplayEngine`` produces in process exactly the completions the servers must give. The
stages then have to write the same bytes either way: the SGLang plumbing (loading the policy,
per-sample seeds, stop tokens, failover) changes nothing but where the tokens come from.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from pipeline import configlib
from pipeline.config import CurateConfig, EvaluateConfig
from pipeline.rollout.sglang import protocol as sglang_protocol
from pipeline.rollout.sglang.backend import SERVED_WEIGHT_VERSION
from pipeline.rollout.types import Completion
from pipeline.stages.curate import run_curate
from pipeline.stages.evaluate import run_evaluate
from tests.rollout.fake_sglang import REPO_ROOT, expected_sample, start_fake_servers

BENCHMARK = "arith?difficulty=2&size=12"
EVAL_OPTIONS = [f"eval.benchmarks={json.dumps([BENCHMARK])}", "eval.num_samples=4", "eval.ks=[1,2,4]",
                "eval.max_new_tokens=6", "eval.bootstrap_samples=50", "shard_size=4", "template=raw",
                "reward.num_workers=1", "progress=false"]


class _ReplayEngine:
    """In process, the completions the fake servers give for the policy loaded as ``SERVED_WEIGHT_VERSION``."""

    weight_version = SERVED_WEIGHT_VERSION

    def generate(self, requests, params):
        completions = []
        for request in requests:
            for index in range(request.num_samples):
                tokens, logprobs, finish = expected_sample(
                    list(request.prompt_token_ids),
                    sampling_seed=sglang_protocol.sample_seed(params.seed, request.prompt_id, index),
                    weight_version=str(SERVED_WEIGHT_VERSION), max_new_tokens=params.max_new_tokens,
                    stop_token_ids=list(params.stop_token_ids))
                completions.append(Completion(
                    prompt_id=request.prompt_id, sample_index=index, token_ids=torch.tensor(tokens),
                    logprobs=torch.tensor(logprobs, dtype=torch.float32), finish_reason=finish,
                    weight_version=SERVED_WEIGHT_VERSION))
        return completions

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    """A random 1-layer Llama and the demo's kind of tokenizer, as a Hugging Face folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipeline.models.tokenizer import train_tokenizer

    tokenizer = train_tokenizer([f"What is {a} + {b}? \\boxed{{{a + b}}}" for a in range(20) for b in range(20)],
                                vocab_size=48)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("policy")
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def _served(servers, tmp_path) -> list[str]:
    return ["rollout.engine=sglang", f"rollout.servers={json.dumps([s.url for s in servers])}",
            f"rollout.weights_dir={tmp_path / 'weights'}", "rollout.request_timeout_s=30"]


def _files(directory, pattern) -> dict[str, bytes]:
    return {str(path.relative_to(directory)): path.read_bytes() for path in sorted(directory.glob(pattern))}


def _without_times(results: dict) -> dict:
    return {key: value for key, value in results.items() if key not in ("created", "engine")}


@pytest.fixture(scope="module")
def evaluated(policy_dir, tmp_path_factory):
    """The same evaluation in process (replayed completions) and on two servers, one of which dies mid-stage."""
    tmp_path = tmp_path_factory.mktemp("evaluate")
    replayed = run_evaluate(
        configlib.load(EvaluateConfig, overrides=[f"policy={policy_dir}", f"output_dir={tmp_path / 'replay'}",
                                                  *EVAL_OPTIONS]),
        engine=_ReplayEngine(), out=lambda line: None)
    servers = start_fake_servers(tmp_path, [{"mode": "die_after", "die_after": 1}, {}])
    try:
        cfg = configlib.load(EvaluateConfig, overrides=[f"policy={policy_dir}", f"output_dir={tmp_path / 'sglang'}",
                                                        *EVAL_OPTIONS, *_served(servers, tmp_path)])
        results = run_evaluate(cfg, out=lambda line: None)
        servers[0].process.wait(timeout=10)
        bodies = [body for server in servers for body in server.generate_bodies()]
        loads = [r["body"] for server in servers for r in server.requests()
                 if r["path"] == "/update_weights_from_disk"]
    finally:
        for server in servers:
            server.kill()
    return tmp_path, replayed, results, bodies, loads, servers[0].process.returncode


def test_evaluation_on_servers_equals_the_in_process_engine_for_the_same_completions(evaluated, policy_dir):
    tmp_path, replayed, results, bodies, loads, first_exit = evaluated
    assert first_exit == 3  # the die_after server went away mid-stage
    # both servers loaded the scored policy itself, once, as the served version
    assert [(load["model_path"], load["weight_version"]) for load in loads] == [
        (str(policy_dir.resolve()), str(SERVED_WEIGHT_VERSION))] * 2
    assert _files(tmp_path / "sglang", "*/shard_*.jsonl") == _files(tmp_path / "replay", "*/shard_*.jsonl")
    assert _without_times(results) == _without_times(replayed)
    entry = results["benchmarks"][BENCHMARK]
    assert entry["problems"]["n"] == [4] * entry["num_problems"]  # no sample lost or duplicated by the failover
    assert entry["num_generated_tokens"] > 0 and results["num_generated_tokens"] == entry["num_generated_tokens"]
    assert results["engine"] == "sglang" and replayed["engine"] == "local"
    # every sample its own seed, and the stop tokens travel with it
    seeds = [params["sampling_seed"] for body in bodies for params in body["sampling_params"]]
    assert len(set(seeds)) == 12 * 4 <= len(seeds)  # the died server's batch was resent: seeds repeat, samples don't
    assert all(params["stop_token_ids"] for body in bodies for params in body["sampling_params"])


def test_curation_on_servers_equals_the_in_process_engine_for_the_same_completions(policy_dir, tmp_path):
    options = [f"sources={json.dumps(['arith?difficulty=2&size=10'])}", f"policy={policy_dir}", "num_samples=3",
               "max_new_tokens=6", "shard_size=4", "template=raw", "reward.num_workers=1", "progress=false",
               "rules.drop_impossible=false"]
    run_curate(configlib.load(CurateConfig, overrides=[*options, f"output_dir={tmp_path / 'replay'}"]),
               engine=_ReplayEngine(), out=lambda line: None)
    servers = start_fake_servers(tmp_path, [{"mode": "die_after", "die_after": 1}, {}])
    try:
        run_curate(configlib.load(CurateConfig, overrides=[*options, f"output_dir={tmp_path / 'sglang'}",
                                                           *_served(servers, tmp_path)]), out=lambda line: None)
    finally:
        for server in servers:
            server.kill()
    outputs = ("shards/*.parquet", "pass_rates.parquet", "kept.jsonl", "report.md")
    for pattern in outputs:
        assert _files(tmp_path / "sglang", pattern) == _files(tmp_path / "replay", pattern), pattern
    manifest = json.loads((tmp_path / "sglang" / "manifest.json").read_text())
    assert manifest["engine"] == "sglang" and manifest["counts"]["total"] == 10
    assert manifest["num_generated_tokens"] == sum(shard["num_generated_tokens"] for shard in manifest["shards"]) > 0


_EVALUATE_SCRIPT = """
import sys
from pipeline import configlib
from pipeline.config import EvaluateConfig
from pipeline.stages.evaluate import run_evaluate
run_evaluate(configlib.load(EvaluateConfig, overrides=sys.argv[1:]), out=lambda line: None)
"""


@pytest.mark.slow
def test_evaluation_on_servers_resumes_after_kill_9_to_the_same_bytes(evaluated, policy_dir, tmp_path):
    reference_dir = evaluated[0] / "replay"
    # slow servers, so the kill lands after the first shard and before the last
    servers = start_fake_servers(tmp_path, [{"delay_s": 0.4}, {"delay_s": 0.4}])
    output_dir = tmp_path / "killed"
    args = [sys.executable, "-c", _EVALUATE_SCRIPT, f"policy={policy_dir}", f"output_dir={output_dir}",
            *EVAL_OPTIONS, *_served(servers, tmp_path)]
    try:
        process = subprocess.Popen(args, cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
        deadline = time.monotonic() + 120
        while not list(output_dir.glob("*/shard_00000.jsonl")):
            assert process.poll() is None and time.monotonic() < deadline, "no shard written"
            time.sleep(0.05)
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
        assert not (output_dir / "results.json").exists()
        run_evaluate(configlib.load(EvaluateConfig, overrides=args[3:]), out=lambda line: None)
    finally:
        for server in servers:
            server.kill()
    manifest = json.loads((output_dir / "manifest.json").read_text())
    statuses = [shard["status"] for shard in manifest["benchmarks"][BENCHMARK]["shards"]]
    assert statuses[0] == "reused" and "done" in statuses  # resumed: finished shards kept, the rest sampled
    assert _files(output_dir, "*/shard_*.jsonl") == _files(reference_dir, "*/shard_*.jsonl")
    assert _without_times(json.loads((output_dir / "results.json").read_text())) == _without_times(
        json.loads((reference_dir / "results.json").read_text()))
