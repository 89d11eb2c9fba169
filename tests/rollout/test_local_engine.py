"""LocalEngine: parity with transformers.generate, log-prob recomputation, seeds, stops, weight updates."""

from __future__ import annotations

import warnings
from collections import Counter

import pytest
import torch

from pipeline.rollout import RolloutEngine, RolloutError
from pipeline.rollout.local import LocalEngine
from pipeline.rollout.types import Completion, GenerationRequest, SamplingParams
from tests.rollout.tiny_llama import VOCAB, ragged_prompts, tiny_llama


def _requests(prompts: list[list[int]], counts: list[int] | int) -> list[GenerationRequest]:
    counts = counts if isinstance(counts, list) else [counts] * len(prompts)
    return [GenerationRequest(f"p{i}", p, n) for i, (p, n) in enumerate(zip(prompts, counts))]


def _left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt) :] = torch.tensor(prompt)
        mask[i, width - len(prompt) :] = 1
    return ids, mask


def _hf_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Raw ``generate`` continuations, cut after the first EOS (``generate`` pads after it)."""
    ids, mask = _left_padded(prompts)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    eos = model.generation_config.eos_token_id
    continuations = []
    for row in out[:, ids.shape[1] :].tolist():
        if eos is not None and eos in row:
            row = row[: row.index(eos) + 1]
        continuations.append(row)
    return continuations


def _recomputed_logprobs(model, prompt: list[int], completion: Completion, temperature: float) -> torch.Tensor:
    """The trainer's view: one fp32 forward over prompt + completion, no cache, no padding."""
    full = torch.tensor([prompt + completion.token_ids.tolist()])
    with torch.no_grad():
        logits = model(full).logits[0, len(prompt) - 1 : -1]
    scale = temperature if temperature > 0 else 1.0
    return torch.log_softmax(logits / scale, dim=-1).gather(-1, completion.token_ids[:, None]).squeeze(-1)


def test_greedy_matches_transformers_generate_with_eos_and_small_chunks() -> None:
    prompts = ragged_prompts(9)
    probe = _hf_greedy(tiny_llama(), prompts, max_new_tokens=12)
    # An EOS the model actually emits early for some prompts, so rows finish at different
    # steps and the finished rows are compacted out of the batch.
    eos = Counter(tok for row in probe for tok in row[:6]).most_common(1)[0][0]
    model = tiny_llama(eos_token_id=eos)
    expected = _hf_greedy(model, prompts, max_new_tokens=12)
    assert any(len(row) < 12 for row in expected) and any(len(row) == 12 for row in expected)
    for max_batch_rows in (256, 4):
        engine = LocalEngine(model, max_batch_rows=max_batch_rows, show_progress=False)
        completions = engine.generate(_requests(prompts, 1), SamplingParams(max_new_tokens=12, temperature=0.0))
        assert [c.token_ids.tolist() for c in completions] == expected
        for c in completions:
            assert c.finish_reason == ("stop" if c.token_ids[-1].item() == eos else "length")
            assert c.logprobs.dtype == torch.float32 and c.token_ids.dtype == torch.long


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.9), (0.0, 1.0)])
def test_logprobs_equal_fp32_full_forward_recomputation(temperature: float, top_p: float) -> None:
    # fp32 rounding of cached vs full attention grows with the logit scale: ~1.5e-6 at
    # |logit| ≈ 3 (this model), ~5e-6 at 7, ~2e-5 at 14 — noise, not a bug.
    model = tiny_llama(seed=3, init_std=0.1)
    prompts = ragged_prompts(6, seed=4)
    # Ten stop ids make rows finish at scattered steps (exercises masking and compaction).
    params = SamplingParams(
        max_new_tokens=24, temperature=temperature, top_p=top_p, seed=11, stop_token_ids=tuple(range(10, 20))
    )
    completions = LocalEngine(model, show_progress=False).generate(_requests(prompts, [3, 1, 4, 2, 5, 1]), params)
    assert len({c.num_tokens for c in completions}) > (3 if temperature > 0 else 1)
    worst = 0.0
    for c in completions:
        reference = _recomputed_logprobs(model, prompts[int(c.prompt_id[1:])], c, temperature)
        worst = max(worst, (reference - c.logprobs).abs().max().item())
    assert worst < 1e-5


def test_seeded_sampling_is_deterministic_and_seed_dependent() -> None:
    engine = LocalEngine(tiny_llama(), show_progress=False)
    requests = _requests(ragged_prompts(4), 3)

    def run(seed: int) -> list[list[int]]:
        params = SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.95, seed=seed)
        return [c.token_ids.tolist() for c in engine.generate(requests, params)]

    assert run(5) == run(5)
    assert run(5) != run(6)
    # The samples of one prompt differ from each other (each row draws its own noise).
    first = run(5)
    assert len({tuple(row) for row in first[:3]}) > 1


def test_generation_passes_the_kv_cache_under_the_name_transformers_takes() -> None:
    # transformers ≥ 5.24 warns on forward(past_key_values=...) and will drop it; older 5.x only know that name.
    engine = LocalEngine(tiny_llama(), show_progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        completions = engine.generate(_requests(ragged_prompts(2), 2), SamplingParams(max_new_tokens=4, seed=0))
    assert len(completions) == 4 and all(c.num_tokens == 4 for c in completions)


def test_ragged_sample_counts_and_order() -> None:
    engine = LocalEngine(tiny_llama(), max_batch_rows=3, show_progress=False)
    requests = _requests(ragged_prompts(4), [3, 0, 1, 5])
    completions = engine.generate(requests, SamplingParams(max_new_tokens=5, seed=0))
    assert [(c.prompt_id, c.sample_index) for c in completions] == (
        [("p0", s) for s in range(3)] + [("p2", 0)] + [("p3", s) for s in range(5)]
    )
    assert all(c.weight_version == 0 and c.finish_reason == "length" and c.num_tokens == 5 for c in completions)
    assert engine.generate([], SamplingParams(max_new_tokens=5)) == []
    assert engine.generate(_requests(ragged_prompts(2), 0), SamplingParams(max_new_tokens=5)) == []


def test_stop_token_ids_end_each_completion_at_first_stop() -> None:
    engine = LocalEngine(tiny_llama(seed=5), show_progress=False)
    stops = (3, 7, 21, 42, 55, 60, 77, 88, 91, 99)
    params = SamplingParams(max_new_tokens=20, temperature=1.0, seed=2, stop_token_ids=stops)
    completions = engine.generate(_requests(ragged_prompts(5), 4), params)
    reasons = Counter(c.finish_reason for c in completions)
    assert reasons["stop"] > 0 and reasons["length"] > 0
    for c in completions:
        tokens = c.token_ids.tolist()
        assert not any(t in stops for t in tokens[:-1])
        if c.finish_reason == "stop":
            assert tokens[-1] in stops
        else:
            assert len(tokens) == 20 and tokens[-1] not in stops


def test_ignore_eos_generates_through_eos() -> None:
    prompts = ragged_prompts(4)
    eos = Counter(t for row in _hf_greedy(tiny_llama(), prompts, 8) for t in row[:2]).most_common(1)[0][0]
    engine = LocalEngine(tiny_llama(eos_token_id=eos), show_progress=False)
    stopped = engine.generate(_requests(prompts, 1), SamplingParams(max_new_tokens=8, temperature=0.0))
    assert any(c.finish_reason == "stop" for c in stopped)
    through = engine.generate(_requests(prompts, 1), SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))
    assert all(c.num_tokens == 8 and c.finish_reason == "length" for c in through)
    for a, b in zip(stopped, through):
        assert b.token_ids[: a.num_tokens].tolist() == a.token_ids.tolist()


class _LetterDecoder:
    """Token t decodes to one letter; enough of a tokenizer for stop strings."""

    def batch_decode(self, sequences: list[list[int]], *, skip_special_tokens: bool = False) -> list[str]:
        return ["".join(chr(ord("a") + t % 26) for t in seq) for seq in sequences]


def test_stop_strings_stop_on_the_completing_token() -> None:
    model = tiny_llama(seed=7)
    prompts = ragged_prompts(3, seed=9)
    free = LocalEngine(model, show_progress=False).generate(
        _requests(prompts, 1), SamplingParams(max_new_tokens=16, temperature=0.0)
    )
    decoder = _LetterDecoder()
    text = decoder.batch_decode([free[0].token_ids.tolist()])[0]
    stop = text[5:8]  # a 3-letter string prompt 0 produces, ending at token 7 at the latest
    engine = LocalEngine(model, tokenizer=decoder, show_progress=False)
    completions = engine.generate(
        _requests(prompts, 1), SamplingParams(max_new_tokens=16, temperature=0.0, stop_strings=(stop,))
    )
    for greedy, c in zip(free, completions):
        full = decoder.batch_decode([greedy.token_ids.tolist()])[0]
        if stop in full:
            end = full.index(stop) + len(stop)
            assert c.finish_reason == "stop" and c.token_ids.tolist() == greedy.token_ids.tolist()[:end]
        else:
            assert c.finish_reason == "length" and c.token_ids.tolist() == greedy.token_ids.tolist()
    assert completions[0].finish_reason == "stop" and completions[0].num_tokens <= 8
    with pytest.raises(ValueError, match="tokenizer"):
        LocalEngine(model, show_progress=False).generate(
            _requests(prompts, 1), SamplingParams(max_new_tokens=4, stop_strings=("x",))
        )


def test_update_weights_changes_outputs_and_bumps_version() -> None:
    model = tiny_llama(seed=0)
    engine = LocalEngine(model, show_progress=False)
    requests = _requests(ragged_prompts(4), 1)
    params = SamplingParams(max_new_tokens=10, temperature=0.0)
    before = [c.token_ids.tolist() for c in engine.generate(requests, params)]
    other = tiny_llama(seed=1)
    engine.update_weights(((n, p.detach().clone()) for n, p in other.named_parameters()), version=1)
    after = engine.generate(requests, params)
    assert engine.weight_version == 1 and all(c.weight_version == 1 for c in after)
    assert [c.token_ids.tolist() for c in after] != before
    assert [c.token_ids.tolist() for c in after] == _hf_greedy(other, [list(r.prompt_token_ids) for r in requests], 10)
    # Updating back restores the original outputs exactly.
    engine.update_weights(dict(tiny_llama(seed=0).named_parameters()), version=2)
    assert [c.token_ids.tolist() for c in engine.generate(requests, params)] == before


def test_update_weights_rejects_bad_updates_and_then_refuses_to_generate() -> None:
    model = tiny_llama()
    engine = LocalEngine(model, show_progress=False)
    good = {n: p.detach().clone() for n, p in model.named_parameters()}
    requests = _requests(ragged_prompts(2), 1)
    params = SamplingParams(max_new_tokens=3)
    with pytest.raises(ValueError, match="greater|> the current"):
        engine.update_weights(good, version=0)
    with pytest.raises(ValueError, match="no parameter"):
        engine.update_weights({**good, "model.layers.9.mlp.up_proj.weight": torch.zeros(1)}, version=1)
    with pytest.raises(RolloutError, match="inconsistent"):
        engine.generate(requests, params)
    missing = dict(good)
    missing.pop("model.norm.weight")
    with pytest.raises(ValueError, match="model.norm.weight"):
        engine.update_weights(missing, version=1)
    wrong_shape = {**good, "model.norm.weight": torch.ones(3)}
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights(wrong_shape, version=1)
    with pytest.raises(ValueError, match="twice"):
        engine.update_weights(list(good.items()) + [("model.norm.weight", good["model.norm.weight"])], version=1)
    assert engine.weight_version == 0
    engine.update_weights(good, version=1)
    assert engine.generate(requests, params)[0].weight_version == 1


def test_update_weights_tied_embeddings_accept_both_names() -> None:
    model = tiny_llama(tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    engine = LocalEngine(model, show_progress=False)
    source = tiny_llama(seed=4, tie_word_embeddings=True)
    state = dict(source.state_dict())  # holds lm_head.weight and embed_tokens.weight
    assert "lm_head.weight" in state
    engine.update_weights(state, version=1)
    assert torch.equal(model.lm_head.weight, source.model.embed_tokens.weight)
    bad = {**state, "lm_head.weight": state["lm_head.weight"] + 1.0}
    with pytest.raises(ValueError, match="tied"):
        engine.update_weights(bad, version=2)


def test_request_validation() -> None:
    engine = LocalEngine(tiny_llama(max_position_embeddings=16), show_progress=False)
    assert isinstance(engine, RolloutEngine)
    with pytest.raises(ValueError, match="twice"):
        engine.generate(
            [GenerationRequest("a", [1, 2], 1), GenerationRequest("a", [3], 1)], SamplingParams(max_new_tokens=2)
        )
    with pytest.raises(ValueError, match="max_position_embeddings"):
        engine.generate([GenerationRequest("a", [1] * 10, 1)], SamplingParams(max_new_tokens=7))
    with pytest.raises(ValueError, match="vocab"):
        engine.generate([GenerationRequest("a", [VOCAB], 1)], SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="empty"):
        GenerationRequest("a", [], 1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(max_new_tokens=2, top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(max_new_tokens=2, temperature=-1.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
