"""The logit verification gate of ``winnow convert``: a converted checkpoint must compute what its source did.

The output is loaded back the way its consumer will load it (``transformers.
AutoModelForCausalLM`` without ``trust_remote_code``; megatron ``dist_checkpointing`` under
the recorded TP/PP layout) and its logits on a fixed seeded batch (``GATE_BATCH`` rows of
``GATE_SEQ_LEN`` tokens, no padding, explicit causal mask on the megatron side) are
compared with the source model's in fp32. A maximum absolute difference above ``atol``
(``GATE_ATOL`` = 1e-4) fails with a ``CheckpointError``.

A layout other than TP = PP = 1 is checked on ``tp x pp`` spawned gloo ranks
(``layout_logits``); this is the one module under ``pipeline/checkpoint/`` that brings up
process groups of its own. The batch is 2 x 64 tokens: its (B, T, V) fp32 logits are
2 x 64 x 152k x 4 B = 78 MB for a Qwen2.5 vocabulary, on each side of the comparison.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Iterator

import torch

from pipeline.checkpoint.artifact import load_weights
from pipeline.errors import CheckpointError
from pipeline.models.spec import ModelSpec
from pipeline.parallel.launch import RankFailure, run_ranks
from pipeline.parallel.rendezvous import reserved_port

__all__ = [
    "GATE_ATOL",
    "GATE_BATCH",
    "GATE_SEED",
    "GATE_SEQ_LEN",
    "build_unsplit_model",
    "first_lines",
    "gate_input_ids",
    "hf_logits",
    "layout_logits",
    "logit_diff",
    "megatron_logits",
]

GATE_ATOL = 1e-4
GATE_BATCH, GATE_SEQ_LEN, GATE_SEED = 2, 64, 1234


def build_unsplit_model(spec: ModelSpec, *, parallel_context: Any = None) -> torch.nn.Module:
    """megatron's local layer spec everywhere: its checkpoint keys equal TE's (``sharded_state_dict_keys_map``)."""
    from pipeline.models.factory import build_gpt_model
    from pipeline.models.layer_spec import select_layer_spec

    return build_gpt_model(
        spec, parallel_context=parallel_context, layer_spec=select_layer_spec(spec, prefer_te=False)
    ).eval()


def gate_input_ids(spec: ModelSpec) -> torch.Tensor:
    seq_len = min(GATE_SEQ_LEN, spec.max_position_embeddings)
    generator = torch.Generator().manual_seed(GATE_SEED)
    return torch.randint(0, spec.vocab_size, (GATE_BATCH, seq_len), generator=generator)  # (B, T)


def _megatron_inputs(input_ids: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, ...]:
    batch, seq_len = input_ids.shape
    position_ids = torch.arange(seq_len).expand(batch, seq_len)  # (B, T)
    # megatron's convention, True = masked. Explicit: without one megatron builds it on "cuda".
    causal_mask = torch.ones(1, 1, seq_len, seq_len, dtype=torch.bool).triu_(1)  # (1, 1, T, T)
    return input_ids.to(device), position_ids.to(device), causal_mask.to(device)


def megatron_logits(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """(B, T, V) fp32 logits of an unsplit (TP=1, PP=1) model."""
    device = next(model.parameters()).device
    with torch.no_grad():
        return model(*_megatron_inputs(input_ids, device)).float().cpu()


def hf_logits(folder: Path, input_ids: torch.Tensor) -> torch.Tensor:
    """(B, T, V) fp32 logits of the HF folder, loaded as its users will load it."""
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(
            folder, local_files_only=True, trust_remote_code=False, dtype=torch.float32, attn_implementation="eager"
        )
    except (OSError, ValueError, KeyError, RuntimeError) as error:
        raise CheckpointError(f"transformers cannot load {folder}: {first_lines(str(error))}") from error
    with torch.no_grad():
        return model.eval()(input_ids).logits.float()


def logit_diff(expected: torch.Tensor, actual: torch.Tensor, *, atol: float, what: str) -> float:
    """Max |expected - actual|; raises when above ``atol`` or not finite."""
    if expected.shape != actual.shape:
        raise CheckpointError(
            f"verification failed: {what}: logits of shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
        )
    if not torch.isfinite(expected).all():
        raise CheckpointError(f"verification failed: {what}: the source model's logits are not finite")
    diff = (expected - actual).abs()  # (B, T, V)
    worst = float(diff.max()) if torch.isfinite(diff).all() else float("inf")
    if not worst <= atol:
        b, t, v = (int(i) for i in torch.unravel_index(diff.nan_to_num(float("inf")).argmax(), diff.shape))
        raise CheckpointError(
            f"verification failed: {what}: max |logit diff| {worst:.4g} > tolerance {atol:g} "
            f"(row {b}, position {t}, token {v}); nothing was written"
        )
    return worst


def first_lines(text: str, num_lines: int = 3) -> str:
    """The first non-blank lines of an error text, joined on one line."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return " | ".join(lines[:num_lines]) + (" ..." if len(lines) > num_lines else "")


# ---------------------------------------------------------------- layout check on spawned ranks


def _layout_worker(
    rank: int,
    result_dir: str,
    world_size: int,
    tensor_parallel: int,
    pipeline_parallel: int,
    port: int,
    step_dir: str,
    spec_fields: dict[str, Any],
    input_ids: torch.Tensor,
) -> None:
    """One rank of the layout check: build its shard, load the checkpoint, run the pipeline forward.

    Positional parameters, as ``run_ranks`` passes them: ``rank``, ``result_dir``, then its ``args``.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from pipeline.parallel.context import ParallelContext

    # Ranks share the machine's cores: more threads per rank only adds contention.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    context = ParallelContext.initialize(
        tensor_parallel=tensor_parallel,
        pipeline_parallel=pipeline_parallel,
        seed=GATE_SEED,
        rank=rank,
        world_size=world_size,
        local_rank=rank,
        master_addr="127.0.0.1",
        master_port=port,
    )
    try:
        model = build_unsplit_model(ModelSpec(**spec_fields), parallel_context=context)
        load_weights(Path(step_dir), model)
        device = next(model.parameters()).device
        tokens, position_ids, causal_mask = _megatron_inputs(input_ids, device)
        collected: list[torch.Tensor] = []

        def forward_step(data_iterator: Iterator[torch.Tensor], stage_model: torch.nn.Module):
            output = stage_model(next(data_iterator), position_ids, causal_mask)

            def keep_logits(logits: torch.Tensor):
                collected.append(logits.float().cpu())  # (B, T, V / TP)
                return logits.sum() * 0.0, {}

            return output, keep_logits

        with torch.no_grad():
            get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iter([tokens]),
                model=[model],
                num_microbatches=1,
                seq_length=tokens.shape[1],
                micro_batch_size=tokens.shape[0],
                forward_only=True,
            )
        if context.is_pipeline_last:
            torch.save(collected[0], Path(result_dir) / f"logits_tp{context.tp_rank:04d}.pt")
    finally:
        context.destroy()


def layout_logits(
    step_dir: Path,
    *,
    spec: ModelSpec,
    input_ids: torch.Tensor,
    tensor_parallel: int,
    pipeline_parallel: int,
    timeout_s: float,
) -> torch.Tensor:
    """(B, T, V) logits of ``step_dir`` loaded on tp x pp spawned gloo ranks (vocab shards concatenated)."""
    world_size = tensor_parallel * pipeline_parallel
    where = f"TP={tensor_parallel}, PP={pipeline_parallel}"
    try:
        with reserved_port() as port, run_ranks(
            _layout_worker, args=(world_size, tensor_parallel, pipeline_parallel, port, str(step_dir), spec.to_dict(),
                                  input_ids),
            num_ranks=world_size, timeout_s=timeout_s, description=f"layout check under {where}",
        ) as result_dir:
            shards = sorted(result_dir.glob("logits_tp*.pt"))
            assert len(shards) == tensor_parallel, f"expected {tensor_parallel} logit shards, got {len(shards)}"
            return torch.cat([torch.load(path, weights_only=True) for path in shards], dim=-1)  # (B, T, V)
    except TimeoutError as error:
        raise CheckpointError(str(error)) from None
    except RankFailure as failure:
        print(failure.detail, file=sys.stderr, flush=True)  # the failing rank's traceback, for a bug report
        raise CheckpointError(
            f"loading the checkpoint under {where} failed on {failure.rank_name}: {first_lines(failure.detail, 1)}"
        ) from None
