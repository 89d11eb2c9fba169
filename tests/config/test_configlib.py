from dataclasses import dataclass
from typing import Literal

import pytest

from pipeline import configlib
from pipeline.config import DataInspectConfig, EvalConfig
from pipeline.configlib import ConfigError, option, section


@dataclass(kw_only=True, slots=True)
class Inner:
    rate: float = option(0.1, gt=0.0, le=1.0, help="a rate")
    mode: Literal["a", "b"] = option("a", help="a mode")
    sizes: list[int] = option(default_factory=lambda: [1, 2], help="sizes")
    cap: int | None = option(None, ge=1, help="optional cap")


@dataclass(kw_only=True, slots=True)
class Outer:
    inner: Inner = section(Inner, help="inner section")
    name: str = option("x", help="a name")
    flag: bool = option(False, help="a flag")


def test_defaults_round_trip_through_plain_data():
    cfg = configlib.from_dict(Outer, configlib.to_dict(Outer()))
    assert cfg == Outer()


def test_overrides_are_dotted_and_typed():
    cfg = configlib.load(Outer, overrides=["inner.rate=0.5", "inner.mode=b", "flag=true", "inner.sizes=[3,4]", "inner.cap=7"])
    assert (cfg.inner.rate, cfg.inner.mode, cfg.flag, cfg.inner.sizes, cfg.inner.cap) == (0.5, "b", True, [3, 4], 7)
    assert isinstance(configlib.load(Outer, overrides=["inner.rate=1"]).inner.rate, float)
    # YAML 1.1 would read 3e-3 as a string; configs mean the number.
    assert configlib.load(Outer, overrides=["inner.rate=3e-3"]).inner.rate == 0.003


@pytest.mark.parametrize(
    "override, message",
    [
        ("inner.rat=0.5", r"unknown option inner\.rat; known options here: cap, mode, rate, sizes"),
        ("innr.rate=0.5", r"unknown option innr"),
        ("inner.rate=0", r"inner\.rate: 0\.0 is out of range; must be > 0"),
        ("inner.rate=2", r"inner\.rate: 2\.0 is out of range; must be <= 1"),
        ("inner.mode=c", r"inner\.mode: 'c' is not allowed; expected one of 'a', 'b'"),
        ("flag=yes please", r"flag: expected true or false"),
        ("inner.sizes=[1, x]", r"inner\.sizes\[1\]: expected an integer"),
        ("inner.cap=0", r"inner\.cap: 0 is out of range"),
        ("inner.rate=abc", r"inner\.rate: expected a number"),
        ("inner.rate=.nan", r"inner\.rate: NaN"),
        ("inner.rate=" + "9" * 400, r"inner\.rate: 9+ is too large for a number"),
        ("inner=3", r"inner: expected a Inner section"),
        ("novalue", r"not of the form dotted.path=value"),
    ],
)
def test_bad_values_name_the_field(override, message):
    with pytest.raises(ConfigError, match=message):
        configlib.load(Outer, overrides=[override])


def test_yaml_file_merges_and_reports_errors(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("inner:\n  mode: b\nname: run\n")
    cfg = configlib.load(Outer, yaml_path=path, overrides=["inner.rate=0.2"])
    assert (cfg.inner.mode, cfg.name, cfg.inner.rate) == ("b", "run", 0.2)
    path.write_text("inner: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        configlib.load(Outer, yaml_path=path)
    with pytest.raises(ConfigError, match="does not exist"):
        configlib.load(Outer, yaml_path=tmp_path / "missing.yaml")


def test_cross_field_validation_names_field():
    with pytest.raises(ConfigError, match=r"eval\.ks: \[64\] outside"):
        configlib.load(_EvalWrapper, overrides=["eval.ks=[1,64]"])


@dataclass(kw_only=True, slots=True)
class _EvalWrapper:
    eval: EvalConfig = section(EvalConfig, help="eval")


def test_resolved_config_is_saved_and_reloads(tmp_path):
    cfg = configlib.load(DataInspectConfig, overrides=["data.on_bad_row=skip", "num_examples=5"])
    path = configlib.save_resolved(cfg, tmp_path)
    assert configlib.load(DataInspectConfig, yaml_path=path) == cfg


def test_every_option_has_help():
    for path, _, _, help_text in configlib.iter_options(Outer):
        assert help_text, path


def test_load_of_a_config_with_required_options_names_the_missing_one():
    """A stage config with required options (an export's checkpoint and out) loads from its defaults plus
    overrides, and one left out is a ConfigError naming it, not a TypeError from the constructor."""
    from pipeline.config import ExportConfig

    with pytest.raises(ConfigError, match="checkpoint: required option is missing"):
        configlib.load(ExportConfig)
    with pytest.raises(ConfigError, match="out: required option is missing"):
        configlib.load(ExportConfig, overrides=["checkpoint=/runs/rl"])
    cfg = configlib.load(ExportConfig, overrides=["checkpoint=/runs/rl", "out=/runs/hf"])
    assert (cfg.checkpoint, cfg.out) == ("/runs/rl", "/runs/hf")
    assert configlib.load(ExportConfig, overrides=["checkpoint=/a", "out=/b"]) == ExportConfig(checkpoint="/a", out="/b")
