"""Prompt templates: raw, plain (\\boxed instruction), chat (duck-typed tokenizer chat template)."""

import pytest

from pipeline.data.records import Prompt
from pipeline.data.templates import BOXED_INSTRUCTION, TEMPLATES, has_chat_template, render_prompt

PROBLEM = "What is 2 + 3?"


class FakeChatTokenizer:
    chat_template = "fake"

    def __init__(self):
        self.calls = []

    def apply_chat_template(self, conversation, **kwargs):
        self.calls.append((conversation, kwargs))
        return "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in conversation) + "<assistant>"


class BaseModelTokenizer:
    chat_template = None  # what HF tokenizers of base models carry

    def apply_chat_template(self, conversation, **kwargs):
        raise AssertionError("must not be called without a chat template")


def test_registry():
    assert sorted(TEMPLATES) == ["chat", "plain", "raw"]


def test_raw_is_the_problem_only():
    assert render_prompt(PROBLEM, template="raw") == PROBLEM


def test_plain_appends_the_boxed_instruction():
    text = render_prompt(Prompt(id="x", problem=PROBLEM + "\n", answer="5", source="t"), template="plain")
    assert text == f"{PROBLEM}\n\n{BOXED_INSTRUCTION}"
    assert "\\boxed{}" in BOXED_INSTRUCTION


def test_chat_wraps_the_plain_text_as_one_user_turn_with_generation_prompt():
    tokenizer = FakeChatTokenizer()
    text = render_prompt(PROBLEM, template="chat", tokenizer=tokenizer)
    assert text == f"<user>{PROBLEM}\n\n{BOXED_INSTRUCTION}</user><assistant>"
    ((conversation, kwargs),) = tokenizer.calls
    assert conversation == [{"role": "user", "content": f"{PROBLEM}\n\n{BOXED_INSTRUCTION}"}]
    assert kwargs == {"tokenize": False, "add_generation_prompt": True}


@pytest.mark.parametrize("tokenizer", [None, BaseModelTokenizer(), object()])
def test_chat_falls_back_to_plain_without_a_chat_template(tokenizer):
    assert not has_chat_template(tokenizer)
    assert render_prompt(PROBLEM, template="chat", tokenizer=tokenizer) == render_prompt(PROBLEM, template="plain")


def test_chat_rejects_a_non_string_rendering():
    class TokenizingTokenizer(FakeChatTokenizer):
        def apply_chat_template(self, conversation, **kwargs):
            return [1, 2, 3]

    with pytest.raises(ValueError, match="returned list, expected str"):
        render_prompt(PROBLEM, template="chat", tokenizer=TokenizingTokenizer())


def test_chat_with_a_real_hf_tokenizer():
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    word_level = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=word_level)
    assert not has_chat_template(tokenizer)  # a bare tokenizer has chat_template=None
    tokenizer.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    text = render_prompt(PROBLEM, template="chat", tokenizer=tokenizer)
    assert text == f"<|user|>{PROBLEM}\n\n{BOXED_INSTRUCTION}\n<|assistant|>"


def test_unknown_template():
    with pytest.raises(ValueError, match=r"unknown prompt template 'fancy'; known: \['chat', 'plain', 'raw'\]"):
        render_prompt(PROBLEM, template="fancy")
