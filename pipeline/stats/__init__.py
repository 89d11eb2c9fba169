"""Per-prompt statistics store (checkpointed): what every adaptive method needs, keyed by prompt id.

``PromptStatsStore`` holds the cumulative and Ada-EMA counters, E3 ranks, DEPO estimator
predictions and curation pass rates as ``(P,)`` tensors; ``winnow stats show`` (in
``pipeline.stats.cli``) prints a run's exported ``stats.parquet``.
"""

from pipeline.stats.store import (
    COLUMNS,
    DERIVED_COLUMNS,
    SETTABLE_COLUMNS,
    ColumnSpec,
    PromptStatsStore,
    StatsError,
)

__all__ = ["COLUMNS", "DERIVED_COLUMNS", "SETTABLE_COLUMNS", "ColumnSpec", "PromptStatsStore", "StatsError"]
