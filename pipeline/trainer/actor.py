"""The Megatron actor: a GPTModel with megatron's DDP, optimizer and schedules, plus what RL needs.

This module and ``pipeline/parallel/`` are the only places that touch
megatron's distributed machinery. Loss code (``pipeline/trainer/losses.py``,
``pipeline/algorithms/``) receives tensors and a global normalizer, never a
process group.

Log-probs never go through megatron's logits: the output layer of the last
pipeline stage is turned into a pass-through (its weight stays where megatron
keeps it, so checkpoints and tied embeddings are untouched), and the chunked
vocab-parallel head of :mod:`pipeline.algorithms.logprobs` computes log-probs
and entropies from the final hidden states with a TP reducer, so the
(tokens, vocab) float32 tensor never exists.

Normalization across micro-batches and data-parallel ranks: each loss is
``sum over this micro-batch / global denominator`` (the denominator summed over
every micro-batch of every DP rank), so summing the micro-batch losses gives the
full-batch loss. megatron's schedule divides by the number of micro-batches only
for two-tuple loss returns, so we return three-tuples with
``calculate_per_token_loss=True``. In that mode megatron's DDP *sums* gradients over
DP ranks (its ``gradient_scaling_factor`` is 1, not 1/DP), which is exactly what a
globally normalised loss needs: each rank trains its own rows (``data_parallel_share``)
and the sum of the ranks' gradients is the full batch's.

Devices: batches arrive on the CPU (rollouts, advantages) and every micro-batch, its
positions and causal mask, and every tensor handed to a collective are placed on
``context.device``; the collectives themselves live in ``ParallelContext`` and check
that device (``pipeline.parallel.reducers``), so a CPU run exercises the same checks a
GPU run needs. Results return on the batch's device. On the CPU all moves are no-ops.

FP8: Transformer Engine's FP8 GEMMs need the flattened token count of a micro-batch
to be a multiple of 16 (``FP8Options.token_multiple``); micro-batches are then
right-padded with fully masked positions (``pad_to_token_multiple``), which causal
attention keeps invisible to the real tokens. Without FP8 nothing is padded.
"""

from __future__ import annotations

import logging
import math
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region

from pipeline.algorithms.logprobs import token_logprobs_and_entropy
from pipeline.config import OptimConfig, TrainerConfig
from pipeline.models.factory import build_gpt_model
from pipeline.models.layer_spec import FP8Options, select_layer_spec
from pipeline.models.layout import shard_full_state_dict
from pipeline.models.spec import ModelSpec
from pipeline.parallel.context import ParallelContext
from pipeline.trainer.batch import (
    TrainBatch,
    balance_rows,
    pad_to_token_multiple,
    plan_micro_batches,
    without_targets,
)
from pipeline.trainer.schedule import LearningRateSchedule

logger = logging.getLogger(__name__)


class TokenLoss(Protocol):
    """A loss over the response tokens of a micro-batch (see ``pipeline/trainer/losses.py``)."""

    def denominator(self, micro: TrainBatch) -> torch.Tensor: ...

    def __call__(
        self, *, logprobs: torch.Tensor, entropy: torch.Tensor | None, micro: TrainBatch, normalizer: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, Any]]: ...


@dataclass(slots=True)
class StepResult:
    loss: float
    grad_norm: float
    skipped: bool
    learning_rate: float
    num_micro_batches: int
    metrics: dict[str, float]


def _pass_through_output_layer(output_layer: torch.nn.Module) -> None:
    """Make megatron's output layer return its input; the weight stays registered."""

    def forward(self, input_, weight=None, runtime_gather_output=None):  # noqa: ARG001
        return input_, None

    output_layer.forward = types.MethodType(forward, output_layer)


def _finalize_grads_without_token_scaling(models, num_tokens=None, **kwargs):
    """megatron's finalize (DP all-reduce, tied-embedding sync) minus its division by the
    token count: our losses are already divided by the global normalizer."""
    del num_tokens
    return finalize_model_grads(models, None, **kwargs)


# trainer.recompute → megatron's own TransformerConfig options (Korthikanti et al., "Reducing
# Activation Recomputation in Large Transformer Models", §4-5). Per layer and micro-batch at 16-bit
# with TP t: none keeps s·b·h·(34/t + 5·a·s/(h·t)) bytes; selective recomputes core attention and
# drops the 5·a·s/h term (the s² scores; flash attention never stores them anyway); full keeps
# only the layer input, 2·s·b·h bytes, for one extra forward of every layer in the backward.
RECOMPUTE_OPTIONS: dict[str, dict[str, Any]] = {
    "none": {},
    "selective": {"recompute_granularity": "selective"},
    "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
}


def _causal_mask(length: int, *, device: torch.device | None = None) -> torch.Tensor:
    # megatron's convention: True = masked. Always explicit: without one megatron
    # builds its causal mask on device="cuda".
    return torch.ones(1, 1, length, length, dtype=torch.bool, device=device).triu_(1)


def model_inputs(micro: TrainBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(tokens (B, T), positions (B, T), causal mask (1, 1, T, T))`` on the micro-batch's device."""
    length = micro.tokens.shape[1]
    device = micro.tokens.device
    positions = torch.arange(length, device=device).unsqueeze(0).expand(micro.batch_size, -1)
    return micro.tokens, positions, _causal_mask(length, device=device)


class Actor:
    """A policy on this rank's TP/PP shard: trainable, or frozen when ``optim`` is None.

    A frozen actor (the reference policy of the KL term) has no DDP wrapper, gradient
    buffers or optimizer state, only the model and the log-prob head.
    """

    def __init__(self, *, spec: ModelSpec, context: ParallelContext, trainer: TrainerConfig,
                 optim: OptimConfig | None, seed: int):
        self.spec = spec
        self.context = context
        self.trainer = trainer
        self.optim = optim
        self.device = context.device
        fp8 = FP8Options(enabled=True, recipe=trainer.fp8) if trainer.fp8 != "off" else None
        self.token_multiple = fp8.token_multiple if fp8 is not None else 1
        # TE's layers run on the GPU only: a context that computes on the CPU (gloo, also on a
        # CUDA machine) takes the local spec even where TE is installed.
        if fp8 is not None and self.device.type != "cuda":
            raise ValueError(f"trainer.fp8={trainer.fp8}: FP8 needs Transformer Engine and CUDA; this rank "
                             f"computes on the {self.device.type} (backend gloo or no GPU)")
        layer_spec, self.layer_spec_choice = select_layer_spec(spec, fp8=fp8, prefer_te=self.device.type == "cuda")
        bf16 = trainer.precision == "bf16"
        model = build_gpt_model(
            spec, parallel_context=context, seed=seed, layer_spec=(layer_spec, self.layer_spec_choice),
            params_dtype=torch.bfloat16 if bf16 else torch.float32, fp8=fp8,
            config_overrides=RECOMPUTE_OPTIONS[trainer.recompute],
        )
        logger.info("actor layer spec: %s (%s)", self.layer_spec_choice.name, self.layer_spec_choice.reason)
        if context.is_pipeline_last:
            _pass_through_output_layer(model.output_layer)
        self.num_skipped_steps = 0
        self._forward_backward = get_forward_backward_func()
        if optim is None:
            model.requires_grad_(False)
            self.model, self.optimizer, self.schedule = model.eval(), None, None
            return
        # Grad sync and the tied-embedding all-reduce happen once per step in finalize.
        model.config.finalize_model_grads_func = _finalize_grads_without_token_scaling
        model.config.calculate_per_token_loss = True
        self.distributed_optimizer = (context.data_parallel > 1 if trainer.distributed_optimizer is None
                                      else trainer.distributed_optimizer)
        self.model = DistributedDataParallel(
            model.config,
            DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                          use_distributed_optimizer=self.distributed_optimizer),
            model,
        )
        # Without TE or Apex this is torch's AdamW in its default (per-parameter) implementation. Its fused
        # kernel is the same update to float rounding and ~20 ms faster per step on the 21M bench model, but
        # the demo bootstrap's outcome is chaotic in rounding: with the fused kernel the same config and seed
        # gave held-out pass@1 0.18 instead of 0.48 (docs/benchmarks.md), so the kernel stays the one every
        # published number was produced with.
        self.optimizer = get_megatron_optimizer(
            MegatronOptimizerConfig(
                optimizer="adam",
                lr=optim.lr,
                weight_decay=optim.weight_decay,
                adam_beta1=optim.beta1,
                adam_beta2=optim.beta2,
                adam_eps=optim.eps,
                clip_grad=optim.clip_grad,
                bf16=bf16,  # megatron then keeps fp32 master weights in the optimizer
                fp16=False,
                use_distributed_optimizer=self.distributed_optimizer,
            ),
            [self.model],
        )
        self.schedule = LearningRateSchedule(optim)

    @property
    def trainable(self) -> bool:
        return self.optimizer is not None

    def finish_optimizer_load(self) -> None:
        """Restore each parameter's Adam ``step`` after a distributed-optimizer load, one tensor each.

        Why: without Apex or TE, megatron-core 0.16.1 saves the step in the optimizer's param
        groups, and on load (a) writes it into every parameter's state as *one shared* tensor,
        which torch's Adam then increments in place once per parameter per step, and (b) copies
        the per-parameter state over it from the loading template, whose step is the
        placeholder's (``prepare_optimizer_state``). Either way Adam's bias correction is
        wrong from the first update after a resume; the group's loaded step is the true one.
        """
        if not self.distributed_optimizer:
            return
        for inner in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            for group in inner.optimizer.param_groups:
                if group.get("step") is None:
                    continue
                for param in group["params"]:
                    state = inner.optimizer.state[param]
                    if "step" in state:
                        state["step"] = torch.tensor(float(group["step"]), dtype=state["step"].dtype,
                                                     device=state["step"].device)

    def prepare_optimizer_state(self) -> None:
        """Give a never-stepped distributed optimizer the Adam state a checkpoint save or load needs.

        Why: megatron-core 0.16.1's ``DistributedOptimizer.state_dict()`` reads every parameter's
        ``step`` from torch's Adam state (without Apex or TE, i.e. on CPU and in plain pip GPU
        installs), and both saving and loading go through it — but torch's Adam creates that
        state lazily, at its first step, so a fresh optimizer asserts (``len(steps) == 1``).
        One step at learning rate 0 on zero gradients creates it, and resetting ``step`` to 0
        leaves exactly the state Adam would start from: zero moments, no step taken, weights
        untouched (decoupled weight decay is scaled by the learning rate). A no-op for an
        optimizer that has stepped, and for the regular optimizer, which needs no such state.
        """
        if not self.distributed_optimizer:
            return
        for inner in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            adam = inner.optimizer
            if all(len(adam.state[p]) for group in adam.param_groups for p in group["params"]):
                continue
            with torch.no_grad():  # the fp32 shards are views of the model's parameters
                learning_rates = [group["lr"] for group in adam.param_groups]
                for group in adam.param_groups:
                    group["lr"] = 0.0
                    for param in group["params"]:
                        param.grad = torch.zeros_like(param)
                adam.step()
                adam.zero_grad()
                for group, learning_rate in zip(adam.param_groups, learning_rates):
                    group["lr"] = learning_rate
                for state in adam.state.values():
                    if "step" in state:
                        state["step"] = torch.zeros_like(state["step"])

    # ------------------------------------------------------------------ helpers
    @property
    def module(self):
        return self.model.module if self.trainable else self.model

    def _output_weight(self) -> torch.Tensor:
        module = self.module
        if module.share_embeddings_and_output_weights:
            return module.shared_embedding_or_output_weight()
        return module.output_layer.weight

    def _head(self, hidden: torch.Tensor, tokens: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Token-aligned (B, T) log-probs and entropies from final hidden states (B, T, H)."""
        if self.module.config.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(hidden.transpose(0, 1)).transpose(0, 1)
        # Identity forward, TP all-reduce of the hidden-state gradient in backward:
        # what megatron's ColumnParallelLinear output layer would have done.
        hidden = copy_to_tensor_model_parallel_region(hidden[:, :-1])  # (B, T-1, H)
        batch, steps, width = hidden.shape
        weight = self._output_weight()
        vocab_start, _ = self.context.vocab_range(self.spec.vocab_size)
        result = token_logprobs_and_entropy(
            hidden=hidden.reshape(batch * steps, width),
            output_weight=weight,
            targets=tokens[:, 1:].reshape(-1),
            temperature=temperature,
            chunk_size=self._logprob_chunk_size(weight.shape[0]),
            vocab_start=vocab_start,
            reducer=self.context.tp_vocab_reducer(),
        )
        pad = hidden.new_zeros(batch, 1, dtype=result.logprobs.dtype)
        logprobs = torch.cat([pad, result.logprobs.view(batch, steps)], dim=1)  # (B, T)
        entropy = torch.cat([pad, result.entropy.view(batch, steps)], dim=1)  # (B, T)
        return logprobs, entropy

    def _logprob_chunk_size(self, vocab_local: int) -> int:
        """The configured chunk, or as many tokens as ``logprob_buffer_mib`` of float32 logits hold."""
        if self.trainer.logprob_chunk_size is not None:
            return self.trainer.logprob_chunk_size
        return max(2, self.trainer.logprob_buffer_mib * 2**20 // (4 * vocab_local))

    def _micro_batches(self, batch: TrainBatch, *, only: list[int] | None = None) -> tuple[list[TrainBatch], int, int]:
        """Split by token count; with pipeline stages, every micro-batch has one shape.

        ``only`` keeps those micro-batches of the split (by position), each built exactly as
        in the full split: same rows, same padded length.
        """
        lengths = batch.seq_lengths
        if self.context.pipeline_parallel == 1:
            plans = plan_micro_batches(lengths, max_tokens=self.trainer.micro_batch_tokens)
            plans = plans if only is None else [plans[i] for i in only]
            micros = [self._place(batch.select(rows, length=int(lengths[rows].max()))) for rows in plans]
            return micros, micros[0].tokens.shape[1], micros[0].batch_size
        # p2p buffers are allocated from (seq_length, micro_batch_size): pad to the batch's
        # longest sequence and fill the last micro-batch with fully masked rows.
        length = int(lengths.max())
        rows = max(1, self.trainer.micro_batch_tokens // length)
        num_micro = math.ceil(batch.batch_size / rows)
        padded = _pad_rows(batch, num_micro * rows)
        micros = [self._place(padded.select(torch.arange(i * rows, (i + 1) * rows), length=length))
                  for i in (range(num_micro) if only is None else only)]
        return micros, micros[0].tokens.shape[1], rows

    def _place(self, micro: TrainBatch) -> TrainBatch:
        """A micro-batch as the model consumes it: FP8-aligned (a no-op without FP8), on this rank's device."""
        return pad_to_token_multiple(micro, multiple=self.token_multiple).to(self.device)

    def _run(self, batch: TrainBatch, *, loss: TokenLoss | None, temperature: float, forward_only: bool,
             only: list[int] | None = None):
        micros, seq_length, micro_rows = self._micro_batches(batch, only=only)
        normalizer = None
        if loss is not None:
            local = torch.stack([loss.denominator(m) for m in micros]).sum()
            normalizer = self.context.dp_sum(local.to(torch.float64))  # on the device: micros are there
        collected: list[tuple[torch.Tensor, torch.Tensor]] = []

        def forward_step(data_iterator: Iterator[TrainBatch], model):
            micro = next(data_iterator)
            output = model(*model_inputs(micro))
            one = torch.tensor(1, dtype=torch.int, device=micro.tokens.device)

            def loss_func(hidden: torch.Tensor):
                logprobs, entropy = self._head(hidden, micro.tokens, temperature)
                if loss is None:
                    collected.append((logprobs.detach(), entropy.detach()))
                    zero = logprobs.sum() * 0.0
                    return zero, one, {}
                value, metrics = loss(logprobs=logprobs, entropy=entropy, micro=micro, normalizer=normalizer)
                reported = {k: (v.detach() if torch.is_tensor(v) else torch.tensor(float(v))) for k, v in metrics.items()}
                reported["loss"] = value.detach()
                return value, one, reported

            return output, loss_func

        outputs = self._forward_backward(
            forward_step_func=forward_step,
            data_iterator=iter(micros),
            model=[self.model],
            num_microbatches=len(micros),
            seq_length=seq_length,
            micro_batch_size=micro_rows,
            forward_only=forward_only,
        )
        return micros, outputs, collected

    # ------------------------------------------------------------------ public API
    def checkpoint_metadata(self) -> dict[str, Any]:
        """What a checkpoint must record to be rebuilt and converted without the run's config."""
        return {
            "model_spec": self.spec.to_dict(),
            "layer_spec": self.layer_spec_choice.to_dict(),
            "layout": {"tensor_parallel": self.context.tensor_parallel,
                       "pipeline_parallel": self.context.pipeline_parallel,
                       "data_parallel": self.context.data_parallel},
        }

    def load_full_state_dict(self, full_state_dict: dict[str, torch.Tensor]) -> None:
        """Load unsplit (TP=1, PP=1) megatron weights; this rank keeps its own shard."""
        local = shard_full_state_dict(
            self.module, full_state_dict, tp_rank=self.context.tp_rank, tp_size=self.context.tensor_parallel
        )
        self.module.load_state_dict(local, strict=True)

    def compute_logprobs(self, batch: TrainBatch, *, temperature: float = 1.0) -> torch.Tensor:
        """(B, T) token-aligned log-probs of the response tokens under the current weights.

        Available on every pipeline stage; positions outside ``response_mask`` hold 0.
        """
        return self.compute_token_stats(batch, temperature=temperature)[0]

    def compute_token_stats(self, batch: TrainBatch, *, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T) log-probs and entropies of the response tokens (0 elsewhere), on every rank.

        The batch is split into micro-batches exactly as one rank would split it, and each
        data-parallel rank runs only its share of them (``data_parallel_micro_batches``); a
        sum over the DP group, in which every element has one non-zero contributor, then
        gives every rank the whole batch's values. Each value is therefore bit-identical to
        the one a single rank computes for the whole batch, and a step's π_old and reference
        passes cost each rank 1/DP of the batch instead of all of it.

        Why micro-batches of the whole batch, not the rows ``data_parallel_share`` trains: a
        row's log-prob depends in its last bits on the rows it shares a micro-batch with
        (GEMM blocking changes with the micro-batch's shape; 5e-7 measured on CPU), so
        scoring the training shares would change the values; and the RL step reads every
        row's statistics on every rank (token weights, the rollout mismatch, the entropy
        metric). Memory: the ``(2, B, T)`` float32 result, as before; communication: one
        all-reduce of it over the DP group per call, 2 x 512 x 8,192 x 4 B = 32 MiB for a
        7B step of 512 rows of 8,192 tokens on 2 x 8 H100.
        """
        plans = self._micro_rows(batch)
        mine = self.data_parallel_micro_batches(batch)
        length = batch.tokens.shape[1]
        stats = torch.zeros((2, batch.batch_size, length), dtype=torch.float32, device=self.device)  # (2, B, T)
        if mine:  # every rank of a model replica (TP, PP) has the same share, so all skip together
            self.model.eval()
            with torch.no_grad():
                _, _, collected = self._run(batch, loss=None, temperature=temperature, forward_only=True, only=mine)
            self.model.train(self.trainable)
            if self.context.is_pipeline_last:
                for index, (logprobs, entropy) in zip(mine, collected):
                    rows = plans[index]
                    width = min(logprobs.shape[1], length)  # FP8 padding may run past the batch
                    stats[0, rows, :width] = logprobs[: len(rows), :width].float()
                    stats[1, rows, :width] = entropy[: len(rows), :width].float()
        if self.context.is_pipeline_last:
            stats = torch.where(batch.response_mask.to(self.device), stats, 0.0)
        stats = self.context.broadcast_from_last_stage(stats)
        if self.context.data_parallel > 1:
            stats = self.context.dp_sum(stats)
        stats = stats.to(batch.tokens.device)
        return stats[0], stats[1]

    def data_parallel_micro_batches(self, batch: TrainBatch) -> list[int]:
        """Positions of the micro-batches (of the one-rank split of ``batch``) this DP rank scores.

        Balanced by padded token count with the rows' own rule (``balance_rows``, LPT), from the
        batch alone, so the ranks of one replica agree without communicating. A rank may get
        none when the batch has fewer micro-batches than DP ranks.
        """
        plans = self._micro_rows(batch)
        if self.context.data_parallel == 1:
            return list(range(len(plans)))
        lengths = batch.seq_lengths
        padded_length = int(lengths.max())
        costs = torch.tensor([len(rows) * (int(lengths[rows].max()) if self.context.pipeline_parallel == 1
                                           else padded_length) for rows in plans], dtype=torch.long)
        return balance_rows(costs, self.context.data_parallel)[self.context.dp_rank].tolist()

    def _micro_rows(self, batch: TrainBatch) -> list[torch.Tensor]:
        """The original row indices of each micro-batch, in ``_micro_batches`` order."""
        if self.context.pipeline_parallel == 1:
            return plan_micro_batches(batch.seq_lengths, max_tokens=self.trainer.micro_batch_tokens)
        rows = max(1, self.trainer.micro_batch_tokens // int(batch.seq_lengths.max()))
        return [r for r in torch.arange(batch.batch_size).split(rows)]

    def train_step(self, batch: TrainBatch, loss: TokenLoss, *, temperature: float = 1.0) -> StepResult:
        """One optimizer step on the global ``batch`` (the same on every rank); a non-finite step is skipped.

        Each data-parallel rank trains only its share of the rows (``data_parallel_share``);
        the loss is normalised over the global batch, so the update equals DP=1's.
        """
        if not self.trainable:
            raise ValueError("this actor is frozen (built without an optimizer config); it cannot train")
        batch = self.data_parallel_share(batch)
        learning_rate = self.schedule.apply(self.optimizer)
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        # Only the last pipeline stage gets loss outputs; every stage runs all the micro-batches.
        micros, outputs, _ = self._run(batch, loss=loss, temperature=temperature, forward_only=False)
        metrics = self._reduce_metrics(outputs)
        if not self._all_ranks_finite(math.isfinite(metrics.get("loss", 0.0)) and self._grads_finite()):
            self.num_skipped_steps += 1
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
            logger.warning("non-finite loss or gradient: step skipped (%d so far)", self.num_skipped_steps)
            return StepResult(metrics.get("loss", float("nan")), float("nan"), True, learning_rate, len(micros), metrics)
        _, grad_norm, _ = self.optimizer.step()
        self.schedule.step()
        return StepResult(metrics.get("loss", 0.0), float(grad_norm), False, learning_rate, len(micros), metrics)

    def data_parallel_share(self, batch: TrainBatch) -> TrainBatch:
        """This DP rank's rows of the global batch, balanced by token count (``balance_rows``).

        The shares are computed from the batch alone, so every rank of one model replica (its
        TP and PP ranks) takes the same rows without communicating. A rank left without rows
        (fewer rows than DP ranks) trains an all-masked copy of one row: it still runs every
        collective and contributes zero. Memory: one ``(B/DP, T)`` copy of the batch tensors.
        """
        if self.context.data_parallel == 1:
            return batch
        rows = balance_rows(batch.seq_lengths, self.context.data_parallel)[self.context.dp_rank]
        if rows.numel() == 0:
            return without_targets(batch.select(torch.tensor([0])))
        return batch.select(rows)

    def _all_ranks_finite(self, finite: bool) -> bool:
        """Whether every rank's step is finite: every rank skips together or none does."""
        flag = torch.tensor([float(finite)], dtype=torch.float32, device=self.device)
        return self.context.world_min(flag).item() >= 1.0

    def _grads_finite(self) -> bool:
        # One read of each gradient and one host sync: a sum is NaN/inf whenever an element
        # is (inf − inf is NaN), where isfinite().all() costs five passes and a sync per
        # tensor. Only gradients summing past float32's range (~3e38) are refused on top.
        sums = [p.main_grad.sum() for p in self.model.parameters() if getattr(p, "main_grad", None) is not None]
        return not sums or bool(torch.isfinite(torch.stack(sums).sum()))

    def _reduce_metrics(self, outputs: list[dict[str, torch.Tensor]]) -> dict[str, float]:
        """Loss: sum over micro-batches and DP ranks; other metrics: mean. Shared by all stages."""
        payload: list[dict[str, float] | None] = [None]
        if self.context.is_pipeline_last:
            keys = sorted(outputs[0]) if outputs else []
            values = torch.tensor(
                [[float(o[k]) for k in keys] for o in outputs], dtype=torch.float64
            ).reshape(len(outputs), len(keys))
            sums = self.context.dp_sum(values.sum(dim=0).to(self.device)).cpu()
            counts = self.context.dp_sum(torch.tensor(float(len(outputs)), dtype=torch.float64, device=self.device))
            counts = counts.cpu()
            payload[0] = {
                k: float(sums[i] if k == "loss" else sums[i] / counts) for i, k in enumerate(keys)
            }
        return self.context.broadcast_object_from_last_stage(payload[0]) or {}


def _pad_rows(batch: TrainBatch, num_rows: int) -> TrainBatch:
    extra = num_rows - batch.batch_size
    if extra == 0:
        return batch

    def pad(tensor: torch.Tensor | None) -> torch.Tensor | None:
        if tensor is None:
            return None
        return torch.cat([tensor, tensor.new_zeros((extra, tensor.shape[1]))])

    return TrainBatch(
        tokens=pad(batch.tokens),
        response_mask=pad(batch.response_mask),
        advantages=pad(batch.advantages),
        old_logprobs=pad(batch.old_logprobs),
        ref_logprobs=pad(batch.ref_logprobs),
        token_mask=pad(batch.token_mask),
    )
