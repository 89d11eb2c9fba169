"""The SGLang client's requests-in-flight limit: derived from the servers' running-request capacity.

One rule (``pipeline.config.rollout_in_flight_limit``) sets the client's limits, the servers'
``--max-running-requests`` and the line ``winnow plan`` prints.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline import configlib
from pipeline.config import RLConfig, RolloutConfig, rollout_in_flight_limit
from pipeline.configlib import ConfigError
from pipeline.launch import task
from pipeline.rollout.sglang import protocol as api
from pipeline.rollout.sglang import generation
from pipeline.rollout.sglang.client import SGLangClientConfig
from pipeline.rollout.sglang.generation import SGLangEngine
from pipeline.rollout.types import GenerationRequest, SamplingParams
from recipes.campaigns import llama31_8b
from tests.rollout.fake_sglang import start_fake_servers


def _rollout(num_servers: int, **options) -> RolloutConfig:
    return RolloutConfig(engine="sglang", servers=[f"http://r{i}:30000" for i in range(num_servers)],
                         weights_dir="w", **options)


@pytest.mark.parametrize(("num_servers", "sequences"), [(1, 256), (8, 2048), (16, 4096)])
def test_the_limit_is_servers_times_their_capacity(num_servers, sequences):
    limit = rollout_in_flight_limit(RolloutConfig(), num_servers=num_servers)
    assert (limit.sequences, limit.per_server, limit.derived) == (sequences, 256, True)
    assert limit.describe() == (f"{num_servers} server{'s' if num_servers > 1 else ''} × 256 = {sequences:,} "
                                "sequences (rollout.max_running_requests_per_server)")
    small = rollout_in_flight_limit(RolloutConfig(max_running_requests_per_server=48), num_servers=num_servers)
    assert small.sequences == 48 * num_servers


def test_an_explicit_total_wins_up_to_what_the_servers_run():
    limit = rollout_in_flight_limit(RolloutConfig(max_in_flight_sequences=3000), num_servers=16)
    assert (limit.sequences, limit.derived) == (3000, False)
    assert limit.describe() == ("3,000 sequences (rollout.max_in_flight_sequences; 16 servers × 256 = 4,096 "
                                "derived)")
    # The servers cannot run more than their capacity, whatever the client is allowed.
    assert rollout_in_flight_limit(RolloutConfig(max_in_flight_sequences=10_000), num_servers=2).sequences == 512


@pytest.mark.parametrize("override", ["rollout.max_running_requests_per_server=0",
                                      "rollout.max_running_requests_per_server=-4",
                                      "rollout.max_in_flight_sequences=0"])
def test_bad_values_fail_at_load_naming_the_field(override):
    field = override.split("=")[0]
    with pytest.raises(ConfigError, match=f"^{field}: .* must be >= 1"):
        configlib.load(RLConfig, overrides=[override])


def test_the_client_built_from_a_rollout_config_has_the_derived_limits():
    client = SGLangClientConfig.from_rollout(_rollout(16), show_progress=False)
    # 4,096 sequences in calls of 8: 512 calls, 32 per server (256 sequences).
    assert (client.max_samples_per_request, client.max_in_flight, client.max_in_flight_per_server) == (8, 512, 32)
    one = SGLangClientConfig.from_rollout(_rollout(1))
    assert (one.max_samples_per_request, one.max_in_flight, one.max_in_flight_per_server) == (8, 32, 32)
    explicit = SGLangClientConfig.from_rollout(_rollout(16, max_in_flight_sequences=3000))
    assert (explicit.max_in_flight, explicit.max_in_flight_per_server) == (375, 32)  # 375 × 8 = 3,000
    # A server that runs fewer sequences than a call would carry gets smaller calls, one at a time.
    small = SGLangClientConfig.from_rollout(_rollout(3, max_running_requests_per_server=5))
    assert (small.max_samples_per_request, small.max_in_flight, small.max_in_flight_per_server) == (5, 3, 1)
    chosen = SGLangClientConfig.from_rollout(_rollout(2, max_running_requests_per_server=16), max_samples_per_request=4)
    assert (chosen.max_samples_per_request, chosen.max_in_flight, chosen.max_in_flight_per_server) == (4, 8, 4)


def test_the_client_never_has_more_than_the_limit_in_flight(tmp_path: Path, monkeypatch):
    servers = start_fake_servers(tmp_path, [dict(delay_s=0.2), dict(delay_s=0.2)])
    running: dict[str, int] = {}
    peaks: dict[str, int] = {}
    peak_total = 0
    real_request = generation.call

    async def counted(client, method, url, *, body=None, **kwargs):
        # The sequences each server is generating: from the call leaving the client to its answer.
        nonlocal peak_total
        if not url.endswith(api.GENERATE_PATH):
            return await real_request(client, method, url, body=body, **kwargs)
        server, sequences = url[: -len(api.GENERATE_PATH)], len(body["input_ids"])
        running[server] = running.get(server, 0) + sequences
        peaks[server] = max(peaks.get(server, 0), running[server])
        peak_total = max(peak_total, sum(running.values()))
        try:
            return await real_request(client, method, url, body=body, **kwargs)
        finally:
            running[server] -= sequences

    monkeypatch.setattr(generation, "call", counted)
    try:
        rollout = RolloutConfig(engine="sglang", servers=[s.url for s in servers], weights_dir="w",
                                max_running_requests_per_server=16)
        config = SGLangClientConfig.from_rollout(rollout, show_progress=False, max_samples_per_request=4)
        engine = SGLangEngine.attach(rollout.servers, config=config)
        requests = [GenerationRequest(f"q{i}", [i + 2, 19], 4) for i in range(24)]  # 96 sequences, 3 rounds
        completions = engine.generate(requests, SamplingParams(max_new_tokens=3, temperature=1.0, seed=1))
    finally:
        for server in servers:
            server.kill()
    assert len(completions) == 96
    # Each server runs 16 at once, and the client fills them: 32 in flight, never more.
    assert peaks == {s.url: 16 for s in servers}
    assert peak_total == 32


def test_the_servers_are_started_with_the_configured_capacity():
    stage = llama31_8b(output_dir="/x").with_overrides(["rl-default.rollout.max_running_requests_per_server=96"]
                                                       ).stage("rl-default")
    commands = task.server_commands(stage, host="gpu-7", python="py")
    assert len(commands) == 4
    assert all(c[c.index("--max-running-requests") + 1] == "96" for c in commands)
    default = task.server_commands(llama31_8b(output_dir="/x").stage("curate"), host="gpu-7", python="py")
    assert all(c[c.index("--max-running-requests") + 1] == "256" for c in default)


def test_extra_args_cannot_set_the_capacity_apart_from_the_client():
    from pipeline.config import RolloutServers

    for args in (["--max-running-requests", "512"], ["--max-running-requests=512"]):
        with pytest.raises(ConfigError, match="rollout.extra_args: --max-running-requests is set by"):
            RolloutServers(nodes=1, extra_args=args)
    RolloutServers(nodes=1, extra_args=["--mem-fraction-static", "0.8"])


def test_the_standin_takes_the_flag_the_servers_are_started_with():
    from pipeline.cli.standin import parse_args

    args, ignored = parse_args(["--model-path", "m", "--max-running-requests", "300"])
    assert (args.max_running_requests, ignored) == (300, [])
