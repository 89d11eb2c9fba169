"""Pure tensor functions of the RL algorithms, registered by name (see ``registry.py``).

Importing this package fills the registries: every method module is imported here.
"""

from pipeline.algorithms import (  # noqa: F401  (imported for their registrations)
    advantages,
    cw_grpo,
    d3s,
    depo,
    e3,
    losses,
    pods,
    reinforce_ada,
)
from pipeline.algorithms.registry import ADVANTAGES, POLICY_LOSSES, SAMPLE_SELECTORS, TOKEN_WEIGHTS

__all__ = ["ADVANTAGES", "POLICY_LOSSES", "SAMPLE_SELECTORS", "TOKEN_WEIGHTS"]
