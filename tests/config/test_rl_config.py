"""RLConfig's cross-field resolution and option sections: what the run folder's config.yaml says is what runs."""

from __future__ import annotations

import pytest

from pipeline import configlib
from pipeline.config import RLConfig
from pipeline.configlib import ConfigError
from pipeline.rl.methods import build_methods
from pipeline.rl.registry import MethodSetting


def _load(*overrides: str) -> RLConfig:
    return configlib.load(RLConfig, overrides=list(overrides))


@pytest.mark.parametrize(("overrides", "correction"), [
    ([], "none"),  # synchronous: no correction unless asked for
    (["rollout.max_staleness=1"], "tis"),  # one update old: truncated importance sampling by default
    (["rollout.max_staleness=1", "algorithm.rollout_correction=none"], "tis"),  # none written out: the same
    (["rollout.max_staleness=1", "algorithm.rollout_correction=mis"], "mis"),  # a correction chosen stays
    (["algorithm.rollout_correction=tis"], "tis"),
])
def test_the_stale_sample_correction_is_resolved_when_the_config_loads(overrides, correction):
    assert _load(*overrides).algorithm.rollout_correction == correction


def test_the_saved_config_is_the_one_the_methods_are_built_from(tmp_path):
    cfg = _load("rollout.max_staleness=1", "algorithm.correction.level=sequence")
    saved = configlib.save_resolved(cfg, tmp_path)
    assert "rollout_correction: tis" in saved.read_text()
    reloaded = configlib.load(RLConfig, yaml_path=saved)
    assert configlib.to_dict(reloaded) == configlib.to_dict(cfg)
    methods = build_methods(reloaded.algorithm, MethodSetting(total_steps=cfg.steps, group_size=cfg.group_size,
                                                              temperature=cfg.temperature))
    assert (methods.rollout_correction.mode, methods.rollout_correction.cfg.level) == ("truncate", "sequence")
    assert methods.needs_token_stats  # π_old is recomputed for the ratios


def test_pods_keeps_its_own_subset_size_capped_at_the_group():
    def pods_keep(*overrides: str) -> int:
        cfg = _load("algorithm.sample_selector=pods", *overrides)
        methods = build_methods(cfg.algorithm, MethodSetting(total_steps=cfg.steps, group_size=cfg.group_size,
                                                             temperature=cfg.temperature))
        assert not methods.shared  # the D³S schedule is not PODS's
        return methods.sample_selector.num_keep

    assert pods_keep() == 8  # group_size 8
    assert pods_keep("algorithm.pods.num_keep=3", "algorithm.d3s.num_keep_init=5", "algorithm.d3s.dynamic=false") == 3
    assert pods_keep("algorithm.pods.num_keep=12") == 8
    with pytest.raises(ConfigError, match=r"algorithm\.pods\.num_keep: 0 is out of range"):
        _load("algorithm.pods.num_keep=0")


def test_context_parallel_is_no_option():
    with pytest.raises(ConfigError, match=r"unknown option parallel\.context_parallel"):
        _load("parallel.context_parallel=1")
