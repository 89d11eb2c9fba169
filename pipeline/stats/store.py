"""Per-prompt statistics: one columnar store, keyed by prompt id, for every adaptive method.

Each column is a ``(P,)`` CPU tensor indexed by a stable prompt index ``0..P-1``
(the position of the id in the list the store was built from), so the index tensors
that the Ada-Est and E3 budgets and the DEPO filter take are store
indices. Columns (``COLUMNS`` lists them with dtypes and fill values):

==========================  =======  =====================================================
``num_samples``             int64    rollouts recorded, cumulative
``num_correct``             int64    of those, correct (the caller's threshold decides)
``reward_sum``              float64  Σ rewards, cumulative (rewards need not be 0/1)
``ema_total``/``ema_correct`` float64 Ada-EMA counters N ← λN + n, K ← λK + k (below)
``last_seen_step``          int64    step of the last update that listed the prompt, −1 never
``num_seen``                int64    updates that listed the prompt (times drawn)
``e3_rank``                 float64  E3 difficulty rank kᵢ ∈ (0, 1], NaN unknown
``estimator_prediction``    float64  the DEPO estimator's last predicted pass rate, NaN
``curation_pass_rate``      float64  pass rate measured by the curation stage, NaN
``curation_num_samples``    int64    samples behind it, 0 when not curated
==========================  =======  =====================================================

Derived: ``pass_rate`` = num_correct / num_samples (NaN while unsampled) and
``ema_pass_rate(α, β)`` = (ema_correct + α) / (ema_total + α + β).

Ada-EMA — "Reinforce-Ada: An
Adaptive Sampling Framework under Non-linear RL Objectives", §3.1 (Algorithm 1 line 19):
N_tot ← λ·N_tot + n, N_pos ← λ·N_pos + k, p̂ = (N_pos + α)/(N_tot + α + β). The semantics
are Reinforce-Ada-Est §3.1's (``ema_beta_update``; the test oracle ``tests/oracles/estimators.py`` checks them): only prompts listed
in an update decay; a prompt listed twice in one update is one encounter with its counts
summed; a prompt listed with zero samples (drawn, then filtered before rollout) still
decays, exactly as the estimator does. We sum the duplicates before decaying, so
N = λN + (n₁ + n₂) exactly; the estimator adds them one after the other, which can
differ from this in the last bit.

``last_seen_step`` may not go backwards for a prompt: an update whose step is older than
a listed prompt's last step is a resume or bookkeeping bug and raises ``ValueError``.

Resume is exact: ``state_dict()`` returns ``{"tensors": {column: (P,) tensor},
"meta": {...JSON...}}`` (the tensors go to safetensors, the meta to JSON), and
``load_state_dict`` checks the prompt id list, λ, names, shapes and dtypes. The Parquet
export (one row per prompt, every column plus ``pass_rate``) round-trips bit for bit too.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipeline.errors import UserError
from pipeline.io import atomic_write

__all__ = [
    "COLUMNS",
    "DERIVED_COLUMNS",
    "SETTABLE_COLUMNS",
    "ColumnSpec",
    "PromptStatsStore",
    "StatsError",
]

STATE_FORMAT = "winnow.prompt_stats"
STATE_VERSION = 1
PARQUET_METADATA_KEY = b"winnow.prompt_stats"
PROMPT_ID_COLUMN = "prompt_id"


class StatsError(UserError):
    """A stats file or state that does not fit (wrong prompts, missing column, bad file)."""


@dataclass(frozen=True, slots=True)
class ColumnSpec:
    dtype: torch.dtype
    fill: float | int


COLUMNS: dict[str, ColumnSpec] = {
    "num_samples": ColumnSpec(torch.int64, 0),
    "num_correct": ColumnSpec(torch.int64, 0),
    "reward_sum": ColumnSpec(torch.float64, 0.0),
    "ema_total": ColumnSpec(torch.float64, 0.0),
    "ema_correct": ColumnSpec(torch.float64, 0.0),
    "last_seen_step": ColumnSpec(torch.int64, -1),
    "num_seen": ColumnSpec(torch.int64, 0),
    "e3_rank": ColumnSpec(torch.float64, math.nan),
    "estimator_prediction": ColumnSpec(torch.float64, math.nan),
    "curation_pass_rate": ColumnSpec(torch.float64, math.nan),
    "curation_num_samples": ColumnSpec(torch.int64, 0),
}
# Columns other components own; the rollout counters change only through record_rollouts,
# which keeps num_correct ≤ num_samples and the EMA consistent.
SETTABLE_COLUMNS = ("e3_rank", "estimator_prediction", "curation_pass_rate", "curation_num_samples")
DERIVED_COLUMNS = ("pass_rate", "ema_pass_rate")

# Valid ranges of the settable columns: (low, high, low is inclusive). NaN means unknown.
_SETTABLE_RANGES: dict[str, tuple[float, float, bool]] = {
    "e3_rank": (0.0, 1.0, False),  # k = rank/|D| with rank ≥ 1
    "estimator_prediction": (0.0, 1.0, True),
    "curation_pass_rate": (0.0, 1.0, True),
    "curation_num_samples": (0.0, math.inf, True),
}


def _check_1d(name: str, tensor: torch.Tensor, length: int) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(tensor).__name__}")
    if tensor.dim() != 1 or tensor.numel() != length:
        raise ValueError(f"{name} must have shape ({length},) like prompt_ids, got {tuple(tensor.shape)}")


def _check_integer(name: str, tensor: torch.Tensor) -> None:
    if tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor (counts), got {tensor.dtype}")


class PromptStatsStore:
    """Columnar per-prompt statistics; see the module docstring for the columns and semantics."""

    def __init__(self, prompt_ids: Sequence[str], *, ema_decay: float = 0.9) -> None:
        if isinstance(prompt_ids, str):
            raise ValueError("prompt_ids must be a sequence of ids, not one string")
        if not (0.0 < ema_decay <= 1.0):
            raise ValueError(f"ema_decay λ must lie in (0, 1], got {ema_decay}")
        ids = list(prompt_ids)
        index: dict[str, int] = {}
        for position, prompt_id in enumerate(ids):
            if not isinstance(prompt_id, str):
                raise ValueError(f"prompt ids must be strings, got {prompt_id!r} at position {position}")
            if prompt_id in index:
                raise ValueError(f"duplicate prompt id {prompt_id!r} at positions {index[prompt_id]} and {position}")
            index[prompt_id] = position
        self.ema_decay = float(ema_decay)
        self._prompt_ids: list[str] = ids
        self._index = index
        self._columns: dict[str, torch.Tensor] = {
            name: torch.full((len(ids),), spec.fill, dtype=spec.dtype) for name, spec in COLUMNS.items()
        }

    # ------------------------------------------------------------------ lookup
    @property
    def prompt_ids(self) -> tuple[str, ...]:
        return tuple(self._prompt_ids)

    @property
    def num_prompts(self) -> int:
        return len(self._prompt_ids)

    def __len__(self) -> int:
        return len(self._prompt_ids)

    def index_of(self, prompt_ids: Sequence[str]) -> torch.Tensor:
        """Store indices of ``prompt_ids`` → ``(B,)`` int64; an unknown id raises ``ValueError`` naming it."""
        if isinstance(prompt_ids, str):
            raise ValueError(f"pass a sequence of prompt ids, not the single string {prompt_ids!r}")
        try:
            positions = [self._index[prompt_id] for prompt_id in prompt_ids]
        except KeyError as error:
            raise ValueError(f"unknown prompt id {error.args[0]!r} (the store holds {self.num_prompts} prompts)") from None
        return torch.tensor(positions, dtype=torch.int64)

    def _resolve(self, prompt_ids: Sequence[str] | torch.Tensor) -> torch.Tensor:
        if not isinstance(prompt_ids, torch.Tensor):
            return self.index_of(prompt_ids)
        _check_integer("prompt index tensor", prompt_ids)
        if prompt_ids.dim() != 1:
            raise ValueError(f"prompt index tensor must be 1-D (B,), got shape {tuple(prompt_ids.shape)}")
        indices = prompt_ids.detach().to(device="cpu", dtype=torch.int64)
        out_of_range = (indices < 0) | (indices >= self.num_prompts)
        if bool(out_of_range.any()):
            bad = int(indices[out_of_range][0])
            raise ValueError(f"prompt index {bad} outside [0, {self.num_prompts})")
        return indices

    # ------------------------------------------------------------------ updates
    def record_rollouts(
        self,
        *,
        prompt_ids: Sequence[str] | torch.Tensor,
        num_samples: torch.Tensor,
        num_correct: torch.Tensor,
        reward_sum: torch.Tensor,
        step: int,
    ) -> dict[str, float | torch.Tensor]:
        """Add one update's per-prompt counts: ``prompt_ids`` ids or indices ``(B,)``, counts ``(B,)``.

        Cumulative counters add; the Ada-EMA counters of the listed prompts decay once
        and add (Reinforce-Ada §3.1); ``last_seen_step`` becomes ``step`` and
        ``num_seen`` grows by one per listed prompt, however often it is listed.
        Validates everything before changing anything, so a rejected update leaves the
        store untouched.
        """
        indices = self._resolve(prompt_ids)  # (B,)
        num_listed = indices.numel()
        for name, tensor in (("num_samples", num_samples), ("num_correct", num_correct), ("reward_sum", reward_sum)):
            _check_1d(name, tensor, num_listed)
        _check_integer("num_samples", num_samples)
        _check_integer("num_correct", num_correct)
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int ≥ 0, got {step!r}")
        samples = num_samples.detach().to(device="cpu", dtype=torch.int64)  # (B,)
        correct = num_correct.detach().to(device="cpu", dtype=torch.int64)  # (B,)
        rewards = reward_sum.detach().to(device="cpu", dtype=torch.float64)  # (B,)
        if bool((samples < 0).any()) or bool((correct < 0).any()) or bool((correct > samples).any()):
            raise ValueError("need 0 ≤ num_correct ≤ num_samples for every listed prompt")
        if not bool(torch.isfinite(rewards).all()):
            raise ValueError("reward_sum contains non-finite values")

        touched, inverse = torch.unique(indices, sorted=True, return_inverse=True)  # (U,), (B,)
        last_seen = self._columns["last_seen_step"][touched]  # (U,)
        stale = last_seen > step
        if bool(stale.any()):
            first = int(stale.nonzero()[0, 0])
            raise ValueError(
                f"step {step} is older than the last update of prompt "
                f"{self._prompt_ids[int(touched[first])]!r} (step {int(last_seen[first])}); "
                "steps may not go backwards (was the stats state restored on resume?)"
            )
        # Duplicates within one update are one encounter: sum them first, then decay once.
        batch_samples = torch.zeros(touched.numel(), dtype=torch.int64).index_add_(0, inverse, samples)  # (U,)
        batch_correct = torch.zeros(touched.numel(), dtype=torch.int64).index_add_(0, inverse, correct)  # (U,)
        batch_rewards = torch.zeros(touched.numel(), dtype=torch.float64).index_add_(0, inverse, rewards)  # (U,)

        columns = self._columns
        columns["num_samples"][touched] += batch_samples
        columns["num_correct"][touched] += batch_correct
        columns["reward_sum"][touched] += batch_rewards
        columns["ema_total"][touched] = self.ema_decay * columns["ema_total"][touched] + batch_samples.double()
        columns["ema_correct"][touched] = self.ema_decay * columns["ema_correct"][touched] + batch_correct.double()
        columns["last_seen_step"][touched] = step
        columns["num_seen"][touched] += 1
        return {
            "stats/num_prompts_updated": float(touched.numel()),
            "stats/num_prompts_first_seen": float((columns["num_seen"][touched] == 1).sum()),
            "stats/num_prompts_sampled": float((columns["num_samples"] > 0).sum()),
        }

    def set_column(
        self, name: str, *, prompt_ids: Sequence[str] | torch.Tensor, values: torch.Tensor
    ) -> None:
        """Overwrite a settable column (``SETTABLE_COLUMNS``) for ``prompt_ids`` ``(B,)`` with ``values`` ``(B,)``.

        NaN clears a float entry back to unknown. Ranges: ``e3_rank`` ∈ (0, 1], the pass
        rates ∈ [0, 1], ``curation_num_samples`` ≥ 0. Listing a prompt twice is an error
        (which value should win is not defined). For E3 at the end of a pass, with the
        tracker indexed by store indices::

            seen = tracker.num_rollouts > 0
            store.set_column("e3_rank", prompt_ids=seen.nonzero().squeeze(1), values=tracker.difficulty[seen])

        (unseen prompts keep NaN instead of the tracker's neutral rank).
        """
        if name not in SETTABLE_COLUMNS:
            raise StatsError(
                f"column {name!r} is not settable; settable columns: {', '.join(SETTABLE_COLUMNS)}"
                + (" (rollout counters change only through record_rollouts)" if name in COLUMNS else "")
            )
        indices = self._resolve(prompt_ids)  # (B,)
        _check_1d("values", values, indices.numel())
        spec = COLUMNS[name]
        if spec.dtype == torch.int64:
            _check_integer(f"values for {name}", values)
        new_values = values.detach().to(device="cpu", dtype=spec.dtype)  # (B,)
        if indices.numel() != torch.unique(indices).numel():
            raise ValueError(f"set_column({name!r}) lists a prompt more than once")
        low, high, low_inclusive = _SETTABLE_RANGES[name]
        known = new_values[~torch.isnan(new_values)] if new_values.is_floating_point() else new_values
        below = (known < low) if low_inclusive else (known <= low)
        if bool(below.any()) or bool((known > high).any()):
            bracket = "[" if low_inclusive else "("
            raise ValueError(f"values for {name} must lie in {bracket}{low}, {high}] or be NaN (unknown)")
        self._columns[name][indices] = new_values

    def seed_from_curation(
        self, *, prompt_ids: Sequence[str] | torch.Tensor, pass_rates: torch.Tensor, num_samples: torch.Tensor
    ) -> None:
        """Record the curation stage's measurements: pass rates ``(B,)`` in [0, 1] from ``num_samples`` ``(B,)``.

        The pass rate is NaN exactly where ``num_samples`` is 0 (nothing was measured).
        """
        indices = self._resolve(prompt_ids)  # (B,)
        _check_1d("pass_rates", pass_rates, indices.numel())
        _check_1d("num_samples", num_samples, indices.numel())
        _check_integer("num_samples", num_samples)
        if bool((num_samples < 0).any()):
            raise ValueError("curation num_samples must be ≥ 0")
        unmeasured = num_samples.cpu() == 0  # (B,)
        if bool((unmeasured != torch.isnan(pass_rates.detach().cpu().double())).any()):
            raise ValueError("a curation pass rate is NaN exactly when its num_samples is 0 (nothing measured)")
        # Everything the second call could reject is checked above or by the first call,
        # so a bad seed leaves both columns untouched.
        self.set_column("curation_pass_rate", prompt_ids=indices, values=pass_rates)
        self.set_column("curation_num_samples", prompt_ids=indices, values=num_samples)

    # ------------------------------------------------------------------ reads
    def column(self, name: str) -> torch.Tensor:
        """A copy of one stored column or of ``pass_rate``, ``(P,)``."""
        if name == "pass_rate":
            return self.pass_rate()
        if name not in COLUMNS:
            raise StatsError(f"unknown column {name!r}; columns: {', '.join([*COLUMNS, 'pass_rate'])}")
        return self._columns[name].clone()

    def pass_rate(self) -> torch.Tensor:
        """num_correct / num_samples ``(P,)`` float64, NaN where nothing was sampled."""
        samples = self._columns["num_samples"]
        rate = self._columns["num_correct"].double() / samples.clamp(min=1).double()
        return torch.where(samples > 0, rate, torch.full_like(rate, math.nan))

    def ema_pass_rate(self, alpha: float = 1.0, beta: float = 1.0) -> torch.Tensor:
        """Ada-EMA/Beta posterior mean p̂ = (ema_correct + α)/(ema_total + α + β) ``(P,)`` (Reinforce-Ada §3.1).

        The defaults are a uniform Beta(1, 1) prior.
        """
        if alpha < 0 or beta < 0 or alpha + beta <= 0:
            raise ValueError(f"need α, β ≥ 0 with α + β > 0, got α={alpha}, β={beta}")
        return (self._columns["ema_correct"] + alpha) / (self._columns["ema_total"] + alpha + beta)

    def rows(self, prompt_ids: Sequence[str] | torch.Tensor) -> dict[str, torch.Tensor]:
        """Every stored column and ``pass_rate`` for ``prompt_ids``, each ``(B,)``."""
        indices = self._resolve(prompt_ids)
        selected = {name: values[indices] for name, values in self._columns.items()}
        selected["pass_rate"] = self.pass_rate()[indices]
        return selected

    def _sort_key(self, by: str, *, alpha: float, beta: float) -> torch.Tensor:
        if by == "ema_pass_rate":
            return self.ema_pass_rate(alpha, beta)
        if by == "pass_rate":
            return self.pass_rate()
        if by in COLUMNS:
            return self._columns[by]
        raise StatsError(f"cannot sort by {by!r}; choose one of: {', '.join([*COLUMNS, *DERIVED_COLUMNS])}")

    def top(
        self,
        n: int,
        *,
        by: str = "pass_rate",
        ascending: bool = False,
        min_samples: int = 0,
        prior_alpha: float = 1.0,
        prior_beta: float = 1.0,
    ) -> list[dict[str, Any]]:
        """The first ``n`` prompts with ≥ ``min_samples`` samples, ordered by a column.

        ``by`` is a stored column, ``pass_rate`` or ``ema_pass_rate`` (prior Beta(α, β)).
        NaN (unknown) values come last in either direction; ties keep store order. Each
        row is a dict of plain Python values: ``prompt_id``, ``index``, every stored
        column, ``pass_rate`` and ``ema_pass_rate``.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise StatsError(f"n must be an int ≥ 0, got {n!r}")
        if isinstance(min_samples, bool) or not isinstance(min_samples, int) or min_samples < 0:
            raise StatsError(f"min_samples must be an int ≥ 0, got {min_samples!r}")
        key = self._sort_key(by, alpha=prior_alpha, beta=prior_beta)  # (P,)
        eligible = self._columns["num_samples"] >= min_samples  # (P,)
        known = ~torch.isnan(key) if key.is_floating_point() else torch.ones_like(eligible)
        ranked = (eligible & known).nonzero().squeeze(1)  # (R,) ascending store order
        order = torch.sort(key[ranked], descending=not ascending, stable=True).indices
        unknown = (eligible & ~known).nonzero().squeeze(1)
        chosen = torch.cat([ranked[order], unknown])[:n]  # (≤ n,)

        pass_rate = self.pass_rate()
        ema = self.ema_pass_rate(prior_alpha, prior_beta)
        result: list[dict[str, Any]] = []
        for position in chosen.tolist():  # at most n rows, for display
            row: dict[str, Any] = {"prompt_id": self._prompt_ids[position], "index": position}
            row.update({name: values[position].item() for name, values in self._columns.items()})
            row["pass_rate"] = pass_rate[position].item()
            row["ema_pass_rate"] = ema[position].item()
            result.append(row)
        return result

    def summary(self) -> dict[str, float]:
        """How the prompts stand: counts, mean pass rate and the 0 / 1 / mixed pass-rate shares.

        ``num_prompts_seen`` counts prompts with at least one sample; the mean (over those
        prompts, not over samples) and the shares are over them too, NaN when none is seen.
        Pass rate 0 or 1 is the zero-variance case adaptive methods fight.
        """
        samples = self._columns["num_samples"]
        correct = self._columns["num_correct"]
        seen = samples > 0
        num_seen = int(seen.sum())
        if num_seen:
            mean_pass_rate = float(self.pass_rate()[seen].mean())
            share_zero = float(((correct == 0) & seen).sum()) / num_seen
            share_one = float(((correct == samples) & seen).sum()) / num_seen
            share_mixed = float(((correct > 0) & (correct < samples)).sum()) / num_seen
        else:
            mean_pass_rate = share_zero = share_one = share_mixed = math.nan
        return {
            "num_prompts": float(self.num_prompts),
            "num_prompts_seen": float(num_seen),
            "num_samples": float(samples.sum()),
            "mean_pass_rate": mean_pass_rate,
            "share_pass_rate_0": share_zero,
            "share_pass_rate_1": share_one,
            "share_pass_rate_mixed": share_mixed,
        }

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """``{"tensors": {column: (P,) tensor}, "meta": JSON-able dict}``, copies of the live state."""
        return {
            "tensors": {name: values.clone() for name, values in self._columns.items()},
            "meta": {
                "format": STATE_FORMAT,
                "version": STATE_VERSION,
                "ema_decay": self.ema_decay,
                "prompt_ids": list(self._prompt_ids),
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()`` output exactly; everything is checked before anything changes."""
        if not isinstance(state, dict) or set(state) != {"tensors", "meta"}:
            raise StatsError("stats state must be a dict with exactly the keys 'tensors' and 'meta'")
        meta, tensors = state["meta"], state["tensors"]
        if not isinstance(meta, dict) or not isinstance(tensors, dict):
            raise StatsError("stats state: 'meta' and 'tensors' must both be dicts")
        if meta.get("format") != STATE_FORMAT or meta.get("version") != STATE_VERSION:
            raise StatsError(
                f"stats state has format {meta.get('format')!r} version {meta.get('version')!r}, "
                f"expected {STATE_FORMAT!r} version {STATE_VERSION}"
            )
        self._check_prompt_ids(list(meta.get("prompt_ids", [])), source="the stats state")
        if meta.get("ema_decay") != self.ema_decay:
            # The EMA counters mean something only under the λ they were accumulated with.
            raise StatsError(
                f"the stats state was accumulated with ema_decay {meta.get('ema_decay')!r}, "
                f"this store uses {self.ema_decay}; construct the store with the checkpoint's value"
            )
        self._columns = self._validated_columns(tensors, source="the stats state")

    def _check_prompt_ids(self, loaded: list[str], *, source: str) -> None:
        for position, (mine, theirs) in enumerate(zip(self._prompt_ids, loaded)):
            if mine != theirs:
                raise StatsError(
                    f"{source} does not match this store's prompts: first mismatch at index {position}, "
                    f"{theirs!r} there vs {mine!r} here"
                )
        if len(loaded) != self.num_prompts:
            shorter, longer = (loaded, self._prompt_ids) if len(loaded) < self.num_prompts else (self._prompt_ids, loaded)
            extra = longer[len(shorter)]
            raise StatsError(
                f"{source} holds {len(loaded)} prompts, this store {self.num_prompts}; "
                f"first mismatch at index {len(shorter)}: {extra!r} is only in "
                f"{source if longer is loaded else 'this store'}"
            )

    def _validated_columns(self, tensors: dict[str, torch.Tensor], *, source: str) -> dict[str, torch.Tensor]:
        missing = [name for name in COLUMNS if name not in tensors]
        unknown = [name for name in tensors if name not in COLUMNS]
        if missing or unknown:
            raise StatsError(f"{source} is missing columns {missing} / has unknown columns {unknown}")
        columns: dict[str, torch.Tensor] = {}
        for name, spec in COLUMNS.items():
            values = tensors[name]
            if not isinstance(values, torch.Tensor):
                raise StatsError(f"{source}: column {name!r} is a {type(values).__name__}, not a tensor")
            if values.dtype != spec.dtype or tuple(values.shape) != (self.num_prompts,):
                raise StatsError(
                    f"{source}: column {name!r} is {values.dtype} {tuple(values.shape)}, "
                    f"expected {spec.dtype} ({self.num_prompts},)"
                )
            columns[name] = values.detach().to("cpu").clone().contiguous()
        if bool((columns["num_correct"] > columns["num_samples"]).any()) or bool((columns["num_correct"] < 0).any()):
            raise StatsError(f"{source}: num_correct must lie in [0, num_samples]")
        return columns

    # ------------------------------------------------------------------ Parquet
    def to_parquet(self, path: str | os.PathLike[str]) -> None:
        """Write one row per prompt: ``prompt_id``, every stored column, ``pass_rate``.

        Written to a temporary name and renamed into place, so a reader never sees half a file.
        """
        import pyarrow as pa
        import pyarrow.parquet as pq

        arrays: dict[str, Any] = {PROMPT_ID_COLUMN: pa.array(self._prompt_ids, type=pa.string())}
        for name, values in self._columns.items():
            arrays[name] = pa.array(values.numpy())
        arrays["pass_rate"] = pa.array(self.pass_rate().numpy())
        table = pa.table(arrays).replace_schema_metadata(
            {PARQUET_METADATA_KEY: json.dumps({"version": STATE_VERSION, "ema_decay": self.ema_decay}).encode()}
        )
        atomic_write(path, lambda tmp: pq.write_table(table, tmp))

    @classmethod
    def from_parquet(cls, path: str | os.PathLike[str]) -> PromptStatsStore:
        """Read a file written by ``to_parquet``; ``pass_rate`` is recomputed, not trusted."""
        import numpy as np
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"stats file {str(path)!r} does not exist")
        try:
            table = pq.read_table(path)
        except (pa.ArrowException, OSError) as error:
            raise StatsError(f"{path}: not a readable Parquet file ({error})") from None
        raw_meta = (table.schema.metadata or {}).get(PARQUET_METADATA_KEY)
        if raw_meta is None:
            raise StatsError(f"{path}: not a winnow stats file (no {PARQUET_METADATA_KEY.decode()!r} metadata)")
        file_meta = json.loads(raw_meta)
        if file_meta.get("version") != STATE_VERSION:
            raise StatsError(f"{path}: stats format version {file_meta.get('version')!r}, expected {STATE_VERSION}")
        if PROMPT_ID_COLUMN not in table.column_names:
            raise StatsError(f"{path}: missing column {PROMPT_ID_COLUMN!r}")
        ids_column = table.column(PROMPT_ID_COLUMN)
        if not pa.types.is_string(ids_column.type) or ids_column.null_count:
            raise StatsError(f"{path}: column {PROMPT_ID_COLUMN!r} must hold strings without nulls")
        try:
            store = cls(ids_column.to_pylist(), ema_decay=file_meta.get("ema_decay"))
        except (ValueError, TypeError) as error:
            raise StatsError(f"{path}: {error}") from None
        tensors: dict[str, torch.Tensor] = {}
        for name, spec in COLUMNS.items():
            if name not in table.column_names:
                raise StatsError(f"{path}: missing column {name!r}")
            column = table.column(name)
            expected = pa.int64() if spec.dtype == torch.int64 else pa.float64()
            if column.type != expected or column.null_count:
                raise StatsError(
                    f"{path}: column {name!r} is {column.type} with {column.null_count} nulls, "
                    f"expected {expected} without nulls"
                )
            tensors[name] = torch.from_numpy(np.array(column.to_numpy(), copy=True))
        store._columns = store._validated_columns(tensors, source=str(path))
        return store
