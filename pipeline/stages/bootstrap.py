"""`winnow bootstrap`: a base policy from nothing, for the CPU demo and the tests.

RL needs a policy whose pass rate is clearly above zero and far from solved. This
stage trains a BPE tokenizer on worked synthetic problems (``arith`` by default:
answers in ``\\boxed{}``), then supervises a small Llama-style Megatron actor on
them with the actor's own cross-entropy step. Results are cached under
``<cache_dir>/<hash of the resolved config>/`` and reused by any later run with the
same config:

    tokenizer/            Hugging Face tokenizer files
    checkpoints/          our checkpoint format (``pipeline/checkpoint/manager.py``)
    metrics.jsonl         per-step loss, learning rate, tokens/s
    summary.json          written last: the cache entry is complete only with it

Users with GPUs start from a converted Hugging Face checkpoint instead
(``winnow convert hf-to-megatron``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline import configlib
from pipeline.config import BootstrapConfig
from pipeline.data import Prompt, load_prompts, render_prompt
from pipeline.io import resolve_cache_dir

logger = logging.getLogger(__name__)

TEMPLATE = "raw"  # the tiny policy sees the bare problem; the solution ends in \boxed{}


@dataclass(frozen=True, slots=True)
class BootstrapResult:
    directory: Path
    tokenizer_dir: Path
    checkpoint_dir: Path
    cached: bool
    summary: dict


# Trainer options that change speed, memory or failure handling but not what is learned:
# a cached policy stays valid when they change.
_UNHASHED_TRAINER_OPTIONS = ("logprob_chunk_size", "logprob_buffer_mib", "old_logprobs", "max_skipped_steps")


# What a cache entry holds beyond the config: 2 = the tokenizer's post-processor prepends
# <bos> (``encode_prompt`` adds special tokens by the tokenizer's own settings). Entries of
# format 1 hold a tokenizer without it, whose prompts would lose their <bos>; a new key
# retrains them instead of reusing them. Training is deterministic and the training ids
# are the same, so the retrained policy equals the old one.
CACHE_FORMAT = 2


def config_hash(cfg: BootstrapConfig) -> str:
    data = configlib.to_dict(cfg)
    data.pop("cache_dir")
    data.pop("progress")
    for name in _UNHASHED_TRAINER_OPTIONS:
        data["trainer"].pop(name)
    data["cache_format"] = CACHE_FORMAT
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def load_training_prompts(cfg: BootstrapConfig) -> list[Prompt]:
    prompts: list[Prompt] = []
    for spec in cfg.sources:
        loaded, _ = load_prompts(spec, split="train", seed=cfg.seed)
        missing = [p.id for p in loaded if not p.metadata.get("solution")]
        if missing:
            raise ValueError(f"bootstrap.sources: {spec} has prompts without a worked solution (e.g. {missing[0]})")
        prompts.extend(loaded)
    return prompts


def encode_example(tokenizer, prompt_text: str, response_text: str) -> tuple[list[int], int]:
    """Token ids ``[bos] prompt response [eos]`` and the index where the response starts.

    ``[bos] prompt`` is ``encode_prompt``'s (the demo tokenizer's post-processor adds the BOS).

    Prompt and response are encoded separately, exactly as at generation time (the
    engine continues from ``encode_prompt``'s ids), so training and sampling see the
    same token boundaries.
    """
    from pipeline.models.tokenizer import encode_prompt

    prompt_ids = encode_prompt(tokenizer, prompt_text)
    response_ids = tokenizer.encode(" " + response_text, add_special_tokens=False)
    return [*prompt_ids, *response_ids, tokenizer.eos_token_id], len(prompt_ids)


def make_batch(examples: list[tuple[list[int], int]], *, pad_id: int):
    from pipeline.trainer.batch import TrainBatch

    length = max(len(ids) for ids, _ in examples)
    tokens = torch.full((len(examples), length), pad_id, dtype=torch.long)  # (B, T)
    response_mask = torch.zeros((len(examples), length), dtype=torch.bool)  # (B, T)
    for row, (ids, start) in enumerate(examples):
        tokens[row, : len(ids)] = torch.tensor(ids)
        response_mask[row, start : len(ids)] = True
    return TrainBatch(tokens=tokens, response_mask=response_mask)


def run_bootstrap(cfg: BootstrapConfig, *, context=None) -> BootstrapResult:
    """Train (or reuse from the cache) the tokenizer and base policy described by ``cfg``."""
    from tqdm import tqdm

    from pipeline.metrics import MetricsWriter
    from pipeline.models.spec import ModelSpec
    from pipeline.models.tokenizer import save_tokenizer, train_tokenizer
    from pipeline.parallel.rendezvous import initialize_process_context
    from pipeline.trainer.actor import Actor
    from pipeline.checkpoint.manager import CheckpointManager
    from pipeline.trainer.losses import CrossEntropyLoss

    directory = resolve_cache_dir(cfg.cache_dir) / config_hash(cfg)  # relative: under the one cache root
    summary_path = directory / "summary.json"
    if summary_path.is_file():
        return BootstrapResult(directory, directory / "tokenizer", directory / "checkpoints", True,
                               json.loads(summary_path.read_text()))
    started = time.perf_counter()
    directory.mkdir(parents=True, exist_ok=True)
    configlib.save_resolved(cfg, directory)

    prompts = load_training_prompts(cfg)
    texts = [render_prompt(p, template=TEMPLATE) + " " + p.metadata["solution"] for p in prompts]
    tokenizer = train_tokenizer(texts, vocab_size=cfg.vocab_size, pad_to_multiple_of=cfg.vocab_multiple)
    tokenizer_dir = save_tokenizer(tokenizer, directory / "tokenizer")
    examples = [encode_example(tokenizer, render_prompt(p, template=TEMPLATE), p.metadata["solution"]) for p in prompts]
    longest = max(len(ids) for ids, _ in examples)
    if longest > cfg.model.max_position_embeddings:
        raise ValueError(
            f"bootstrap.model.max_position_embeddings: {cfg.model.max_position_embeddings} is shorter than the "
            f"longest training example ({longest} tokens)"
        )

    if context is None:
        context = initialize_process_context(seed=cfg.seed)
    spec = ModelSpec.from_model_config(cfg.model, vocab_size=len(tokenizer))
    actor = Actor(spec=spec, context=context, trainer=cfg.trainer, optim=cfg.optim, seed=cfg.seed)
    loss = CrossEntropyLoss()
    writer = MetricsWriter(directory)
    order_generator = torch.Generator().manual_seed(cfg.seed)
    order: list[int] = []
    num_tokens = 0
    bar = tqdm(range(cfg.optim.total_steps), desc="bootstrap SFT", disable=not cfg.progress, unit="step")
    for step in bar:
        if len(order) < cfg.batch_size:  # a new epoch, in a seeded order
            order += torch.randperm(len(examples), generator=order_generator).tolist()
        rows, order = order[: cfg.batch_size], order[cfg.batch_size:]
        batch = make_batch([examples[i] for i in rows], pad_id=tokenizer.pad_token_id)
        result = actor.train_step(batch, loss)
        num_tokens += int(batch.response_mask.sum())
        elapsed = time.perf_counter() - started
        writer.log(step, {"loss": result.loss, "grad_norm": result.grad_norm, "lr": result.learning_rate,
                          "skipped": result.skipped, "tokens_per_s": num_tokens / elapsed})
        bar.set_postfix(loss=f"{result.loss:.3f}", tok_s=f"{num_tokens / elapsed:,.0f}")
    writer.close()

    manager = CheckpointManager(directory / "checkpoints", keep_last=1, rank=context.rank, world_size=context.world_size)
    manager.save(cfg.optim.total_steps, actor=actor, metadata={"tokenizer": "../../tokenizer"})
    summary = {
        "num_parameters": sum(p.numel() for p in actor.module.parameters()),
        "num_examples": len(examples),
        "vocab_size": len(tokenizer),
        "final_loss": result.loss,
        "trained_tokens": num_tokens,
        "seconds": time.perf_counter() - started,
        "model_spec": spec.to_dict(),
    }
    if context.rank == 0:
        summary_path.write_text(json.dumps(summary, indent=1))
    return BootstrapResult(directory, tokenizer_dir, directory / "checkpoints", False, summary)

