"""What a checkpoint on disk is: resolving run/step directories, the one tokenizer lookup,
``is_hf_folder``, and ``load_weights`` (a run or step directory, verified, into any model)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pipeline.checkpoint.artifact import (
    find_tokenizer_dir,
    is_hf_folder,
    load_weights,
    resolve_checkpoint,
    tokenizer_candidates,
)
from pipeline.errors import CheckpointError
from tests.checkpoint.tiny_models import build_hf_model, tiny_spec

LLAMA = tiny_spec("llama", tie_embeddings=False, num_query_groups=2)


def _step_dir(run: Path, step: int = 0, *, manifest: dict | None = None) -> Path:
    step_dir = run / f"step_{step:08d}"
    step_dir.mkdir(parents=True)
    (step_dir / "manifest.json").write_text(json.dumps({"step": step, "files": {}, **(manifest or {})}))
    return step_dir


def _tokenizer(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "tokenizer.json").write_text("{}")
    return folder


# --- the tokenizer lookup -----------------------------------------------------------------------


def test_tokenizer_candidates_follow_the_manifest_pointer_then_step_run_and_parent(tmp_path):
    step_dir = _step_dir(tmp_path / "cache" / "checkpoints", manifest={"tokenizer": "../../tok"})
    run = step_dir.parent
    assert tokenizer_candidates(step_dir) == [
        (tmp_path / "cache" / "tok").resolve(), step_dir / "tokenizer", run / "tokenizer", run.parent / "tokenizer",
    ]


def test_find_tokenizer_dir_takes_the_first_candidate_holding_tokenizer_files(tmp_path):
    step_dir = _step_dir(tmp_path / "run")
    (step_dir / "tokenizer").mkdir()  # present but empty: skipped
    in_run = _tokenizer(tmp_path / "run" / "tokenizer")
    _tokenizer(tmp_path / "tokenizer")
    assert find_tokenizer_dir(None, candidates=tokenizer_candidates(step_dir)) == in_run
    assert find_tokenizer_dir(None, candidates=[tmp_path / "nothing"]) is None


def test_an_explicit_tokenizer_must_hold_tokenizer_files(tmp_path):
    explicit = _tokenizer(tmp_path / "mine")
    fallback = _tokenizer(tmp_path / "fallback")
    assert find_tokenizer_dir(explicit, candidates=[fallback]) == explicit
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="not a folder holding tokenizer files"):
        find_tokenizer_dir(tmp_path / "empty", candidates=[fallback])  # never silently replaced


def test_is_hf_folder_needs_a_config_and_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert not is_hf_folder(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert is_hf_folder(tmp_path)


# --- resolving ----------------------------------------------------------------------------------


def test_resolve_checkpoint_follows_latest_and_refuses_a_bad_pointer(tmp_path):
    first, second = _step_dir(tmp_path, 1), _step_dir(tmp_path, 2)
    (tmp_path / "latest").write_text(first.name + "\n")
    assert resolve_checkpoint(tmp_path) == first
    assert resolve_checkpoint(tmp_path, step=2) == resolve_checkpoint(second) == second
    with pytest.raises(CheckpointError, match="already one checkpoint"):
        resolve_checkpoint(second, step=2)
    (tmp_path / "latest").write_text("elsewhere\n")
    with pytest.raises(CheckpointError, match="points to 'elsewhere'"):
        resolve_checkpoint(tmp_path)


def test_resolve_checkpoint_without_a_pointer_takes_the_newest_that_verifies(tmp_path):
    older, newer = _step_dir(tmp_path, 1), _step_dir(tmp_path, 2)
    (newer / "manifest.json").write_text(json.dumps({"files": {"weights/x": {"size": 1}}}))
    assert resolve_checkpoint(tmp_path) == older
    with pytest.raises(CheckpointError, match="weights/x is missing"):
        resolve_checkpoint(newer)  # designated: an error, never replaced by an older one


# --- loading weights ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def converted_run(tmp_path_factory, megatron_single_rank) -> dict[str, Path]:
    from pipeline.checkpoint.convert import hf_to_megatron

    root = tmp_path_factory.mktemp("artifact")
    build_hf_model(LLAMA).save_pretrained(root / "hf")
    hf_to_megatron(hf=root / "hf", out=root / "run", verify=False)
    return {"hf": root / "hf", "run": root / "run"}


def test_load_weights_resolves_a_run_directory_and_loads_exactly(converted_run, megatron_single_rank):
    from pipeline.checkpoint.convert import hf_to_megatron_state
    from pipeline.checkpoint.hf_io import HFCheckpointReader
    from pipeline.checkpoint.hf_map import MegatronLayout
    from pipeline.models.factory import build_gpt_model

    step_dir = converted_run["run"] / "step_00000000"
    expected = dict(hf_to_megatron_state(dict(HFCheckpointReader.open(converted_run["hf"]).iter_tensors()),
                                         spec=LLAMA, layout=MegatronLayout.build(LLAMA)))
    for path in (converted_run["run"], step_dir):  # a run directory or one of its steps: the same step
        model = build_gpt_model(LLAMA)
        assert load_weights(path, model) == step_dir
        parameters = dict(model.named_parameters())
        assert sorted(parameters) == sorted(expected)
        for name, tensor in expected.items():
            assert torch.equal(parameters[name], tensor), name


def test_load_weights_refuses_a_checkpoint_that_does_not_verify(converted_run, tmp_path, megatron_single_rank):
    from pipeline.models.factory import build_gpt_model

    run = Path(shutil.copytree(converted_run["run"], tmp_path / "run"))
    victim = max((run / "step_00000000" / "weights").glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="does not match its sha256"):
        load_weights(run, build_gpt_model(LLAMA))
