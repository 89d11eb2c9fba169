"""The package's floors, checked on the source (an AST walk; nothing is imported).

winnow is built in floors, each importing only from its own floor and the ones below:

    errors, io, registry → config → algorithms → parallel → models → checkpoint
    → data, rewards, stats, trainer, rollout, eval, estimator, rl → stages → launch → cli

The library floor has sub-floors of its own (``SUB_FLOORS``), the same rule inside it:

    stats, rewards, trainer → data → rollout → eval, estimator → rl

Every import counts, including the ones made inside functions to keep ``winnow --help``
fast (only ``if TYPE_CHECKING:`` blocks are exempt: they never run). On top of the floor
order: no import cycles among the modules of ``pipeline``, ``recipes`` and ``tools``
(a cycle through a ``__main__`` block counts too); ``torch.distributed`` and megatron's
``parallel_state`` only under ``parallel/``, ``trainer/`` and the conversion gate;
``argparse`` only under ``cli/`` and ``tools/``; ``recipes`` only from the CLI and tools;
renames that publish a file (``os.replace``/``os.rename``/``Path.rename``) only in ``io`` and
the checkpoint manager, so every durable write goes through one implementation.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Top-level name under ``pipeline`` → its floor (0 is the bottom).
FLOORS: dict[str, int] = {
    "errors": 0, "io": 0, "deferred_compile": 0, "registry": 0,
    "configlib": 1, "config": 1, "configdocs": 1, "metrics": 1,
    "algorithms": 2,
    "parallel": 3,
    "models": 4,
    "checkpoint": 5,
    "data": 6, "rewards": 6, "stats": 6, "trainer": 6, "rollout": 6, "eval": 6, "estimator": 6, "rl": 6,
    "stages": 7,
    "launch": 8,
    "cli": 9,
}
LIBRARY_CEILING = FLOORS["rl"]  # everything at or below this floor is the library
# Inside the library floor: top-level name → its sub-floor (0 is the bottom). The statistics
# store, the rewards and the trainer need no other library package; data reads answers with
# the rewards' extractor; rollout engines, evaluation and the estimator consume data and
# rollouts; the RL loop uses them all.
SUB_FLOORS: dict[str, int] = {
    "stats": 0, "rewards": 0, "trainer": 0,
    "data": 1,
    "rollout": 2,
    "eval": 3, "estimator": 3,
    "rl": 4,
}
DISTRIBUTED_MODULES = ("torch.distributed", "megatron.core.parallel_state")
# The distributed-checkpoint *file format* (megatron's dist_checkpointing reads and writes it)
# is no collective: the checkpoint floor may name its exceptions and readers.
FILE_FORMAT_MODULES = ("torch.distributed.checkpoint",)
DISTRIBUTED_ALLOWED = ("pipeline/parallel/", "pipeline/trainer/", "pipeline/checkpoint/gate.py")
PUBLISHING_RENAMES_ALLOWED = ("pipeline/io.py", "pipeline/checkpoint/manager.py")


def _python_files(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (REPO / folder).rglob("*.py"))


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _runtime_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node except those inside ``if TYPE_CHECKING:`` blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(child for child in ast.iter_child_nodes(node) if not _is_type_checking_block(child))


def _imports(path: Path, known: set[str]) -> list[tuple[str, int]]:
    """(imported module, line) for every runtime import; ``from pkg import sub`` resolves to ``pkg.sub``."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in _runtime_nodes(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.append((candidate if candidate in known else base, node.lineno))
    return found


def _floor(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "pipeline" or len(parts) < 2:
        return None
    return FLOORS.get(parts[1])


def _sub_floor(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "pipeline" or len(parts) < 2:
        return None
    return SUB_FLOORS.get(parts[1])


def _upward_imports(graph: dict[str, dict], floor_of, what: str = "floor") -> list[str]:
    """Imports that go up the levels ``floor_of`` gives modules (None: not placed, not checked)."""
    violations = []
    for name, node in graph.items():
        own = floor_of(name)
        if own is None:
            continue
        for target, line in node["imports"]:
            target_floor = floor_of(target)
            if target_floor is not None and target_floor > own:
                violations.append(f"{node['path'].relative_to(REPO)}:{line} imports {target} "
                                  f"({what} {target_floor} > {own})")
    return violations


def _sub_floor_violations(graph: dict[str, dict]) -> list[str]:
    """Imports between library packages that go up the sub-floors."""
    return _upward_imports(graph, _sub_floor, "sub-floor")


def _import_cycles(graph: dict[str, dict]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan's algorithm, iteratively)."""
    edges = {name: {target for target, _ in node["imports"] if target in graph and target != name}
             for name, node in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(start: str) -> None:
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))

    for name in sorted(edges):
        if name not in index:
            visit(name)
    return cycles


@pytest.fixture(scope="module")
def graph() -> dict[str, dict]:
    files = _python_files("pipeline", "recipes", "tools")
    known = {_module_name(p) for p in files}
    return {_module_name(p): {"path": p, "imports": _imports(p, known)} for p in files}


def test_every_pipeline_package_has_a_floor(graph):
    unplaced = sorted({name.split(".")[1] for name in graph if name.startswith("pipeline.")
                       and len(name.split(".")) > 1 and name.split(".")[1] not in FLOORS})
    assert not unplaced, f"give these a floor in FLOORS: {unplaced}"


def test_imports_only_go_down_the_floors(graph):
    violations = _upward_imports(graph, _floor)
    for name, node in graph.items():
        if _floor(name) is None or name.startswith("pipeline.cli"):
            continue
        violations += [f"{node['path'].relative_to(REPO)}:{line} imports {target}: recipes are for the CLI"
                       for target, line in node["imports"] if target.split(".")[0] == "recipes"]
    assert not violations, "\n".join(violations)


def test_the_library_never_imports_stages_launch_cli_or_recipes(graph):
    upper = ("pipeline.stages", "pipeline.launch", "pipeline.cli", "recipes")
    violations = [f"{node['path'].relative_to(REPO)}:{line} imports {target}"
                  for name, node in graph.items() if (_floor(name) or 99) <= LIBRARY_CEILING
                  for target, line in node["imports"] if target == "recipes" or target.startswith(upper)]
    assert not violations, "\n".join(violations)


def test_every_library_package_has_a_sub_floor():
    library = {name for name, floor in FLOORS.items() if floor == LIBRARY_CEILING}
    assert set(SUB_FLOORS) == library, f"SUB_FLOORS must name exactly the library floor's packages: {sorted(library)}"


def test_library_imports_only_go_down_the_sub_floors(graph):
    violations = _sub_floor_violations(graph)
    assert not violations, "\n".join(violations)


def test_no_import_cycles(graph):
    """No cycles among the modules of pipeline, recipes and tools (one module graph: a cycle may cross them)."""
    cycles = _import_cycles(graph)
    assert not cycles, "import cycles: " + "; ".join(" ↔ ".join(cycle) for cycle in cycles)


def test_distributed_apis_stay_in_parallel_trainer_and_the_gate(graph):
    violations = [f"{node['path'].relative_to(REPO)}:{line} imports {target}"
                  for name, node in graph.items() if name.startswith("pipeline")
                  and not str(node["path"].relative_to(REPO)).startswith(DISTRIBUTED_ALLOWED)
                  for target, line in node["imports"]
                  if target.startswith(DISTRIBUTED_MODULES) and not target.startswith(FILE_FORMAT_MODULES)
                  or target == "megatron.core" and "parallel_state" in node["path"].read_text().splitlines()[line - 1]]
    assert not violations, "\n".join(violations)


def test_argparse_only_in_the_cli_and_tools(graph):
    violations = [f"{node['path'].relative_to(REPO)}:{line}" for name, node in graph.items()
                  if not name.startswith(("pipeline.cli", "tools"))
                  for target, line in node["imports"] if target == "argparse"]
    assert not violations, "argparse outside pipeline/cli and tools/: " + ", ".join(violations)


def test_publishing_renames_only_in_io_and_the_checkpoint_manager():
    violations = []
    for path in _python_files("pipeline"):
        relative = str(path.relative_to(REPO))
        if relative in PUBLISHING_RENAMES_ALLOWED:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            called = ast.unparse(node.func)
            # Path.replace(target) takes one argument; str/bytes.replace take two, and
            # dataclasses.replace / datetime.replace take keywords.
            path_replace = node.func.attr == "replace" and len(node.args) == 1 and not node.keywords
            if called in ("os.replace", "os.rename") or node.func.attr == "rename" or path_replace:
                violations.append(f"{relative}:{node.lineno} {called}(...)")
    assert not violations, "use pipeline.io's writers: " + ", ".join(violations)


def test_the_checker_sees_a_violation(tmp_path):
    """The walker itself: a function-level upward import is found, a TYPE_CHECKING one is not."""
    source = tmp_path / "pipeline" / "rewards" / "sample.py"
    source.parent.mkdir(parents=True)
    source.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pipeline.cli\n"
                      "def f():\n    from pipeline.stages import rl\n")
    global REPO
    saved, REPO = REPO, tmp_path
    try:
        imports = _imports(source, {"pipeline.stages.rl"})
    finally:
        REPO = saved
    assert [found for found in imports if found[0].startswith("pipeline")] == [("pipeline.stages.rl", 5)]
    assert _floor("pipeline.stages.rl") > _floor("pipeline.rewards.sample")


def _fake_graph(tmp_path, imports: dict[str, list[str]]) -> dict[str, dict]:
    """A module graph of made-up modules (each importing the listed ones at line 1)."""
    return {name: {"path": tmp_path / (name.replace(".", "/") + ".py"), "imports": [(target, 1) for target in targets]}
            for name, targets in imports.items()}


def test_the_sub_floor_check_sees_an_upward_import(tmp_path):
    global REPO
    saved, REPO = REPO, tmp_path
    try:
        upward = _sub_floor_violations(_fake_graph(tmp_path, {
            "pipeline.stats.store": ["pipeline.data.records"],  # 0 → 1: up
            "pipeline.eval.runner": ["pipeline.estimator.model", "pipeline.rollout.types"],  # same, down
            "pipeline.data.answers": ["pipeline.rewards.extract", "pipeline.config"],  # down, not library
        }))
    finally:
        REPO = saved
    assert upward == ["pipeline/stats/store.py:1 imports pipeline.data.records (sub-floor 1 > 0)"]


def test_the_cycle_check_sees_a_cycle_across_packages(tmp_path):
    graph = _fake_graph(tmp_path, {
        "recipes.papers": ["pipeline.cli.presets", "pipeline.config"],
        "pipeline.cli.presets": ["recipes.papers"],
        "pipeline.config": [],
        "tools.bench.sync": ["tools.bench.common"],
        "tools.bench.common": ["tools.bench.sync", "pipeline.config"],
        "recipes.__main__": ["pipeline.cli.presets"],
    })
    assert sorted(_import_cycles(graph)) == [["pipeline.cli.presets", "recipes.papers"],
                                             ["tools.bench.common", "tools.bench.sync"]]
