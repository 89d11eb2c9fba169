"""Model output, datasets and checkpoints are data: nothing in winnow's code turns them into code.

* A scan of every Python file under ``pipeline/`` and ``tools/`` (its syntax tree, so
  docstrings, comments and ``model.eval()`` do not count) fails on: ``eval``/``exec``;
  ``pickle``/``marshal``/``dill`` loads; ``torch.load`` without ``weights_only=True``;
  ``numpy.load`` with ``allow_pickle=True``; ``yaml.load`` with a loader that builds Python
  objects; ``from_pretrained`` without an explicit ``trust_remote_code=False``, and
  ``trust_remote_code=True`` anywhere; ``shell=True``; a ``0.0.0.0``/``::`` literal (a bind to
  every interface). Shell scripts under ``tools/`` and ``slurm/`` are scanned as text for the
  last two. The scanner itself is tested on snippets it must flag and snippets it must pass.
* A checkpoint whose ``common.pt`` unpickles into code (megatron reads it with ``torch.load``
  at torch's default ``weights_only=True``) is refused with a ``CheckpointError`` by every
  loader, and the code does not run.
* SGLang servers bind loopback unless an address is asked for.

Runtime: about 2 s, plus 10 s for the checkpoint test.
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
from pathlib import Path

import pytest

from tests.distributed_utils import run_distributed

REPO = Path(__file__).resolve().parents[2]
SCANNED_TREES = ("pipeline", "tools")
SHELL_TREES = ("tools", "slurm")
PICKLE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "marshal", "joblib", "cloudpickle"}
UNSAFE_YAML_LOADERS = {"Loader", "UnsafeLoader", "FullLoader", "yaml.Loader", "yaml.UnsafeLoader", "yaml.FullLoader"}
ALL_INTERFACES = {"0.0.0.0", "::"}


def _dotted(node: ast.expr) -> str:
    """``torch.load`` for ``torch.load(...)``, ``<expr>.eval`` for ``model.train().eval()``."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return "<expr>"


def _is_constant(node: ast.expr | None, value: object) -> bool:
    return isinstance(node, ast.Constant) and node.value is value


def _call_violation(node: ast.Call) -> str | None:
    name = _dotted(node.func)
    module, _, function = name.rpartition(".")
    keywords = {keyword.arg: keyword.value for keyword in node.keywords if keyword.arg is not None}
    if name in ("eval", "exec", "builtins.eval", "builtins.exec"):
        return f"{name}() runs text as code"
    if module in PICKLE_MODULES and function in ("load", "loads", "Unpickler"):
        return f"{name}() unpickles: loading a file can run code"
    if name == "torch.load" and not _is_constant(keywords.get("weights_only"), True):
        return "torch.load() without weights_only=True"
    if name in ("np.load", "numpy.load") and _is_constant(keywords.get("allow_pickle"), True):
        return f"{name}(allow_pickle=True)"
    if name in ("yaml.unsafe_load", "yaml.full_load"):
        return f"{name}() builds Python objects"
    if name == "yaml.load" and _dotted(keywords.get("Loader", ast.Constant(None))) in {"<expr>", *UNSAFE_YAML_LOADERS}:
        return "yaml.load() without a safe Loader"
    if _is_constant(keywords.get("trust_remote_code"), True):
        return "trust_remote_code=True runs the model folder's Python code"
    if function == "from_pretrained" and not _is_constant(keywords.get("trust_remote_code"), False):
        return "from_pretrained() without an explicit trust_remote_code=False"
    if _is_constant(keywords.get("shell"), True):
        return "shell=True hands a string to the shell"
    return None


def _docstring_nodes(tree: ast.AST) -> set[int]:
    owners = [node for node in ast.walk(tree)
              if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    return {id(owner.body[0].value) for owner in owners
            if owner.body and isinstance(owner.body[0], ast.Expr) and isinstance(owner.body[0].value, ast.Constant)}


def scan_python(source: str, *, filename: str = "<snippet>") -> list[str]:
    """``file:line: reason`` for every forbidden construct in ``source``."""
    tree = ast.parse(source, filename)
    docstrings = _docstring_nodes(tree)
    found = []
    for node in ast.walk(tree):
        reason = None
        if isinstance(node, ast.Call):
            reason = _call_violation(node)
        elif isinstance(node, ast.ImportFrom) and node.module in PICKLE_MODULES:
            loaders = [alias.name for alias in node.names if alias.name in ("load", "loads", "Unpickler")]
            reason = f"from {node.module} import {', '.join(loaders)}" if loaders else None
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            reason = "from torch import load hides torch.load from this scan" if any(
                alias.name == "load" for alias in node.names) else None
        elif isinstance(node, ast.Constant) and node.value in ALL_INTERFACES and id(node) not in docstrings:
            reason = f"{node.value!r}: binding every interface must be the user's explicit choice"
        if reason is not None:
            found.append(f"{filename}:{node.lineno}: {reason}")
    return found


def scan_shell(text: str, *, filename: str = "<snippet>") -> list[str]:
    found = []
    for number, line in enumerate(text.splitlines(), start=1):
        code = line.split("#", 1)[0]
        if re.search(r"trust[-_]remote[-_]code(?![-_=\s]*(false|False|0)\b)", code):
            found.append(f"{filename}:{number}: trust-remote-code in a script")
        if re.search(r"(?<![\d.])0\.0\.0\.0(?![\d.])", code):
            found.append(f"{filename}:{number}: 0.0.0.0 binds every interface")
    return found


def test_source_tree_has_no_code_execution_unsafe_loading_or_open_binds():
    python_files = [path for tree in SCANNED_TREES for path in sorted((REPO / tree).rglob("*.py"))]
    shell_files = [path for tree in SHELL_TREES for path in sorted((REPO / tree).rglob("*.sh"))]
    assert len(python_files) > 50 and shell_files  # the scan looked where it should
    found = [hit for path in python_files
             for hit in scan_python(path.read_text(encoding="utf-8"), filename=str(path.relative_to(REPO)))]
    found += [hit for path in shell_files
              for hit in scan_shell(path.read_text(encoding="utf-8"), filename=str(path.relative_to(REPO)))]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("snippet", [
    "eval(text)", "exec(code, {})", "import builtins\nbuiltins.eval(x)",
    "import pickle\npickle.load(handle)", "import pickle\npickle.loads(data)", "from pickle import loads",
    "import marshal\nmarshal.loads(data)", "import dill\ndill.load(f)",
    "import torch\ntorch.load(path)", "import torch\ntorch.load(path, weights_only=False)",
    "import torch\ntorch.load(path, weights_only=flag)", "from torch import load",
    "import numpy as np\nnp.load(path, allow_pickle=True)",
    "import yaml\nyaml.load(text)", "import yaml\nyaml.load(text, Loader=yaml.Loader)", "import yaml\nyaml.unsafe_load(t)",
    "AutoModelForCausalLM.from_pretrained(path)", "AutoTokenizer.from_pretrained(path, trust_remote_code=True)",
    "BertModel.from_pretrained(path, local_files_only=True, trust_remote_code=flag)",
    "load_thing(path, trust_remote_code=True)",
    "subprocess.run(command, shell=True)",
    "spec = Spec(host='0.0.0.0')", "HOST = '::'",
])
def test_the_scanner_flags(snippet):
    assert scan_python(snippet), snippet


@pytest.mark.parametrize("snippet", [
    "model.eval()", "module.train(False).eval()", "import torch\ntorch.load(path, weights_only=True)",
    "from pickle import UnpicklingError", "import numpy as np\nnp.load(path)",
    "import yaml\nyaml.load(text, Loader=_SafeSubclass)", "import yaml\nyaml.safe_load(text)",
    "AutoTokenizer.from_pretrained(str(p), local_files_only=True, trust_remote_code=False)",
    "DifficultyEstimator.from_pretrained_minilm(cache_dir)", "subprocess.run(['ls'], shell=False)",
    '"""Binding 0.0.0.0 must be asked for."""', "def f():\n    '''bind ::'''\n", "host = '127.0.0.1'",
])
def test_the_scanner_passes(snippet):
    assert scan_python(snippet) == [], snippet


def test_the_shell_scanner():
    assert scan_shell("python -m sglang.launch_server --host 0.0.0.0 --port 30000")
    assert scan_shell("sglang serve --trust-remote-code")
    assert scan_shell("x --trust_remote_code")
    assert not scan_shell("x --trust-remote-code=false  # 0.0.0.0 in a comment")
    assert not scan_shell("ping 10.0.0.01")


def test_sglang_servers_bind_loopback_unless_an_address_is_given():
    from pipeline.rollout.sglang.protocol import SGLangServerSpec, launch_command

    default = launch_command(SGLangServerSpec(model_path="m", port=30000))
    assert default[default.index("--host") + 1] == "127.0.0.1"
    chosen = launch_command(SGLangServerSpec(model_path="m", port=30000, host="10.1.2.3"))
    assert chosen[chosen.index("--host") + 1] == "10.1.2.3" and chosen.count("--host") == 1


class _RunsCodeWhenUnpickled:
    """Unpickling this calls ``open(marker, "w")``: the classic payload, harmless here."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _tampered_checkpoint_worker(rank, world_size, directory):
    import torch

    from pipeline.checkpoint.artifact import load_weights
    from pipeline.checkpoint.manager import CheckpointManager
    from pipeline.errors import CheckpointError
    from tests.trainer.test_actor import _actor

    actor = _actor(1, 1, micro_batch_tokens=10_000)
    manager = CheckpointManager(directory, keep_last=1)
    step_dir = manager.save(1, actor=actor)
    marker = Path(directory) / "code_ran"
    common = step_dir / "weights" / "common.pt"
    torch.save(_RunsCodeWhenUnpickled(str(marker)), common)
    # The attacker rewrites the manifest too, so the file passes verification and reaches torch.load.
    manifest = json.loads((step_dir / "manifest.json").read_text())
    manifest["files"]["weights/common.pt"] = {"size": common.stat().st_size,
                                              "sha256": hashlib.sha256(common.read_bytes()).hexdigest()}
    (step_dir / "manifest.json").write_text(json.dumps(manifest))
    outcomes = {}
    for name, load in (("load_model_weights", lambda: load_weights(step_dir, actor.module)),
                       ("resume", lambda: manager.load(manager.newest_valid(), actor=actor))):
        try:
            load()
            outcomes[name] = None
        except CheckpointError as error:
            outcomes[name] = str(error)
    return outcomes, marker.exists()


def test_a_checkpoint_that_unpickles_into_code_is_refused_and_the_code_never_runs(tmp_path):
    outcomes, code_ran = run_distributed(_tampered_checkpoint_worker, world_size=1, timeout_s=300,
                                         args=(str(tmp_path),))[0]
    assert not code_ran
    for name, message in outcomes.items():
        assert message is not None, f"{name} loaded a checkpoint that unpickles into code"
        assert "weights" in message and "refused" in message and "io.open" in message, message
        assert "weights_only=False" not in message  # torch's own text suggests exactly that
