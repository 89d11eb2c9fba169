"""The table of stage kinds (``pipeline.config.STAGE_KINDS``) is the one place a kind is defined.

Its config class, its flags and its runner: the CLI, a plan's validation and campaign.json,
the launcher's job shapes and docs/configuration.md all read them from there. The one DAG
walker (``dependency_order``, ``reachable``) orders a plan and finds a stage's ancestors for
the launcher.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from pipeline.cli import build_parser
from pipeline.config import STAGE_KINDS, CurateConfig, ExportConfig, Resources, RolloutServers, StageKind
from pipeline.configlib import ConfigError, option
from pipeline.launch.campaign import (
    CampaignPlan,
    Stage,
    dependency_order,
    reachable,
    run_stage,
    stage_runner,
)
from pipeline.launch.nemo import ExecutorOverrides, apply_executor_overrides

ROOT = Path(__file__).resolve().parents[2]


def test_every_kind_has_a_documented_config_and_a_runner():
    written = (ROOT / "docs" / "configuration.md").read_text()
    sections = set(re.findall(r"^## `([^`]+)` \((\w+)\)$", written, re.M))
    for kind in STAGE_KINDS.values():
        assert (kind.name, kind.config.__name__) in sections, kind.name
        assert f"| `{kind.name}` | {kind.config.__name__} |" in written, kind.name  # its row of the kinds table
        assert callable(kind.runner), kind.name
    # What every stage runs on is documented with them.
    assert {("resources", Resources.__name__), ("resources.rollout", RolloutServers.__name__)} <= sections
    assert "| `hf` | str | required |" in written  # a conversion's options have no default


def test_the_kind_flags_are_the_ones_the_launcher_used_to_list():
    def having(flag: str) -> list[str]:
        return [kind.name for kind in STAGE_KINDS.values() if getattr(kind, flag)]

    assert STAGE_KINDS.names() == ["bootstrap", "convert", "curate", "evaluate", "export", "rl", "train-estimator"]
    assert having("multi_rank") == ["bootstrap", "rl"]
    assert having("rollout_servers") == ["curate", "evaluate", "rl"]
    assert having("converts_model") == ["convert", "export"]
    assert having("checkpoints_on_signal") == ["rl"]
    assert having("servers_need_model_path") == ["evaluate"]
    assert having("check_resources") == ["rl"]


@dataclass(kw_only=True, slots=True)
class ProbeConfig:
    """A stage kind that exists only in this test."""

    size: int = option(1, ge=1, help="anything")


def test_a_kind_added_to_the_table_alone_is_launchable_validated_saved_and_run(tmp_path, monkeypatch):
    ran = []
    probe = StageKind(name="probe", config=ProbeConfig, multi_rank=True,
                      runner=lambda cfg, *, context, out: ran.append(cfg.size) or "done")
    monkeypatch.setitem(STAGE_KINDS._entries, "probe", probe)
    assert build_parser().parse_args(["launch", "stage", "probe", "size=3"]).kind == "probe"
    stage = Stage(name="p", kind="probe", config=ProbeConfig(size=3), resources=Resources(ranks_per_node=2))
    plan = CampaignPlan(name="t", output_dir=tmp_path, stages=[stage])
    saved = plan.to_dict()
    assert CampaignPlan.from_dict(saved).to_dict() == saved
    assert CampaignPlan.from_dict(saved).stages[0].config == ProbeConfig(size=3)
    overridden = apply_executor_overrides(plan, ExecutorOverrides(ranks_per_node=4))
    assert overridden.stages[0].resources.ranks_per_node == 4  # a multi-rank kind
    assert run_stage(stage, out=lambda _: None) == "done" and ran == [3]


def test_a_kind_missing_from_the_table_is_refused_everywhere(tmp_path):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["launch", "stage", "probe"])
    with pytest.raises(ConfigError, match=r"stages.p.kind: 'probe' is not one of \['bootstrap', 'convert', "):
        Stage(name="p", kind="probe", config=ProbeConfig())
    saved = {"name": "t", "output_dir": str(tmp_path), "stages": [
        {"name": "p", "kind": "probe", "depends_on": [], "resources": {}, "config": {}}]}
    with pytest.raises(ConfigError, match="stages.p.kind: 'probe' is not one of"):
        CampaignPlan.from_dict(saved)


def test_validation_reads_the_flags_of_the_table(monkeypatch):
    servers = Resources(rollout=RolloutServers(nodes=1))
    Stage(name="c", kind="curate", config=CurateConfig(policy="/models/m"), resources=servers)
    monkeypatch.setattr(STAGE_KINDS.get("curate"), "rollout_servers", False)
    with pytest.raises(ConfigError, match="resources.rollout: only evaluate, rl stages use rollout servers"):
        Stage(name="c", kind="curate", config=CurateConfig(policy="/models/m"), resources=servers)
    monkeypatch.setattr(STAGE_KINDS.get("export"), "multi_rank", True)
    Stage(name="e", kind="export", config=ExportConfig(checkpoint="c", out="o"), resources=Resources(nodes=2))


def test_a_kind_takes_one_runner():
    with pytest.raises(ValueError, match="stage kind 'rl' has two runners"):
        stage_runner("rl")(lambda cfg, *, context, out: "done")
    with pytest.raises(ValueError, match="unknown stage kind 'probe'"):
        stage_runner("probe")


def test_the_dag_walker():
    edges = {"a": (), "b": ("a",), "c": ("a",), "d": ("c", "b"), "e": ()}
    assert dependency_order(edges) == ["a", "b", "c", "d", "e"]  # ready names in the listed order
    assert reachable("d", edges) == ["c", "b", "a"]  # nearest first, each once
    assert reachable("e", edges) == []
    with pytest.raises(ConfigError, match="dependency cycle among x, y"):
        dependency_order({"x": ("y",), "y": ("x",), "z": ()})


def test_a_conversion_is_sized_by_its_nearest_ancestor(tmp_path):
    """The launcher walks an export's ancestors with the plan's walker, nearest first."""
    import json

    from pipeline.config import EvaluateConfig
    from pipeline.launch.nemo import conversion_model

    def folder(name: str, layers: int) -> str:
        path = tmp_path / name
        path.mkdir()
        (path / "config.json").write_text(json.dumps({
            "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 1024, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": layers, "num_attention_heads": 4,
            "num_key_value_heads": 2, "max_position_embeddings": 256, "torch_dtype": "bfloat16"}))
        return str(path)

    near, far = folder("near", 2), folder("far", 4)
    plan = CampaignPlan(name="t", output_dir=tmp_path / "c", stages=[
        Stage(name="far", kind="evaluate", config=EvaluateConfig(policy=far)),
        Stage(name="near", kind="evaluate", config=EvaluateConfig(policy=near), depends_on=("far",)),
        Stage(name="export", kind="export", depends_on=("near",),
              config=ExportConfig(checkpoint=str(tmp_path / "none"), out=str(tmp_path / "out")))])
    found = conversion_model(plan.stage("export"), plan)
    assert found is not None and found.source == f"stage near's {near}/config.json"
    reordered = dataclasses.replace(plan.stage("export"), depends_on=("far", "near"))
    plan = CampaignPlan(name="t", output_dir=tmp_path / "c", stages=[*plan.stages[:2], reordered])
    assert conversion_model(reordered, plan).source == f"stage far's {far}/config.json"
