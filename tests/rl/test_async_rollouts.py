"""One-step-off-policy rollouts (``rollout.max_staleness=1``): the engine process, the batch in flight, kill -9.

The synchronous loop (``max_staleness=0``) is the code path the rest of ``tests/rl`` and
``tests/reliability`` check; here: the option is checked at load, the engine in its own
process generates what the in-process engine generates, the batch in flight survives a
checkpoint bit for bit, and a run killed with ``kill -9`` and relaunched ends exactly as an
uninterrupted asynchronous run, with no sample older than one version and every prompt
counted once. The end-to-end run uses Reinforce-Ada-Seq: its rounds run inside the
prefetched step, every round with that step's (one version old) weights.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch

from pipeline.models.spec import ModelSpec
from pipeline.rollout.types import Completion, GenerationRequest, RolloutError, SamplingParams

SPEC = ModelSpec(family="llama", vocab_size=64, hidden_size=32, ffn_hidden_size=64, num_layers=2,
                 num_attention_heads=4, num_query_groups=2, max_position_embeddings=64)


@pytest.mark.parametrize("override, message", [
    ("rollout.max_staleness=2", r"rollout\.max_staleness: 2 is out of range; must be <= 1"),
    ("rollout.max_staleness=-1", r"rollout\.max_staleness: -1 is out of range; must be >= 0"),
    ("rollout.max_staleness=one", r"rollout\.max_staleness: expected an integer"),
])
def test_max_staleness_is_checked_at_load(override, message):
    from pipeline import configlib
    from pipeline.config import RLConfig
    from pipeline.configlib import ConfigError

    with pytest.raises(ConfigError, match=message):
        configlib.load(RLConfig, overrides=[override])
    served = configlib.load(RLConfig, overrides=["rollout.max_staleness=1", "rollout.engine=sglang",
                                                 'rollout.servers=["http://127.0.0.1:30000"]', "rollout.weights_dir=w"])
    assert served.rollout.max_staleness == 1  # SGLang servers generate ahead too (tests/rl/test_async_sglang.py)


def _completion(prompt_id: str, index: int, tokens: list[int], version: int) -> Completion:
    ids = torch.tensor(tokens, dtype=torch.long)
    return Completion(prompt_id=prompt_id, sample_index=index, token_ids=ids, logprobs=-torch.rand(len(tokens)),
                      finish_reason="stop" if tokens else "length", weight_version=version)


def test_the_batch_in_flight_survives_a_checkpoint_file_exactly(tmp_path):
    from safetensors.torch import load_file, save_file

    from pipeline.rl.rollouts import RolloutBatch
    from pipeline.rl.sampling import Sampled, SelectedPrompts
    from pipeline.rl.setup import PreparedStep

    completions = [_completion("7#0", 0, [3, 4, 5], 4), _completion("7#0", 1, [], 4), _completion("2#1", 0, [9], 4)]
    pool = RolloutBatch(torch.tensor([7, 2]), [[1, 2], [1, 2, 3]], torch.tensor([0, 0, 1]), completions,
                        ["a", "", "b"], torch.tensor([0.1, -1.0, 1.0]))
    train = pool.select_samples(torch.tensor([True, False, True]))
    prepared = PreparedStep(step=4, seed=11, temperature=0.7, num_candidates=3,
                            selected=SelectedPrompts(torch.tensor([7, 2, 5])[:2], torch.tensor([0.5, 0.25]),
                                                     torch.tensor([5])),
                            sampled=Sampled(pool=pool, train=train, baseline=pool, metrics={"ada/rounds": 2.0}),
                            metrics={"ada/rounds": 2.0, "e3/g_min": 1.0}, epoch_ended=True, generate_seconds=3.0)
    state, tensors = prepared.to_state()
    save_file(tensors, str(tmp_path / "t.safetensors"))  # what the checkpoint manager writes
    loaded = PreparedStep.from_state(json.loads(json.dumps(state)), load_file(str(tmp_path / "t.safetensors")))

    assert (loaded.step, loaded.seed, loaded.temperature, loaded.num_candidates, loaded.epoch_ended) == (4, 11, 0.7, 3, True)
    assert loaded.metrics == prepared.metrics and loaded.sampled.metrics == {"ada/rounds": 2.0}
    for name in ("indices", "predicted_pass_rate", "dropped"):
        assert torch.equal(getattr(loaded.selected, name), getattr(prepared.selected, name))
    for part in ("pool", "train", "baseline"):
        expected, actual = getattr(prepared.sampled, part), getattr(loaded.sampled, part)
        assert torch.equal(actual.prompt_indices, expected.prompt_indices)
        assert actual.prompt_token_ids == expected.prompt_token_ids and actual.texts == expected.texts
        assert torch.equal(actual.group_ids, expected.group_ids) and torch.equal(actual.rewards, expected.rewards)
        assert [(c.prompt_id, c.sample_index, c.finish_reason, c.weight_version) for c in actual.completions] == \
            [(c.prompt_id, c.sample_index, c.finish_reason, c.weight_version) for c in expected.completions]
        for a, e in zip(actual.completions, expected.completions):
            assert torch.equal(a.token_ids, e.token_ids) and torch.equal(a.logprobs, e.logprobs)
    assert loaded.sampled.train.num_samples == 2


def _random_weights(seed: int) -> dict[str, torch.Tensor]:
    from pipeline.rollout.weight_sync import build_hf_model

    torch.manual_seed(seed)
    # Peaked distributions: sampling differs visibly between weight versions.
    return {name: torch.randn_like(p) * 0.5 for name, p in build_hf_model(SPEC).named_parameters()}


def test_the_engine_process_generates_what_the_local_engine_does_and_reports_its_death():
    from pipeline.rollout.local import LocalEngine
    from pipeline.rollout.process_engine import ProcessEngine, split_threads
    from pipeline.rollout.weight_sync import build_hf_model

    assert split_threads(2) == (1, 1) and split_threads(5) == (3, 2) and split_threads(1) == (1, 1)
    requests = [GenerationRequest(prompt_id="a", prompt_token_ids=(1, 2, 3), num_samples=3),
                GenerationRequest(prompt_id="b", prompt_token_ids=(4,), num_samples=2)]
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=5)
    local = LocalEngine(build_hf_model(SPEC), eos_token_ids=63, pad_token_id=0, show_progress=False)
    remote = ProcessEngine(SPEC, eos_token_ids=63, pad_token_id=0, num_threads=torch.get_num_threads())
    try:
        outputs = []
        for version, seed in ((1, 0), (2, 1)):
            weights = _random_weights(seed)
            local.update_weights(weights.items(), version=version)
            remote.update_weights(iter(weights.items()), version=version)
            expected, actual = local.generate(requests, params), remote.generate(requests, params)
            assert remote.weight_version == version
            assert [(c.prompt_id, c.sample_index, c.finish_reason, c.weight_version) for c in actual] == \
                [(c.prompt_id, c.sample_index, c.finish_reason, version) for c in expected]
            for a, e in zip(actual, expected):
                assert torch.equal(a.token_ids, e.token_ids) and torch.equal(a.logprobs, e.logprobs)
            outputs.append([c.token_ids.tolist() for c in actual])
        assert outputs[0] != outputs[1]  # the second push reached the child's model
        with pytest.raises(ValueError, match="must exceed the current weight version 2"):
            remote.update_weights(iter(weights.items()), version=2)
        with pytest.raises(RolloutError, match="token id >= vocab size"):  # the child's error, then it goes on
            remote.generate([GenerationRequest(prompt_id="c", prompt_token_ids=(99,), num_samples=1)], params)
        assert len(remote.generate(requests, params)) == 5
        os.kill(remote._process.pid, signal.SIGKILL)
        with pytest.raises(RolloutError, match="exited with code -9"):
            remote.generate(requests, params)
    finally:
        remote.close()


def _engine_processes(pid: int) -> list[int]:
    """The children of ``pid`` named as the rollout engine's process."""
    from pipeline.rollout.process_engine import PROCESS_NAME

    children = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as handle:
            children += [int(child) for child in handle.read().split()]
    return [child for child in children if _comm(child) == PROCESS_NAME.decode()]


def _comm(pid: int) -> str | None:
    """The name of process ``pid``; None once it has exited (a zombie nobody reaps counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            stat = handle.read()
    except FileNotFoundError:
        return None
    name, state = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2]
    return None if state in "ZX" else name


@pytest.mark.slow
def test_kill_9_mid_async_run_then_resume_matches_an_uninterrupted_async_run(tmp_path, bootstrap_cache_dir):
    from tests.reliability.test_reliability_interruptions import (
        NUM_STEPS,
        STARTUP_TIMEOUT_S,
        STOP_TIMEOUT_S,
        _assert_same_outcome,
        _latest_checkpoint_step,
        _launch,
        _log_tail,
        _rows,
        _run_to_completion,
        _wait_for_exit,
    )

    extra = ["rollout.max_staleness=1", "algorithm.sampling=ada_seq", "algorithm.ada_seq.max_samples=8",
             "eval_set=arith?difficulty=3&size=8"]
    reference, killed = tmp_path / "uninterrupted", tmp_path / "killed"
    _run_to_completion(reference, bootstrap_cache_dir, "uninterrupted", extra=extra)

    process = _launch(killed, bootstrap_cache_dir, "killed", extra=extra)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not (killed / "ckpt" / "latest").is_file():  # killed once the first checkpoint (step 2) is published
        assert process.poll() is None and time.monotonic() < deadline, _log_tail(killed)
        time.sleep(0.02)
    engine_processes = _engine_processes(process.pid)
    assert len(engine_processes) == 1  # the engine generates in a process of its own
    process.send_signal(signal.SIGKILL)
    assert _wait_for_exit(process, killed, STOP_TIMEOUT_S) == -signal.SIGKILL
    resumed_from = _latest_checkpoint_step(killed)
    assert resumed_from < NUM_STEPS, "the kill came after the last checkpoint"
    in_flight = json.loads((killed / "ckpt" / f"step_{resumed_from:08d}" / "state.json").read_text())["in_flight"]
    assert in_flight["step"] == resumed_from  # the next step's batch, generated before the kill, is in it
    assert {version for part in ("pool", "train") for version in in_flight[part]["weight_versions"]} == {resumed_from}
    # The engine process notices its trainer's death and exits (no orphan holding a core).
    deadline = time.monotonic() + 15
    while any(_comm(pid) for pid in engine_processes) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in engine_processes if _comm(pid)]
    _run_to_completion(killed, bootstrap_cache_dir, "relaunched", extra=extra)

    _assert_same_outcome(killed, reference)  # rows, final weights and optimizer, statistics; each prompt once
    rows = _rows(reference)[1:]
    # The first step is generated at start, on policy; every later one by the previous version.
    assert [(row["rollout/staleness_mean"], row["rollout/staleness_max"]) for row in rows] == \
        [(0.0, 0.0)] + [(1.0, 1.0)] * (NUM_STEPS - 1)
    assert max(row["ada/rounds"] for row in rows) > 1  # several rounds inside a prefetched step, one version
    assert all(row["correction/ratio_mean"] > 0 for row in rows)  # TIS is on by default at staleness 1
