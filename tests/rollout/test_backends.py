"""The rollout backends' table: every entry builds its engines, names its servers, and unknown names fail."""

from __future__ import annotations

import types
import typing
from pathlib import Path

import pytest
import torch

from pipeline.config import RolloutConfig
from pipeline.configlib import ConfigError
from pipeline.registry import Registry
from pipeline.rollout.backends import (
    ROLLOUT_BACKENDS,
    ScoredPolicy,
    ServerLaunch,
    rollout_backend,
    serving_backend,
)
from pipeline.rollout.types import GenerationRequest, RolloutEngine, SamplingParams, WeightSink

LOCAL_URLS = ["http://127.0.0.1:30000", "http://127.0.0.1:30001"]


def _spec():
    from pipeline.models.spec import ModelSpec

    return ModelSpec(family="llama", vocab_size=32, hidden_size=16, ffn_hidden_size=32, num_layers=1,
                     num_attention_heads=2, num_query_groups=1, max_position_embeddings=32)


def _tokenizer_dir(tmp_path: Path) -> Path:
    from tests.rollout.test_weight_sync_streamed import _tokenizer

    return _tokenizer(tmp_path / "tokenizer")


def _tokenizer():
    return types.SimpleNamespace(eos_token_id=1, pad_token_id=None)


def _backends_with_servers():
    return [backend for backend in ROLLOUT_BACKENDS.values() if backend.servers is not None]


def test_an_unknown_backend_names_the_table():
    with pytest.raises(ConfigError, match=r"rollout.engine: unknown rollout backend 'vllm'; "
                                          r"choose one of \['local', 'sglang'\]"):
        rollout_backend("vllm")
    with pytest.raises(ConfigError, match=r"resources.rollout.server: no rollout backend is served by 'vllm'; "
                                          r"choose one of \['sglang', 'standin'\]"):
        serving_backend("vllm")


def test_the_config_literals_list_the_table():
    """``rollout.engine`` and a campaign's ``resources.rollout.server`` accept exactly what the table holds."""
    from pipeline.config import RolloutServers

    assert sorted(typing.get_args(typing.get_type_hints(RolloutConfig)["engine"])) == ROLLOUT_BACKENDS.names()
    programs = sorted(p for backend in _backends_with_servers() for p in backend.servers.modules)
    assert sorted(typing.get_args(typing.get_type_hints(RolloutServers)["server"])) == programs
    for backend in ROLLOUT_BACKENDS.values():
        assert rollout_backend(backend.name) is backend
        module = backend.implementation()
        assert callable(module.trainer_engine) and callable(module.scoring_engine)
        assert callable(getattr(module, "serve_arguments", None)) == (backend.servers is not None), backend.name


def test_the_config_knows_which_backends_have_servers():
    """The config floor cannot import the table: its list of served engines must match it."""
    from pipeline.config import ENGINES_WITH_SERVERS

    assert ENGINES_WITH_SERVERS == {backend.name for backend in _backends_with_servers()}


def test_the_table_refuses_a_second_entry_of_one_name():
    table: Registry[int] = Registry("widget")
    table.add("b", 2)
    table.add("a", 1)
    assert (table.names(), table.values(), "a" in table, "c" in table) == (["a", "b"], [1, 2], True, False)
    with pytest.raises(ValueError, match="widget 'a' is registered twice"):
        table.add("a", 3)
    with pytest.raises(ValueError, match=r"unknown widget 'c'; choose one of \['a', 'b'\]"):
        table.get("c")


def test_the_local_trainer_engine_decodes_in_process_and_syncs_in_process(tmp_path):
    from pipeline.rollout.local import LocalEngine
    from pipeline.rollout.weight_sync import LocalSyncedEngine

    backend = rollout_backend("local")
    assert backend.servers is None and backend.scoring_loads_weights
    engine = backend.trainer_engine(RolloutConfig(sync_bucket_mb=3), spec=_spec(), tokenizer=_tokenizer(),
                                    tokenizer_dir=tmp_path)
    try:
        assert type(engine) is LocalSyncedEngine and isinstance(engine.engine, LocalEngine)
        assert engine.bucket_bytes == 3 * 1024**2 and engine.engine.eos_token_ids == (1,)
        completions = engine.generate([GenerationRequest("p", [2, 3], 2)], SamplingParams(max_new_tokens=3, seed=1))
        assert [(c.prompt_id, c.sample_index, c.weight_version) for c in completions] == [("p", 0, 0), ("p", 1, 0)]
    finally:
        engine.close()
    with pytest.raises(ConfigError, match="rollout.engine: local generates in the trainer's processes; it has no "
                                          "servers"):
        backend.serve_command("sglang", ServerLaunch(python="py", model_path="m", tokenizer="m", host="h", port=1,
                                                     tensor_parallel=1, base_gpu_id=0, max_running_requests=8))


@pytest.mark.slow  # the engine's own process imports torch and transformers: seconds on a loaded machine
def test_the_local_trainer_engine_runs_in_a_process_of_its_own_one_step_off_policy(tmp_path):
    from pipeline.rollout.process_engine import ProcessEngine, ProcessSyncedEngine

    engine = rollout_backend("local").trainer_engine(RolloutConfig(max_staleness=1), spec=_spec(),
                                                     tokenizer=_tokenizer(), tokenizer_dir=tmp_path)
    try:
        assert type(engine) is ProcessSyncedEngine and isinstance(engine.engine, ProcessEngine)
    finally:
        engine.close()


def test_the_local_scoring_engine_decodes_the_stages_own_model():
    from pipeline.rollout.local import LocalEngine
    from pipeline.rollout.weight_sync import build_hf_model

    backend = rollout_backend("local")
    model = build_hf_model(_spec())
    engine = backend.scoring_engine(RolloutConfig(), ScoredPolicy(hf_model=model, eos_token_ids=(1, 5),
                                                                  pad_token_id=0), max_batch_rows=7,
                                    show_progress=False)
    assert isinstance(engine, LocalEngine) and isinstance(engine, RolloutEngine)
    assert (engine.model, engine.eos_token_ids, engine._max_batch_rows) == (model, (1, 5), 7)
    with pytest.raises(ConfigError, match="rollout.engine: local generates in this process and needs the "
                                          "policy's weights"):
        backend.scoring_engine(RolloutConfig(), ScoredPolicy(hf_model=None, eos_token_ids=(1,), pad_token_id=0))


@pytest.mark.parametrize("sync", ["disk", "distributed"])
def test_the_sglang_trainer_engine_syncs_through_its_servers_weight_sink(tmp_path, sync):
    from pipeline.rollout.sglang.generation import SGLangEngine
    from pipeline.rollout.sglang.weights import SGLangWeights, UpdateGroupSettings
    from pipeline.rollout.weight_sync import DiskSyncedEngine, DistributedSyncedEngine

    backend = rollout_backend("sglang")
    assert not backend.scoring_loads_weights
    cfg = RolloutConfig(engine="sglang", servers=LOCAL_URLS, weights_dir=str(tmp_path / "weights"), sync=sync,
                        server_tensor_parallel=2, sync_bucket_mb=2)
    # Building contacts no server: the loop's first sync or generation does.
    engine = backend.trainer_engine(cfg, spec=_spec(), tokenizer=_tokenizer(), tokenizer_dir=_tokenizer_dir(tmp_path))
    assert isinstance(engine.engine, SGLangEngine) and engine.engine.pool.live_servers == LOCAL_URLS
    assert isinstance(engine.sink, SGLangWeights) and isinstance(engine.sink, WeightSink)
    assert engine.sink.pool is engine.engine.pool and engine.bucket_bytes == 2 * 1024**2
    if sync == "disk":
        assert type(engine) is DiskSyncedEngine and engine.sink.update_group is None
        assert engine.weights_dir == tmp_path / "weights"
    else:
        assert type(engine) is DistributedSyncedEngine
        assert engine.sink.update_group == UpdateGroupSettings(
            backend="nccl" if torch.cuda.is_available() else "gloo", master_address="127.0.0.1", ranks_per_server=2)
        # The servers must report that tp_size; the collectives wait longer than the HTTP calls beside them.
        assert engine.engine.pool.expected_tp_size == 2
        assert engine.sink.collective_timeout_s > engine.engine.config.admin_timeout_s
    engine.close()


def test_the_sglang_scoring_engine_has_the_servers_load_the_scored_policy(tmp_path):
    from pipeline.rollout.sglang.backend import SERVED_WEIGHT_VERSION
    from pipeline.rollout.sglang.generation import SGLangEngine
    from tests.rollout.fake_sglang import start_fake_servers

    backend = rollout_backend("sglang")
    with pytest.raises(ConfigError, match="load the scored policy from a Hugging Face folder"):
        backend.scoring_engine(RolloutConfig(engine="sglang", servers=LOCAL_URLS, weights_dir="w"),
                               ScoredPolicy(hf_model=None, eos_token_ids=(1,), pad_token_id=0))
    (server,) = start_fake_servers(tmp_path, [{}])
    try:
        exported = []

        def served_folder() -> Path:
            exported.append(True)
            return tmp_path / "policy"

        rollout = RolloutConfig(engine="sglang", servers=[server.url], weights_dir=str(tmp_path))
        engine = backend.scoring_engine(rollout, ScoredPolicy(hf_model=None, eos_token_ids=(1,), pad_token_id=0,
                                                              served_folder=served_folder), show_progress=False)
        assert isinstance(engine, SGLangEngine) and engine.weight_version == SERVED_WEIGHT_VERSION == 1
        loads = [r["body"] for r in server.requests() if r["path"] == "/update_weights_from_disk"]
        assert exported == [True] and [(b["model_path"], b["weight_version"]) for b in loads] == [
            (str(tmp_path / "policy"), "1")]
        engine.close()
        assert server.process.poll() is None  # attached servers outlive the stage
    finally:
        server.kill()


def test_the_sglang_servers_start_with_one_command_line_for_either_program():
    launch = ServerLaunch(python="py", model_path="/models/m", tokenizer="/models/t", host="gpu-3", port=30002,
                          tensor_parallel=2, base_gpu_id=4, max_running_requests=96, extra_args=("--dtype", "bf16"))
    flags = ["--model-path", "/models/m", "--tokenizer-path", "/models/t", "--host", "gpu-3", "--port", "30002",
             "--tp-size", "2", "--base-gpu-id", "4", "--max-running-requests", "96", "--dtype", "bf16"]
    backend = rollout_backend("sglang")
    assert serving_backend("sglang") is serving_backend("standin") is backend
    assert backend.servers.health_path == "/health"
    assert backend.serve_command("sglang", launch) == ["py", "-m", "sglang.launch_server", *flags]
    assert backend.serve_command("standin", launch) == ["py", "-m", "pipeline.cli.standin", *flags]
    with pytest.raises(ConfigError, match=r"'vllm' does not serve the sglang backend; choose one of "
                                          r"\['sglang', 'standin'\]"):
        backend.serve_command("vllm", launch)


def test_the_standin_accepts_every_flag_of_the_serve_command():
    from pipeline.cli.standin import parse_args

    launch = ServerLaunch(python="py", model_path="m", tokenizer="t", host="h", port=3, tensor_parallel=1,
                          base_gpu_id=0, max_running_requests=5)
    command = rollout_backend("sglang").serve_command("standin", launch)
    args, ignored = parse_args(command[3:])
    assert ignored == [] and (args.model_path, args.host, args.port, args.max_running_requests) == ("m", "h", 3, 5)


def test_the_add_a_backend_page_shows_the_code_that_runs():
    """Every ``python`` block of docs/adding-a-backend.md is, after its first line naming the file, in that file."""
    import re

    root = Path(__file__).resolve().parents[2]
    blocks = re.findall(r"```python\n# (\S+)\n(.*?)```", (root / "docs" / "adding-a-backend.md").read_text(), re.S)
    assert [path for path, _ in blocks] == ["pipeline/rollout/backends.py", "pipeline/rollout/local_backend.py"]
    for path, code in blocks:
        assert code in (root / path).read_text(), f"docs/adding-a-backend.md shows code that is not in {path}"
