"""The bootstrap tokenizer: digits stay single tokens, reserved tokens pad the vocabulary."""

from __future__ import annotations

from pipeline.models.tokenizer import load_tokenizer, save_tokenizer, train_tokenizer

CORPUS = ["What is 12 + 7? 12 + 7 = 19. \\boxed{19}", "What is 3 * 45? 3 * 45 = 135. \\boxed{135}"] * 20


def test_reserved_tokens_pad_the_vocabulary_without_changing_any_encoding(tmp_path):
    plain = train_tokenizer(CORPUS, vocab_size=320)
    padded = train_tokenizer(CORPUS, vocab_size=320, pad_to_multiple_of=64)
    assert len(plain) % 64 != 0  # the corpus stops BPE short of 320, at no multiple of 64
    assert len(padded) % 64 == 0 and len(padded) - len(plain) < 64
    reserved = [padded.convert_ids_to_tokens(i) for i in range(len(plain), len(padded))]
    assert reserved == [f"<reserved_{i}>" for i in range(len(padded) - len(plain))]
    for text in [*CORPUS[:2], "What is 98 - 76?"]:
        assert padded.encode(text) == plain.encode(text)
    # A sampled reserved id decodes to nothing, like the other special tokens.
    ids = padded.encode("12 + 7 = 19", add_special_tokens=False)
    assert padded.decode([*ids, len(padded) - 1], skip_special_tokens=True) == padded.decode(ids)
    reloaded = load_tokenizer(save_tokenizer(padded, tmp_path / "tok"))
    assert len(reloaded) == len(padded) and reloaded.encode(CORPUS[0]) == padded.encode(CORPUS[0])


def test_digits_are_single_tokens():
    tokenizer = train_tokenizer(CORPUS, vocab_size=320, pad_to_multiple_of=64)
    tokens = tokenizer.convert_ids_to_tokens(tokenizer.encode("135", add_special_tokens=False))
    assert [t.lstrip("▁") for t in tokens if t.lstrip("▁")] == ["1", "3", "5"]
