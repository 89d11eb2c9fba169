"""Recipes produce valid configs and differ from their parent only where they say they do."""

import pytest

from pipeline import configlib
from recipes.cpu import RECIPES, d3s_cpu, d3s_cw_cpu, grpo_cpu


def _flat(cfg):
    def walk(node, prefix=""):
        for key, value in node.items():
            if isinstance(value, dict):
                yield from walk(value, f"{prefix}{key}.")
            else:
                yield f"{prefix}{key}", value
    return dict(walk(configlib.to_dict(cfg)))


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_recipe_validates(name):
    configlib.validate(RECIPES[name]())


def test_d3s_differs_from_grpo_only_in_the_algorithm():
    base, d3s = _flat(grpo_cpu()), _flat(d3s_cpu())
    changed = {key for key in base if base[key] != d3s[key]}
    assert changed == {"algorithm.sample_selector", "algorithm.token_weights", "algorithm.aggregation",
                       "algorithm.d3s.num_keep_init", "algorithm.d3s.num_keep_final"}


def test_cw_builds_on_d3s():
    assert d3s_cw_cpu().algorithm.token_weights == ["d3s_topk", "cw_grpo"]
    assert grpo_cpu(steps=7).optim.total_steps == 7
