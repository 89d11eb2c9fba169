"""Campaign plans, the status file, and the in-process runner's skip / fail / stop logic (fake stages)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.config import (
    BootstrapConfig,
    ConvertConfig,
    CurateConfig,
    EvaluateConfig,
    ExportConfig,
    ParallelConfig,
    Resources,
    RLConfig,
    RolloutServers,
    TrainEstimatorConfig,
)
from pipeline.configlib import ConfigError
from pipeline.launch.campaign import (
    CampaignPlan,
    CampaignStatus,
    Stage,
    run_campaign_inprocess,
    wire_campaign,
)
from pipeline.stages.bootstrap import config_hash
from recipes.campaigns import cpu_campaign, qwen25_math_7b


def _plan(tmp_path: Path, edges: dict[str, tuple[str, ...]]) -> CampaignPlan:
    return CampaignPlan(name="t", output_dir=tmp_path, stages=[
        Stage(name=name, kind="evaluate", config=EvaluateConfig(policy=name), depends_on=deps)
        for name, deps in edges.items()])


DIAMOND = {"a": (), "b": ("a",), "c": ("a",), "d": ("b", "c"), "e": ()}


class FakeStages:
    """Records the order stages ran in; fails or stops the named ones."""

    def __init__(self, *, fail=(), stop=()) -> None:
        self.ran: list[str] = []
        self.fail, self.stop = set(fail), set(stop)

    def __call__(self, stage: Stage, *, context, out) -> str:
        assert context == "ctx"  # one shared context, passed through
        self.ran.append(stage.name)
        if stage.name in self.fail:
            raise RuntimeError(f"{stage.name} broke")
        return "stopped" if stage.name in self.stop else "done"


def _run(plan, fake):
    return run_campaign_inprocess(plan, context="ctx", out=lambda _: None, runner=fake)


def test_order_is_topological_and_stable(tmp_path):
    plan = _plan(tmp_path, DIAMOND)
    assert [s.name for s in plan.order()] == ["a", "b", "c", "d", "e"]
    assert plan.dependents("a") == ["b", "c", "d"]  # nearest first
    assert plan.dependents("e") == []
    assert plan.dependencies("d") == ["b", "c", "a"]
    assert plan.dependencies("a") == []


@pytest.mark.parametrize("edges, message", [
    ({"a": ("b",), "b": ("a",)}, "dependency cycle among a, b"),
    ({"a": ("zzz",)}, "stages.a.depends_on: no stage named 'zzz'"),
])
def test_bad_graphs_are_refused(tmp_path, edges, message):
    with pytest.raises(ConfigError, match=message):
        _plan(tmp_path, edges)


def test_bad_stages_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="named twice"):
        CampaignPlan(name="t", output_dir=tmp_path, stages=[
            Stage(name="x", kind="evaluate", config=EvaluateConfig()),
            Stage(name="x", kind="evaluate", config=EvaluateConfig())])
    with pytest.raises(ConfigError, match="stages.x.config: a rl stage takes a RLConfig, got EvaluateConfig"):
        Stage(name="x", kind="rl", config=EvaluateConfig())
    with pytest.raises(ConfigError, match="a evaluate stage runs on one rank"):
        Stage(name="x", kind="evaluate", config=EvaluateConfig(), resources=Resources(ranks_per_node=2))
    with pytest.raises(ConfigError, match="SGLang servers need a Hugging Face policy"):
        Stage(name="x", kind="rl", config=RLConfig(), resources=Resources(rollout=RolloutServers(nodes=1)))
    with pytest.raises(ConfigError, match="only curate, evaluate, rl stages use rollout servers"):
        Stage(name="x", kind="export", config=ExportConfig(checkpoint="c", out="o"),
              resources=Resources(rollout=RolloutServers(nodes=1, model_path="/m")))
    with pytest.raises(ConfigError, match="rollout.model_path: the servers of an evaluate stage"):
        Stage(name="x", kind="evaluate", config=EvaluateConfig(policy="/runs/rl/checkpoints"),
              resources=Resources(rollout=RolloutServers(nodes=1)))
    # curation and evaluation may generate on the servers
    Stage(name="x", kind="curate", config=CurateConfig(policy="/models/m"),
          resources=Resources(rollout=RolloutServers(nodes=1)))
    Stage(name="x", kind="evaluate", config=EvaluateConfig(policy="/runs/rl/checkpoints"),
          resources=Resources(rollout=RolloutServers(nodes=1, model_path="/models/m")))


def test_plan_round_trips_through_campaign_json(tmp_path):
    plan = qwen25_math_7b(output_dir=tmp_path)
    plan.save()
    loaded = CampaignPlan.load(tmp_path)
    assert loaded.to_dict() == plan.to_dict()
    assert loaded.stage("rl-default").resources.rollout == RolloutServers(nodes=1, servers_per_node=8,
                                                                          model_path="/models/Qwen2.5-Math-7B")


def test_overrides_reach_one_stage_and_are_validated(tmp_path):
    plan = cpu_campaign(output_dir=tmp_path, tiny=True).with_overrides(["rl-grpo.steps=7", "curate.num_samples=3"])
    assert plan.stage("rl-grpo").config.steps == 7
    assert plan.stage("rl-default").config.steps == 2
    assert plan.stage("curate").config.num_samples == 3
    with pytest.raises(ConfigError, match="no stage named 'nope'"):
        plan.with_overrides(["nope.steps=1"])
    with pytest.raises(ConfigError, match="steps: 0 is out of range"):
        plan.with_overrides(["rl-grpo.steps=0"])


def test_an_overridden_bootstrap_moves_the_policy_every_later_stage_reads(tmp_path):
    plan = cpu_campaign(output_dir=tmp_path, tiny=True)
    moved = plan.with_overrides(["bootstrap.seed=5"])
    bootstrap = moved.stage("bootstrap").config
    entry = str(Path(bootstrap.cache_dir) / config_hash(bootstrap))
    assert entry != plan.stage("curate").config.policy
    assert moved.stage("curate").config.policy == entry
    for stage in moved.stages:
        if stage.kind == "rl":
            assert stage.config.bootstrap == bootstrap  # the rl stages rebuild the same entry
    assert moved.stage("evaluate-grpo").config.tokenizer == str(Path(entry) / "tokenizer")


def test_cpu_campaign_wires_every_path_from_the_root(tmp_path):
    plan = cpu_campaign(output_dir=tmp_path, tiny=True)
    boot = plan.stage("bootstrap").config
    entry = tmp_path / "cache" / "bootstrap" / config_hash(boot)
    curate = plan.stage("curate").config
    assert curate.policy == str(entry) and curate.output_dir == str(tmp_path / "curate")
    assert plan.stage("train-estimator").config.curation_dir == str(tmp_path / "curate")
    default, grpo, methods = plan.stage("rl-default"), plan.stage("rl-grpo"), plan.stage("rl-methods")
    assert grpo.config.data.train == [str(tmp_path / "curate" / "kept.jsonl")]
    assert grpo.config.curation_dir == str(tmp_path / "curate")
    for stage in (default, grpo, methods):
        assert stage.config.bootstrap == boot  # the same cache entry: no second bootstrap
    # The default and the DEPO-filtered stack train on the curation's sources as they are (the raw stream).
    for stage in (default, methods):
        assert stage.config.data.train == curate.sources and stage.config.curation_dir is None
    assert default.depends_on == ("bootstrap",)
    # Only the DEPO-filtered variant needs the estimator (and through it the curation).
    assert methods.config.algorithm.depo.estimator_dir == str(tmp_path / "estimator" / "estimator")
    assert methods.depends_on == ("bootstrap", "train-estimator") and grpo.depends_on == ("curate",)
    evaluate = plan.stage("evaluate-grpo").config
    assert (evaluate.policy, evaluate.tokenizer) == (str(tmp_path / "rl/grpo/checkpoints"), str(entry / "tokenizer"))
    assert plan.stage("export-grpo").config == ExportConfig(
        checkpoint=str(tmp_path / "rl/grpo/checkpoints"), out=str(tmp_path / "export/grpo"),
        tokenizer=str(entry / "tokenizer"))


def test_hf_campaign_starts_every_stage_from_the_model(tmp_path):
    plan = qwen25_math_7b(output_dir=tmp_path, model_dir="/m/q7")
    assert "bootstrap" not in [s.name for s in plan.stages]
    assert plan.stage("curate").config.policy == "/m/q7"
    assert plan.stage("evaluate-default").config.tokenizer == "/m/q7"
    # The trainer refuses an HF folder and SGLang needs one: each gets its own format.
    convert = plan.stage("convert")
    assert convert.config == ConvertConfig(hf="/m/q7", out=str(tmp_path / "base")) and convert.depends_on == ()
    for name in ("rl-default", "rl-grpo"):
        rl = plan.stage(name)
        assert rl.config.policy == str(tmp_path / "base") and rl.depends_on[0] == "convert"
        assert rl.resources.rollout.model_path == "/m/q7"


def _wire(tmp_path, variants: dict[str, RLConfig], **kwargs) -> CampaignPlan:
    return wire_campaign(name="t", output_dir=tmp_path, curate=CurateConfig(), estimator=TrainEstimatorConfig(),
                         rl_variants=variants, evaluate=EvaluateConfig(), **kwargs)


def test_the_estimator_stage_exists_only_when_a_variant_reads_it(tmp_path):
    grpo = RLConfig(policy="/m")
    depo = RLConfig(policy="/m")
    depo.algorithm.prompt_filter = "depo"
    one_gpu = Resources(gpus_per_node=1)

    # Nobody filters with DEPO: no estimator is trained, and the resources it would have run on are no error.
    plan = _wire(tmp_path, {"a": grpo, "b": grpo}, resources={"train-estimator": one_gpu})
    assert "train-estimator" not in [s.name for s in plan.stages]
    assert plan.stage("rl-a").depends_on == ("curate",) and plan.stage("rl-b").depends_on == ("curate",)
    with pytest.raises(ConfigError, match="resources: no stage named 'rl-c'"):  # other names are still checked
        _wire(tmp_path, {"a": grpo}, resources={"rl-c": one_gpu})

    plan = _wire(tmp_path, {"depo": depo, "grpo": grpo}, resources={"train-estimator": one_gpu})
    estimator = plan.stage("train-estimator")
    assert estimator.depends_on == ("curate",) and estimator.resources == one_gpu
    assert estimator.config.curation_dir == str(tmp_path / "curate")
    assert plan.stage("rl-depo").depends_on == ("curate", "train-estimator")
    assert plan.stage("rl-depo").config.algorithm.depo.estimator_dir == str(tmp_path / "estimator" / "estimator")
    assert plan.stage("rl-grpo").depends_on == ("curate",)


def test_status_file_records_attempts_and_times(tmp_path):
    status = CampaignStatus(tmp_path)
    status.initialize(_plan(tmp_path, {"a": ()}))
    assert status.state("a") == "pending"
    status.update("a", "running", job_id="17")
    status.update("a", "failed", error="boom")
    status.update("a", "running", job_id="18")
    record = status.update("a", "done")
    assert record["attempts"] == 2 and record["job_id"] == "18" and record["error"] is None
    assert record["finished"] >= record["started"]
    assert json.loads((tmp_path / "status.json").read_text())["stages"]["a"]["state"] == "done"


def test_failure_stops_dependents_but_not_independent_stages(tmp_path):
    plan = _plan(tmp_path, DIAMOND)
    fake = FakeStages(fail={"b"})
    result = _run(plan, fake)
    assert fake.ran == ["a", "b", "c", "e"]  # d waits on b; e does not
    assert result.states == {"a": "done", "b": "failed", "c": "done", "d": "pending", "e": "done"}
    assert result.blocked == ("d",) and not result.ok
    assert "RuntimeError: b broke" in CampaignStatus(tmp_path).read()["b"]["error"]

    # Relaunch: done stages are skipped, the failed one and its dependents run.
    fixed = FakeStages()
    result = _run(plan, fixed)
    assert fixed.ran == ["b", "d"] and result.ok
    assert result.skipped == ("a", "c", "e")
    assert CampaignStatus(tmp_path).read()["b"]["attempts"] == 2


def test_a_stage_stopped_by_a_signal_stays_pending_and_the_launch_ends(tmp_path):
    plan = _plan(tmp_path, {"a": (), "b": ("a",), "c": ()})
    fake = FakeStages(stop={"a"})
    result = _run(plan, fake)
    assert fake.ran == ["a"]
    assert result.states == {"a": "pending", "b": "pending", "c": "pending"}
    assert "stopped by a signal" in CampaignStatus(tmp_path).read()["a"]["error"]
    resumed = FakeStages()
    assert _run(plan, resumed).ok and resumed.ran == ["a", "b", "c"]


def test_stage_kinds_and_configs_match_the_cli():
    from pipeline.cli import COMMAND_CONFIGS
    from pipeline.config import STAGE_KINDS

    for kind in STAGE_KINDS.values():
        if kind.command:
            assert COMMAND_CONFIGS[kind.name] is kind.config
        else:  # export and convert: their options are `winnow convert` flags
            assert kind.name not in COMMAND_CONFIGS
    assert [kind.name for kind in STAGE_KINDS.values() if not kind.command] == ["convert", "export"]
    assert STAGE_KINDS.get("bootstrap").config is BootstrapConfig and STAGE_KINDS.get("curate").config is CurateConfig


def test_a_gpu_rl_stage_runs_one_rank_per_gpu_in_whole_model_replicas(tmp_path):
    rl = RLConfig(policy="/models/m", parallel=ParallelConfig(tensor_parallel=4))
    with pytest.raises(ConfigError, match="ranks_per_node: 1 rank\\(s\\) on 8 GPUs per node; an rl stage runs one"):
        Stage(name="rl", kind="rl", config=rl, resources=Resources(nodes=2, gpus_per_node=8))
    with pytest.raises(ConfigError, match="6 rank\\(s\\) are not a multiple of TP x PP = 4"):
        Stage(name="rl", kind="rl", config=rl, resources=Resources(ranks_per_node=6))
    Stage(name="rl", kind="rl", config=rl, resources=Resources(nodes=2, ranks_per_node=8, gpus_per_node=8))
