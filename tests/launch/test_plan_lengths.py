"""The planner's step time from a response-length distribution: the stated shape, a curation's measured lengths,
generation at the expected longest response between the mean-length time and the all-max bound, and what
activation recompute adds to the planned update."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pytest

from pipeline.config import InFlightLimit
from pipeline.launch import plan as P
from pipeline.stats import flops as F
from tests.launch.test_plan import FIXTURES, dims

PEAK = P.GPUS["h100"].peak_tflops * 1e12


def _d3s_like(**changes) -> P.PlanInputs:
    """7B, 64 prompts × 32 samples, 1,024 + 3,072 tokens, on 2 trainer nodes and a node of 8 SGLang servers."""
    inputs = P.PlanInputs(
        dims=dims("Qwen2.5-Math-7B"), layout=P.Layout(tensor_parallel=4, data_parallel=4), trainer=P.TrainerSettings(),
        workload=P.Workload(prompts_per_step=64, trained_per_prompt=32, sampled_per_prompt=32, in_flight_per_prompt=32,
                            prompt_tokens=1024, max_new_tokens=3072, steps=10),
        cluster=P.Cluster(gpu=P.GPUS["h100"], trainer_nodes=2, gpus_per_node=8, rollout_nodes=1, servers_per_node=8))
    return P.replace(inputs, **changes)


# ------------------------------------------------------------------------------ distributions


def test_the_expected_longest_response_is_the_order_statistic_of_the_values():
    lengths = P.ResponseLengths.of([300, 100, 400, 200], max_new_tokens=400, source="by hand")
    assert lengths.values == (100, 200, 300, 400) and lengths.mean == 250
    assert (lengths.quantile(0.5), lengths.quantile(0.9)) == (200, 400)
    assert lengths.expected_max(1) == pytest.approx(250)
    # The longer of two draws is 100 with chance 1/16, 200: 3/16, 300: 5/16, 400: 7/16.
    assert lengths.expected_max(2) == pytest.approx((100 + 3 * 200 + 5 * 300 + 7 * 400) / 16)
    assert lengths.expected_max(10_000) == pytest.approx(400)
    # The cap truncates a response; none is shorter than one token.
    assert P.ResponseLengths.of([900, 0], max_new_tokens=500, source="cut").values == (1, 500)


def test_the_stated_shape_has_its_median_p90_and_a_tail_cut_at_the_cap():
    shape = P.long_tail_lengths(3072, median=0.30, p90=0.75)
    assert shape.quantile(0.5) / 3072 == pytest.approx(0.30, abs=0.002)
    assert shape.quantile(0.9) / 3072 == pytest.approx(0.75, abs=0.002)
    assert sum(value == 3072 for value in shape.values) / len(shape.values) == pytest.approx(0.046, abs=0.001)
    assert shape.mean / 3072 == pytest.approx(0.369, abs=0.001)
    assert "median 30% and p90 75%" in shape.source
    moved = P.long_tail_lengths(3072, median=0.30, p90=0.75, mean=0.25)
    assert moved.mean / 3072 == pytest.approx(0.25, rel=1e-6)
    assert moved.quantile(0.9) / moved.quantile(0.5) == pytest.approx(0.75 / 0.30, rel=0.01)  # the spread is kept
    assert set(P.long_tail_lengths(3072, median=0.30, p90=0.75, mean=1.0).values) == {3072}
    with pytest.raises(ValueError, match="0 < median < p90"):
        P.long_tail_lengths(3072, median=0.8, p90=0.75)
    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        P.long_tail_lengths(3072, median=0.3, p90=0.75, mean=0.0)


# ------------------------------------------------------------------------------ generation time


def test_generation_time_of_a_small_case_by_hand():
    """2 prompts × 2 samples on 2 one-GPU servers; measured lengths 100 and 300, equally likely."""
    qwen = dims("Qwen2.5-Math-7B")
    cost = qwen.forward_cost()
    inputs = P.PlanInputs(
        dims=qwen, layout=P.Layout(data_parallel=8), trainer=P.TrainerSettings(),
        workload=P.Workload(prompts_per_step=2, trained_per_prompt=2, sampled_per_prompt=2, in_flight_per_prompt=2,
                            prompt_tokens=50, max_new_tokens=400, steps=1),
        cluster=P.Cluster(gpu=P.GPUS["h100"], trainer_nodes=1, gpus_per_node=8, rollout_nodes=1, servers_per_node=2),
        response_lengths=P.ResponseLengths.of([100, 300], max_new_tokens=400, source="by hand"))
    time = P.time_plan(inputs)
    rate = PEAK * 0.10  # one GPU per server at the rollout MFU
    assert (time.batches.generators, time.batches.rounds, time.batches.waves, time.batches.batch) == (2, 1, 1, 2)
    step = 2 * cost.token(50 + 200 / 2)  # both sequences of a server, at the prompt + half the mean response
    # The round ends with the longest of the 4 responses: 300 unless all four are 100 (1/16); the
    # prefill makes the first token.
    assert time.generation_s == pytest.approx((300 * 15 / 16 + 100 / 16 - 1) * step / rate)
    assert time.generation_mean_s == pytest.approx((200 - 1) * step / rate)
    # Every response at the cap: the FLOPs of each server's responses at full length.
    assert time.generation_max_s == pytest.approx(2 * F.generation_flops(cost, prompt_tokens=50, generated_tokens=400)
                                                  / rate)
    assert time.rollout_s == time.prefill_s + time.generation_s
    assert time.prefill_s == pytest.approx(2 * F.prefill_flops(cost, 50) / (2 * rate))

    # One sequence in flight per server: each server's slot runs its two back to back, the first at the
    # mean length and the round's longest (of 2 slots) last.
    limited = P.replace(inputs, in_flight=InFlightLimit(num_servers=2, per_server=1, sequences=2, derived=True))
    time = P.time_plan(limited)
    assert (time.batches.waves, time.batches.batch) == (2, 1)
    assert time.generation_s == pytest.approx((200 + (300 * 3 / 4 + 100 / 4) - 1) * cost.token(50 + 100) / rate)


@pytest.mark.parametrize("changes", [
    {},  # the stated shape, 8 servers, two waves (the KV cache holds half the sequences at full length)
    {"cluster": P.Cluster(gpu=P.GPUS["h100"], trainer_nodes=2, gpus_per_node=8)},  # rank 0's engine alone
    {"cluster": P.Cluster(gpu=P.GPUS["h100"], trainer_nodes=2, gpus_per_node=8, rollout_nodes=2, servers_per_node=4,
                          server_tensor_parallel=2)},
    {"assumptions": P.Assumptions(response_fraction=0.1)},
    {"response_lengths": P.ResponseLengths.of(np.linspace(200, 1500, 500), max_new_tokens=3072, source="short")},
])
def test_generation_lies_between_the_mean_length_time_and_the_all_max_bound(changes):
    time = P.time_plan(_d3s_like(**changes))
    assert time.generation_mean_s < time.generation_s < time.generation_max_s
    # The update is timed at the mean: every response at the cap costs more.
    capped = P.time_plan(_d3s_like(**{**changes, "response_lengths": None,
                                      "assumptions": P.Assumptions(response_fraction=1.0)}))
    assert time.train_s < capped.train_s and capped.generation_s == pytest.approx(capped.generation_max_s)


def test_hundreds_of_samples_reach_the_cap_so_generation_is_near_the_all_max_bound():
    """The stated shape puts 4.6% of responses at the cap: among 2,048 the longest is at it, so the step waits for
    full-length decodes although the mean is 37% of the cap. On 16 servers every sequence runs at once (one wave)
    and generation is the all-max bound's steps at the mean context's cost."""
    inputs = _d3s_like(cluster=P.replace(_d3s_like().cluster, rollout_nodes=2))
    time = P.time_plan(inputs)
    assert (time.batches.waves, time.batches.batch) == (1, 128)
    assert time.lengths.expected_max(16 * 128) == pytest.approx(3072)
    cost = inputs.dims.forward_cost()
    assert time.generation_s / time.generation_max_s == pytest.approx(
        cost.token(1024 + time.lengths.mean / 2) / cost.token(1024 + 3072 / 2), rel=1e-6)
    assert time.generation_mean_s / time.generation_max_s < 0.4
    # With two waves the first runs at the mean length (SGLang starts a queued sequence as a slot frees).
    two = P.time_plan(_d3s_like())
    assert (two.batches.waves, two.batches.batch) == (2, 128)
    assert two.generation_s == pytest.approx(time.generation_s * (time.lengths.mean + 3072 - 1) / (3072 - 1))


# ------------------------------------------------------------------------------ recompute


def test_full_recompute_adds_a_forward_of_every_trained_row_and_the_plan_says_so():
    from pipeline.cli.plan import format_plan

    base = _d3s_like()
    full = P.replace(base, trainer=P.replace(base.trainer, recompute="full"))
    selective = P.replace(base, trainer=P.replace(base.trainer, recompute="selective"))
    none_time, full_time, selective_time = P.time_plan(base), P.time_plan(full), P.time_plan(selective)
    cost = base.dims.forward_cost()
    rows, row = 64 * 32, 1024 + none_time.lengths.mean
    rate = 16 * PEAK * 0.35  # PP = 1: no bubble
    assert none_time.recompute_s == 0
    assert full_time.train_s - none_time.train_s == pytest.approx(rows * F.sequence_forward_flops(cost, row) / rate)
    assert full_time.recompute_s == pytest.approx(full_time.train_s - none_time.train_s)
    assert selective_time.recompute_s == pytest.approx(
        rows * F.forward_flops(cost, tokens=0, attended=F.causal_pairs(row)) / rate)
    printed = format_plan(P.plan(full), title="full")
    assert f"train {full_time.train_s:.0f} s, full recompute {full_time.recompute_s:.0f} s of it" in printed
    assert "recompute" not in format_plan(P.plan(base), title="none").split("time (")[1]


# ------------------------------------------------------------------------------ the curation's lengths


def _curation(folder: Path, *, kept: tuple[bool, bool] = (True, False), per_response: bool = False,
              per_response_in_second_shard: bool | None = None) -> Path:
    """A finished curation: prompt a (2 responses of 100 and 200 tokens), b (40 and 60), c dropped before
    sampling; a in the first shard, b in the second."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.stats.curation import (
        PASS_RATES_FILE,
        RESPONSE_LENGTHS_COLUMN,
        SHARDS_DIR,
        CurationResult,
        pass_rates,
        write_manifest,
        write_pass_rates,
    )

    folder.mkdir(parents=True)
    num_samples, num_correct = np.array([2, 2, 0]), np.array([1, 2, 0])
    reasons = ["" if kept[0] else "impossible", "" if kept[1] else "trivial", "too_long"]
    result = CurationResult(
        output_dir=folder, prompt_ids=["a", "b", "c"], specs=["s"] * 3, sources=["x"] * 3, num_samples=num_samples,
        num_correct=num_correct, pass_rates=pass_rates(num_samples, num_correct),
        kept_mask=np.array([reason == "" for reason in reasons]), drop_reasons=reasons, samples_per_prompt=2,
        counts={"total": 3, "kept": sum(kept)})
    write_pass_rates(folder / PASS_RATES_FILE, result, difficulty=["medium", "easy", None])
    (folder / SHARDS_DIR).mkdir()
    second = per_response if per_response_in_second_shard is None else per_response_in_second_shard
    for index, (prompt_id, responses, stored) in enumerate((("a", [100, 200], per_response), ("b", [40, 60], second))):
        columns = {"id": [prompt_id], "n": pa.array([2], pa.int64()), "num_generated_tokens": [sum(responses)]}
        if stored:
            columns[RESPONSE_LENGTHS_COLUMN] = pa.array([responses], pa.list_(pa.int64()))
        pq.write_table(pa.table(columns), folder / SHARDS_DIR / f"shard_{index:05d}.parquet")
    write_manifest(folder, {"config": {"num_samples": 2, "max_new_tokens": 512}, "counts": result.counts})
    return folder


def test_a_curation_gives_its_kept_prompts_lengths_per_response_when_stored(tmp_path):
    from pipeline.stats.curation import CurationError, load_response_lengths

    means = load_response_lengths(_curation(tmp_path / "means"))
    assert means.lengths.tolist() == [150.0] and not means.per_response and means.kept_only
    assert (means.num_prompts, means.max_new_tokens) == (1, 512)
    responses = load_response_lengths(_curation(tmp_path / "responses", per_response=True))
    assert responses.lengths.tolist() == [100.0, 200.0] and responses.per_response
    # One shard without per-response lengths: every prompt's mean, so every prompt weighs the same.
    mixed = load_response_lengths(_curation(tmp_path / "mixed", kept=(True, True), per_response=True,
                                            per_response_in_second_shard=False))
    assert sorted(mixed.lengths.tolist()) == [50.0, 150.0] and not mixed.per_response
    # Nothing kept: every sampled prompt's lengths.
    nothing = load_response_lengths(_curation(tmp_path / "none", kept=(False, False), per_response=True))
    assert sorted(nothing.lengths.tolist()) == [40.0, 60.0, 100.0, 200.0] and not nothing.kept_only

    lengths = P.curation_lengths(tmp_path / "responses", max_new_tokens=150)
    assert lengths.values == (100.0, 150.0)  # cut at the rl stage's cap
    assert lengths.source == (f"curation {tmp_path / 'responses'}: 2 responses of 1 kept prompts, sampled at "
                              "max_new_tokens 512")
    with pytest.raises(CurationError, match="no complete curation"):
        load_response_lengths(tmp_path)


def _plan_args(tmp_path: Path, *extra: str) -> list[str]:
    return ["plan", "--model", str(FIXTURES / "Qwen2.5-Math-7B.json"), "--nodes", "1", "--rollout-nodes", "1",
            "--servers-per-node", "8", "--prompt-tokens", "512", "prompts_per_step=16", "group_size=8",
            "max_new_tokens=512", "parallel.tensor_parallel=4", *extra]


def test_the_plan_times_the_step_with_the_curations_lengths_and_prints_them(tmp_path, capsys):
    from pipeline.cli import main
    from pipeline.cli.plan import stage_inputs
    from pipeline.config import RLConfig
    from pipeline import configlib

    folder = _curation(tmp_path / "curate", per_response=True)
    assert main(_plan_args(tmp_path, f"curation_dir={folder}")) == 0
    out = capsys.readouterr().out
    assert (f"responses (curation {folder}: 2 responses of 1 kept prompts, sampled at max_new_tokens 512): median "
            "100, p90 200, mean 150, max 200 of 512 tokens") in out
    assert "at the expected longest response of each batch (mean-length" in out and "all-max bound" in out

    args = argparse.Namespace(gpu="h100", nodes=1, rollout_nodes=1, servers_per_node=8, server_tp=None,
                              distributed_optimizer=None, recompute=None, prompt_tokens=512, mfu=0.35,
                              rollout_mfu=0.10, response_fraction=None)
    cfg = configlib.load(RLConfig, overrides=["prompts_per_step=16", "group_size=8", "max_new_tokens=512",
                                              f"curation_dir={folder}"])
    measured = stage_inputs(cfg, dims("Qwen2.5-Math-7B"), resources=None, args=args, num_runs=1, gpus_per_node=8)
    assert measured.lengths().values == (100.0, 200.0)
    assert P.time_plan(measured).train_flops == pytest.approx(P.step_flops(measured)[0])
    assert P.step_flops(measured)[0] == pytest.approx(128 * 3 * F.sequence_forward_flops(
        dims("Qwen2.5-Math-7B").forward_cost(), 512 + 150) + 128 * F.sequence_forward_flops(
        dims("Qwen2.5-Math-7B").forward_cost(), 512 + 150))  # update + π_old's forward, at the mean
    # --response-fraction overrides the measurement; a curation that has not run yet leaves the stated shape.
    override = stage_inputs(cfg, dims("Qwen2.5-Math-7B"), resources=None, args=argparse.Namespace(
        **{**vars(args), "response_fraction": 0.5}), num_runs=1, gpus_per_node=8)
    assert override.response_lengths is None and override.lengths().mean == pytest.approx(256)
    absent = configlib.load(RLConfig, overrides=["max_new_tokens=512", f"curation_dir={tmp_path / 'later'}"])
    assert stage_inputs(absent, dims("Qwen2.5-Math-7B"), resources=None, args=args, num_runs=1,
                        gpus_per_node=8).lengths().source.startswith("stated shape")


def test_the_plan_prints_the_stated_shape_and_refuses_a_fraction_outside_the_cap(tmp_path, capsys):
    from pipeline.cli import main
    from pipeline.errors import EXIT_USER_ERROR

    assert main(_plan_args(tmp_path)) == 0
    out = capsys.readouterr().out
    assert ("responses (stated shape: log-normal, median 30% and p90 75% of max_new_tokens, cut at it): median 154, "
            "p90 384, mean 189, max 512 of 512 tokens") in out
    assert main(_plan_args(tmp_path, "--response-fraction", "1.5")) == EXIT_USER_ERROR
    assert "error: --response-fraction: 1.5 is not a share of max_new_tokens in (0, 1]" in capsys.readouterr().err
