"""The config's allowed method names are exactly the registered ones (no drift either way)."""

from typing import get_args, get_type_hints

from pipeline.rl import methods, sampling
from pipeline.config import AlgorithmConfig, RewardConfig


def _allowed(field: str) -> set[str]:
    hint = get_type_hints(AlgorithmConfig)[field]
    args = get_args(hint)
    if len(args) == 1:  # list[Literal[...]]
        args = get_args(args[0])
    return set(args)


def test_literals_match_registries():
    assert _allowed("advantage") == set(methods.ADVANTAGES.names())
    assert _allowed("loss") == set(methods.POLICY_LOSSES.names())
    assert _allowed("sample_selector") == set(methods.SAMPLE_SELECTORS.names())
    assert _allowed("token_weights") == set(methods.TOKEN_WEIGHTS.names())
    assert _allowed("temperature") == set(methods.TEMPERATURES.names())
    assert _allowed("prompt_filter") == set(sampling.PROMPT_FILTERS.names())
    assert _allowed("budget") == set(sampling.BUDGETS.names())
    assert _allowed("sampling") == set(sampling.SAMPLERS.names())


def test_reward_config_maps_onto_the_grading_pool():
    import inspect

    from pipeline.rewards import GradingPool

    parameters = inspect.signature(GradingPool).parameters
    assert set(RewardConfig().pool_kwargs()) <= set(parameters)
