"""Bad input: random CLI overrides and random YAML files fail only with a ConfigError naming the key.

``tests/config/test_configlib.py`` checks hand-picked bad values; this file lets
hypothesis pick them. The contract under test (STYLE.md principle 8): whatever a user
types, ``configlib.load`` either returns a config or raises ``ConfigError`` whose message
contains the dotted path of the offending key — never a ``TypeError``, ``KeyError``,
``RecursionError`` or a YAML/JSON exception leaking out of the loader.
"""

from __future__ import annotations

import os
import string

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline import configlib
from pipeline.config import RLConfig
from pipeline.configlib import ConfigError

LEAF_PATHS = [path for path, *_ in configlib.iter_options(RLConfig)]
SECTION_PATHS = sorted({path.rpartition(".")[0] for path in LEAF_PATHS if "." in path})
FIELD_NAMES = sorted({part for path in LEAF_PATHS for part in path.split(".")})

identifiers = st.text(alphabet=string.ascii_lowercase + "_", min_size=1, max_size=8)
# Values as a user would type them after `=`: YAML scalars, flow collections, and the
# things YAML 1.1 reads surprisingly (dates, octal, sexagesimal, anchors, tags, nulls).
yaml_snippets = st.sampled_from([
    "", "null", "~", "true", "no", "on", "0", "-1", "1e400", "-.inf", ".nan", "0x1F", "0o17", "1_000",
    "12:30:00", "2024-01-01", "2024-01-01T10:00:00Z", "[]", "{}", "[1, [2, [3]]]", "{a: 1}", "{1: 2}",
    "[a, {b: c}]", "'quoted'", '"\\u0000"', "!!binary aGVsbG8=", "!!set {a, b}", "!!python/object:os.system",
    "&a [*a]", "*undefined", "[", "{", "a: b: c", "- x", "? complex", "|", ">", "%YAML 1.1", "=", "==",
    "a=b", "..", "\x00", "\t", "\U0001f600", "1" * 400,
])
override_values = st.one_of(
    yaml_snippets,
    st.integers(min_value=-(2**70), max_value=2**70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.text(max_size=20),
    st.lists(st.integers(-5, 5), max_size=3).map(str),
)


@st.composite
def override_paths(draw) -> str:
    kind = draw(st.sampled_from(["leaf", "leaf", "section", "extra_component", "renamed_last", "random"]))
    if kind == "random":
        return ".".join(draw(st.lists(st.sampled_from(FIELD_NAMES) | identifiers, min_size=1, max_size=4)))
    if kind == "section":
        return draw(st.sampled_from(SECTION_PATHS))
    parts = draw(st.sampled_from(LEAF_PATHS)).split(".")
    if kind == "extra_component":
        parts.append(draw(identifiers))
    elif kind == "renamed_last":
        parts[-1] = draw(identifiers)
    return ".".join(parts)


def _offending_prefix(path: str) -> str:
    """The path up to and including its first component that RLConfig does not have.

    For a path that exists (a leaf or a section) this is the whole path: the value
    was bad, so the error must name the full key.
    """
    known = set(LEAF_PATHS) | set(SECTION_PATHS)
    parts = path.split(".")
    for end in range(1, len(parts) + 1):
        prefix = ".".join(parts[:end])
        if prefix not in known or prefix in LEAF_PATHS:
            return prefix
    return path


def _assert_config_error_names(error: BaseException, key: str) -> None:
    assert isinstance(error, ConfigError), f"{type(error).__name__} leaked: {error!r}"
    message = str(error)
    section, _, leaf = key.rpartition(".")
    # A cross-field check reports under its partner's path and names this key by its
    # leaf ("bootstrap.model.num_query_groups: 4 does not divide num_attention_heads=1").
    named_in_its_section = leaf in message and (not section or f"{section}." in message)
    assert key in message or named_in_its_section, f"{message!r} does not name {key!r}"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(path=override_paths(), value=override_values)
def test_random_overrides_load_or_raise_config_error_naming_the_key(path, value):
    try:
        configlib.load(RLConfig, overrides=[f"{path}={value}"])
    except Exception as error:  # noqa: BLE001 - the type is what is under test
        _assert_config_error_names(error, _offending_prefix(path))


@pytest.mark.parametrize("override", ["=3", "steps", ".steps=1", "optim..lr=1", "  =x", "optim.=1"])
def test_malformed_override_syntax_is_a_config_error(override):
    with pytest.raises(ConfigError, match="override"):
        configlib.load(RLConfig, overrides=[override])


scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=10),
    st.dates(), st.datetimes(), st.binary(max_size=8),
)
# Mappings keyed mostly by real field names, so the fuzz reaches deep into the schema.
yaml_trees = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=3)
    | st.dictionaries(st.sampled_from(FIELD_NAMES) | identifiers | st.integers(0, 3), children, max_size=4),
    max_leaves=12,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(tree=st.dictionaries(st.sampled_from(FIELD_NAMES) | identifiers, yaml_trees, max_size=5))
def test_random_yaml_files_load_or_raise_config_error(tree, tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(tree))
    try:
        configlib.load(RLConfig, yaml_path=path)
    except Exception as error:  # noqa: BLE001
        assert isinstance(error, ConfigError), f"{type(error).__name__} leaked: {error!r}"
        # The message names a top-level key of the file (possibly as the head of a dotted path).
        assert any(str(key) in str(error) for key in tree), str(error)


@pytest.mark.parametrize("text", [
    "- a list\n- at the top\n", "just a string\n", "42\n", "a: [\n", "{a: 1, a: 2}\n",
    "steps: !!python/object/apply:os.system ['touch /tmp/PWNED_winnow']\n", "\x00\n", "? [1, 2]\n: x\n",
    "1: 2\n", "steps: 1\n" * 3, "optim: {lr: .inf}\n", "data: {train: [[[[]]]]}\n",
    "a: &x [*x]\n",
    "optim: {lr: 2024-01-01}\n",
    "data: {train: [2024-01-01T00:00:00Z]}\n",
    "steps: 2024-01-01\n",
    "vocab: !!binary aGVsbG8=\n",
])
def test_hostile_yaml_files_are_config_errors(text, tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    try:
        configlib.load(RLConfig, yaml_path=path)
    except Exception as error:  # noqa: BLE001
        assert isinstance(error, ConfigError), f"{type(error).__name__} leaked: {error!r}"
    assert not os.path.exists("/tmp/PWNED_winnow")
