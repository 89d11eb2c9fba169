"""The rehearsal's CPU stand-in for SGLang: SGLang's wire contract, real decoding, weight pushes that change it.

The server runs as the ``serve`` role would start it (``python -m pipeline.cli.standin`` with
SGLang's flags) over a tiny Qwen2.5-shaped model; the client side is winnow's own request
builders and parsers, and every answer is also decoded with SGLang's ``api_types`` structs.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from pipeline.parallel.rendezvous import reserved_port
from pipeline.parallel.weight_transfer import UpdateGroup
from pipeline.rollout.sglang import protocol as api
from pipeline.rollout.types import SamplingParams
from tests.fixtures.real_models.families import write_hf_model
from tests.rollout import sglang_schema

REPO = Path(__file__).resolve().parents[2]
PROMPT = [5, 17, 42, 9, 3]


def _post(url: str, path: str, body: dict) -> tuple[int, object]:
    request = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            raw = response.read()
            status = response.status
    except urllib.error.HTTPError as error:
        raw, status = error.read(), error.code
    try:
        return status, json.loads(raw) if raw else None
    except json.JSONDecodeError:
        return status, raw.decode()


def _get(url: str, path: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(url + path, timeout=60) as response:
        return response.status, response.read()


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("standin")
    return write_hf_model("qwen2_5", root / "a", seed=0), write_hf_model("qwen2_5", root / "b", seed=1)


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    log = tmp_path_factory.mktemp("standin-log") / "requests.jsonl"
    with reserved_port() as port:
        command = [sys.executable, "-m", "pipeline.cli.standin", "--model-path", str(models[0]), "--host",
                   "127.0.0.1", "--port", str(port), "--tp-size", "1", "--base-gpu-id", "0",
                   "--mem-fraction-static", "0.85", "--request-log", str(log)]
        process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if _get(url, "/health")[0] == 200:
                    break
            except OSError:
                pass
            assert process.poll() is None, process.stdout.read()
            assert time.monotonic() < deadline, "the stand-in did not start"
            time.sleep(0.2)
        yield url, log
        process.kill()
        process.wait(timeout=10)


def _generate(url: str, seeds: list[int], *, max_new_tokens: int = 6) -> list[api.SampleOutput]:
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0)
    body = api.generate_body(PROMPT, sampling_seeds=seeds, params=params)
    sglang_schema.api_types().GenerateRequest.from_json_value(body)  # what SGLang accepts, we send
    status, payload = _post(url, "/generate", body)
    assert status == 200, payload
    for item in payload:  # what SGLang answers, it answers
        sglang_schema.api_types().GenerateResponse.from_json_value(item)
    return api.parse_generate_response(payload, num_samples=len(seeds), initial_version=0, current_version=0)


def _forward_logprobs(model_dir: Path, tokens: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, local_files_only=True)
    ids = torch.tensor([PROMPT + tokens])  # (1, P + T)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(PROMPT) - 1 : -1]  # (T, V): each predicts the next token
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]  # (T,)


def test_generate_keeps_sglangs_contract_and_its_logprobs_are_the_models(server, models) -> None:
    url, _ = server
    first, second = _generate(url, [11, 12])
    assert [sample.token_ids for sample in _generate(url, [11, 12])] == [first.token_ids, second.token_ids]
    assert first.token_ids != second.token_ids or first.logprobs != second.logprobs  # a batch of distinct draws
    torch.testing.assert_close(torch.tensor(first.logprobs), _forward_logprobs(models[0], first.token_ids),
                               atol=1e-4, rtol=0)
    assert _get(url, "/health_generate")[0] == 200
    status, info = 200, json.loads(_get(url, "/model_info")[1])
    assert info["weight_version"] == "default"
    # The one rank it plays in an update group, where the client checks rollout.server_tensor_parallel.
    assert api.parse_server_info_tp_size(json.loads(_get(url, api.SERVER_INFO_PATH)[1])) == 1


def test_a_disk_update_changes_what_it_generates(server, models) -> None:
    url, _ = server
    before = _generate(url, [7], max_new_tokens=8)[0]
    status, payload = _post(url, api.UPDATE_FROM_DISK_PATH, api.update_weights_from_disk_body(str(models[1]), version=3))
    assert status == 200 and payload["success"], payload
    after = _generate(url, [7], max_new_tokens=8)[0]
    assert after.weight_version == 3
    assert (after.token_ids, after.logprobs) != (before.token_ids, before.logprobs)
    torch.testing.assert_close(torch.tensor(after.logprobs), _forward_logprobs(models[1], after.token_ids),
                               atol=1e-4, rtol=0)
    status, payload = _post(url, api.UPDATE_FROM_DISK_PATH, api.update_weights_from_disk_body("/nonexistent", version=4))
    assert status == 400 and not payload["success"] and "does not exist" in payload["message"]
    assert _generate(url, [7], max_new_tokens=8)[0].weight_version == 3  # a refused update changes nothing


def test_the_update_group_pushes_weights_inside_a_session_only(server, models) -> None:
    from safetensors.torch import load_file

    url, log = server
    weights = load_file(str(models[0] / "model.safetensors"))  # back to model a, by broadcast this time
    names = sorted(weights)
    status, payload = _post(url, api.UPDATE_FROM_DISTRIBUTED_PATH, api.update_weights_from_distributed_body(
        names[:1], dtypes=["float32"], shapes=[list(weights[names[0]].shape)], version=5, group_name="g"))
    assert status == 400 and "must run between begin_weight_update" in payload["message"]  # the scheduler's refusal
    with reserved_port() as port, ThreadPoolExecutor(max_workers=1) as pool:  # answered once both ranks joined
        joined = pool.submit(_post, url, api.INIT_UPDATE_GROUP_PATH, api.init_weights_update_group_body(
            master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=2, group_name="g", backend="gloo"))
        group = UpdateGroup.join(master_address="127.0.0.1", master_port=port, rank=0, world_size=2, name="g",
                                 backend="gloo", timeout_s=60)
        assert joined.result()[1]["success"]
    try:
        assert _post(url, api.BEGIN_WEIGHT_UPDATE_PATH, api.begin_weight_update_body())[1]["success"]
        assert not _post(url, api.BEGIN_WEIGHT_UPDATE_PATH, api.begin_weight_update_body())[1]["success"]
        with ThreadPoolExecutor(max_workers=1) as pool:
            announced = pool.submit(_post, url, api.UPDATE_FROM_DISTRIBUTED_PATH,
                                    api.update_weights_from_distributed_body(
                                        names, dtypes=["float32"] * len(names),
                                        shapes=[list(weights[n].shape) for n in names], version=5, group_name="g"))
            group.broadcast([weights[n].contiguous() for n in names])
            assert announced.result()[1]["success"]
        assert _post(url, api.END_WEIGHT_UPDATE_PATH, api.end_weight_update_body())[1]["success"]
    finally:
        group.destroy()
    sample = _generate(url, [7], max_new_tokens=8)[0]
    assert sample.weight_version == 5
    torch.testing.assert_close(torch.tensor(sample.logprobs), _forward_logprobs(models[0], sample.token_ids),
                               atol=1e-4, rtol=0)
    status, payload = _post(url, api.DESTROY_UPDATE_GROUP_PATH, api.destroy_weights_update_group_body("g"))
    assert payload["success"]
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    assert {entry["path"] for entry in entries} >= {"/generate", "/update_weights_from_distributed"}
    assert {entry["weight_version"] for entry in entries if entry["path"] == "/generate"} >= {"default", "3", "5"}


def test_it_refuses_a_tp_size_it_cannot_play(models) -> None:
    result = subprocess.run([sys.executable, "-m", "pipeline.cli.standin", "--model-path", str(models[0]),
                             "--tp-size", "2"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stderr.startswith("error: --tp-size 2")
