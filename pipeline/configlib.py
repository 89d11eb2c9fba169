"""Typed config machinery: dataclasses in, validated dataclasses out.

Every option is a dataclass field declared with :func:`option`, which carries its
one default, a help line (``docs/configuration.md`` is generated from it) and
optional bounds. :func:`from_dict` builds a config from plain data (YAML, CLI
overrides) and fails on the first problem with a :class:`ConfigError` naming the
dotted field path and what is allowed. Nothing is coerced silently: a YAML
``"3"`` for an ``int`` field is an error, an ``int`` for a ``float`` field is
widened.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

from pipeline.errors import UserError
from pipeline.io import atomic_write_text

T = TypeVar("T")


class _Loader(yaml.SafeLoader):
    """YAML 1.1 reads ``3e-3`` (no dot) as a string; config values mean the number."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _yaml_load(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass

_MISSING = dataclasses.MISSING


class ConfigError(UserError):
    """A config value is missing, unknown, of the wrong type, or out of range."""


def option(
    default: Any = _MISSING,
    *,
    help: str,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    default_factory: Any = _MISSING,
) -> Any:
    """Declare a config field with its single default, help text and bounds."""
    metadata = {"help": help, "ge": ge, "gt": gt, "le": le, "lt": lt}
    if default_factory is not _MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    if isinstance(default, (list, dict, set)):
        raise TypeError("mutable defaults need default_factory")
    if dataclasses.is_dataclass(default):
        raise TypeError("nested config defaults need default_factory")
    return dataclasses.field(default=default, metadata=metadata)


def section(cls: type[T], *, help: str) -> T:
    """A nested config section, defaulting to the section's own defaults."""
    return dataclasses.field(default_factory=cls, metadata={"help": help})


def _describe(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in get_args(tp))
    if tp is type(None):
        return "null"
    if origin in (list, Sequence):
        return f"a list of {_describe(get_args(tp)[0])}"
    if origin is tuple:
        return "a list of " + ", ".join(_describe(a) for a in get_args(tp) if a is not Ellipsis)
    if origin in (dict, Mapping):
        return f"a mapping to {_describe(get_args(tp)[1])}"
    if dataclasses.is_dataclass(tp):
        return f"a {tp.__name__} section"
    return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, path: str) -> Any:
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin is Literal:
        if any(value == allowed and type(value) is type(allowed) for allowed in get_args(tp)):
            return value
        raise ConfigError(f"{path}: {value!r} is not allowed; expected {_describe(tp)}")
    if origin in (Union, types.UnionType):
        for arm in get_args(tp):
            try:
                return _convert(value, arm, path)
            except ConfigError:
                continue
        raise ConfigError(f"{path}: {value!r} is not {_describe(tp)}")
    if tp is type(None):
        if value is None:
            return None
        raise ConfigError(f"{path}: expected null, got {value!r}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: expected {_describe(tp)} (a mapping), got {value!r}")
        return from_dict(tp, value, path=path)
    if origin in (list, Sequence):
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
            raise ConfigError(f"{path}: expected {_describe(tp)}, got {value!r}")
        (item_tp,) = get_args(tp)
        return [_convert(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is tuple:
        args = get_args(tp)
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
            raise ConfigError(f"{path}: expected {_describe(tp)}, got {value!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(v, args[0], f"{path}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise ConfigError(f"{path}: expected {len(args)} values, got {len(value)}")
        return tuple(_convert(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if origin in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: expected {_describe(tp)}, got {value!r}")
        key_tp, value_tp = get_args(tp)
        return {
            _convert(k, key_tp, f"{path}.<key>"): _convert(v, value_tp, f"{path}.{k}")
            for k, v in value.items()
        }
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                return float(value)
            except OverflowError:  # an integer beyond float's range (~1.8e308)
                raise ConfigError(f"{path}: {value} is too large for a number") from None
        raise ConfigError(f"{path}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{path}: expected a string, got {value!r}")
    if tp is Path:
        if isinstance(value, (str, Path)):
            return Path(value)
        raise ConfigError(f"{path}: expected a path, got {value!r}")
    raise TypeError(f"{path}: unsupported config type {tp!r}")


def _check_bounds(value: Any, field: dataclasses.Field, path: str) -> None:
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    if isinstance(value, float) and value != value:
        raise ConfigError(f"{path}: NaN is not a valid value")
    meta = field.metadata
    checks = (("ge", lambda b: value >= b, ">="), ("gt", lambda b: value > b, ">"),
              ("le", lambda b: value <= b, "<="), ("lt", lambda b: value < b, "<"))
    for key, ok, symbol in checks:
        bound = meta.get(key)
        if bound is not None and not ok(bound):
            raise ConfigError(f"{path}: {value!r} is out of range; must be {symbol} {bound}")


def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls, include_extras=False)


def from_dict(cls: type[T], data: Mapping[str, Any], *, path: str = "") -> T:
    """Build ``cls`` from plain data; unknown keys and bad values raise ConfigError."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path or '<root>'}: expected a mapping, got {data!r}")
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = f"{path}." if path else ""
        raise ConfigError(
            f"unknown option {where}{unknown[0]}; known options here: {', '.join(sorted(fields))}"
        )
    kwargs = {}
    for name, value in data.items():
        field_path = f"{path}.{name}" if path else name
        converted = _convert(value, hints[name], field_path)
        _check_bounds(converted, fields[name], field_path)
        kwargs[name] = converted
    for name, field in fields.items():
        if name not in kwargs and field.default is _MISSING and field.default_factory is _MISSING:
            field_path = f"{path}.{name}" if path else name
            raise ConfigError(f"{field_path}: required option is missing")
    try:
        return cls(**kwargs)
    except ConfigError as error:
        if path and not str(error).startswith(path):
            raise ConfigError(f"{path}.{error}") from None
        raise


def validate(obj: Any, *, path: str = "") -> None:
    """Check bounds and types of an already-built config (e.g. from a recipe)."""
    from_dict(type(obj), to_dict(obj), path=path)


def to_dict(obj: Any) -> Any:
    """Plain data (dicts, lists, scalars) of a config, suitable for YAML/JSON."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    if isinstance(obj, Path):
        return str(obj)
    return obj


def to_flat_dict(obj: Any) -> dict[str, Any]:
    """``to_dict(obj)`` with nested sections flattened to dotted keys (``"optim.lr"``), as overrides name them."""

    def walk(node: Mapping[str, Any], prefix: str) -> typing.Iterator[tuple[str, Any]]:
        for key, value in node.items():
            if isinstance(value, dict):
                yield from walk(value, f"{prefix}{key}.")
            else:
                yield f"{prefix}{key}", value

    return dict(walk(to_dict(obj), ""))


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b.c=value`` → (["a", "b", "c"], value); the value is read as YAML."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {text!r} is not of the form dotted.path=value")
    parts = key.strip().split(".")
    if any(not p for p in parts):
        raise ConfigError(f"override {text!r} has an empty path component")
    try:
        value = _yaml_load(raw) if raw.strip() else ""
    except yaml.YAMLError as error:
        raise ConfigError(f"override {key}: cannot read value {raw!r}: {error}") from None
    return parts, value


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply dotted overrides to plain config data (a new dict is returned)."""
    result = copy.deepcopy(data)
    for text in overrides:
        parts, value = parse_override(text)
        node = result
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if not isinstance(child, dict):
                if child is None and part not in node:
                    raise ConfigError(
                        f"unknown option {'.'.join(parts[: i + 1])}; "
                        f"known options here: {', '.join(sorted(node))}"
                    )
                child = {}
                node[part] = child
            node = child
        node[parts[-1]] = value
    return result


def _defaults(cls: type) -> dict[str, Any]:
    """The plain data of ``cls``'s defaults: every init field that has one (all of them: ``to_dict(cls())``)."""
    fields = [f for f in dataclasses.fields(cls) if f.init]
    if all(f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING for f in fields):
        return to_dict(cls())
    return {f.name: to_dict(f.default if f.default is not dataclasses.MISSING else f.default_factory())
            for f in fields if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING}


def load(cls: type[T], *, base: T | None = None, yaml_path: str | Path | None = None,
         overrides: Sequence[str] = ()) -> T:
    """base (or defaults) ← YAML file ← dotted overrides, validated as ``cls``.

    A class with required options (no default) starts from the defaults it has; ``from_dict``
    then names each required option the file and overrides left out.
    """
    data = to_dict(base) if base is not None else _defaults(cls)
    if yaml_path is not None:
        try:
            loaded = _yaml_load(Path(yaml_path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {yaml_path} does not exist") from None
        except yaml.YAMLError as error:
            raise ConfigError(f"config file {yaml_path} is not valid YAML: {error}") from None
        if loaded is not None:
            if not isinstance(loaded, dict):
                raise ConfigError(f"config file {yaml_path}: top level must be a mapping")
            _check_plain(loaded, path="", source=str(yaml_path), ancestors=())
            data = _deep_merge(data, loaded)
    data = apply_overrides(data, overrides)
    return from_dict(cls, data)


_PLAIN_SCALARS = (str, int, float, bool, type(None))


def _check_plain(value: Any, *, path: str, source: str, ancestors: tuple[int, ...]) -> None:
    """Configs are plain data: YAML dates, binary blobs and self-referencing anchors are refused."""
    where = path or "<top level>"
    if isinstance(value, _PLAIN_SCALARS):
        return
    if id(value) in ancestors:
        raise ConfigError(f"config file {source}: {where} refers to itself (a recursive YAML anchor)")
    if isinstance(value, dict):
        for key, child in value.items():
            if not isinstance(key, str):
                raise ConfigError(f"config file {source}: {where} has a non-string key {key!r}")
            _check_plain(child, path=f"{path}.{key}" if path else key, source=source,
                         ancestors=(*ancestors, id(value)))
        return
    if isinstance(value, list):
        for index, child in enumerate(value):
            _check_plain(child, path=f"{where}[{index}]", source=source, ancestors=(*ancestors, id(value)))
        return
    raise ConfigError(
        f"config file {source}: {where} is a {type(value).__name__}; options take strings, numbers, "
        "booleans, lists and mappings (quote dates and times)"
    )


def _deep_merge(base: dict[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def dump_yaml(obj: Any) -> str:
    return yaml.safe_dump(to_dict(obj), sort_keys=False)


def save_resolved(obj: Any, directory: str | Path, name: str = "config.yaml") -> Path:
    """Write the resolved config next to a run's outputs (atomically; every rank may call it at once)."""
    return atomic_write_text(Path(directory) / name, dump_yaml(obj))


def iter_options(cls: type, prefix: str = "", defaults: Any = None) -> typing.Iterator[tuple[str, str, Any, str]]:
    """(dotted path, type description, default, help) for every leaf option.

    Defaults are read from an instance (``defaults`` or ``cls()``), so a section whose
    stage overrides its defaults (``BootstrapConfig.optim``) is documented as it is used.
    """
    hints = _hints(cls)
    if defaults is None:
        defaults = cls()
    for field in dataclasses.fields(cls):
        path = f"{prefix}{field.name}"
        tp = hints[field.name]
        value = getattr(defaults, field.name)
        if dataclasses.is_dataclass(tp):
            yield from iter_options(tp, prefix=f"{path}.", defaults=value)
            continue
        yield path, _describe(tp), to_dict(value), field.metadata.get("help", "")
