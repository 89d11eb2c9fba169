"""The batch source: one ``BATCH_SOURCES`` entry per ``rollout.max_staleness``, chosen once per run.

The loop's behaviour at each staleness is checked end to end elsewhere (``tests/rl/test_rl_loop.py``,
``tests/rl/test_async_rollouts.py``, ``tests/rl/test_stop_sync.py``); here: every staleness the
config accepts has its entry, the entry a run builds follows the config, and what each entry keeps
in a checkpoint (the batch generated ahead) round-trips or is refused.
"""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

from pipeline import configlib
from pipeline.config import RLConfig, RolloutConfig
from pipeline.rl.batches import BATCH_SOURCES, GenerateAhead, GenerateNow, build_batch_source, staleness_mode
from pipeline.rl.rollouts import RolloutBatch
from pipeline.rl.sampling import Sampled, SelectedPrompts
from pipeline.rl.setup import PreparedStep
from pipeline.rollout.types import Completion


def _prepared(step: int) -> PreparedStep:
    completions = [Completion(prompt_id="3#0", sample_index=i, token_ids=torch.tensor([5, 6 + i]),
                              logprobs=torch.tensor([-0.5, -0.25 * i]), finish_reason="stop", weight_version=step)
                   for i in range(2)]
    pool = RolloutBatch(torch.tensor([3]), [[1, 2]], torch.tensor([0, 0]), completions, ["a", "b"],
                        torch.tensor([1.0, 0.0]))
    return PreparedStep(step=step, seed=17, temperature=0.9, num_candidates=1,
                        selected=SelectedPrompts(torch.tensor([3]), None, torch.tensor([], dtype=torch.long)),
                        sampled=Sampled(pool=pool, train=pool, baseline=pool, metrics={}), metrics={"x": 1.0},
                        epoch_ended=False)


def _run(max_staleness: int) -> SimpleNamespace:
    cfg = configlib.load(RLConfig, overrides=[f"rollout.max_staleness={max_staleness}"])
    return SimpleNamespace(cfg=cfg)


def test_every_staleness_the_config_accepts_has_a_batch_source():
    (field,) = [f for f in dataclasses.fields(RolloutConfig) if f.name == "max_staleness"]
    accepted = range(field.metadata["ge"], field.metadata["le"] + 1)
    assert sorted(staleness_mode(s) for s in accepted) == BATCH_SOURCES.names() == ["ahead", "now"]
    assert [type(build_batch_source(_run(s))) for s in accepted] == [GenerateNow, GenerateAhead]


def test_ahead_keeps_its_batch_in_flight_in_the_checkpoint_and_gets_it_back():
    run = _run(1)
    source = build_batch_source(run)
    assert source.state() == ({}, {})  # nothing in flight: nothing in the checkpoint
    source.in_flight = _prepared(4)
    state, tensors = source.state()
    assert set(state) == {"in_flight"} and state["in_flight"]["step"] == 4
    assert tensors and all(name.startswith("in_flight.") for name in tensors)

    restored = build_batch_source(run)
    restored.load_state({"stream": {}, **json.loads(json.dumps(state))}, tensors)
    assert restored.in_flight.step == 4 and restored.in_flight.metrics == {"x": 1.0}
    assert torch.equal(restored.in_flight.sampled.pool.rewards, torch.tensor([1.0, 0.0]))
    assert restored.state()[0] == state


def test_now_refuses_a_checkpoint_holding_a_batch_generated_ahead():
    ahead = build_batch_source(_run(1))
    ahead.in_flight = _prepared(6)
    state, tensors = ahead.state()
    now = build_batch_source(_run(0))
    assert now.state() == ({}, {})
    now.load_state({"stream": {}}, {})  # a synchronous checkpoint resumes
    with pytest.raises(ValueError, match=r"holds step 6's batch, generated ahead .* rollout\.max_staleness=1"):
        now.load_state(state, tensors)
