"""PromptStatsStore: vectorized updates vs a float64 loop reference, Ada-EMA (Reinforce-Ada §3.1)
equivalence with PassRateEstimator, exact state_dict / safetensors / Parquet round trips."""

from __future__ import annotations

import json
import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from pipeline.errors import UserError
from pipeline.stats import COLUMNS, PromptStatsStore, StatsError
from tests.oracles.estimators import PassRateEstimator, RankTracker

# ---------------------------------------------------------------------------
# helpers and the loop reference
# ---------------------------------------------------------------------------


def assert_bit_equal(left: torch.Tensor, right: torch.Tensor, name: str = "") -> None:
    assert left.dtype == right.dtype and left.shape == right.shape, name
    if left.dtype == torch.float64:  # compare bits, so NaN == NaN and -0.0 != 0.0
        assert torch.equal(left.view(torch.int64), right.view(torch.int64)), name
    else:
        assert torch.equal(left, right), name


def assert_same_state(left: PromptStatsStore, right: PromptStatsStore) -> None:
    left_state, right_state = left.state_dict(), right.state_dict()
    assert left_state["meta"] == right_state["meta"]
    assert set(left_state["tensors"]) == set(right_state["tensors"]) == set(COLUMNS)
    for name in COLUMNS:
        assert_bit_equal(left_state["tensors"][name], right_state["tensors"][name], name)


def reference_columns(
    num_prompts: int, decay: float, updates: list[tuple[int, list[tuple[int, int, int, float]]]]
) -> dict[str, list]:
    """Python floats/ints, one prompt at a time: the store's documented semantics written out."""
    columns = {name: [spec.fill] * num_prompts for name, spec in COLUMNS.items()}
    for step, entries in updates:
        summed: dict[int, list] = {}  # a prompt listed twice is one encounter with summed counts
        for prompt, num_samples, num_correct, reward in entries:
            totals = summed.setdefault(prompt, [0, 0, 0.0])
            totals[0] += num_samples
            totals[1] += num_correct
            totals[2] += reward
        for prompt, (num_samples, num_correct, reward) in summed.items():
            columns["num_samples"][prompt] += num_samples
            columns["num_correct"][prompt] += num_correct
            columns["reward_sum"][prompt] += reward
            columns["ema_total"][prompt] = decay * columns["ema_total"][prompt] + num_samples  # N ← λN + n
            columns["ema_correct"][prompt] = decay * columns["ema_correct"][prompt] + num_correct  # K ← λK + k
            columns["last_seen_step"][prompt] = step
            columns["num_seen"][prompt] += 1
    return columns


def apply(store: PromptStatsStore, entries: list[tuple[int, int, int, float]], *, step: int, by_name: bool) -> None:
    indices = [prompt for prompt, _, _, _ in entries]
    store.record_rollouts(
        prompt_ids=[store.prompt_ids[i] for i in indices] if by_name else torch.tensor(indices, dtype=torch.int64),
        num_samples=torch.tensor([n for _, n, _, _ in entries], dtype=torch.int64),
        num_correct=torch.tensor([k for _, _, k, _ in entries], dtype=torch.int64),
        reward_sum=torch.tensor([r for _, _, _, r in entries], dtype=torch.float64),
        step=step,
    )


@st.composite
def update_sequences(draw):
    num_prompts = draw(st.integers(1, 6))
    decay = draw(st.sampled_from([0.37, 0.5, 0.9, 1.0]))
    updates = []
    step = 0
    for _ in range(draw(st.integers(1, 6))):
        step += draw(st.integers(0, 3))
        raw = draw(st.lists(
            st.tuples(st.integers(0, num_prompts - 1), st.integers(0, 8), st.integers(0, 8),
                      st.floats(-3.0, 3.0, allow_nan=False)),
            max_size=8,
        ))
        updates.append((step, [(p, n, min(k, n), r) for p, n, k, r in raw]))
    by_name = draw(st.lists(st.booleans(), min_size=len(updates), max_size=len(updates)))
    return num_prompts, decay, updates, by_name


def populated_store() -> PromptStatsStore:
    """Every column non-trivial: NaNs, −0.0, non-integer rewards, unicode ids."""
    store = PromptStatsStore(["alpha", "βeta/7", "gamma", "δ-unseen", "eps"], ema_decay=0.8)
    generator = torch.Generator().manual_seed(0)
    for step in range(4):
        indices = torch.randint(0, 3, (5,), generator=generator)
        num_samples = torch.randint(1, 9, (5,), generator=generator)
        num_correct = (num_samples * torch.rand(5, generator=generator, dtype=torch.float64)).long()
        store.record_rollouts(
            prompt_ids=indices, num_samples=num_samples, num_correct=num_correct,
            reward_sum=torch.randn(5, generator=generator, dtype=torch.float64), step=step * 3,
        )
    store.set_column("e3_rank", prompt_ids=["alpha", "gamma"], values=torch.tensor([1 / 3, 1.0], dtype=torch.float64))
    store.set_column("estimator_prediction", prompt_ids=["alpha", "eps"], values=torch.tensor([-0.0, 0.1], dtype=torch.float64))
    store.seed_from_curation(
        prompt_ids=["gamma", "eps"], pass_rates=torch.tensor([0.125, math.nan], dtype=torch.float64),
        num_samples=torch.tensor([16, 0]),
    )
    return store


# ---------------------------------------------------------------------------
# vectorized updates vs the loop reference
# ---------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(update_sequences())
def test_record_rollouts_matches_loop_reference(case):
    num_prompts, decay, updates, by_name = case
    store = PromptStatsStore([f"p{i}" for i in range(num_prompts)], ema_decay=decay)
    for (step, entries), name_mode in zip(updates, by_name):
        apply(store, entries, step=step, by_name=name_mode)
    expected = reference_columns(num_prompts, decay, updates)
    for name, spec in COLUMNS.items():
        assert_bit_equal(store.column(name), torch.tensor(expected[name], dtype=spec.dtype), name)
    samples = torch.tensor(expected["num_samples"], dtype=torch.float64)
    correct = torch.tensor(expected["num_correct"], dtype=torch.float64)
    reference_rate = torch.where(samples > 0, correct / samples.clamp(min=1), torch.tensor(math.nan, dtype=torch.float64))
    assert_bit_equal(store.pass_rate(), reference_rate, "pass_rate")


@settings(max_examples=100, deadline=None)
@given(update_sequences(), st.sampled_from([(1.0, 1.0), (0.5, 2.0), (0.0, 3.0)]))
def test_ema_pass_rate_equals_pass_rate_estimator(case, prior):
    num_prompts, decay, updates, _ = case
    alpha, beta = prior
    store = PromptStatsStore([f"p{i}" for i in range(num_prompts)], ema_decay=decay)
    estimator = PassRateEstimator(num_prompts=num_prompts, decay=decay, prior_alpha=alpha, prior_beta=beta)
    for step, entries in updates:
        apply(store, entries, step=step, by_name=False)
        estimator.update(
            prompt_ids=torch.tensor([p for p, _, _, _ in entries], dtype=torch.int64),
            num_samples=torch.tensor([n for _, n, _, _ in entries], dtype=torch.int64),
            num_correct=torch.tensor([k for _, _, k, _ in entries], dtype=torch.int64),
        )
    # The estimator adds duplicates one after the other, the store sums them first: equal up to rounding.
    torch.testing.assert_close(
        store.ema_pass_rate(alpha, beta), estimator.estimate(torch.arange(num_prompts)), rtol=1e-13, atol=0.0
    )


def test_ema_without_duplicates_is_bit_identical_to_pass_rate_estimator():
    store = PromptStatsStore(["a", "b", "c"], ema_decay=0.9)
    estimator = PassRateEstimator(num_prompts=3, decay=0.9)
    for step, (ids, samples, correct) in enumerate([([0, 2], [8, 4], [3, 0]), ([2, 1], [4, 2], [1, 2]), ([2], [0], [0])]):
        store.record_rollouts(prompt_ids=torch.tensor(ids), num_samples=torch.tensor(samples),
                              num_correct=torch.tensor(correct), reward_sum=torch.zeros(len(ids), dtype=torch.float64), step=step)
        estimator.update(prompt_ids=torch.tensor(ids), num_samples=torch.tensor(samples), num_correct=torch.tensor(correct))
    assert_bit_equal(store.ema_pass_rate(), estimator.estimate(torch.arange(3)))
    assert_bit_equal(store.column("ema_total"), estimator.num_total)


def test_duplicates_within_one_update_are_one_encounter():
    store = PromptStatsStore(["a", "b"], ema_decay=0.5)
    store.record_rollouts(prompt_ids=["a"], num_samples=torch.tensor([4]), num_correct=torch.tensor([2]),
                          reward_sum=torch.tensor([2.0], dtype=torch.float64), step=1)
    metrics = store.record_rollouts(
        prompt_ids=["a", "b", "a"], num_samples=torch.tensor([3, 2, 1]), num_correct=torch.tensor([1, 0, 1]),
        reward_sum=torch.tensor([0.5, -1.0, 0.25], dtype=torch.float64), step=2,
    )
    # a: N = 0.5·4 + (3 + 1) = 6, K = 0.5·2 + (1 + 1) = 3 — one decay, not two (which would give N = 5).
    rows = store.rows(["a", "b"])
    assert rows["ema_total"].tolist() == [6.0, 2.0]
    assert rows["ema_correct"].tolist() == [3.0, 0.0]
    assert rows["num_samples"].tolist() == [8, 2]
    assert rows["num_correct"].tolist() == [4, 0]
    assert rows["reward_sum"].tolist() == [2.75, -1.0]
    assert rows["num_seen"].tolist() == [2, 1]  # listed twice in one update, drawn once
    assert rows["last_seen_step"].tolist() == [2, 2]
    assert rows["pass_rate"].tolist() == [0.5, 0.0]
    assert metrics == {"stats/num_prompts_updated": 2.0, "stats/num_prompts_first_seen": 1.0,
                       "stats/num_prompts_sampled": 2.0}
    # p̂ = (3 + 1)/(6 + 2) = 0.5 and (0 + 1)/(2 + 2) = 0.25 under Beta(1, 1).
    assert store.ema_pass_rate().tolist() == [0.5, 0.25]


def test_zero_sample_entry_decays_like_the_estimator_and_counts_as_drawn():
    store = PromptStatsStore(["a"], ema_decay=0.5)
    store.record_rollouts(prompt_ids=["a"], num_samples=torch.tensor([4]), num_correct=torch.tensor([4]),
                          reward_sum=torch.tensor([4.0], dtype=torch.float64), step=0)
    store.record_rollouts(prompt_ids=["a"], num_samples=torch.tensor([0]), num_correct=torch.tensor([0]),
                          reward_sum=torch.tensor([0.0], dtype=torch.float64), step=1)
    assert store.column("ema_total").tolist() == [2.0]
    assert store.column("num_seen").tolist() == [2]
    assert store.column("num_samples").tolist() == [4]


def test_empty_update_changes_nothing():
    store = populated_store()
    before = PromptStatsStore(store.prompt_ids, ema_decay=0.8)
    before.load_state_dict(store.state_dict())
    store.record_rollouts(prompt_ids=[], num_samples=torch.zeros(0, dtype=torch.int64),
                          num_correct=torch.zeros(0, dtype=torch.int64), reward_sum=torch.zeros(0), step=100)
    assert_same_state(store, before)


# ---------------------------------------------------------------------------
# invalid input
# ---------------------------------------------------------------------------


def test_unknown_prompt_ids_name_the_id():
    store = PromptStatsStore(["a", "b"])
    with pytest.raises(ValueError, match="unknown prompt id 'zz'"):
        store.index_of(["a", "zz"])
    with pytest.raises(ValueError, match="unknown prompt id 'zz'"):
        store.record_rollouts(prompt_ids=["zz"], num_samples=torch.tensor([1]), num_correct=torch.tensor([0]),
                              reward_sum=torch.tensor([0.0]), step=0)
    with pytest.raises(ValueError, match="unknown prompt id 'q'"):
        store.rows(["q"])
    with pytest.raises(ValueError, match="unknown prompt id 'q'"):
        store.set_column("e3_rank", prompt_ids=["q"], values=torch.tensor([0.5], dtype=torch.float64))
    with pytest.raises(ValueError, match=r"prompt index 2 outside \[0, 2\)"):
        store.rows(torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="single string"):
        store.index_of("a")
    assert store.index_of(["b", "a", "b"]).tolist() == [1, 0, 1]


def test_constructor_rejects_duplicates_and_bad_decay():
    with pytest.raises(ValueError, match="duplicate prompt id 'a' at positions 0 and 2"):
        PromptStatsStore(["a", "b", "a"])
    for decay in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="ema_decay"):
            PromptStatsStore(["a"], ema_decay=decay)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_correct": torch.tensor([5, 0])}, "num_correct ≤ num_samples"),
        ({"num_samples": torch.tensor([-1, 2]), "num_correct": torch.tensor([0, 0])}, "num_correct ≤ num_samples"),
        ({"reward_sum": torch.tensor([math.inf, 0.0])}, "non-finite"),
        ({"reward_sum": torch.tensor([math.nan, 0.0])}, "non-finite"),
        ({"num_samples": torch.tensor([4.0, 2.0])}, "integer tensor"),
        ({"num_samples": torch.tensor([4, 2, 1])}, r"shape \(2,\)"),
        ({"step": 1}, "older than the last update of prompt 'a'"),
        ({"step": -3}, "step must be an int ≥ 0"),
    ],
)
def test_rejected_update_raises_and_changes_nothing(kwargs, message):
    store = PromptStatsStore(["a", "b"])
    store.record_rollouts(prompt_ids=["a"], num_samples=torch.tensor([2]), num_correct=torch.tensor([1]),
                          reward_sum=torch.tensor([1.0]), step=5)
    before = store.state_dict()
    update = {"prompt_ids": ["a", "b"], "num_samples": torch.tensor([4, 2]), "num_correct": torch.tensor([1, 2]),
              "reward_sum": torch.tensor([1.0, 2.0]), "step": 6} | kwargs
    with pytest.raises(ValueError, match=message):
        store.record_rollouts(**update)
    for name in COLUMNS:
        assert_bit_equal(store.column(name), before["tensors"][name], name)


def test_set_column_validates_name_range_and_duplicates():
    store = PromptStatsStore(["a", "b"])
    with pytest.raises(StatsError, match="not settable.*e3_rank.*record_rollouts"):
        store.set_column("num_samples", prompt_ids=["a"], values=torch.tensor([3]))
    with pytest.raises(StatsError, match="not settable"):
        store.set_column("nope", prompt_ids=["a"], values=torch.tensor([3.0]))
    with pytest.raises(ValueError, match=r"e3_rank must lie in \(0.0, 1.0\]"):
        store.set_column("e3_rank", prompt_ids=["a"], values=torch.tensor([0.0], dtype=torch.float64))
    with pytest.raises(ValueError, match=r"estimator_prediction must lie in \[0.0, 1.0\]"):
        store.set_column("estimator_prediction", prompt_ids=["a"], values=torch.tensor([1.5]))
    with pytest.raises(ValueError, match="more than once"):
        store.set_column("estimator_prediction", prompt_ids=["a", "a"], values=torch.tensor([0.1, 0.2]))
    with pytest.raises(ValueError, match="integer tensor"):
        store.set_column("curation_num_samples", prompt_ids=["a"], values=torch.tensor([1.5]))
    store.set_column("estimator_prediction", prompt_ids=torch.tensor([1]), values=torch.tensor([0.25]))
    store.set_column("estimator_prediction", prompt_ids=["b"], values=torch.tensor([math.nan]))  # back to unknown
    assert torch.isnan(store.column("estimator_prediction")).all()


def test_seed_from_curation_sets_both_columns_or_neither():
    store = PromptStatsStore(["a", "b", "c"])
    store.seed_from_curation(prompt_ids=["c", "a"], pass_rates=torch.tensor([0.25, math.nan], dtype=torch.float64),
                             num_samples=torch.tensor([8, 0]))
    assert store.column("curation_num_samples").tolist() == [0, 0, 8]
    rates = store.column("curation_pass_rate")
    assert math.isnan(rates[0]) and math.isnan(rates[1]) and rates[2] == 0.25
    before = store.state_dict()
    for pass_rates, num_samples, message in [
        (torch.tensor([0.5, 2.0]), torch.tensor([4, 4]), "must lie in"),
        (torch.tensor([0.5, 0.5]), torch.tensor([4, -1]), "≥ 0"),
        (torch.tensor([0.5, 0.5]), torch.tensor([4, 0]), "NaN exactly when"),
        (torch.tensor([0.5, math.nan]), torch.tensor([4, 4]), "NaN exactly when"),
    ]:
        with pytest.raises(ValueError, match=message):
            store.seed_from_curation(prompt_ids=["a", "b"], pass_rates=pass_rates, num_samples=num_samples)
    for name in COLUMNS:
        assert_bit_equal(store.column(name), before["tensors"][name], name)


def test_e3_ranks_from_rank_tracker_keep_unseen_prompts_unknown():
    store = PromptStatsStore(["a", "b", "c", "d"])
    tracker = RankTracker(num_prompts=4)
    tracker.update(prompt_ids=torch.tensor([0, 0, 1, 3, 3]), rewards=torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0]))
    tracker.end_pass()
    seen = tracker.num_rollouts > 0
    store.set_column("e3_rank", prompt_ids=seen.nonzero().squeeze(1), values=tracker.difficulty[seen])
    # averages a 1, b 0, d 0.5 → ranks 1, 3, 2 of |D| = 3 seen prompts; c was never rolled out.
    ranks = store.column("e3_rank")
    assert ranks[[0, 1, 3]].tolist() == [1 / 3, 1.0, 2 / 3]
    assert math.isnan(ranks[2])


# ---------------------------------------------------------------------------
# state_dict and Parquet round trips
# ---------------------------------------------------------------------------


def test_state_dict_round_trips_exactly_through_safetensors_and_json(tmp_path):
    store = populated_store()
    state = store.state_dict()
    save_file(state["tensors"], tmp_path / "tensors.safetensors")
    (tmp_path / "state.json").write_text(json.dumps(state["meta"]))
    restored = PromptStatsStore(store.prompt_ids, ema_decay=0.8)
    restored.load_state_dict({"tensors": load_file(tmp_path / "tensors.safetensors"),
                              "meta": json.loads((tmp_path / "state.json").read_text())})
    assert_same_state(store, restored)
    assert math.copysign(1.0, restored.column("estimator_prediction")[0].item()) == -1.0  # −0.0 survived
    # Resume is exact: the same next update gives the same state.
    for target in (store, restored):
        target.record_rollouts(prompt_ids=["δ-unseen", "alpha"], num_samples=torch.tensor([3, 5]),
                               num_correct=torch.tensor([1, 5]), reward_sum=torch.tensor([0.3, 4.9], dtype=torch.float64), step=20)
    assert_same_state(store, restored)


def test_state_dict_is_a_copy():
    store = populated_store()
    state = store.state_dict()
    state["tensors"]["num_samples"].fill_(99)
    state["meta"]["prompt_ids"].append("x")
    assert store.column("num_samples").max() < 99 and len(store.prompt_ids) == 5


def test_load_rejects_a_different_prompt_list_naming_the_first_mismatch():
    state = populated_store().state_dict()
    ids = list(state["meta"]["prompt_ids"])
    swapped = PromptStatsStore([ids[0], ids[1], ids[3], ids[2], ids[4]], ema_decay=0.8)
    with pytest.raises(StatsError, match="first mismatch at index 2, 'gamma' there vs 'δ-unseen' here"):
        swapped.load_state_dict(state)
    shorter = PromptStatsStore(ids[:4], ema_decay=0.8)
    with pytest.raises(StatsError, match="holds 5 prompts, this store 4; first mismatch at index 4: 'eps' is only in the stats state"):
        shorter.load_state_dict(state)
    longer = PromptStatsStore([*ids, "zeta"], ema_decay=0.8)
    with pytest.raises(StatsError, match="'zeta' is only in this store"):
        longer.load_state_dict(state)
    assert isinstance(StatsError("x"), ValueError) and isinstance(StatsError("x"), UserError)


def test_load_rejects_bad_tensors_and_decay_without_changing_anything():
    source = populated_store()
    target = PromptStatsStore(source.prompt_ids, ema_decay=0.8)
    untouched = target.state_dict()
    cases = []
    wrong_dtype = source.state_dict()
    wrong_dtype["tensors"]["num_samples"] = wrong_dtype["tensors"]["num_samples"].double()
    cases.append((wrong_dtype, "column 'num_samples' is torch.float64"))
    missing = source.state_dict()
    del missing["tensors"]["e3_rank"]
    cases.append((missing, r"missing columns \['e3_rank'\]"))
    wrong_shape = source.state_dict()
    wrong_shape["tensors"]["reward_sum"] = wrong_shape["tensors"]["reward_sum"][:3]
    cases.append((wrong_shape, r"'reward_sum' is torch.float64 \(3,\)"))
    impossible = source.state_dict()
    impossible["tensors"]["num_correct"] = impossible["tensors"]["num_samples"] + 1
    cases.append((impossible, r"num_correct must lie in \[0, num_samples\]"))
    other_decay = source.state_dict()
    other_decay["meta"]["ema_decay"] = 0.9
    cases.append((other_decay, "accumulated with ema_decay 0.9"))
    for state, message in cases:
        with pytest.raises(StatsError, match=message):
            target.load_state_dict(state)
    assert_same_state(target, PromptStatsStore(source.prompt_ids, ema_decay=0.8))
    assert untouched["meta"] == target.state_dict()["meta"]


def test_parquet_round_trips_exactly(tmp_path):
    store = populated_store()
    path = tmp_path / "stats.parquet"
    store.to_parquet(path)
    assert not (tmp_path / "stats.parquet.tmp").exists()
    restored = PromptStatsStore.from_parquet(path)
    assert restored.ema_decay == 0.8
    assert restored.prompt_ids == store.prompt_ids
    assert_same_state(store, restored)
    table = pq.read_table(path)
    assert table.num_rows == 5
    assert table.column_names == ["prompt_id", *COLUMNS, "pass_rate"]
    assert_bit_equal(torch.from_numpy(table.column("pass_rate").to_numpy()), store.pass_rate())


def test_parquet_of_an_empty_store(tmp_path):
    PromptStatsStore([]).to_parquet(tmp_path / "empty.parquet")
    restored = PromptStatsStore.from_parquet(tmp_path / "empty.parquet")
    assert len(restored) == 0 and restored.top(5) == []
    assert math.isnan(restored.summary()["mean_pass_rate"])


def test_from_parquet_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        PromptStatsStore.from_parquet(tmp_path / "missing.parquet")
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"not parquet at all")
    with pytest.raises(StatsError, match="not a readable Parquet file"):
        PromptStatsStore.from_parquet(garbage)
    foreign = tmp_path / "foreign.parquet"
    pq.write_table(pa.table({"prompt_id": ["a"]}), foreign)
    with pytest.raises(StatsError, match="not a winnow stats file"):
        PromptStatsStore.from_parquet(foreign)
    good = tmp_path / "good.parquet"
    populated_store().to_parquet(good)
    table = pq.read_table(good)
    pq.write_table(table.drop_columns(["num_seen"]), tmp_path / "dropped.parquet")
    with pytest.raises(StatsError, match="missing column 'num_seen'"):
        PromptStatsStore.from_parquet(tmp_path / "dropped.parquet")
    position = table.column_names.index("num_correct")
    retyped = table.set_column(position, "num_correct", table.column("num_correct").cast(pa.float64()))
    pq.write_table(retyped, tmp_path / "retyped.parquet")
    with pytest.raises(StatsError, match="column 'num_correct' is double"):
        PromptStatsStore.from_parquet(tmp_path / "retyped.parquet")


# ---------------------------------------------------------------------------
# top and summary, hand-computed
# ---------------------------------------------------------------------------


def hand_store() -> PromptStatsStore:
    """p0 0/4, p1 4/4, p2 2/8, p3 1/2, p4 never sampled — one update, so the EMA counters equal the counts."""
    store = PromptStatsStore(["p0", "p1", "p2", "p3", "p4"], ema_decay=0.9)
    store.record_rollouts(
        prompt_ids=["p0", "p1", "p2", "p3"], num_samples=torch.tensor([4, 4, 8, 2]),
        num_correct=torch.tensor([0, 4, 2, 1]), reward_sum=torch.tensor([0.0, 4.0, 2.0, 1.0], dtype=torch.float64), step=3,
    )
    store.set_column("e3_rank", prompt_ids=["p0", "p2"], values=torch.tensor([1.0, 0.75], dtype=torch.float64))
    return store


def ids(rows: list[dict]) -> list[str]:
    return [row["prompt_id"] for row in rows]


def test_top_orders_by_column_with_nan_last_and_stable_ties():
    store = hand_store()
    # pass rates p0 0, p1 1, p2 0.25, p3 0.5, p4 NaN
    assert ids(store.top(3)) == ["p1", "p3", "p2"]
    assert ids(store.top(10)) == ["p1", "p3", "p2", "p0", "p4"]
    assert ids(store.top(10, ascending=True)) == ["p0", "p2", "p3", "p1", "p4"]
    assert ids(store.top(10, ascending=True, min_samples=4)) == ["p0", "p2", "p1"]
    assert ids(store.top(10, by="num_samples")) == ["p2", "p0", "p1", "p3", "p4"]  # p0, p1 tie at 4: store order
    assert ids(store.top(10, by="e3_rank", ascending=True)) == ["p2", "p0", "p1", "p3", "p4"]
    assert store.top(0) == []
    # EMA p̂ under Beta(1, 1): p0 1/6, p1 5/6, p2 3/10, p3 2/4, p4 1/2 → p1, p3, p4 (tie at 0.5 in store order), p2, p0
    assert ids(store.top(10, by="ema_pass_rate")) == ["p1", "p3", "p4", "p2", "p0"]
    # Beta(0, 3): p1 4/7, p3 1/5, p2 2/11, then p0 0/7 and p4 0/3 tie at 0 in store order.
    assert ids(store.top(10, by="ema_pass_rate", prior_alpha=0.0, prior_beta=3.0)) == ["p1", "p3", "p2", "p0", "p4"]
    row = store.top(1)[0]
    assert row == {
        "prompt_id": "p1", "index": 1, "num_samples": 4, "num_correct": 4, "reward_sum": 4.0, "ema_total": 4.0,
        "ema_correct": 4.0, "last_seen_step": 3, "num_seen": 1, "e3_rank": row["e3_rank"],
        "estimator_prediction": row["estimator_prediction"], "curation_pass_rate": row["curation_pass_rate"],
        "curation_num_samples": 0, "pass_rate": 1.0, "ema_pass_rate": 5 / 6,
    }
    assert math.isnan(row["e3_rank"]) and math.isnan(row["estimator_prediction"])


def test_top_rejects_unknown_column_listing_the_allowed_ones():
    with pytest.raises(StatsError, match="cannot sort by 'difficulty'; choose one of: num_samples, .*pass_rate, ema_pass_rate"):
        hand_store().top(5, by="difficulty")
    with pytest.raises(StatsError, match="min_samples"):
        hand_store().top(5, min_samples=-1)


def test_summary_hand_computed():
    summary = hand_store().summary()
    # seen p0..p3; mean of per-prompt rates (0 + 1 + 0.25 + 0.5)/4 = 0.4375; rate 0: p0, rate 1: p1, mixed: p2, p3
    assert summary == {
        "num_prompts": 5.0, "num_prompts_seen": 4.0, "num_samples": 18.0, "mean_pass_rate": 0.4375,
        "share_pass_rate_0": 0.25, "share_pass_rate_1": 0.25, "share_pass_rate_mixed": 0.5,
    }
    unseen = PromptStatsStore(["a"]).summary()
    assert unseen["num_prompts_seen"] == 0.0 and math.isnan(unseen["share_pass_rate_0"])
