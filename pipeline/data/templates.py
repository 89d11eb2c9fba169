"""Prompt templates: how a ``Prompt``'s problem becomes the text the policy sees.

``TEMPLATES`` maps a name to ``fn(problem, *, tokenizer=None) -> str``:

``raw``
    the problem only (the CPU demo's tiny model is trained on bare ``arith`` problems).
``plain``
    the problem, a blank line, then ``BOXED_INSTRUCTION`` asking for the final answer in
    ``\\boxed{}`` (the instruction graders in ``pipeline.rewards`` expect).
``chat``
    the ``plain`` text as one user message, rendered with the tokenizer's chat template
    and the generation prompt appended. The tokenizer is duck-typed: anything with an
    ``apply_chat_template`` method and a non-``None`` ``chat_template`` (or no such
    attribute). Without one (no tokenizer, or a base model's tokenizer with
    ``chat_template=None``) the ``plain`` text is returned, so one config serves base
    and instruct models.

``prompt_token_ids`` is the one encoding every stage (curation, RL, evaluation) feeds the
engine: ``chat`` gives exactly the ids of ``tokenizer.apply_chat_template(messages,
add_generation_prompt=True, tokenize=True)`` (the template writes the model's start
tokens); ``raw`` and ``plain`` give the rendered text encoded with the tokenizer's own
special-token settings (``add_special_tokens=True``: Llama 3 prepends
``<|begin_of_text|>``, Qwen2.5 adds nothing). A prompt never starts with two BOS tokens
(``pipeline.models.tokenizer``).
"""

from __future__ import annotations

from typing import Any, Protocol

from pipeline.data.records import Prompt

BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


class ChatTokenizer(Protocol):
    def apply_chat_template(self, conversation: list[dict[str, str]], **kwargs: Any) -> Any: ...


class Template(Protocol):
    def __call__(self, problem: str, *, tokenizer: ChatTokenizer | None = None) -> str: ...


def render_raw(problem: str, *, tokenizer: ChatTokenizer | None = None) -> str:
    del tokenizer  # same signature as every template
    return problem


def render_plain(problem: str, *, tokenizer: ChatTokenizer | None = None) -> str:
    del tokenizer
    return f"{problem.strip()}\n\n{BOXED_INSTRUCTION}"


def has_chat_template(tokenizer: object | None) -> bool:
    """Whether ``tokenizer`` can render chats (HF tokenizers without one carry ``chat_template=None``)."""
    return (
        tokenizer is not None
        and callable(getattr(tokenizer, "apply_chat_template", None))
        and getattr(tokenizer, "chat_template", "") is not None
    )


def render_chat(problem: str, *, tokenizer: ChatTokenizer | None = None) -> str:
    if not has_chat_template(tokenizer):
        return render_plain(problem)
    assert tokenizer is not None
    rendered = tokenizer.apply_chat_template(chat_messages(problem), tokenize=False, add_generation_prompt=True)
    if not isinstance(rendered, str):
        raise ValueError(
            f"chat template: {type(tokenizer).__name__}.apply_chat_template(tokenize=False) returned "
            f"{type(rendered).__name__}, expected str"
        )
    return rendered


TEMPLATES: dict[str, Template] = {"raw": render_raw, "plain": render_plain, "chat": render_chat}


def render_prompt(prompt: Prompt | str, *, template: str, tokenizer: ChatTokenizer | None = None) -> str:
    """Render a ``Prompt`` (or a problem string) with the template named ``template``."""
    if template not in TEMPLATES:
        raise ValueError(f"unknown prompt template {template!r}; known: {sorted(TEMPLATES)}")
    problem = prompt.problem if isinstance(prompt, Prompt) else prompt
    return TEMPLATES[template](problem, tokenizer=tokenizer)


def chat_messages(problem: str) -> list[dict[str, str]]:
    """The conversation the ``chat`` template renders: the ``plain`` text as one user turn."""
    return [{"role": "user", "content": render_plain(problem)}]


def prompt_token_ids(tokenizer, prompt: Prompt | str, *, template: str) -> list[int]:
    """A ``Prompt`` rendered with ``template`` and encoded exactly as every stage feeds the engine."""
    from pipeline.models.tokenizer import encode_chat, encode_prompt

    if template not in TEMPLATES:
        raise ValueError(f"unknown prompt template {template!r}; known: {sorted(TEMPLATES)}")
    if template == "chat" and has_chat_template(tokenizer):
        return encode_chat(tokenizer, chat_messages(prompt.problem if isinstance(prompt, Prompt) else prompt))
    return encode_prompt(tokenizer, render_prompt(prompt, template=template, tokenizer=tokenizer))
