"""The CPU demo's prompts are pinned: the ids its policy trains and samples on never move.

Before prompts were encoded by each tokenizer's own convention, every prompt was
``[bos] + tokenizer.encode(text, add_special_tokens=False)``. The demo's tokenizer now
prepends ``<bos>`` through its post-processor; these ids and digests were computed with
the old rule, so a change in either the tokenizer or the encoding fails here.
"""

from __future__ import annotations

import hashlib
import json

import pytest

from pipeline.config import BootstrapConfig, RLConfig
from pipeline.data import load_prompts, render_prompt
from pipeline.data.templates import prompt_token_ids
from pipeline.models.tokenizer import load_tokenizer, save_tokenizer, train_tokenizer
from pipeline.stages.bootstrap import TEMPLATE, config_hash, load_training_prompts


@pytest.fixture(scope="module")
def demo_tokenizer(tmp_path_factory):
    """The tokenizer `winnow bootstrap` trains with the demo's config, saved and reloaded as every stage loads it."""
    cfg = BootstrapConfig()
    texts = [render_prompt(p, template=TEMPLATE) + " " + p.metadata["solution"] for p in load_training_prompts(cfg)]
    tokenizer = train_tokenizer(texts, vocab_size=cfg.vocab_size, pad_to_multiple_of=cfg.vocab_multiple)
    return load_tokenizer(save_tokenizer(tokenizer, tmp_path_factory.mktemp("demo_tokenizer")))


def _digest(ids: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()


def test_the_demo_held_out_prompts_are_byte_identical(demo_tokenizer):
    prompts, _ = load_prompts(RLConfig().eval_set, split="test")
    ids = [prompt_token_ids(demo_tokenizer, p, template="raw") for p in prompts]
    assert [p.problem for p in prompts[:2]] == ["What is 30 * 69?", "What is 34 - 75?"]
    assert ids[:2] == [[1, 53, 51, 40, 16, 13, 57, 40, 19, 22, 25], [1, 53, 51, 40, 16, 17, 55, 40, 20, 18, 25]]
    bos = demo_tokenizer.bos_token_id
    assert all(row[0] == bos and row[1] != bos for row in ids)
    assert ids == [[bos, *demo_tokenizer.encode(p.problem, add_special_tokens=False)] for p in prompts]


@pytest.mark.parametrize("template, digest", [
    ("raw", "9e5eb19640cb0467a89b7b37f9e6df8d3501b6336a1cc3f92876679c0c1bb9d2"),
    ("plain", "e298fc039b469acd75a760db5539ccf5d9bbec91685f3393f510fb612f8ef61c"),
])
def test_the_demo_benchmark_prompts_are_byte_identical(demo_tokenizer, template, digest):
    prompts = [p for name in ("gsm8k", "math500") for p in load_prompts(name, split="test")[0]]
    assert _digest([prompt_token_ids(demo_tokenizer, p, template=template) for p in prompts]) == digest


def test_bootstrap_entries_cached_before_the_post_processor_are_not_reused():
    # 81d62419a1b7ace0: the demo's entry of cache format 1, whose tokenizer lacks the
    # post-processor (its prompts would lose their <bos>); format 2 trains a new one.
    assert config_hash(BootstrapConfig()) != "81d62419a1b7ace0"
