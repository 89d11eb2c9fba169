"""HF checkpoint folders: streaming reader with named errors, atomic sharded writer that transformers loads."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.checkpoint.hf_io import (
    CONFIG_FILE,
    GENERATION_CONFIG_FILE,
    INDEX_FILE,
    SINGLE_FILE,
    CheckpointError,
    HFCheckpointReader,
    write_hf_checkpoint,
)
from tests.checkpoint.tiny_models import build_hf_model, hf_saved_state, random_hf_state, tiny_spec

SPEC = tiny_spec("qwen2", tie_embeddings=False, num_layers=2)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """save_pretrained folders of one random model: sharded (with index) and single-file."""
    model = build_hf_model(SPEC)
    root = tmp_path_factory.mktemp("hf")
    model.save_pretrained(root / "sharded", max_shard_size="20KB")
    model.save_pretrained(root / "single")
    return {"sharded": root / "sharded", "single": root / "single", "state": hf_saved_state(model, SPEC)}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, **{f"w{i}": i + 3 for i in range(20)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="</s>"
    )
    folder = tmp_path_factory.mktemp("tokenizer")
    tokenizer.save_pretrained(folder)
    (folder / GENERATION_CONFIG_FILE).write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1, "do_sample": True, "temperature": 0.6}))
    return folder


def _copy(source: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(source, tmp_path / "ckpt"))


def _weight_map(folder: Path) -> dict[str, str]:
    return json.loads((folder / INDEX_FILE).read_text())["weight_map"]


# --- reading ----------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["sharded", "single"])
def test_reader_validates_and_streams_a_transformers_checkpoint(saved, layout):
    reader = HFCheckpointReader.open(saved[layout])
    assert reader.spec == SPEC
    expected = saved["state"]
    assert sorted(reader.names()) == sorted(expected)
    for name, tensor in reader.iter_tensors():
        assert torch.equal(tensor, expected[name]), name
    name = "model.layers.1.self_attn.k_proj.bias"
    assert torch.equal(reader.get_tensor(name), expected[name])
    if layout == "sharded":
        assert len({reader.info(n).file for n in reader.names()}) > 1


def test_missing_shard_is_named(saved, tmp_path):
    folder = _copy(saved["sharded"], tmp_path)
    victim = _weight_map(folder)["model.layers.1.mlp.down_proj.weight"]
    (folder / victim).unlink()
    with pytest.raises(CheckpointError, match=rf"missing shard: .*{INDEX_FILE} maps \d+ tensors .* to .*{victim}, which does not exist"):
        HFCheckpointReader.open(folder)
    assert not (folder / victim).exists()


def test_index_naming_a_file_that_does_not_exist_is_named(saved, tmp_path):
    folder = _copy(saved["sharded"], tmp_path)
    index = json.loads((folder / INDEX_FILE).read_text())
    index["weight_map"]["model.norm.weight"] = "model-00009-of-00009.safetensors"
    (folder / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"missing shard: .*'model.norm.weight'.*model-00009-of-00009.safetensors"):
        HFCheckpointReader.open(folder)


def test_index_pointing_a_tensor_at_the_wrong_shard_is_named(saved, tmp_path):
    folder = _copy(saved["sharded"], tmp_path)
    index = json.loads((folder / INDEX_FILE).read_text())
    weight_map = index["weight_map"]
    other = next(f for f in sorted(set(weight_map.values())) if f != weight_map["model.norm.weight"])
    weight_map["model.norm.weight"] = other
    (folder / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"missing tensor 'model.norm.weight': .* maps it to .*{other}, which lacks it"):
        HFCheckpointReader.open(folder)


@pytest.mark.parametrize("damage", ["truncate", "garbage_header"])
def test_truncated_or_corrupt_safetensors_file_is_named(saved, tmp_path, damage):
    folder = _copy(saved["sharded"], tmp_path)
    victim = folder / _weight_map(folder)["model.layers.0.mlp.gate_proj.weight"]
    data = victim.read_bytes()
    victim.write_bytes(data[:-64] if damage == "truncate" else data[:8] + b"{not json" + data[17:])
    with pytest.raises(CheckpointError, match=rf"corrupt or truncated safetensors file: {victim}"):
        HFCheckpointReader.open(folder)


def test_shape_not_matching_config_is_named(saved, tmp_path):
    folder = _copy(saved["single"], tmp_path)
    config = json.loads((folder / CONFIG_FILE).read_text())
    config["intermediate_size"] = 64
    (folder / CONFIG_FILE).write_text(json.dumps(config))
    with pytest.raises(
        CheckpointError,
        match=r"shape mismatch for tensor 'model\.layers\.0\.mlp\.\w+_proj\.weight' in .*model\.safetensors: "
        r"the file has \((48, 32|32, 48)\), .*config\.json implies \((64, 32|32, 64)\)",
    ):
        HFCheckpointReader.open(folder)


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"model_type": "mistral"}, r"unsupported model_type 'mistral'; supported: \['llama', 'qwen2', 'qwen3'\]"),
        ({"architectures": ["Qwen2ForSequenceClassification"]}, r"unsupported architectures \['Qwen2ForSequenceClassification'\]"),
        ({"use_sliding_window": True}, r"use_sliding_window"),
    ],
)
def test_unsupported_architecture_is_named(saved, tmp_path, edit, message):
    folder = _copy(saved["single"], tmp_path)
    config = json.loads((folder / CONFIG_FILE).read_text())
    (folder / CONFIG_FILE).write_text(json.dumps({**config, **edit}))
    with pytest.raises(CheckpointError, match=message):
        HFCheckpointReader.open(folder)


def test_missing_and_unexpected_tensors_are_named(saved, tmp_path):
    folder = _copy(saved["single"], tmp_path)
    tensors = load_file(folder / SINGLE_FILE)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, folder / SINGLE_FILE, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"missing tensor 'model.layers.1.mlp.up_proj.weight' in"):
        HFCheckpointReader.open(folder)
    tensors = {**load_file(saved["single"] / SINGLE_FILE), "model.layers.0.self_attn.o_proj.bias": torch.zeros(32)}
    save_file(tensors, folder / SINGLE_FILE, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"unexpected tensor 'model.layers.0.self_attn.o_proj.bias' in {folder / SINGLE_FILE}"):
        HFCheckpointReader.open(folder)


def test_folder_without_config_or_safetensors_is_refused(saved, tmp_path):
    folder = _copy(saved["single"], tmp_path)
    (folder / SINGLE_FILE).rename(folder / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"no safetensors weights .*found \['pytorch_model.bin'\]; only safetensors"):
        HFCheckpointReader.open(folder)
    (folder / CONFIG_FILE).unlink()
    with pytest.raises(CheckpointError, match=rf"missing config: {folder / CONFIG_FILE} does not exist"):
        HFCheckpointReader.open(folder)


def test_stored_tied_head_must_equal_the_embedding(tmp_path):
    spec = tiny_spec("llama", tie_embeddings=True, num_layers=1)
    state = random_hf_state(spec)
    folder = write_hf_checkpoint(tmp_path / "tied", state.items(), spec=spec)
    tensors = load_file(folder / SINGLE_FILE)
    save_file({**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"].clone()}, folder / SINGLE_FILE, metadata={"format": "pt"})
    assert "lm_head.weight" in HFCheckpointReader.open(folder)
    save_file({**tensors, "lm_head.weight": torch.zeros_like(tensors["model.embed_tokens.weight"])}, folder / SINGLE_FILE, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="'lm_head.weight' .* differs from 'model.embed_tokens.weight'"):
        HFCheckpointReader.open(folder)


# --- writing ----------------------------------------------------------------------------------


def test_written_folder_loads_in_transformers_bit_exact(tmp_path, tokenizer_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    state = random_hf_state(SPEC, seed=5, dtype=torch.bfloat16)
    folder = write_hf_checkpoint(
        tmp_path / "out",
        iter(state.items()),
        spec=SPEC,
        generation_config={"pad_token_id": 1},
        tokenizer_dir=tokenizer_dir,
        max_shard_bytes=8 * 1024,
    )
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    weight_map = _weight_map(folder)
    assert set(weight_map) == set(state) and set(weight_map.values()) == set(shards)
    for shard in shards:  # the size bound holds except for a single oversized tensor
        tensors = load_file(folder / shard)
        assert len(tensors) == 1 or sum(t.numel() * t.element_size() for t in tensors.values()) <= 8 * 1024

    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.bfloat16)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    loaded = model.state_dict()
    for name, tensor in state.items():
        assert loaded[name].dtype == torch.bfloat16 and torch.equal(loaded[name], tensor), name
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    assert tokenizer.convert_tokens_to_ids(["w0", "</s>"]) == [3, 1]
    generation = GenerationConfig.from_pretrained(folder, local_files_only=True)
    # From the source folder's generation_config.json, updated by the given values.
    assert (generation.bos_token_id, generation.eos_token_id, generation.pad_token_id) == (0, 1, 1)
    assert generation.temperature == 0.6
    config = json.loads((folder / CONFIG_FILE).read_text())
    assert (config["torch_dtype"], config["eos_token_id"], config["pad_token_id"]) == ("bfloat16", 1, 1)
    # Our reader reads what our writer wrote, bit for bit.
    reader = HFCheckpointReader.open(folder)
    assert all(torch.equal(reader.get_tensor(name), tensor) for name, tensor in state.items())
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_small_model_is_one_file_without_index(tmp_path):
    state = random_hf_state(SPEC)
    folder = write_hf_checkpoint(tmp_path / "out", state.items(), spec=SPEC)
    assert sorted(p.name for p in folder.iterdir()) == [CONFIG_FILE, GENERATION_CONFIG_FILE, SINGLE_FILE]


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir())


def test_failure_mid_stream_leaves_nothing_behind(tmp_path):
    state = random_hf_state(SPEC)

    def stream():
        for i, item in enumerate(state.items()):
            if i == 7:
                raise RuntimeError("source went away")
            yield item

    with pytest.raises(RuntimeError, match="source went away"):
        write_hf_checkpoint(tmp_path / "out", stream(), spec=SPEC, max_shard_bytes=1024)
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda s: s.pop("model.layers.1.self_attn.q_proj.bias"), r"missing tensor 'model.layers.1.self_attn.q_proj.bias'"),
        (lambda s: s.__setitem__("lm_head.bias", torch.zeros(100)), r"unexpected tensor 'lm_head.bias'"),
        (lambda s: s.__setitem__("model.norm.weight", torch.zeros(33)), r"shape mismatch for tensor 'model.norm.weight': got \(33,\)"),
    ],
)
def test_writer_refuses_a_tensor_set_that_does_not_match_the_spec(tmp_path, mutate, message):
    state = random_hf_state(SPEC)
    mutate(state)
    with pytest.raises(CheckpointError, match=message):
        write_hf_checkpoint(tmp_path / "out", state.items(), spec=SPEC, max_shard_bytes=2048)
    assert _leftovers(tmp_path) == []


def test_existing_target_is_kept_unless_overwrite(tmp_path, tokenizer_dir):
    state = random_hf_state(SPEC, seed=1)
    target = write_hf_checkpoint(tmp_path / "out", state.items(), spec=SPEC)
    with pytest.raises(CheckpointError, match="already exists"):
        write_hf_checkpoint(target, state.items(), spec=SPEC)
    new_state = random_hf_state(SPEC, seed=2)
    write_hf_checkpoint(target, new_state.items(), spec=SPEC, overwrite=True)
    assert torch.equal(load_file(target / SINGLE_FILE)["model.norm.weight"], new_state["model.norm.weight"])
    assert _leftovers(tmp_path) == ["out"]
    empty = tmp_path / "no_tokenizer"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="holds none of"):
        write_hf_checkpoint(tmp_path / "other", state.items(), spec=SPEC, tokenizer_dir=empty)
    assert _leftovers(tmp_path) == ["no_tokenizer", "out"]


def test_special_token_ids_come_from_the_tokenizer_without_a_generation_config(tmp_path, tokenizer_dir):
    import shutil

    from transformers import GenerationConfig

    bare = tmp_path / "tokenizer"
    shutil.copytree(tokenizer_dir, bare)
    (bare / GENERATION_CONFIG_FILE).unlink(missing_ok=True)
    folder = write_hf_checkpoint(tmp_path / "out", random_hf_state(SPEC).items(), spec=SPEC, tokenizer_dir=bare)
    generation = GenerationConfig.from_pretrained(folder, local_files_only=True)
    assert generation.eos_token_id == 1  # "</s>": generate() stops at the end of an answer
    assert json.loads((folder / CONFIG_FILE).read_text())["eos_token_id"] == 1
