"""A small BPE tokenizer trained on the task corpus, saved as Hugging Face tokenizer files.

Used by the bootstrap stage to build the CPU demo's policy from nothing. Digits are
always single tokens (``Digits(individual_digits=True)``): merged digit strings
would make arithmetic a lookup over thousands of unrelated tokens. Words and LaTeX
pieces (``\\boxed{``) merge as usual. The result loads with
``transformers.AutoTokenizer.from_pretrained(dir, local_files_only=True)``.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

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
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK
    )


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


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Prompt token ids as the policy sees them at training and generation time: ``[bos] + text``."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return [tokenizer.bos_token_id, *ids] if tokenizer.bos_token_id is not None else ids

