"""Every paper preset passes `winnow launch`'s plan check and its stage's pre-flight on its model's published config.

Each preset runs as one rl stage (``winnow launch stage rl``, ``docs/reproducing.md``) on 8×H100
nodes at its ``PaperModel.tensor_parallel``, with a node of 8 SGLang servers: the check plans its
memory, KV cache and context exactly as the launch does (``check_campaign_plan``, default prompt
allowance), on the model the stage names: a folder holding the model's published ``config.json``
beside empty weight and tokenizer files (the pre-flight checks that they are there; nothing
reads them). The held-out set a preset scores (``eval_set``) is generated inside the rl stage
with the same ``max_new_tokens`` (``pipeline.rl.step.evaluate``), so the rl context check is its
check too; a preset has no evaluate stage of its own.

Runtime: ~5 s on the shared 2-core machine (no model is built).
"""

from __future__ import annotations

import argparse
import shutil

import pytest

from pipeline.cli.plan import check_campaign_plan
from pipeline.config import Resources, RolloutServers
from pipeline.launch import plan as planner
from pipeline.launch.campaign import CampaignPlan, Stage
from pipeline.stages.preflight import preflight
from recipes.papers import PAPER_PRESETS
from tests.launch.test_plan import FIXTURES, PRESET_FIXTURES

# `winnow launch`'s planner flags at their defaults; the launch refuses rather than forcing or skipping.
LAUNCH_ARGS = argparse.Namespace(gpu="h100", distributed_optimizer=None, recompute=None, prompt_tokens=None,
                                 mfu=0.35, rollout_mfu=0.1, response_fraction=1.0, force=False,
                                 skip_plan_check=False)


@pytest.fixture(scope="module")
def model_folders(tmp_path_factory) -> dict[str, str]:
    """Backbone key → a folder holding the published config.json of the model its presets start from."""
    root = tmp_path_factory.mktemp("models")
    folders = {}
    for key, fixture in PRESET_FIXTURES.items():
        folder = root / key
        folder.mkdir()
        shutil.copy(FIXTURES / f"{fixture}.json", folder / "config.json")
        for stand_in in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
            (folder / stand_in).write_bytes(b"")
        folders[key] = str(folder)
    return folders


def _preset_stage(name: str, policy: str, tmp_path) -> CampaignPlan:
    preset = PAPER_PRESETS[name]
    cfg = preset(policy=policy)
    # The run writes under the campaign's output folder, as the launch command in docs/reproducing.md sets it.
    cfg.logging.output_dir, cfg.checkpoint.directory = str(tmp_path / "rl"), str(tmp_path / "rl" / "checkpoints")
    # The campaigns' trainer nodes for these sizes (recipes/campaigns.py): 1 for 1.5B models, else 2.
    nodes = 1 if planner.load_model_dims(policy).num_parameters() < 2e9 else 2
    resources = Resources(nodes=nodes, ranks_per_node=8, gpus_per_node=8,
                          rollout=RolloutServers(nodes=1, servers_per_node=8))
    return CampaignPlan(name=name, output_dir=tmp_path, stages=[Stage(name="rl", kind="rl", config=cfg,
                                                                      resources=resources)])


@pytest.mark.parametrize("name", sorted(PAPER_PRESETS))
def test_every_paper_preset_passes_the_launch_plan_check_and_its_preflight(name, model_folders, tmp_path):
    key = str(PAPER_PRESETS[name].options["backbone"])
    plan = _preset_stage(name, model_folders[key], tmp_path)
    [stage] = plan.stages
    # The stage's own checks (its data sources, policy, generation length, output folders), as the job runs them.
    preflight(stage.config)
    printed: list[str] = []
    check_campaign_plan(plan, LAUNCH_ARGS, out=printed.append)  # raises, naming the stage, when refused
    report = "\n".join(printed)
    assert f"layout: TP={PAPER_PRESETS[name].model.tensor_parallel} " in report
    assert "verdict: FITS" in report and ": fits" in report, report
    [context] = planner.stage_contexts(plan)
    assert context.source == model_folders[key] and context.problem() is None
    assert context.max_new_tokens + planner.prompt_allowance(context.dims) <= context.dims.max_position_embeddings
