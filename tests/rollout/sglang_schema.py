"""SGLang's own request/response schema, loaded without importing the ``sglang`` package.

``sglang`` is installed with ``--no-deps``, so ``import sglang`` fails on CPU. Two
sources still give us its contract:

* ``sglang/api/v1/api_types.py`` — generated msgspec structs of the HTTP JSON contract,
  needing only msgspec; loaded by path. ``GenerateRequest.from_json_value`` is exactly
  the check the server runs on every ``/generate`` body (``api_contract.py``; a
  violation is its HTTP 400).
* ``sglang/srt/managers/io_struct.py`` — the ``*ReqInput`` msgspec structs behind the
  weight-update endpoints. It imports zmq, pydantic and torch internals, so it is
  *parsed* (``ast``), not imported: each class's annotated fields (with its base
  ``BaseReq``'s) become a ``msgspec.defstruct`` with the same names, types, and
  required/optional split. Unknown keys are forbidden here although the server ignores
  them, because an ignored typo (``flush_cach``) would silently do nothing.
* ``sglang/srt/arg_groups/fields/*.py`` — the server's CLI flags, one per annotated
  field (``--`` + name with ``-``), plus ``Arg(cli_name=..., aliases=[...])`` literals;
  parsed the same way to check our launch command.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import sys
import types
from pathlib import Path
from typing import Any, Dict, List, Literal, Optional, Tuple, Union

import msgspec


@functools.cache
def sglang_dir() -> Path:
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.submodule_search_locations, "sglang is not installed in the venv"
    return Path(list(spec.submodule_search_locations)[0])


@functools.cache
def api_types() -> types.ModuleType:
    """``sglang/api/v1/api_types.py`` as a module (named ``sglang_api_types``)."""
    path = sglang_dir() / "api" / "v1" / "api_types.py"
    spec = importlib.util.spec_from_file_location("sglang_api_types", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # msgspec resolves the postponed annotations through sys.modules.
    sys.modules["sglang_api_types"] = module
    spec.loader.exec_module(module)
    return module


_NAMES: dict[str, Any] = {"str": str, "int": int, "float": float, "bool": bool, "bytes": bytes, "Any": Any}


def _resolve(node: ast.expr) -> Any:
    """A type from an annotation's AST (the subset io_struct's request structs use)."""
    if isinstance(node, ast.Constant) and node.value is None:
        return type(None)
    if isinstance(node, ast.Name):
        if node.id not in _NAMES:
            raise NotImplementedError(f"annotation name {node.id!r}")
        return _NAMES[node.id]
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
        head = node.value.id
        args = list(node.slice.elts) if isinstance(node.slice, ast.Tuple) else [node.slice]
        if head == "Optional":
            return Optional[_resolve(args[0])]
        if head == "List":
            return List[_resolve(args[0])]
        if head == "Dict":
            return Dict[_resolve(args[0]), _resolve(args[1])]
        if head == "Tuple":
            return Tuple[tuple(_resolve(a) for a in args)]
        if head == "Union":
            return Union[tuple(_resolve(a) for a in args)]
        if head == "Literal":
            return Literal[tuple(ast.literal_eval(a) for a in args)]
        if head == "Annotated":
            # Annotated[List[bytes], Base64Bytes()]: JSON carries base64 strings, which
            # msgspec decodes into bytes for a bytes-typed field.
            return _resolve(args[0])
    raise NotImplementedError(f"annotation {ast.unparse(node)!r}")


@functools.cache
def _io_struct_classes() -> dict[str, ast.ClassDef]:
    tree = ast.parse((sglang_dir() / "srt" / "managers" / "io_struct.py").read_text())
    return {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}


def _class_fields(name: str) -> list[tuple[str, Any, Any]]:
    node = _io_struct_classes()[name]
    fields: list[tuple[str, Any, Any]] = []
    for base in node.bases:
        if isinstance(base, ast.Name) and base.id in _io_struct_classes():
            fields += _class_fields(base.id)
    for statement in node.body:
        if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
            field_type = _resolve(statement.annotation)
            if statement.value is None:
                fields.append((statement.target.id, field_type, msgspec.NODEFAULT))
            else:
                fields.append((statement.target.id, field_type, ast.literal_eval(statement.value)))
    return fields


@functools.cache
def io_struct(name: str) -> type[msgspec.Struct]:
    """A strict msgspec struct mirroring ``io_struct.<name>`` (e.g. ``UpdateWeightFromDiskReqInput``)."""
    fields = [(n, t) if d is msgspec.NODEFAULT else (n, t, d) for n, t, d in _class_fields(name)]
    return msgspec.defstruct(name, fields, kw_only=True, forbid_unknown_fields=True)


def io_struct_required(name: str) -> set[str]:
    return {n for n, _, d in _class_fields(name) if d is msgspec.NODEFAULT}


@functools.cache
def launch_server_flags() -> dict[str, bool]:
    """Every ``sglang.launch_server`` flag declared in ``arg_groups/fields`` → whether it is a bare switch (bool)."""
    flags: dict[str, bool] = {}
    for path in sorted((sglang_dir() / "srt" / "arg_groups" / "fields").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                continue
            annotation = node.annotation
            if not (isinstance(annotation, ast.Subscript) and isinstance(annotation.value, ast.Name)):
                continue
            if annotation.value.id != "A" or not isinstance(annotation.slice, ast.Tuple):
                continue
            field_type, meta = annotation.slice.elts[0], annotation.slice.elts[1]
            is_switch = isinstance(field_type, ast.Name) and field_type.id == "bool"
            names = ["--" + node.target.id.replace("_", "-")]
            if isinstance(meta, ast.Call):
                for keyword in meta.keywords:
                    if keyword.arg == "cli_name":
                        names = [ast.literal_eval(keyword.value)]
                    elif keyword.arg == "aliases":
                        names += list(ast.literal_eval(keyword.value))
                    elif keyword.arg == "action" and isinstance(keyword.value, ast.Constant):
                        is_switch = keyword.value.value in ("store_true", "store_false")
            for flag in names:
                flags[flag] = is_switch
    return flags
