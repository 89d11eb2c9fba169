"""Every body the SGLang client builds, checked against SGLang's own schema; responses in its shape."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.rollout.sglang import protocol as api
from pipeline.rollout.sglang.client import SGLangClientConfig
from pipeline.rollout.sglang.generation import SGLangEngine
from pipeline.rollout.types import RolloutError, SamplingParams
from tests.rollout import sglang_schema

API = sglang_schema.api_types()


def _wire(body: object) -> bytes:
    """What goes over HTTP (httpx's json= uses json.dumps)."""
    return json.dumps(body).encode()


def _check_generate_body(body: dict) -> None:
    request = API.GenerateRequest.from_json_value(json.loads(_wire(body)))  # the server's own 400 check
    for element in body["sampling_params"]:
        msgspec.json.decode(_wire(element), type=API.SamplingParams)
    assert request.return_logprob is True


sampling_params = st.builds(
    SamplingParams,
    max_new_tokens=st.integers(1, 4096),
    temperature=st.floats(0.0, 2.0),
    top_p=st.floats(0.01, 1.0),
    stop_token_ids=st.lists(st.integers(0, 200_000), max_size=4).map(tuple),
    stop_strings=st.lists(st.text(min_size=1, max_size=5), max_size=3).map(tuple),
    seed=st.none() | st.integers(0, 2**63 - 1),
    ignore_eos=st.booleans(),
)


@settings(max_examples=60, deadline=None)
@given(params=sampling_params, prompt=st.lists(st.integers(0, 150_000), min_size=1, max_size=20), k=st.integers(1, 5))
def test_generate_body_passes_sglang_contract(params: SamplingParams, prompt: list[int], k: int) -> None:
    seeds = [api.sample_seed(params.seed or 0, "prompt-x", s) for s in range(k)]
    body = api.generate_body(prompt, sampling_seeds=seeds, params=params)
    _check_generate_body(body)
    request = API.GenerateRequest.from_json_value(body)
    assert request.input_ids == [prompt] * k
    assert [p.sampling_seed for p in request.sampling_params] == seeds
    first = request.sampling_params[0]
    assert first.max_new_tokens == params.max_new_tokens and first.top_p == params.top_p
    assert first.temperature == params.temperature and first.ignore_eos == params.ignore_eos
    assert list(first.stop_token_ids or []) == list(params.stop_token_ids)
    assert list(first.stop or []) == list(params.stop_strings)
    assert first.n == 1


def test_the_contract_check_has_teeth() -> None:
    """SGLang rejects `seed` (its field is `sampling_seed`), and so does our check."""
    with pytest.raises(API.JsonContractError, match="unknown field `seed`"):
        API.GenerateRequest.from_json_value({"input_ids": [1], "sampling_params": {"seed": 3}})


def test_sample_seeds_are_stable_distinct_and_in_i64_range() -> None:
    seeds = {api.sample_seed(7, f"p{p}", s) for p in range(50) for s in range(20)}
    assert len(seeds) == 1000 and all(0 <= s < 2**63 for s in seeds)
    assert api.sample_seed(7, "p1", 3) == api.sample_seed(7, "p1", 3) != api.sample_seed(8, "p1", 3)


def _response(tokens: list[int], logprobs: list[float], *, finish: object, version: str | None) -> dict:
    """A /generate result in SGLang's documented shape, encoded by SGLang's own codec."""
    meta = API.GenerateMetaInfo(
        id="abc",
        prompt_tokens=3,
        completion_tokens=len(tokens),
        finish_reason=finish,
        output_token_logprobs=[API.LogprobEntry(logprob=lp, token_id=t) for lp, t in zip(logprobs, tokens)],
        weight_version=version,
    )
    encoded = API.GenerateResponse(text="xyz", meta_info=meta, output_ids=tokens).to_json_value()
    assert API.GenerateResponse.from_json_value(encoded) is not None
    return encoded


def test_parse_generate_response_in_sglang_shape() -> None:
    batch = [
        _response([5, 6, 2], [-0.5, -1.25, -0.01], finish=API.FinishStop(matched=2), version="3"),
        _response([9, 9], [-2.0, -0.1], finish=API.FinishLength(length=2), version="3"),
        _response([], [], finish=API.FinishAbort(message="aborted", status_code=503), version="3"),
    ]
    assert batch[0]["meta_info"]["output_token_logprobs"][0] == [-0.5, 5, None]
    assert batch[0]["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}
    outputs = api.parse_generate_response(json.loads(_wire(batch)), num_samples=3, initial_version=0, current_version=3)
    assert [o.token_ids for o in outputs] == [[5, 6, 2], [9, 9], []]
    assert outputs[0].logprobs == [-0.5, -1.25, -0.01]
    assert [o.finish_reason for o in outputs] == ["stop", "length", "abort"]
    assert {o.weight_version for o in outputs} == {3}
    # A single (non-batch) answer is an object, not a list.
    single = api.parse_generate_response(batch[1], num_samples=1, initial_version=0, current_version=3)
    assert single[0].token_ids == [9, 9]


def test_weight_version_mapping() -> None:
    parse = api.parse_weight_version
    assert parse("default", initial_version=4, current_version=9) == 4
    assert parse(None, initial_version=4, current_version=9) == 9
    assert parse("12", initial_version=4, current_version=9) == 12
    with pytest.raises(api.MalformedResponse, match="weight_version"):
        parse("v2-final", initial_version=0, current_version=0)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda r: r.pop("meta_info"), "meta_info"),
        (lambda r: r["meta_info"].update(finish_reason={"type": "weird"}), "finish_reason"),
        (lambda r: r["meta_info"].update(finish_reason=None), "finish_reason"),
        (lambda r: r["meta_info"].pop("output_token_logprobs"), "return_logprob"),
        (lambda r: r["meta_info"]["output_token_logprobs"].append([-0.1, 4]), "entries"),
        (lambda r: r["meta_info"]["output_token_logprobs"].append([None, 4, None]), "log-probability"),
        (lambda r: r["meta_info"]["output_token_logprobs"].append([-0.1, -4, None]), "token id"),
        (lambda r: r.update(output_ids=[1, 2, 3]), "output_ids"),
        (lambda r: r["meta_info"].update(completion_tokens=7), "completion_tokens"),
        (lambda r: r["meta_info"].update(weight_version="latest"), "weight_version"),
    ],
)
def test_malformed_responses_are_rejected(mutate, match: str) -> None:
    response = _response([5, 6], [-0.5, -1.0], finish=API.FinishLength(length=2), version="0")
    mutate(response)
    with pytest.raises(api.MalformedResponse, match=match):
        api.parse_generate_response(response, num_samples=1, initial_version=0, current_version=0)
    with pytest.raises(api.MalformedResponse, match="expected 2 results"):
        api.parse_generate_response([response], num_samples=2, initial_version=0, current_version=0)


def _decode_io_struct(name: str, body: dict) -> object:
    decoded = msgspec.json.decode(_wire(body), type=sglang_schema.io_struct(name))
    assert sglang_schema.io_struct_required(name) <= set(body), "a required field is missing"
    return decoded


def test_update_weights_from_disk_body() -> None:
    body = api.update_weights_from_disk_body("/ckpt/step_10/hf", version=10, load_format="safetensors")
    decoded = _decode_io_struct("UpdateWeightFromDiskReqInput", body)
    assert decoded.model_path == "/ckpt/step_10/hf" and decoded.weight_version == "10"
    assert decoded.flush_cache is True and decoded.abort_all_requests is False and decoded.load_format == "safetensors"


def test_update_weights_from_distributed_and_group_bodies() -> None:
    body = api.update_weights_from_distributed_body(
        ["model.embed_tokens.weight", "lm_head.weight"],
        dtypes=["torch.bfloat16", "float32"],
        shapes=[(100, 8), [100, 8]],
        version=5,
    )
    decoded = _decode_io_struct("UpdateWeightsFromDistributedReqInput", body)
    assert decoded.dtypes == ["bfloat16", "float32"] and decoded.shapes == [[100, 8], [100, 8]]
    assert decoded.group_name == "weight_update_group" and decoded.weight_version == "5"
    with pytest.raises(ValueError, match="one length"):
        api.update_weights_from_distributed_body(["a"], dtypes=[], shapes=[[1]], version=1)
    group = api.init_weights_update_group_body(
        master_address="10.0.0.1", master_port=29600, rank_offset=3, world_size=5
    )
    decoded_group = _decode_io_struct("InitWeightsUpdateGroupReqInput", group)
    assert (decoded_group.rank_offset, decoded_group.world_size, decoded_group.backend) == (3, 5, "nccl")
    destroy = _decode_io_struct("DestroyWeightsUpdateGroupReqInput",
                                api.destroy_weights_update_group_body("winnow-weights-3"))
    assert destroy.group_name == "winnow-weights-3"
    server_source = (sglang_schema.sglang_dir() / "srt" / "entrypoints" / "http_server.py").read_text()
    assert f'@app.post("{api.DESTROY_UPDATE_GROUP_PATH}")' in server_source


def test_weight_update_session_bodies() -> None:
    """SGLang 0.5.23's session endpoints: begin takes a runner selector, end takes nothing."""
    begin = _decode_io_struct("BeginWeightUpdateReqInput", api.begin_weight_update_body())
    assert begin.selector == "all"
    assert _decode_io_struct("BeginWeightUpdateReqInput", api.begin_weight_update_body("target")).selector == "target"
    _decode_io_struct("EndWeightUpdateReqInput", api.end_weight_update_body())
    assert sglang_schema.io_struct_required("EndWeightUpdateReqInput") == set()
    with pytest.raises(msgspec.ValidationError, match="selector"):
        _decode_io_struct("EndWeightUpdateReqInput", {"selector": "all"})
    with pytest.raises(ValueError, match="selector"):
        api.begin_weight_update_body("everything")
    # The endpoints exist on the server, and the distributed update is one that needs a session.
    server_source = (sglang_schema.sglang_dir() / "srt" / "entrypoints" / "http_server.py").read_text()
    for path in (api.BEGIN_WEIGHT_UPDATE_PATH, api.END_WEIGHT_UPDATE_PATH, api.UPDATE_FROM_DISTRIBUTED_PATH):
        assert f'@app.post("{path}")' in server_source
    updater = (sglang_schema.sglang_dir() / "srt" / "managers" / "scheduler_components" / "weight_updater.py")
    updater_source = updater.read_text()
    assert f"{api.UPDATE_FROM_DISTRIBUTED_PATH.lstrip('/')} must run between" in updater_source
    assert "update_weights_from_disk must run between" not in updater_source


def test_strict_mirror_catches_a_typo() -> None:
    with pytest.raises(msgspec.ValidationError, match="flush_cach"):
        _decode_io_struct("UpdateWeightFromDiskReqInput", {"model_path": "/x", "flush_cach": True})


def test_update_response_parsing() -> None:
    assert api.parse_update_response({"success": True, "message": "ok", "num_paused_requests": 0}) == (True, "ok")
    assert api.parse_update_response({"success": False, "message": "bad path"}) == (False, "bad path")
    with pytest.raises(api.MalformedResponse):
        api.parse_update_response({"message": "no success field"})


def test_launch_command_uses_only_real_sglang_flags() -> None:
    flags = sglang_schema.launch_server_flags()
    spec = api.SGLangServerSpec(
        model_path="/models/qwen",
        port=31000,
        tp_size=2,
        base_gpu_id=2,
        mem_fraction_static=0.7,
        dtype="bfloat16",
        random_seed=3,
        weight_version=7,
        enable_deterministic_inference=True,
    )
    command = api.launch_command(spec)
    assert command[1:3] == ["-m", "sglang.launch_server"]
    assert (sglang_schema.sglang_dir() / "launch_server.py").exists()
    args = command[3:]
    index = 0
    while index < len(args):
        flag = args[index]
        assert flag in flags, f"{flag} is not a sglang.launch_server flag"
        if flags[flag]:
            index += 1
        else:
            assert not args[index + 1].startswith("--"), f"{flag} needs a value"
            index += 2
    pairs = dict(zip(args[::1], args[1::1]))
    assert pairs["--host"] == "127.0.0.1" and pairs["--port"] == "31000" and pairs["--weight-version"] == "7"
    assert "0.0.0.0" not in command
    assert spec.base_url == "http://127.0.0.1:31000"
    assert api.SGLangServerSpec(model_path="m", port=1, host="::1").base_url == "http://[::1]:1"
    with pytest.raises(ValueError, match="port"):
        api.SGLangServerSpec(model_path="m", port=0)


def test_launch_reports_a_server_that_exits(tmp_path: Path) -> None:
    """In this CPU venv sglang cannot even import, so the launched server dies at once."""
    spec = api.SGLangServerSpec(model_path=str(tmp_path / "no-model"), port=39871)
    config = SGLangClientConfig(startup_timeout_s=60, health_poll_s=0.1, probe_timeout_s=1, show_progress=False)
    with pytest.raises(RolloutError, match=r"exited with code \d+ before becoming healthy") as info:
        SGLangEngine.launch([spec], log_dir=tmp_path, config=config)
    assert "sglang.launch_server" in str(info.value)
    assert (tmp_path / "sglang-0-port39871.log").exists()


@pytest.mark.timeout(20)
def test_attach_gives_up_at_the_deadline() -> None:
    from pipeline.parallel.rendezvous import free_port

    port = free_port()  # nothing listens on it
    config = SGLangClientConfig(startup_timeout_s=1.0, health_poll_s=0.1, probe_timeout_s=0.5, show_progress=False)
    with pytest.raises(RolloutError, match="not healthy within 1s"):
        SGLangEngine.attach([f"http://127.0.0.1:{port}"], config=config)
