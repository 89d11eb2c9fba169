"""A small BPE tokenizer trained on the task corpus, saved as Hugging Face tokenizer files.

Used by the bootstrap stage to build the CPU demo's policy from nothing. Digits are
always single tokens (``Digits(individual_digits=True)``): merged digit strings
would make arithmetic a lookup over thousands of unrelated tokens. Words and LaTeX
pieces (``\\boxed{``) merge as usual. The result loads with
``transformers.AutoTokenizer.from_pretrained(dir, local_files_only=True)``.

Its post-processor prepends ``<bos>`` (as Llama 3's does), so ``add_special_tokens=True``
gives ``[bos] + text``: the ids the demo's policy has always been trained and sampled on.

The module also holds the two rules every stage shares for any tokenizer, demo or
downloaded: ``encode_text`` (a prompt's ids by the tokenizer's own special-token
settings, never with two leading BOS tokens) and ``stop_token_ids`` (the model's
``generation_config.json`` EOS ids plus the tokenizer's EOS).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)


def train_tokenizer(texts: Iterable[str], *, vocab_size: int, pad_to_multiple_of: int = 1):
    """A ``PreTrainedTokenizerFast`` with BPE merges learned from ``texts``.

    A small corpus stops BPE well short of ``vocab_size`` (the arithmetic corpus has 59
    tokens), so the length is whatever the corpus gives; ``pad_to_multiple_of`` then appends
    reserved special tokens (``<reserved_0>``, …; never in the data, so training drives their
    logits down, and decoding with ``skip_special_tokens`` drops them) until the vocabulary
    splits evenly over tensor-parallel ranks, as Llama 3's reserved tokens do.
    """
    from transformers import PreTrainedTokenizerFast

    if vocab_size < len(SPECIAL_TOKENS) + 10:
        raise ValueError(f"vocab_size must be ≥ {len(SPECIAL_TOKENS) + 10}, got {vocab_size}")
    tokenizer = Tokenizer(models.BPE(unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Metaspace(), pre_tokenizers.Digits(individual_digits=True)]
    )
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=list("0123456789+-*/=().,;?{}\\ "),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    reserved = -tokenizer.get_vocab_size() % pad_to_multiple_of
    if reserved:
        tokenizer.add_special_tokens([f"<reserved_{index}>" for index in range(reserved)])
    tokenizer.post_processor = bos_post_processor(tokenizer.token_to_id(BOS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK
    )


def bos_post_processor(bos_id: int) -> processors.TemplateProcessing:
    """``<bos>`` before every sequence when special tokens are added (a pair gets one before each part)."""
    return processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B:1",
                                         special_tokens=[(BOS, bos_id)])


def save_tokenizer(tokenizer, directory: str | Path) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(directory))
    return directory


def load_tokenizer(directory: str | Path):
    """Load saved tokenizer files; never runs remote code."""
    from transformers import AutoTokenizer

    path = Path(directory)
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{path / 'tokenizer.json'} does not exist")
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)


def drop_repeated_bos(tokenizer, ids: list[int]) -> list[int]:
    """``ids`` without the extra copies of a BOS token repeated at the start (``[bos, bos, …]`` → ``[bos, …]``)."""
    bos = tokenizer.bos_token_id
    start = 0
    while bos is not None and start + 1 < len(ids) and ids[start] == bos and ids[start + 1] == bos:
        start += 1
    return ids[start:]


def encode_text(tokenizer, text: str) -> list[int]:
    """A prompt's ids by the tokenizer's own convention: ``add_special_tokens=True``.

    Each tokenizer knows whether its model starts a sequence with BOS: Llama 3's (and the
    demo's) post-processor prepends it, Qwen2.5's adds nothing. Text that already starts
    with the BOS string (a chat template rendered to text) would then start with it twice;
    the repeat is dropped, so a prompt never starts with two BOS tokens.
    """
    return drop_repeated_bos(tokenizer, list(tokenizer(text, add_special_tokens=True)["input_ids"]))


def encode_chat(tokenizer, messages: Sequence[dict[str, str]]) -> list[int]:
    """The ids of ``tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)``.

    The template writes the model's start tokens itself (``transformers`` tokenizes its
    text without adding special tokens), so these are exactly the ids the model was tuned on.
    """
    encoded = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
    ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded  # transformers 5 returns a BatchEncoding
    if ids and isinstance(ids[0], list):
        ids = ids[0]
    return drop_repeated_bos(tokenizer, [int(i) for i in ids])


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Prompt token ids of a rendered text as the policy sees them at training and generation time.

    For the demo's tokenizer: ``[bos] + text``. See ``encode_text``.
    """
    return encode_text(tokenizer, text)


GENERATION_CONFIG_FILE = "generation_config.json"


def _ids(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def generation_config_eos_ids(folder: str | Path | None) -> list[int]:
    """``eos_token_id`` of ``folder/generation_config.json`` (an int or a list; Llama-3.1- and
    Qwen2.5-Instruct ship lists), else of ``folder/config.json``; empty when neither names one."""
    if folder is None:
        return []
    for name in (GENERATION_CONFIG_FILE, "config.json"):
        path = Path(folder) / name
        if path.is_file():
            value = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
            if value is not None:
                return _ids(value)
    return []


def stop_token_ids(tokenizer, *, folders: Sequence[str | Path | None] = (), generation_config=None) -> tuple[int, ...]:
    """Every id generation stops at: the model's EOS ids and the tokenizer's EOS, sorted.

    The model's ids come from ``generation_config`` (a ``transformers.GenerationConfig`` or
    anything with ``eos_token_id``) when given, and from the ``generation_config.json`` of each
    of ``folders`` (an HF folder; a converted checkpoint's ``tokenizer/``, where conversion
    copies it). A model whose tokenizer names one EOS but whose chat turns end with another
    (Llama-3.1-Instruct: ``<|eot_id|>``, ``<|eom_id|>`` and ``<|end_of_text|>``) stops at all.
    """
    ids = set(_ids(getattr(generation_config, "eos_token_id", None)))
    for folder in folders:
        ids.update(generation_config_eos_ids(folder))
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return tuple(sorted(ids))


def pad_token_id(tokenizer) -> int:
    """The id to pad batches with: the tokenizer's pad, else its EOS (Llama 3 has no pad token), else 0."""
    for value in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if value is not None:
            return int(value)
    return 0
