"""SGLangEngine against real HTTP servers on 127.0.0.1 that die, hang, lie and refuse.

Every test checks the whole delivery: each requested ``(prompt, sample)`` exactly once,
in order, with exactly the tokens the fake model produces for that sample's seed and
the serving weight version — so a lost, duplicated or mixed-up sample fails the test.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from pipeline.rollout.sglang import protocol as api
from pipeline.rollout.sglang.client import SGLangClientConfig
from pipeline.rollout.sglang.generation import SGLangEngine
from pipeline.rollout.sglang.weights import SGLangWeights
from pipeline.rollout.types import Completion, GenerationRequest, RolloutError, SamplingParams
from tests.rollout.fake_sglang import FakeServer, expected_sample, start_fake_servers

SEED = 1234
PARAMS = SamplingParams(max_new_tokens=6, temperature=1.0, seed=SEED, stop_token_ids=(7, 11, 500))


def _config(**overrides: Any) -> SGLangClientConfig:
    settings: dict[str, Any] = dict(
        max_in_flight=8,
        max_samples_per_request=2,
        request_timeout_s=20.0,
        connect_timeout_s=2.0,
        backoff_initial_s=0.05,
        backoff_max_s=0.2,
        startup_timeout_s=20.0,
        health_poll_s=0.05,
        watchdog_interval_s=None,
        probe_timeout_s=0.5,
        admin_timeout_s=10.0,
        show_progress=False,
    )
    settings.update(overrides)
    return SGLangClientConfig(**settings)


def _requests(num_prompts: int = 12) -> list[GenerationRequest]:
    return [GenerationRequest(f"q{i}", [i + 1, 17, 3 * i + 2], 1 + i % 5) for i in range(num_prompts)]


def _assert_exact_delivery(
    completions: list[Completion], requests: list[GenerationRequest], *, version: str = "default", as_int: int = 0
) -> None:
    expected_keys = [(r.prompt_id, s) for r in requests for s in range(r.num_samples)]
    assert [(c.prompt_id, c.sample_index) for c in completions] == expected_keys
    prompts = {r.prompt_id: list(r.prompt_token_ids) for r in requests}
    for c in completions:
        tokens, logprobs, finish = expected_sample(
            prompts[c.prompt_id],
            sampling_seed=api.sample_seed(SEED, c.prompt_id, c.sample_index),
            weight_version=version,
            max_new_tokens=PARAMS.max_new_tokens,
            stop_token_ids=list(PARAMS.stop_token_ids),
        )
        assert c.token_ids.tolist() == tokens
        assert c.logprobs.tolist() == pytest.approx(logprobs, abs=1e-6)
        assert c.finish_reason == finish and c.weight_version == as_int


@pytest.fixture
def servers(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[list[FakeServer]]:
    started = start_fake_servers(tmp_path, request.param)
    yield started
    for server in started:
        server.kill()


def _ok(n: int, **kwargs: Any) -> list[dict[str, Any]]:
    return [dict(kwargs) for _ in range(n)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("servers", [_ok(3, delay_s=0.02)], indirect=True)
def test_every_sample_exactly_once_and_load_balanced(servers: list[FakeServer]) -> None:
    engine = SGLangEngine.attach([s.url for s in servers], config=_config())
    requests = _requests()
    completions = engine.generate(requests, PARAMS)
    _assert_exact_delivery(completions, requests)
    counts = [len(s.generate_bodies()) for s in servers]
    assert sum(counts) == sum(-(-r.num_samples // 2) for r in requests)  # ceil(n / 2) calls per prompt
    assert min(counts) >= sum(counts) // 6, counts  # round-robin over least-loaded servers
    for server in servers:
        for body in server.generate_bodies():
            assert len(body["input_ids"]) == len(body["sampling_params"]) <= 2
    assert engine.pool.live_servers == [s.url for s in servers]
    # A second batch on the same engine reproduces the first (per-sample seeds).
    again = engine.generate(requests, PARAMS)
    assert [c.token_ids.tolist() for c in again] == [c.token_ids.tolist() for c in completions]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("servers", [_ok(3, delay_s=0.15)], indirect=True)
def test_server_killed_mid_batch(servers: list[FakeServer]) -> None:
    engine = SGLangEngine.attach([s.url for s in servers], config=_config(max_in_flight=6))
    requests = _requests(16)
    served = threading.Event()

    def kill_once_it_has_served() -> None:
        # Mid-batch by construction: after its first /generate arrived (a fixed timer raced the
        # client's start-up on a loaded machine and killed a server that had served nothing).
        deadline = time.monotonic() + 30.0
        while not servers[1].generate_bodies() and time.monotonic() < deadline and not served.is_set():
            time.sleep(0.01)
        servers[1].kill()

    killer = threading.Thread(target=kill_once_it_has_served, daemon=True)
    killer.start()
    try:
        completions = engine.generate(requests, PARAMS)
    finally:
        served.set()
        killer.join(timeout=5)
    _assert_exact_delivery(completions, requests)
    assert servers[1].process.poll() is not None
    assert 0 < len(servers[1].generate_bodies()) < sum(-(-r.num_samples // 2) for r in requests)
    assert list(engine.pool.dead_servers) == [servers[1].url]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "servers", [[{"delay_s": 0.05}, {"mode": "die_after", "die_after": 2, "delay_s": 0.05}]], indirect=True
)
def test_server_dying_with_requests_in_flight(servers: list[FakeServer]) -> None:
    engine = SGLangEngine.attach([s.url for s in servers], config=_config())
    requests = _requests()
    completions = engine.generate(requests, PARAMS)
    _assert_exact_delivery(completions, requests)
    assert list(engine.pool.dead_servers) == [servers[1].url]
    assert len(servers[1].generate_bodies()) >= 3  # it died on the third, taking the others in flight with it


@pytest.mark.timeout(60)
@pytest.mark.parametrize("servers", [_ok(2, delay_s=0.05)], indirect=True)
def test_hung_process_is_dropped_by_the_watchdog(servers: list[FakeServer]) -> None:
    engine = SGLangEngine.attach([s.url for s in servers], config=_config(watchdog_interval_s=0.2, probe_timeout_s=0.3))
    servers[1].stop()  # SIGSTOP: connections are accepted, nothing ever answers
    requests = _requests()
    start = time.monotonic()
    completions = engine.generate(requests, PARAMS)
    elapsed = time.monotonic() - start
    _assert_exact_delivery(completions, requests)
    # Well before request_timeout_s (20 s): three failed probes at 0.2 s intervals.
    assert elapsed < 10, elapsed
    assert "health probe failed" in engine.pool.dead_servers[servers[1].url]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("servers", [[{"delay_s": 0.02}, {"mode": "hang_generate"}]], indirect=True)
def test_hanging_generate_times_out(servers: list[FakeServer]) -> None:
    engine = SGLangEngine.attach([s.url for s in servers], config=_config(request_timeout_s=0.5))
    requests = _requests(8)
    start = time.monotonic()
    completions = engine.generate(requests, PARAMS)
    _assert_exact_delivery(completions, requests)
    assert time.monotonic() - start < 10
    assert "no answer" in engine.pool.dead_servers[servers[1].url]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "servers, reason",
    [
        ([{"delay_s": 0.02}, {"mode": "malformed"}], "malformed JSON"),
        ([{"delay_s": 0.02}, {"mode": "http500"}], "HTTP 500"),
        ([{"delay_s": 0.02}, {"weight_version": "5"}], "serves weight version [5]"),
    ],
    indirect=["servers"],
)
def test_faulty_server_is_dropped_and_its_work_redone(servers: list[FakeServer], reason: str) -> None:
    engine = SGLangEngine.attach([s.url for s in servers], config=_config())
    requests = _requests()
    completions = engine.generate(requests, PARAMS)
    _assert_exact_delivery(completions, requests)
    assert reason in engine.pool.dead_servers[servers[1].url]
    # Dropped after max_consecutive_failures=3; calls already in flight then were abandoned.
    assert 3 <= len(servers[1].generate_bodies()) <= 8


@pytest.mark.timeout(60)
@pytest.mark.parametrize("servers", [[{"mode": "http500"}, {"mode": "malformed"}]], indirect=True)
def test_no_server_left_raises(servers: list[FakeServer]) -> None:
    engine = SGLangEngine.attach([s.url for s in servers], config=_config())
    with pytest.raises(RolloutError, match="no SGLang server left"):
        engine.generate(_requests(), PARAMS)
    assert engine.pool.live_servers == []
    with pytest.raises(RolloutError, match="no SGLang server left"):
        engine.generate(_requests(2), PARAMS)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("servers", [[{"delay_s": 0.02}, {"mode": "http400"}]], indirect=True)
def test_rejected_request_raises_at_once(servers: list[FakeServer]) -> None:
    engine = SGLangEngine.attach([s.url for s in servers], config=_config())
    with pytest.raises(RolloutError, match="rejected /generate for prompt .*context length"):
        engine.generate(_requests(), PARAMS)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("servers", [[{"mode": "hang_generate"}]], indirect=True)
def test_batch_timeout_bounds_the_call(servers: list[FakeServer]) -> None:
    engine = SGLangEngine.attach([s.url for s in servers], config=_config(batch_timeout_s=1.0))
    start = time.monotonic()
    with pytest.raises(RolloutError, match="batch_timeout_s=1 passed with 0 of"):
        engine.generate(_requests(3), PARAMS)
    assert time.monotonic() - start < 5


@pytest.mark.timeout(60)
@pytest.mark.parametrize("servers", [_ok(2)], indirect=True)
def test_weight_update_from_disk_then_flush_then_new_version(servers: list[FakeServer]) -> None:
    engine = SGLangEngine.attach([s.url for s in servers], config=_config())
    requests = _requests(6)
    _assert_exact_delivery(engine.generate(requests, PARAMS), requests)
    SGLangWeights(engine.pool).load_from_disk("/exports/step_1", version=1)
    assert engine.weight_version == 1
    for server in servers:
        paths = [r["path"] for r in server.requests() if r["path"] != "/generate"]
        assert paths == ["/update_weights_from_disk", "/flush_cache"]
        body = server.requests()[-2]["body"]
        assert body["model_path"] == "/exports/step_1" and body["weight_version"] == "1"
    _assert_exact_delivery(engine.generate(requests, PARAMS), requests, version="1", as_int=1)
    with pytest.raises(ValueError, match="current weight version 1"):
        SGLangWeights(engine.pool).load_from_disk("/exports/step_0", version=1)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("servers", [[{}, {"fail_updates": True}]], indirect=True)
def test_update_failing_on_one_server_drops_it(servers: list[FakeServer]) -> None:
    engine = SGLangEngine.attach([s.url for s in servers], config=_config())
    SGLangWeights(engine.pool).load_from_disk("/exports/step_2", version=2)
    assert engine.weight_version == 2
    assert "refusing the update" in engine.pool.dead_servers[servers[1].url]
    requests = _requests(4)
    _assert_exact_delivery(engine.generate(requests, PARAMS), requests, version="2", as_int=2)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("servers", [[{"fail_updates": True}, {"fail_updates": True}]], indirect=True)
def test_update_failing_everywhere_keeps_the_version(servers: list[FakeServer]) -> None:
    engine = SGLangEngine.attach([s.url for s in servers], config=_config())
    with pytest.raises(RolloutError, match="failed on every server"):
        SGLangWeights(engine.pool).load_from_disk("/exports/step_3", version=3)
    assert engine.weight_version == 0 and len(engine.pool.live_servers) == 2
    requests = _requests(3)
    _assert_exact_delivery(engine.generate(requests, PARAMS), requests)


def test_result_of_an_abandoned_attempt_is_discarded() -> None:
    """Two attempts on one server finish in the same loop turn; the failure is handled
    first and drops the server, so the other attempt is abandoned and its (successful)
    result must be discarded, its work re-queued — never delivered twice."""
    from tqdm import tqdm

    from pipeline.rollout.sglang.client import ServerFault
    from pipeline.rollout.sglang.generation import _Attempt, _Batch, _Work

    requests = _requests(2)
    engine = SGLangEngine(["http://127.0.0.1:9", "http://127.0.0.1:10"], config=_config(max_consecutive_failures=1))
    server = engine.pool.servers[0]
    output = api.SampleOutput(token_ids=[1], logprobs=[-0.5], finish_reason="length", weight_version=0)

    async def scenario() -> _Batch:
        bar = tqdm(disable=True)
        batch = _Batch(engine.pool, client=None, requests=requests, params=PARAMS, bar=bar)  # type: ignore[arg-type]

        async def succeed() -> list[api.SampleOutput]:
            return [output]

        async def fail() -> list[api.SampleOutput]:
            raise ServerFault("boom")

        works = [_Work(request_index=r, sample_indices=(0,), seeds=(r,)) for r in range(2)]
        ok_task, failed_task = asyncio.create_task(succeed()), asyncio.create_task(fail())
        await asyncio.sleep(0)
        assert ok_task.done() and failed_task.done()
        batch.tasks = {
            ok_task: _Attempt(work=works[0], server=server),
            failed_task: _Attempt(work=works[1], server=server),
        }
        server.in_flight = 2
        batch._finish(failed_task, batch.tasks.pop(failed_task))
        assert server.dead and len(batch.pending) == 2 and all(w in batch.pending for w in works)
        batch._finish(ok_task, batch.tasks.pop(ok_task))
        return batch

    batch = asyncio.run(scenario())
    assert batch.results == {} and server.in_flight == 0
    assert all(work.avoid is server for work in batch.pending)
