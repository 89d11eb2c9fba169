"""Per-prompt statistics store (checkpointed): what every adaptive method needs, keyed by prompt id.

``PromptStatsStore`` holds the cumulative and Ada-EMA counters, E3 ranks, DEPO estimator
predictions and curation pass rates as ``(P,)`` tensors; ``winnow stats show`` (in
``pipeline.cli.stats``) prints a run's exported ``stats.parquet``. Public API::

    store = PromptStatsStore(prompt_ids, ema_decay=0.9)
    store.record_rollouts(prompt_ids=ids_or_indices, num_samples=n, num_correct=k, reward_sum=r, step=step)
    store.set_column("e3_rank", prompt_ids=..., values=...)      # SETTABLE_COLUMNS only
    store.seed_from_curation(prompt_ids=..., pass_rates=..., num_samples=...)
    store.pass_rate(); store.ema_pass_rate(alpha, beta); store.column(name); store.rows(ids)
    store.top(n, by="pass_rate", ascending=False, min_samples=0); store.summary()
    store.state_dict() / load_state_dict(state)                  # {"tensors": ..., "meta": ...}
    store.to_parquet(path); PromptStatsStore.from_parquet(path)
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
