"""`winnow convert`: HF → megatron → HF is bit-exact, the logit gate rejects bad conversions
atomically, training checkpoints (TP=1, TP=2) export to HF models with the actor's log-probs,
bad input fails with exit code 2 naming the file/tensor and leaves nothing behind.

Conversions run in this process through ``pipeline.cli.convert.main`` (the CLI entry point
without the ``winnow`` wrapper); the layout check and the TP=2 training run spawn gloo ranks.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline.checkpoint.gate import GATE_ATOL
from pipeline.checkpoint.hf_io import GENERATION_CONFIG_FILE, HFCheckpointReader
from pipeline.cli.convert import build_parser, main, parse_size
from pipeline.models.spec import ModelSpec
from tests.checkpoint.tiny_models import build_hf_model, tiny_spec
from tests.distributed_utils import run_distributed

ROOT = Path(__file__).resolve().parents[2]
LLAMA = tiny_spec("llama", tie_embeddings=False, num_query_groups=2)
QWEN2_TIED = tiny_spec("qwen2", tie_embeddings=True, num_query_groups=2)
QWEN3_TIED = tiny_spec("qwen3", tie_embeddings=True, num_query_groups=2)
TOKENIZER_FILE_NAMES = ("tokenizer.json", "tokenizer_config.json")


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
    generation = {"bos_token_id": 0, "eos_token_id": 1, "do_sample": True, "temperature": 0.6}
    (folder / GENERATION_CONFIG_FILE).write_text(json.dumps(generation))
    return folder


def _save_hf(spec: ModelSpec, folder: Path, *, tokenizer_dir: Path | None, dtype=torch.float32, shard="40KB") -> Path:
    build_hf_model(spec).to(dtype).save_pretrained(folder, max_shard_size=shard)
    if tokenizer_dir is not None:
        for file in tokenizer_dir.iterdir():
            shutil.copyfile(file, folder / file.name)
    return folder


def _hf_tensors(folder: Path) -> dict[str, torch.Tensor]:
    return dict(HFCheckpointReader.open(folder).iter_tensors())


def _run(argv: list[str | Path], capsys) -> tuple[int, str, str]:
    code = main([str(arg) for arg in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _error_line(err: str) -> str:
    """The CLI's one ``error:`` line (progress notes may precede it on stderr)."""
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err
    return lines[0]


def _leftovers(parent: Path, name: str) -> list[str]:
    """Staging folders of a conversion into ``parent/name`` that survived it."""
    return [p.name for p in parent.iterdir() if p.name.startswith(f".{name}.")]


@pytest.fixture(scope="module")
def converted(tmp_path_factory, tokenizer_dir) -> dict[str, Path]:
    """A tiny Llama HF folder and its hf-to-megatron run directory, shared read-only."""
    root = tmp_path_factory.mktemp("converted")
    hf = _save_hf(LLAMA, root / "hf", tokenizer_dir=tokenizer_dir)
    assert main(["hf-to-megatron", "--hf", str(hf), "--out", str(root / "run")]) == 0
    return {"hf": hf, "run": root / "run"}


@pytest.fixture
def run_copy(converted, tmp_path) -> Path:
    return Path(shutil.copytree(converted["run"], tmp_path / "run"))


@pytest.fixture
def single_rank():
    """This process as a one-rank megatron layout (the tool then reuses it)."""
    from pipeline.parallel.context import ParallelContext

    context = ParallelContext.initialize(
        tensor_parallel=1, pipeline_parallel=1, seed=4321, rank=0, world_size=1, local_rank=0, backend="gloo",
    )
    try:
        yield context
    finally:
        context.destroy()


# --- round trip ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, dtype",
    [(LLAMA, torch.float32), (QWEN2_TIED, torch.bfloat16), (QWEN3_TIED, torch.bfloat16)],
    ids=["llama-untied-fp32", "qwen2-tied-bf16", "qwen3-tied-bf16"],
)
def test_hf_to_megatron_to_hf_is_bit_exact(tmp_path, tokenizer_dir, capsys, spec, dtype):
    from pipeline.checkpoint.manager import CheckpointManager

    hf = _save_hf(spec, tmp_path / "hf", tokenizer_dir=tokenizer_dir, dtype=dtype)
    code, out, err = _run(["hf-to-megatron", "--hf", hf, "--out", tmp_path / "run"], capsys)
    assert code == 0, err
    assert "verification: passed" in out
    run = tmp_path / "run"
    manifest = json.loads((run / "step_00000000" / "manifest.json").read_text())
    assert manifest["source"] == "hf" and manifest["model_only"] is True
    assert ModelSpec(**manifest["model_spec"]) == spec
    assert manifest["layout"] == {"tensor_parallel": 1, "pipeline_parallel": 1, "data_parallel": 1}
    assert manifest["layer_spec"]["name"] == "local"
    assert manifest["hf_dtype"] == str(dtype).removeprefix("torch.")
    assert CheckpointManager(run, keep_last=1).newest_valid() == run / "step_00000000"
    assert {p.name for p in (run / "tokenizer").iterdir()} >= {*TOKENIZER_FILE_NAMES, GENERATION_CONFIG_FILE}

    code, out, err = _run(
        ["megatron-to-hf", "--ckpt", run, "--out", tmp_path / "export", "--max-shard-size", "30KB"], capsys
    )
    assert code == 0, err
    original, exported = _hf_tensors(hf), _hf_tensors(tmp_path / "export")
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert exported[name].dtype == dtype and torch.equal(exported[name], tensor), name
    assert len(list((tmp_path / "export").glob("model-*.safetensors"))) > 1  # --max-shard-size reached the writer
    assert ModelSpec.from_hf_config(tmp_path / "export") == spec
    for name in TOKENIZER_FILE_NAMES:
        assert (tmp_path / "export" / name).read_bytes() == (tokenizer_dir / name).read_bytes()
    generation = json.loads((tmp_path / "export" / GENERATION_CONFIG_FILE).read_text())
    assert generation["eos_token_id"] == 1 and generation["temperature"] == 0.6
    assert _leftovers(tmp_path, "run") == [] and _leftovers(tmp_path, "export") == []


def test_bf16_export_is_gated_on_the_rounded_weights(converted, tmp_path, capsys):
    code, out, err = _run(
        ["megatron-to-hf", "--ckpt", converted["run"], "--out", tmp_path / "bf16", "--dtype", "bf16"], capsys
    )
    assert code == 0, err
    exported = _hf_tensors(tmp_path / "bf16")
    for name, tensor in _hf_tensors(converted["hf"]).items():
        assert torch.equal(exported[name], tensor.to(torch.bfloat16)), name
    # The rounding itself moves O(1) logits far more than the gate's tolerance: the gate
    # compares against the rounded megatron weights, and reports the rounding separately.
    rounding = float(re.search(r"rounding moved the logits by up to (\S+)", out).group(1))
    assert rounding > 100 * GATE_ATOL


# --- the gate -----------------------------------------------------------------------------------


def _swap_k_and_v_of_layer_1(original):
    def convert(param, *args, **kwargs):
        tensors = original(param, *args, **kwargs)
        if param.hf_names[0] == "model.layers.1.self_attn.q_proj.weight":
            q, k, v = tensors
            return q, v, k
        return tensors

    return convert


_swap_k_and_v_of_layer_1.changes = ["model.layers.1.self_attn.k_proj.weight", "model.layers.1.self_attn.v_proj.weight"]


def _nudge_a_norm_weight(original):
    def convert(param, *args, **kwargs):
        tensors = original(param, *args, **kwargs)
        if param.hf_names[0] == "model.layers.2.post_attention_layernorm.weight":
            return (tensors[0] + 1e-2,)
        return tensors

    return convert


_nudge_a_norm_weight.changes = ["model.layers.2.post_attention_layernorm.weight"]


@pytest.mark.parametrize("corruption", [_swap_k_and_v_of_layer_1, _nudge_a_norm_weight])
def test_gate_rejects_a_wrong_hf_export_and_writes_nothing(converted, tmp_path, capsys, monkeypatch, corruption):
    import pipeline.checkpoint.convert as convert

    monkeypatch.setattr(convert, "megatron_to_hf_tensors", corruption(convert.megatron_to_hf_tensors))
    out = tmp_path / "export"
    code, _, err = _run(["megatron-to-hf", "--ckpt", converted["run"], "--out", out], capsys)
    assert code == 2
    assert _error_line(err).startswith("error: verification failed") and "max |logit diff|" in err
    assert not out.exists() and _leftovers(tmp_path, "export") == []

    # An existing output survives a failed --overwrite untouched.
    out.mkdir()
    (out / "previous").write_text("kept")
    code, _, _ = _run(["megatron-to-hf", "--ckpt", converted["run"], "--out", out, "--overwrite"], capsys)
    assert code == 2 and [p.name for p in out.iterdir()] == ["previous"]
    assert _leftovers(tmp_path, "export") == []

    # Without the gate the same conversion goes through: the gate is what caught it.
    code, _, err = _run(
        ["megatron-to-hf", "--ckpt", converted["run"], "--out", tmp_path / "unchecked", "--no-verify"], capsys
    )
    assert code == 0, err
    original, unchecked = _hf_tensors(converted["hf"]), _hf_tensors(tmp_path / "unchecked")
    differing = sorted(name for name in original if not torch.equal(unchecked[name], original[name]))
    assert differing == corruption.changes


def test_gate_rejects_a_wrong_megatron_checkpoint_and_writes_nothing(converted, tmp_path, capsys, monkeypatch):
    import pipeline.checkpoint.convert as convert

    original = convert.hf_to_megatron_tensor

    def swap_gate_and_up(param, hf_tensors, **kwargs):
        if param.hf_names[0] == "model.layers.0.mlp.gate_proj.weight":
            hf_tensors = hf_tensors[::-1]
        return original(param, hf_tensors, **kwargs)

    monkeypatch.setattr(convert, "hf_to_megatron_tensor", swap_gate_and_up)
    code, _, err = _run(["hf-to-megatron", "--hf", converted["hf"], "--out", tmp_path / "run"], capsys)
    assert code == 2 and _error_line(err).startswith("error: verification failed")
    assert not (tmp_path / "run").exists() and _leftovers(tmp_path, "run") == []


# --- training checkpoints -----------------------------------------------------------------------


def _hf_response_logprobs(folder: Path, batch) -> torch.Tensor:
    """(B, T) token-aligned log-probs of the exported model, 0 outside the response (as the actor's)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(batch.tokens).logits  # (B, T, V)
    logprobs = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, batch.tokens[:, 1:, None])[..., 0]  # (B, T-1)
    logprobs = torch.cat([torch.zeros(batch.tokens.shape[0], 1), logprobs], dim=1)  # (B, T)
    return torch.where(batch.response_mask, logprobs, 0.0)


def test_training_checkpoint_exports_with_the_actors_logprobs(tmp_path, capsys, single_rank, tokenizer_dir):
    from pipeline.checkpoint.manager import CheckpointManager
    from pipeline.trainer.losses import CrossEntropyLoss
    from tests.trainer.test_actor import _actor, _batch

    actor = _actor(1, 1, micro_batch_tokens=10_000, context=single_rank)
    batch = _batch()
    actor.train_step(batch, CrossEntropyLoss())
    CheckpointManager(tmp_path / "run", keep_last=2).save(1, actor=actor)
    expected = actor.compute_logprobs(batch)
    code, out, err = _run(
        ["megatron-to-hf", "--ckpt", tmp_path / "run", "--out", tmp_path / "export", "--tokenizer", tokenizer_dir], capsys
    )
    assert code == 0, err
    assert "step_00000001" in out and f"tokenizer: {tokenizer_dir}" in out
    assert (tmp_path / "export" / "tokenizer.json").read_bytes() == (tokenizer_dir / "tokenizer.json").read_bytes()
    torch.testing.assert_close(_hf_response_logprobs(tmp_path / "export", batch), expected, rtol=0, atol=GATE_ATOL)


def _train_and_save_worker(rank, world_size, directory):
    from pipeline.checkpoint.manager import CheckpointManager
    from pipeline.trainer.losses import CrossEntropyLoss
    from tests.trainer.test_actor import _actor, _batch

    actor = _actor(world_size, 1, micro_batch_tokens=36)
    actor.train_step(_batch(), CrossEntropyLoss())
    CheckpointManager(directory, keep_last=1, rank=rank, world_size=world_size).save(3, actor=actor)
    return actor.compute_logprobs(_batch())


@pytest.mark.slow
@pytest.mark.distributed
def test_tp2_training_checkpoint_exports_with_the_actors_logprobs(tmp_path, capsys):
    from tests.trainer.test_actor import _batch

    expected = run_distributed(_train_and_save_worker, world_size=2, args=(str(tmp_path / "run"),), timeout_s=240)[0]
    manifest = json.loads((tmp_path / "run" / "step_00000003" / "manifest.json").read_text())
    assert manifest["layout"]["tensor_parallel"] == 2
    code, _, err = _run(
        ["megatron-to-hf", "--ckpt", tmp_path / "run" / "step_00000003", "--out", tmp_path / "export"], capsys
    )
    assert code == 0, err
    assert "no tokenizer found" in err and not (tmp_path / "export" / "tokenizer.json").exists()
    torch.testing.assert_close(_hf_response_logprobs(tmp_path / "export", _batch()), expected, rtol=0, atol=GATE_ATOL)


# --- layouts ------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("spec, tp, pp", [(QWEN3_TIED, 2, 1), (QWEN2_TIED, 1, 2)], ids=["qwen3-tp2", "qwen2-pp2"])
def test_hf_to_megatron_verifies_the_intended_layout(converted, tmp_path, capsys, spec, tp, pp):
    # QWEN3_TIED: the per-head q/k norms every TP rank applies to its own heads (Qwen2's biases
    # under TP=2 are in test_hf_parity); QWEN2_TIED with PP=2: the last stage's copy of the tied
    # embedding.
    hf = _save_hf(spec, tmp_path / "hf", tokenizer_dir=None)
    code, out, err = _run(["hf-to-megatron", "--hf", hf, "--out", tmp_path / "run", "--tp", tp, "--pp", pp], capsys)
    assert code == 0, err
    assert f"(megatron TP={tp}, PP={pp})" in out
    manifest = json.loads((tmp_path / "run" / "step_00000000" / "manifest.json").read_text())
    assert manifest["layout"] == {"tensor_parallel": tp, "pipeline_parallel": pp, "data_parallel": 1}


# --- bad input ----------------------------------------------------------------------------------


def _delete_a_shard(folder: Path) -> str:
    victim = sorted(folder.glob("model-*.safetensors"))[1]
    victim.unlink()
    return victim.name


def _unsupported_architecture(folder: Path) -> str:
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="mistral", architectures=["MistralForCausalLM"])
    (folder / "config.json").write_text(json.dumps(config))
    return "unsupported model_type 'mistral'"


def _mismatched_shapes(folder: Path) -> str:
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] = 64
    (folder / "config.json").write_text(json.dumps(config))
    return "shape mismatch for tensor 'model.layers."


def _truncated_safetensors(folder: Path) -> str:
    victim = sorted(folder.glob("model-*.safetensors"))[0]
    os.truncate(victim, victim.stat().st_size - 100)
    return f"corrupt or truncated safetensors file: {victim}"


def _indivisible_tp(folder: Path) -> str:
    return "--tp 3 --pp 1: vocab_size 100 is not divisible"


@pytest.mark.parametrize(
    "damage", [_delete_a_shard, _unsupported_architecture, _mismatched_shapes, _truncated_safetensors, _indivisible_tp]
)
def test_bad_hf_input_fails_with_exit_2_and_writes_nothing(converted, tmp_path, capsys, damage):
    hf = Path(shutil.copytree(converted["hf"], tmp_path / "hf"))
    expected = damage(hf)
    argv = ["hf-to-megatron", "--hf", hf, "--out", tmp_path / "run"]
    code, _, err = _run(argv + (["--tp", "3"] if damage is _indivisible_tp else []), capsys)
    assert code == 2
    assert expected in _error_line(err)
    assert not (tmp_path / "run").exists() and _leftovers(tmp_path, "run") == []


def _remove_manifest(run: Path) -> tuple[str, str]:
    (run / "step_00000000" / "manifest.json").unlink()
    return "step_00000000", "manifest.json is missing"


def _flip_a_weight_byte(run: Path) -> tuple[str, str]:
    victim = max((run / "step_00000000" / "weights").glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    return "", f"{victim} does not match its sha256"


def _manifest_disagrees_with_weights(run: Path) -> tuple[str, str]:
    manifest_path = run / "step_00000000" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["model_spec"]["ffn_hidden_size"] = 64
    manifest_path.write_text(json.dumps(manifest))
    # The file and megatron's own description of the first mismatching tensor.
    return "", f"cannot load the model weights from {run / 'step_00000000' / 'weights'}|linear_fc1.weight"


def _not_a_checkpoint(run: Path) -> tuple[str, str]:
    shutil.rmtree(run / "step_00000000")
    (run / "latest").unlink()
    return "", "is not a winnow checkpoint"


def _missing_step(run: Path) -> tuple[str, str]:
    return "--step=7", "step_00000007 does not exist; steps in"


@pytest.mark.parametrize(
    "damage",
    [_remove_manifest, _flip_a_weight_byte, _manifest_disagrees_with_weights, _not_a_checkpoint, _missing_step],
)
def test_bad_checkpoint_fails_with_exit_2_and_writes_nothing(run_copy, tmp_path, capsys, damage):
    where, expected_parts = damage(run_copy)
    ckpt = run_copy / where if where and not where.startswith("--") else run_copy
    extra = [where] if where.startswith("--") else []
    code, _, err = _run(["megatron-to-hf", "--ckpt", ckpt, "--out", tmp_path / "export", *extra], capsys)
    assert code == 2
    assert all(part in _error_line(err) for part in expected_parts.split("|"))
    assert not (tmp_path / "export").exists() and _leftovers(tmp_path, "export") == []


def test_existing_output_needs_overwrite(converted, tmp_path, capsys):
    (tmp_path / "export").mkdir()
    code, _, err = _run(["megatron-to-hf", "--ckpt", converted["run"], "--out", tmp_path / "export"], capsys)
    assert code == 2 and "already exists (pass --overwrite" in err
    code, _, err = _run(
        ["megatron-to-hf", "--ckpt", converted["run"], "--out", tmp_path / "export", "--overwrite", "--no-verify"],
        capsys,
    )
    assert code == 0, err
    assert (tmp_path / "export" / "model.safetensors").is_file()


def test_refuses_to_replace_its_own_input(converted, tmp_path, capsys):
    run = Path(shutil.copytree(converted["run"], tmp_path / "run"))
    code, _, err = _run(["megatron-to-hf", "--ckpt", run / "step_00000000", "--out", run, "--overwrite"], capsys)
    assert code == 2 and "overlaps the input" in _error_line(err)
    assert (run / "step_00000000" / "manifest.json").is_file() and _leftovers(tmp_path, "run") == []
    code, _, err = _run(["hf-to-megatron", "--hf", converted["hf"], "--out", tmp_path / "x", "--atol", "0"], capsys)
    assert code == 2 and "--atol: expected a positive tolerance" in _error_line(err)


# --- command line -------------------------------------------------------------------------------


@pytest.mark.parametrize("argv", [["--help"], ["hf-to-megatron", "--help"], ["megatron-to-hf", "--help"]])
def test_script_help_works(argv):
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "convert_checkpoint.py"), *argv],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    assert "usage: convert_checkpoint.py" in result.stdout
    assert ("--ckpt" in result.stdout) == (argv[0] == "megatron-to-hf")


def test_sizes_follow_transformers_units():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30
    assert parse_size("40KB") == 40_000 and parse_size("1234") == 1234
    with pytest.raises(ValueError, match="invalid size"):
        parse_size("5 parsecs")


def _documented_commands() -> list[list[str]]:
    commands = []
    for block in re.findall(r"```(?:bash|sh|console)\n(.*?)```", (ROOT / "docs" / "conversion.md").read_text(), re.S):
        for line in block.splitlines():
            words = shlex.split(line.split("  #")[0])
            if len(words) > 2 and Path(words[0]).name == "winnow" and words[1] == "convert":
                commands.append(words[2:])
            elif len(words) > 1 and words[1].endswith("convert_checkpoint.py"):
                commands.append(words[2:])
    return commands


def test_documented_commands_parse():
    commands = _documented_commands()
    assert {argv[0] for argv in commands} == {"hf-to-megatron", "megatron-to-hf"}
    parser = build_parser()
    for argv in commands:
        args = parser.parse_args(argv)
        assert args.handler.__name__ == f"run_{argv[0].replace('-', '_')}"
