"""`winnow curate` end to end on a tiny Hugging Face policy: outputs, round trips, resume, reruns."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from pipeline import configlib
from pipeline.configlib import ConfigError
from pipeline.stages import curate_rules as rules
from pipeline.stages.curate import (
    KEPT_FILE,
    MANIFEST_FILE,
    PASS_RATES_FILE,
    PLOT_FILE,
    REPORT_FILE,
    CurateConfig,
    CurationError,
    run_curate,
    shard_seed,
)
from pipeline.stats.curation import load_curation

ARITH_SOURCES = ["arith?difficulty=1&size=12", "arith?difficulty=2&size=12"]
CONTEXT = 40  # the policy's max_position_embeddings
MAX_NEW_TOKENS = 8
NUM_ARITH = 24
NUM_SHARDS = 3  # 24 arith + 2 file prompts sampled, 10 per shard


def _train_tiny_policy(directory, *, num_steps=300):
    """A 2-layer Llama fitted for 300 steps to answer `arith` problems as ``\\boxed{a}``: some
    problems it solves every time, some never, many in between — a spread of pass rates."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipeline.data import load_prompts
    from pipeline.models.tokenizer import encode_prompt, train_tokenizer

    train, _ = load_prompts("arith?difficulty=2&size=200", split="train")
    tokenizer = train_tokenizer([p.problem + " \\boxed{" + p.answer + "}" for p in train], vocab_size=48)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=CONTEXT, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    rows = [(encode_prompt(tokenizer, p.problem),
             tokenizer.encode(" \\boxed{" + p.answer + "}", add_special_tokens=False) + [tokenizer.eos_token_id])
            for p in train]
    length = max(len(a) + len(b) for a, b in rows)
    tokens = torch.full((len(rows), length), tokenizer.pad_token_id)  # (N, T)
    labels = torch.full((len(rows), length), -100)  # (N, T)
    attention = torch.zeros((len(rows), length), dtype=torch.long)  # (N, T)
    for i, (prompt_ids, response_ids) in enumerate(rows):
        end = len(prompt_ids) + len(response_ids)
        tokens[i, :end] = torch.tensor(prompt_ids + response_ids)
        labels[i, len(prompt_ids):end] = torch.tensor(response_ids)
        attention[i, :end] = 1
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small runs fastest on one thread, and CI shares its cores
    try:
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        generator = torch.Generator().manual_seed(0)
        for _ in range(num_steps):
            batch = torch.randint(0, len(rows), (32,), generator=generator)
            loss = model(input_ids=tokens[batch], attention_mask=attention[batch], labels=labels[batch]).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    return _train_tiny_policy(tmp_path_factory.mktemp("policy"))


@pytest.fixture(scope="module")
def extra_source(tmp_path_factory):
    """A JSONL source with one prompt for each pre-sampling rule, and one with rich metadata."""
    from pipeline.data import load_prompts

    first_arith = load_prompts(ARITH_SOURCES[0], split="train")[0][0]
    rows = [
        {"id": "dup", "problem": "  " + first_arith.problem.upper(), "answer": first_arith.answer},
        {"id": "bad-ref", "problem": "What is 5 + 5?", "answer": "$$"},  # empty once the $ go
        {"id": "long", "problem": "What is " + " + ".join(["1"] * 30) + "?", "answer": "30"},
        {"id": "meta", "problem": "What is 2 + 3?", "answer": "5", "level": 1, "tags": ["x", "y"], "note": None,
         "solution": "2 + 3 = 5. \\boxed{5}"},
        {"id": "meta2", "problem": "What is 4 - 1?", "answer": "3", "subject": "arith"},
    ]
    path = tmp_path_factory.mktemp("data") / "extra.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def _config(policy_dir, extra_source, output_dir, *overrides):
    return configlib.load(CurateConfig, overrides=[
        f"sources={json.dumps([*ARITH_SOURCES, extra_source])}", f"policy={policy_dir}", "num_samples=4",
        f"max_new_tokens={MAX_NEW_TOKENS}", "shard_size=10", "template=raw", f"output_dir={output_dir}",
        "reward.num_workers=1", "progress=false", *overrides,
    ])


class _CountingGenerate:
    """Wraps ``LocalEngine.generate``: counts calls and can fail on one of them."""

    def __init__(self, monkeypatch, *, fail_on_call=None):
        from pipeline.rollout.local import LocalEngine

        self.num_calls = 0
        original = LocalEngine.generate
        counter = self

        def generate(engine, requests, params):
            counter.num_calls += 1
            if counter.num_calls == fail_on_call:
                raise RuntimeError("simulated failure in generation")
            return original(engine, requests, params)

        monkeypatch.setattr(LocalEngine, "generate", generate)


@pytest.fixture(scope="module")
def completed(policy_dir, extra_source, tmp_path_factory):
    """One uninterrupted curation, shared by the tests that read it."""
    cfg = _config(policy_dir, extra_source, tmp_path_factory.mktemp("curate") / "full")
    lines = []
    result = run_curate(cfg, out=lines.append)
    return cfg, result, lines


# ----------------------------------------------------------------------------- config


def test_config_defaults_and_validation(tmp_path):
    cfg = CurateConfig()
    assert (cfg.num_samples, cfg.rules.trivial_threshold, cfg.rules.drop_impossible, cfg.rules.hard_subset,
            cfg.rules.verify_reference, cfg.rules.dedup) == (16, 0.375, True, None, True, True)
    assert configlib.load(CurateConfig, overrides=["rules.hard_subset=[1, 2]"]).rules.hard_subset == (1, 2)
    with pytest.raises(ConfigError, match="hard_subset"):
        configlib.load(CurateConfig, overrides=["rules.hard_subset=[3, 2]"])
    with pytest.raises(ConfigError, match="exceeds num_samples=4"):
        configlib.load(CurateConfig, overrides=["num_samples=4", "rules.hard_subset=[5, 6]"])
    with pytest.raises(ConfigError, match="rules.trivial_threshold"):
        configlib.load(CurateConfig, overrides=["rules.trivial_threshold=1.5"])
    with pytest.raises(ConfigError, match="policy: required"):
        run_curate(configlib.load(CurateConfig, overrides=[f"output_dir={tmp_path}"]))


def test_shard_seeds_are_distinct_and_stable():
    seeds = [shard_seed(0, index) for index in range(100)] + [shard_seed(1, 0)]
    assert len(set(seeds)) == len(seeds) and all(0 <= s < 2**63 for s in seeds)
    assert shard_seed(0, 3) == shard_seed(0, 3)


# ----------------------------------------------------------------------------- end to end


def test_end_to_end_outputs(completed, extra_source):
    from pipeline.data import inspect_dataset, load_prompts

    cfg, result, lines = completed
    output_dir = result.output_dir
    assert "[4/5] sample k=4 for 26 prompts in 3 shard(s) (T=1.0, top_p=1.0, 8 new tokens)" in lines

    # Each pre-sampling rule caught exactly its planted prompt; 26 were sampled.
    counts = result.counts
    assert counts["total"] == NUM_ARITH + 5
    assert (counts["reference_fails"], counts["duplicate"], counts["too_long"]) == (1, 1, 1)
    assert counts["kept"] + sum(counts[rule] for rule in rules.RULE_ORDER) == counts["total"]
    reason_of = dict(zip(result.prompt_ids, result.drop_reasons))
    assert (reason_of["bad-ref"], reason_of["dup"], reason_of["long"]) == (
        rules.REFERENCE_FAILS, rules.DUPLICATE, rules.TOO_LONG)
    assert int(result.sampled_mask.sum()) == 26
    # The policy shows a spread: the rules after sampling all have work, and some prompts stay.
    assert counts["trivial"] > 0 and counts["impossible"] > 0 and counts["kept"] > 0

    # Shards: pass_rate is c / n with n = k, difficulty follows the buckets, seeds from (seed, index).
    shard_paths = sorted((output_dir / "shards").glob("shard_*.parquet"))
    assert [p.name for p in shard_paths] == [f"shard_{i:05d}.parquet" for i in range(NUM_SHARDS)]
    shards = [pq.read_table(path) for path in shard_paths]
    assert [len(t) for t in shards] == [10, 10, 6]
    for index, table in enumerate(shards):
        assert json.loads(table.schema.metadata[b"winnow.curate"])["seed"] == shard_seed(cfg.seed, index)
        n, c = table.column("n").to_numpy(), table.column("c").to_numpy()
        assert np.all(n == 4) and np.all((c >= 0) & (c <= 4))
        np.testing.assert_array_equal(table.column("pass_rate").to_numpy(), c / n)
        assert table.column("difficulty").to_pylist() == rules.difficulty_names(n, c)
        assert table.column_names == ["id", "source", "problem", "answer", "metadata", "n", "c", "pass_rate",
                                      "difficulty", "num_generated_tokens", "question_logprob", "response_lengths"]
        question_logprobs = table.column("question_logprob").to_numpy()
        assert np.all(np.isfinite(question_logprobs)) and np.all(question_logprobs < 0)

    # pass_rates.parquet: every prompt; its kept flags and reasons are the rules applied to the shards' (n, c).
    table = pq.read_table(output_dir / PASS_RATES_FILE)
    assert table.column("id").to_pylist() == result.prompt_ids
    by_id = {row["id"]: row for shard in shards for row in shard.to_pylist()}
    for row in table.to_pylist():
        if row["id"] in by_id:
            assert (row["n"], row["c"], row["pass_rate"]) == (4, by_id[row["id"]]["c"], by_id[row["id"]]["c"] / 4)
        else:
            assert (row["n"], row["c"], row["pass_rate"], row["difficulty"]) == (0, 0, None, None)
        assert row["kept"] == (row["drop_reason"] is None)
        if row["kept"]:
            assert 1 <= row["c"] and row["c"] / row["n"] <= 0.375
        elif row["drop_reason"] == rules.TRIVIAL:
            assert row["c"] / row["n"] > 0.375
        elif row["drop_reason"] == rules.IMPOSSIBLE:
            assert row["c"] == 0

    # kept.jsonl reads back through the data loaders, metadata included.
    originals = {p.id: p for spec in [*ARITH_SOURCES, extra_source] for p in load_prompts(spec)[0]}
    kept, report = load_prompts(str(output_dir / KEPT_FILE))
    assert [p.id for p in kept] == result.kept_ids and report.num_bad == 0
    for prompt in kept:
        original = originals[prompt.id]
        assert (prompt.problem, prompt.answer, prompt.metadata) == (original.problem, original.answer,
                                                                    original.metadata)
    assert inspect_dataset(str(output_dir / KEPT_FILE))["num_prompts"] == counts["kept"]

    # load_curation gives back what run_curate returned.
    loaded = load_curation(output_dir)
    assert loaded.prompt_ids == result.prompt_ids and loaded.specs == result.specs
    assert loaded.drop_reasons == result.drop_reasons and loaded.counts == result.counts
    for name in ("num_samples", "num_correct", "pass_rates", "kept_mask"):
        np.testing.assert_array_equal(getattr(loaded, name), getattr(result, name))
    assert np.isnan(loaded.pass_rates[~loaded.sampled_mask]).all() and loaded.samples_per_prompt == 4

    # Report, plot and manifest.
    report_text = (output_dir / REPORT_FILE).read_text()
    assert f"| too_long | 1 | {NUM_ARITH + 5 - 3} |" in report_text
    assert f"| **kept** | | **{counts['kept']}** |" in report_text
    assert f"| `{ARITH_SOURCES[0]}` | 12 | 12 |" in report_text
    assert (output_dir / PLOT_FILE).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    manifest = json.loads((output_dir / MANIFEST_FILE).read_text())
    assert manifest["counts"] == counts and manifest["config"]["num_samples"] == 4
    assert [s["status"] for s in manifest["shards"]] == ["generated"] * NUM_SHARDS
    assert manifest["difficulty"]["before"]["num_correct"] == {
        str(j): int(np.sum(result.num_correct[result.sampled_mask] == j)) for j in range(5)}
    assert sum(manifest["difficulty"]["after"]["buckets"].values()) == counts["kept"]
    assert manifest["rule_metrics"]["reference_fails/reason/invalid_gold"] == 1
    assert {"torch", "transformers", "python"} <= set(manifest["versions"])
    assert set(manifest["timings"]) >= {"load_s", "screen_s", "policy_s", "sampling_s", "outputs_s", "total_s"}


def _outputs(output_dir):
    """What must be identical between a resumed and an uninterrupted run."""
    shards = {path.name: pq.read_table(path) for path in sorted((output_dir / "shards").glob("*.parquet"))}
    return (shards, pq.read_table(output_dir / PASS_RATES_FILE), (output_dir / KEPT_FILE).read_bytes(),
            (output_dir / REPORT_FILE).read_bytes())


def test_resume_after_a_failure_in_the_second_shard(completed, policy_dir, extra_source, tmp_path, monkeypatch):
    _, full, _ = completed
    cfg = _config(policy_dir, extra_source, tmp_path / "resumed")
    failing = _CountingGenerate(monkeypatch, fail_on_call=2)
    with pytest.raises(RuntimeError, match="simulated failure"):
        run_curate(cfg, out=lambda line: None)
    assert failing.num_calls == 2
    shards_dir = tmp_path / "resumed" / "shards"
    assert sorted(p.name for p in shards_dir.iterdir()) == ["shard_00000.parquet"]
    with pytest.raises(CurationError, match="no complete curation"):
        load_curation(tmp_path / "resumed")

    counting = _CountingGenerate(monkeypatch)
    resumed = run_curate(cfg, out=lambda line: None)
    assert counting.num_calls == NUM_SHARDS - 1  # only the shards that were not written
    manifest = json.loads((tmp_path / "resumed" / MANIFEST_FILE).read_text())
    assert [s["status"] for s in manifest["shards"]] == ["reused", "generated", "generated"]

    shards, pass_rates, kept, report = _outputs(tmp_path / "resumed")
    full_shards, full_pass_rates, full_kept, full_report = _outputs(full.output_dir)
    assert shards.keys() == full_shards.keys()
    for name, table in shards.items():
        assert table.equals(full_shards[name], check_metadata=True), name
    assert pass_rates.equals(full_pass_rates) and kept == full_kept and report == full_report
    np.testing.assert_array_equal(resumed.num_correct, full.num_correct)


def test_shards_store_each_responses_length_for_the_planner(completed):
    from pipeline.launch.plan import curation_lengths
    from pipeline.stats.curation import RESPONSE_LENGTHS_COLUMN, load_response_lengths

    _, result, _ = completed
    lengths_of = {}
    for path in sorted((result.output_dir / "shards").glob("shard_*.parquet")):
        table = pq.read_table(path)
        for row in table.to_pylist():
            lengths = row[RESPONSE_LENGTHS_COLUMN]
            assert len(lengths) == row["n"] and sum(lengths) == row["num_generated_tokens"]
            assert all(1 <= length <= MAX_NEW_TOKENS for length in lengths)
            lengths_of[row["id"]] = lengths
    assert len(lengths_of) == 26
    # Lengths vary between the responses of one prompt: per-prompt means would hide that spread.
    assert any(len(set(lengths)) > 1 for lengths in lengths_of.values())

    measured = load_response_lengths(result.output_dir)
    assert measured.per_response and measured.kept_only and measured.num_prompts == result.counts["kept"]
    assert measured.lengths.size == 4 * result.counts["kept"]
    assert measured.lengths.tolist() == [length for prompt_id in result.kept_ids for length in lengths_of[prompt_id]]
    source = curation_lengths(result.output_dir, max_new_tokens=MAX_NEW_TOKENS).source
    assert f"{4 * result.counts['kept']} responses of {result.counts['kept']} kept prompts" in source
    assert "mean response lengths" not in source


def test_shards_of_an_older_version_without_response_lengths_mix_with_new_ones(completed, tmp_path, monkeypatch):
    """A resumed curation whose first shard an older version wrote: the new shards carry per-response
    lengths, the old one does not, and the planner falls back to every kept prompt's mean."""
    import shutil

    from pipeline.stats.curation import RESPONSE_LENGTHS_COLUMN, load_response_lengths

    cfg, full, _ = completed
    output_dir = tmp_path / "mixed"
    shutil.copytree(full.output_dir, output_dir)
    shards_dir = output_dir / "shards"
    old = pq.read_table(shards_dir / "shard_00000.parquet")
    pq.write_table(old.drop_columns([RESPONSE_LENGTHS_COLUMN]), shards_dir / "shard_00000.parquet")
    (shards_dir / f"shard_{NUM_SHARDS - 1:05d}.parquet").unlink()
    counting = _CountingGenerate(monkeypatch)
    mixed = run_curate(configlib.load(CurateConfig, base=cfg, overrides=[f"output_dir={output_dir}"]),
                       out=lambda line: None)
    assert counting.num_calls == 1
    manifest = json.loads((output_dir / MANIFEST_FILE).read_text())
    assert [s["status"] for s in manifest["shards"]] == ["reused"] * (NUM_SHARDS - 1) + ["generated"]
    assert RESPONSE_LENGTHS_COLUMN in pq.read_schema(shards_dir / f"shard_{NUM_SHARDS - 1:05d}.parquet").names
    assert mixed.counts == full.counts and mixed.kept_ids == full.kept_ids

    measured = load_response_lengths(output_dir)
    assert not measured.per_response and measured.lengths.size == full.counts["kept"]
    tokens_of = {row["id"]: row["num_generated_tokens"] for path in sorted(shards_dir.glob("shard_*.parquet"))
                 for row in pq.read_table(path, columns=["id", "num_generated_tokens"]).to_pylist()}
    np.testing.assert_allclose(measured.lengths, [tokens_of[prompt_id] / 4 for prompt_id in full.kept_ids])


def test_rerun_with_other_rules_reuses_every_shard(completed, tmp_path, monkeypatch):
    import shutil

    cfg, full, _ = completed
    output_dir = tmp_path / "rerun"
    shutil.copytree(full.output_dir, output_dir)
    counting = _CountingGenerate(monkeypatch)
    rerun_cfg = configlib.load(CurateConfig, base=cfg, overrides=[
        f"output_dir={output_dir}", "rules.trivial_threshold=null", "rules.hard_subset=[1, 1]"])
    returned = run_curate(rerun_cfg, out=lambda line: None)
    assert counting.num_calls == 0

    rerun = load_curation(output_dir)
    np.testing.assert_array_equal(rerun.num_correct, full.num_correct)
    sampled = full.sampled_mask
    c = full.num_correct
    assert rerun.counts["trivial"] == 0
    assert rerun.counts["impossible"] == int(np.sum(sampled & (c == 0)))
    assert rerun.counts["outside_hard_subset"] == int(np.sum(sampled & (c >= 2)))
    assert rerun.kept_ids == [pid for pid, s, ci in zip(full.prompt_ids, sampled, c) if s and ci == 1]
    assert returned.counts == rerun.counts and returned.kept_ids == rerun.kept_ids


def test_shards_of_another_curation_are_refused(completed, policy_dir, extra_source, tmp_path, monkeypatch):
    import shutil

    _, full, _ = completed
    shutil.copytree(full.output_dir, tmp_path / "other")
    counting = _CountingGenerate(monkeypatch)
    cfg = _config(policy_dir, extra_source, tmp_path / "other", "temperature=0.5")
    with pytest.raises(CurationError, match="written by another curation"):
        run_curate(cfg, out=lambda line: None)
    assert counting.num_calls == 0


def test_duplicate_ids_across_sources_are_an_error(policy_dir, extra_source, tmp_path):
    cfg = configlib.load(CurateConfig, overrides=[
        f"sources={json.dumps([extra_source, extra_source])}", f"policy={policy_dir}", f"output_dir={tmp_path}"])
    with pytest.raises(CurationError, match="appears in .* ids must be unique across sources"):
        run_curate(cfg, out=lambda line: None)


# ----------------------------------------------------------------------------- nothing kept


def test_prompts_that_all_exceed_the_context_are_an_error_before_sampling(policy_dir, extra_source, tmp_path,
                                                                          monkeypatch):
    counting = _CountingGenerate(monkeypatch)
    # With as many new tokens as the model has positions, no prompt fits.
    cfg = _config(policy_dir, extra_source, tmp_path, f"max_new_tokens={CONTEXT}")
    message = (rf"curation kept 0 of {NUM_ARITH + 5} prompts: 0 sampled, {NUM_ARITH + 3} dropped as too long for the "
               rf"context \(prompt \+ max_new_tokens={CONTEXT} > the model's {CONTEXT} positions\), 0 by the "
               r"difficulty rules .*lower max_new_tokens")
    with pytest.raises(CurationError, match=message):
        run_curate(cfg, out=lambda line: None)
    assert counting.num_calls == 0
    assert not (tmp_path / KEPT_FILE).exists() and not (tmp_path / MANIFEST_FILE).exists()


def test_rules_that_keep_nothing_are_an_error_not_an_empty_file(completed, tmp_path, monkeypatch):
    import shutil

    cfg, full, _ = completed
    output_dir = tmp_path / "strict"
    shutil.copytree(full.output_dir, output_dir)
    counting = _CountingGenerate(monkeypatch)
    # No prompt of k = 4 has more than 4 correct: the hard subset [4, 4] keeps only what `trivial` already dropped.
    strict = configlib.load(CurateConfig, base=cfg, overrides=[f"output_dir={output_dir}", "rules.hard_subset=[4, 4]"])
    counts = full.counts
    by_rules = counts["kept"] + counts["trivial"] + counts["impossible"]
    message = (rf"curation kept 0 of {counts['total']} prompts: 26 sampled, 1 dropped as too long .*, {by_rules} by "
               rf"the difficulty rules \(trivial {counts['trivial']}, impossible {counts['impossible']}, "
               rf"outside_hard_subset {counts['kept']}\), 2 by the screen .*rules.hard_subset")
    with pytest.raises(CurationError, match=message):
        run_curate(strict, out=lambda line: None)
    assert counting.num_calls == 0  # the rules re-applied to the stored shards
    assert not (output_dir / KEPT_FILE).exists() and not (output_dir / MANIFEST_FILE).exists()
    assert "| **kept** | | **0** |" in (output_dir / REPORT_FILE).read_text()  # the report shows why
