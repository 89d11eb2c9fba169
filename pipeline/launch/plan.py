"""The planner: per-GPU memory, KV-cache capacity, context, step time and GPU-hours of an RL job.

Pure functions over small dataclasses; ``pipeline/cli/plan.py`` fills ``PlanInputs`` from a
model's ``config.json``, a stage config or campaign recipe, a cluster profile and flags, and
prints the result. Nothing here imports torch or megatron.

What it models, and from where:

* **Model states** (``model_state_bytes``): megatron-core 0.16.1's mixed-precision Adam as
  winnow's actor builds it (``pipeline/trainer/actor.py``): bf16 weights (2 bytes/param),
  fp32 gradients in megatron's DDP ``main_grad`` buffer (``grad_reduce_in_fp32=True``:
  4 bytes), and ``Float16OptimizerWithFloat16Params``' fp32 master weights plus Adam's
  two fp32 moments (12 bytes). With fp32 precision: 4 + 4 + 8 (``FP32Optimizer`` keeps no
  master copy). With the distributed optimizer the 12 (or 8) optimizer bytes are divided by
  the data-parallel size; the gradient buffer is not (megatron's ``DistributedOptimizer``
  reduce-scatters into the full ``grad_data`` buffer and each rank steps its shard):
  ZeRO stage 1, Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
  Parameter Models", §5.1 (P_os), and megatron-core's ``docs/source/api-guide/dist_optimizer.md``
  table (bf16 params, fp32 grads: 6 + 12/d bytes per parameter).
* **Activations** (``layer_activation_bytes``): Korthikanti et al., "Reducing Activation
  Recomputation in Large Transformer Models", §4.1 counts every tensor a layer saves for
  backward (Eq. 1: ``sbh(34 + 5as/h)`` bytes for GPT-3's layer at 16 bits; Eq. 2 with tensor
  parallelism, Eq. 4 with sequence parallelism; §5: selective recompute drops the ``5as/h``
  attention-score term; full recompute keeps only each layer's input, ``2sbh``). Winnow's
  layer differs from GPT-3's (RMSNorm, RoPE, grouped-query attention, SwiGLU, no dropout,
  fused attention), so the same count is done for the layer megatron-core 0.16.1 builds,
  per backend; ``korthikanti_gpt_layer_bytes`` keeps the paper's own formula for reference.
  Neither backend stores the ``s²`` score matrix: the Transformer Engine spec (GPU) runs
  flash/fused attention and the local spec (CPU) torch's ``scaled_dot_product_attention``
  (``pipeline/models/local_modules.py``); both save only Q, K, V, the output and a float32
  log-sum-exp per head and token. ``attention="unfused"`` adds the paper's score term for
  what-ifs on megatron's unfused ``DotProductAttention``.
* **Pipeline schedule**: with 1F1B the first stage holds ``min(p, m)`` micro-batches in
  flight (Korthikanti §4.2.3; Narayanan et al., "Efficient Large-Scale Language Model
  Training on GPU Clusters Using Megatron-LM", §2.2.1), stage ``i`` holds ``min(p − i, m)``;
  the bubble is ``(p − 1)/(m + p − 1)`` of the step (ibid., §2.2.1).
* **Log-prob head** (``head_buffer_bytes``): the float32 ``(chunk, V/t)`` working buffer of
  ``pipeline.algorithms.logprobs.token_logprobs_and_entropy`` (``trainer.logprob_buffer_mib``,
  smaller when a micro-batch has fewer tokens), a bf16 copy of its logit rows for a bf16
  weight, and the float32 ``(V/t, h)`` weight-gradient accumulator of its backward.
* **FLOPs** (``step_flops``): ``pipeline.stats.flops``' count, the one the RL step's metrics and
  the campaign ledger use: forward ``2·N`` per token plus ``4·L·a·d`` per attended key, causal
  (``N`` the matmul weights, output head included, embedding lookup not: Narayanan et al.
  §5.1, Eq. 3; Chowdhery et al., "PaLM", Appendix B). Trainer: forward + backward (3×
  forward, plus what ``recompute`` redoes) of every trained row, and a forward of it for each
  extra log-prob pass (π_old recompute, reference policy). Rollout: each prompt's prefill once
  per sampling round, and the decode of every sampled response. At the mean response length;
  MFUs are assumptions, printed with the result.
* **Response lengths** (``ResponseLengths``): the lengths a curation measured for the prompts
  RL trains on (``curation_lengths``), else a stated long-tail shape (``long_tail_lengths``: a
  log-normal with a median and a 90th percentile given as fractions of ``max_new_tokens``, cut
  at the cap). The update, the log-prob passes and the prefill are timed at its mean.
* **Generation time** (``generation_seconds``): a generator (an SGLang server, or the
  in-process engine) decodes its batch for as many steps as the batch's longest response, each
  step costing the whole batch's decode FLOPs at the mean context: decode is memory-bound (every
  step reads the weights and the batch's KV cache), so a batch whose short responses have
  finished is not proportionally cheaper, and the step waits for its slowest generator. So the
  time is set by the expected longest response of the round (``ResponseLengths.expected_max``),
  between the mean-length time and the bound where every response reaches the cap; all three
  are printed.
* **Checkpoint write** (``checkpoint_write_plan``): a checkpoint holds each rank's weights and
  optimizer state (no gradients). megatron's ``dist_checkpointing`` writes a replicated shard
  once, from the first data-parallel rank, so that rank writes the whole model-parallel
  share of weights plus its optimizer share (all of it without the distributed optimizer):
  ``model_state_bytes`` less the gradients. Time: those bytes at an assumed per-rank write
  bandwidth of the shared filesystem, times a safety factor, plus a fixed cost (collectives
  between phases, metadata, the manifest). It sets the SLURM ``--signal`` lead of rl jobs.
* **DEPO estimator** (``estimator_from_rl``, ``estimator_step_flops``): a run whose
  ``algorithm.prompt_filter`` is ``depo`` runs its difficulty estimator (a BERT encoder, fp32)
  once a step on global rank 0's GPU: it scores the ``⌈oversample·B⌉`` candidates, one forward
  each, before generation, and trains ``minibatches`` AdamW minibatches of ``minibatch_size``
  prompts (3 forwards each) after the update; the other ranks wait for it at the broadcast of
  the decision. ``2·N·T̄·(3·minibatches·minibatch_size + ⌈oversample·B⌉)`` FLOPs
  (``pipeline.stats.flops.estimator_flops``; ``N`` the encoder's matmul weights, ``T̄`` the
  tokens a question takes, the estimator's ``max_length`` as an upper bound), at an assumed
  30% of the card's fp32 peak; its weights, gradients and AdamW state (16 bytes a parameter)
  are on pipeline stage 0.
* **KV cache** (``kv_cache_plan``): ``2·L·g·d·bytes`` per token (K and V of every layer),
  split over a server's TP ranks (replicated when ``g < tp``); capacity is SGLang's
  ``--mem-fraction-static`` share of the GPU minus the weights.
* **Requests in flight** (``in_flight_from_rl``): the sequences the SGLang client keeps in
  flight, servers × ``rollout.max_running_requests_per_server`` (each server's
  ``--max-running-requests``) unless ``rollout.max_in_flight_sequences`` sets it; the rule is the
  client's own (``pipeline.config.rollout_in_flight_limit``).
* **Context** (``context_problem``, ``stage_contexts``): every stage that generates (rl,
  curate, evaluate) needs its ``max_new_tokens`` plus a prompt within the model's
  ``max_position_embeddings``; curation and evaluation drop each prompt that does not fit
  (``pipeline.eval.sharded.fits_context``), so a length that leaves no room drops them all.
  The prompt allowance is ``prompt_allowance``; the model of each stage is found across the
  campaign (a checkpoint an earlier stage writes has that stage's model).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from functools import lru_cache
from statistics import NormalDist
from typing import Any, Literal, Mapping

import numpy as np

from pipeline.config import InFlightLimit, rollout_in_flight_limit
from pipeline.models.spec import ModelSpec
from pipeline.stats.flops import (
    ForwardCost,
    decoder_layer_matmul_parameters,
    estimator_flops,
    generation_flops,
    peak_bf16_flops,
    prefill_flops,
    sequence_forward_flops,
    update_flops,
)

__all__ = [
    "ESTIMATOR_ENCODERS",
    "GPUS",
    "Assumptions",
    "CheckpointWrite",
    "Cluster",
    "EstimatorEncoder",
    "EstimatorWorkload",
    "GenerationBatches",
    "GPUSpec",
    "KVCachePlan",
    "Layout",
    "MemoryBreakdown",
    "ModelDims",
    "Plan",
    "PlanInputs",
    "ResponseLengths",
    "StageContext",
    "TimePlan",
    "TrainerSettings",
    "Workload",
    "candidate_layouts",
    "bootstrap_model_dims",
    "checkpoint_write_plan",
    "context_problem",
    "curation_lengths",
    "estimator_from_rl",
    "estimator_step_flops",
    "generation_batches",
    "generation_seconds",
    "head_buffer_bytes",
    "in_flight_from_rl",
    "korthikanti_gpt_layer_bytes",
    "kv_cache_plan",
    "layer_activation_bytes",
    "long_tail_lengths",
    "memory_plan",
    "model_state_bytes",
    "pipeline_bubble",
    "plan",
    "prompt_allowance",
    "smallest_fitting_layout",
    "stage_contexts",
    "stage_generation",
    "stage_parameters",
    "step_flops",
    "sync_seconds",
    "time_plan",
]

GIB = 1 << 30
Precision = Literal["bf16", "fp32"]
Recompute = Literal["none", "selective", "full"]
Backend = Literal["te", "local"]
Attention = Literal["fused", "unfused"]


# ------------------------------------------------------------------------------------ model


@dataclass(kw_only=True, slots=True, frozen=True)
class ModelDims:
    """The dimensions the planner needs, always taken from a ``ModelSpec``.

    A ``config.json`` is read by ``ModelSpec.from_hf_config`` (``from_hf_config`` here), so the
    planner sizes exactly the architecture the trainer builds and the converter loads: the same
    families (``pipeline.models.families``), defaults and refusals, Qwen3's per-head q/k RMSNorm
    (``2·d`` parameters per layer) included.
    """

    name: str
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    qkv_bias: bool = False
    qk_norm: bool = False
    tie_embeddings: bool = False

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any] | str | Path, *, name: str | None = None) -> ModelDims:
        """From a ``config.json`` dict, file or model folder: the ``ModelSpec`` it parses into.

        ``name`` defaults to the model's folder (or the file's stem), else the config's ``_name_or_path``,
        else its ``model_type``. A config ``ModelSpec`` refuses raises its ``ValueError``.
        """
        if not isinstance(config, Mapping):
            path = Path(config)
            path = path / "config.json" if path.is_dir() else path
            if not path.is_file():
                raise ValueError(f"config: no config.json at {path}")
            name = name or (path.parent.name if path.name == "config.json" else path.stem)
            config = json.loads(path.read_text())
        spec = ModelSpec.from_hf_config(config)
        return cls.from_spec(spec, name=name or str(config.get("_name_or_path") or spec.family))

    @classmethod
    def from_spec(cls, spec: ModelSpec, *, name: str = "model") -> ModelDims:
        """From a trainer ``ModelSpec`` (a winnow checkpoint's manifest holds one)."""
        return cls(name=name, vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
                   ffn_hidden_size=spec.ffn_hidden_size, num_layers=spec.num_layers,
                   num_attention_heads=spec.num_attention_heads, num_kv_heads=spec.num_query_groups,
                   head_dim=spec.kv_channels, max_position_embeddings=spec.max_position_embeddings,
                   qkv_bias=spec.qkv_bias, qk_norm=spec.qk_layernorm, tie_embeddings=spec.tie_embeddings)

    @property
    def q_width(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.num_kv_heads * self.head_dim

    def layer_parameters(self, tp: int = 1) -> int:
        """One decoder layer's parameters on one of ``tp`` tensor-parallel ranks (norms replicated)."""
        h, qkv = self.hidden_size, self.q_width + 2 * self.kv_width
        matmuls = decoder_layer_matmul_parameters(hidden_size=h, ffn_hidden_size=self.ffn_hidden_size,
                                                  q_width=self.q_width, kv_width=self.kv_width)
        split = matmuls + (qkv if self.qkv_bias else 0)
        replicated = 2 * h + (2 * self.head_dim if self.qk_norm else 0)
        return split // tp + replicated

    def forward_cost(self) -> ForwardCost:
        """Per-token forward FLOPs of this model (``pipeline.stats.flops``)."""
        return ForwardCost.decoder(hidden_size=self.hidden_size, ffn_hidden_size=self.ffn_hidden_size,
                                   num_layers=self.num_layers, q_width=self.q_width, kv_width=self.kv_width,
                                   vocab_size=self.vocab_size)

    def num_parameters(self) -> int:
        """All parameters, counting a tied embedding once."""
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_embeddings else 2)
        return self.num_layers * self.layer_parameters() + embeddings + self.hidden_size


# ------------------------------------------------------------------------------- inputs


@dataclass(kw_only=True, slots=True, frozen=True)
class GPUSpec:
    name: str
    memory_gib: float
    peak_tflops: float  # dense bf16 tensor-core peak
    # fp32 peak without tensor cores: what the DEPO estimator's fp32 matmuls get when TF32 is off
    # (torch's default for matmuls); an image that turns TF32 on makes the estimator faster than planned.
    peak_fp32_tflops: float


GPUS = {
    # NVIDIA H100 SXM5 datasheet: 80 GB HBM3; its dense bf16 peak is pipeline.stats.flops' (989 TFLOPS);
    # FP32 67 TFLOPS (NVIDIA H100 Tensor Core GPU datasheet, SXM column).
    "h100": GPUSpec(name="H100 SXM 80GB", memory_gib=80 * 1e9 / GIB, peak_tflops=peak_bf16_flops("H100") / 1e12,
                    peak_fp32_tflops=67.0),
    # NVIDIA H200 datasheet: 141 GB HBM3e, same compute as H100 SXM (FP32 67 TFLOPS).
    "h200": GPUSpec(name="H200 141GB", memory_gib=141 * 1e9 / GIB, peak_tflops=peak_bf16_flops("H200") / 1e12,
                    peak_fp32_tflops=67.0),
}


@dataclass(kw_only=True, slots=True, frozen=True)
class Layout:
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    data_parallel: int = 1

    @property
    def model_parallel(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel

    def __str__(self) -> str:
        return f"TP={self.tensor_parallel} PP={self.pipeline_parallel} DP={self.data_parallel}"


@dataclass(kw_only=True, slots=True, frozen=True)
class TrainerSettings:
    """How the trainer runs: what the actor does today unless a what-if flag says otherwise."""

    precision: Precision = "bf16"
    distributed_optimizer: bool = True  # the actor's default (trainer.distributed_optimizer: on when DP > 1)
    recompute: Recompute = "none"  # the actor's default (trainer.recompute)
    backend: Backend = "te"  # te: Transformer Engine spec (GPU); local: megatron local modules (CPU)
    attention: Attention = "fused"
    sequence_parallel: bool = False  # the actor builds its model without it
    grad_bytes: int = 4  # megatron DDP main_grad, grad_reduce_in_fp32=True
    micro_batch_tokens: int = 8192
    logprob_buffer_mib: int = 256
    reference_model: bool = False  # algorithm.kl_coef > 0 loads a frozen copy
    old_logprob_forward: bool = True  # trainer.old_logprobs == "recompute"


@dataclass(kw_only=True, slots=True, frozen=True)
class Workload:
    """One RL step's shape and the run's length."""

    prompts_per_step: int
    trained_per_prompt: int  # responses per prompt that reach the update (group size)
    sampled_per_prompt: int  # responses per prompt generated, worst case (ada_seq: its cap)
    in_flight_per_prompt: int  # responses per prompt generated at once (one sampling round)
    prompt_tokens: int  # the longest templated prompt
    max_new_tokens: int
    steps: int
    num_runs: int = 1  # rl stages of the campaign (variants)
    max_staleness: int = 0  # rollout.max_staleness: 1 generates the next step while this one updates
    sync: str = "distributed"  # rollout.sync with servers: "distributed" (update group) or "disk"


@dataclass(kw_only=True, slots=True, frozen=True)
class Cluster:
    gpu: GPUSpec
    trainer_nodes: int
    gpus_per_node: int
    rollout_nodes: int = 0
    servers_per_node: int = 1
    server_tensor_parallel: int = 1
    reserve_gib: float = 4.0  # CUDA context, NCCL and cuBLAS workspaces per GPU
    fragmentation: float = 0.10  # share of the rest the caching allocator may lose

    @property
    def trainer_gpus(self) -> int:
        return self.trainer_nodes * self.gpus_per_node

    @property
    def rollout_gpus(self) -> int:
        return self.rollout_nodes * self.gpus_per_node

    @property
    def usable_bytes(self) -> int:
        return int((self.gpu.memory_gib - self.reserve_gib) * (1 - self.fragmentation) * GIB)


@dataclass(kw_only=True, slots=True, frozen=True)
class Assumptions:
    mfu: float = 0.35  # trainer model-FLOP utilization
    rollout_mfu: float = 0.10  # SGLang generation: decode is memory-bound
    # The DEPO estimator's share of the card's fp32 peak: a 6-layer, 384-wide encoder on batches of 32
    # (training) and 64 (scoring) questions is too small to keep an H100 busy.
    estimator_mfu: float = 0.30
    # The stated response-length shape (``long_tail_lengths``) when no curation measured the lengths:
    # median and 90th percentile as fractions of max_new_tokens; with these 4.6% of responses reach the
    # cap and the mean is 37% of it.
    response_median: float = 0.30
    response_p90: float = 0.75
    # The shape's mean, as a fraction of max_new_tokens, when set (its spread kept; 1.0: every response
    # at the cap); None: the shape as stated.
    response_fraction: float | None = None
    mem_fraction_static: float = 0.85  # SGLang --mem-fraction-static: weights + KV cache share of a GPU
    server_bytes_per_param: int = 2  # SGLang serves bf16
    # GB/s one rank sustains writing a checkpoint to the shared filesystem: a conservative figure
    # for a parallel filesystem client under load (Lustre and GPFS clients reach several GB/s alone).
    checkpoint_write_gbps: float = 1.0
    checkpoint_safety: float = 2.0  # contention with other jobs, a slow storage target
    checkpoint_fixed_s: float = 60.0  # agreement collectives, metadata, manifest and publish
    # GB/s of a weight sync's NCCL broadcast from the trainer's rank 0 to the servers: well under one
    # 400 Gb/s NIC's 50 GB/s, for the bucket round trips and the servers' copies into their weights.
    sync_broadcast_gbps: float = 20.0
    server_load_gbps: float = 2.0  # a server reading a safetensors export (sync=disk) from the shared filesystem


@dataclass(kw_only=True, slots=True, frozen=True)
class PlanInputs:
    dims: ModelDims
    layout: Layout
    trainer: TrainerSettings
    workload: Workload
    cluster: Cluster
    assumptions: Assumptions = field(default_factory=Assumptions)
    in_flight: InFlightLimit | None = None  # the SGLang client's limit (``in_flight_from_rl``); None: no servers
    # Measured response lengths (``curation_lengths``); None: the assumptions' stated shape.
    response_lengths: ResponseLengths | None = None
    estimator: EstimatorWorkload | None = None  # the DEPO estimator's step (``estimator_from_rl``); None: no DEPO

    @property
    def seq_length(self) -> int:
        return self.workload.prompt_tokens + self.workload.max_new_tokens

    def lengths(self) -> ResponseLengths:
        """The response lengths the step is timed with: the measured ones, else the stated shape."""
        if self.response_lengths is not None:
            return self.response_lengths
        a = self.assumptions
        return long_tail_lengths(self.workload.max_new_tokens, median=a.response_median, p90=a.response_p90,
                                 mean=a.response_fraction)


# ------------------------------------------------------------------------ DEPO estimator


@dataclass(kw_only=True, slots=True, frozen=True)
class EstimatorEncoder:
    """The BERT encoder of DEPO's difficulty estimator (``pipeline.estimator.model.DifficultyEstimator``),
    as the planner sizes it, and the tokens it reads of a question (``max_length``)."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    vocab_size: int
    max_position_embeddings: int
    type_vocab_size: int
    max_length: int

    @classmethod
    def from_description(cls, described: Mapping[str, Any], *, name: str) -> EstimatorEncoder:
        """From a saved estimator's ``estimator.json`` (``DifficultyEstimator.describe``): its
        ``bert_config`` and ``max_length``. A description without them raises ``ValueError``."""
        try:
            config = described["bert_config"]
            return cls(name=name, hidden_size=int(config["hidden_size"]),
                       intermediate_size=int(config["intermediate_size"]),
                       num_layers=int(config["num_hidden_layers"]), vocab_size=int(config["vocab_size"]),
                       max_position_embeddings=int(config["max_position_embeddings"]),
                       type_vocab_size=int(config.get("type_vocab_size", 2)),
                       max_length=int(described["max_length"]))
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"not an estimator description ({error!r})") from error

    @classmethod
    def load(cls, directory: str | Path) -> EstimatorEncoder:
        """A trained estimator's folder (``algorithm.depo.estimator_dir``): its ``estimator.json``."""
        path = Path(directory) / ESTIMATOR_DESCRIPTION
        if not path.is_file():
            raise ValueError(f"no {ESTIMATOR_DESCRIPTION} in {directory}")
        described = json.loads(path.read_text())
        kind = described.get("kind") if isinstance(described, dict) else None
        known = ESTIMATOR_ENCODERS.get(kind) if isinstance(kind, str) else None
        return cls.from_description(described, name=known.name if known is not None else str(kind))

    def forward_cost(self) -> ForwardCost:
        """Per-token forward FLOPs: ``2·N`` with ``N = L·(4h² + 2h·I)`` matmul weights (``pipeline.stats.flops``)."""
        return ForwardCost.from_bert_config({"hidden_size": self.hidden_size,
                                             "intermediate_size": self.intermediate_size,
                                             "num_hidden_layers": self.num_layers})

    def num_parameters(self) -> int:
        """Every parameter of the estimator: the embeddings (word, position, token type and their LayerNorm),
        each layer's ``4h² + 2h·I`` matmul weights with their ``4h + I + h`` biases and two LayerNorms
        (``4h``), and the three one-unit heads (``h + 1`` each). all-MiniLM-L6-v2 (h = 384, I = 1,536,
        6 layers, 30,522 words, 512 positions, 2 token types): 11,918,592 + 6 × 1,774,464 + 1,155 =
        22,566,531, as the model built from its ``config.json`` counts (no pooler: it is built without one)."""
        h, inner = self.hidden_size, self.intermediate_size
        embeddings = (self.vocab_size + self.max_position_embeddings + self.type_vocab_size) * h + 2 * h
        layer = 4 * h * h + 2 * h * inner + 4 * h + inner + h + 4 * h
        return embeddings + self.num_layers * layer + 3 * (h + 1)


# The file a saved estimator describes itself in (``pipeline.estimator.model``'s, read here without torch).
ESTIMATOR_DESCRIPTION = "estimator.json"

# A fresh estimator by ``algorithm.depo.encoder`` (``DifficultyEstimator.from_pretrained_minilm`` and ``.tiny``).
# all-MiniLM-L6-v2's config.json; the 256 tokens it reads are the sequence length it was fine-tuned with.
# Its matmul weights, the N of the FLOPs: 6 × (4·384² + 2·384·1,536) = 10,616,832; its non-embedding
# parameters are 10,646,784, the other 29,952 being biases and LayerNorms (element-wise, no matmul FLOPs).
ESTIMATOR_ENCODERS: dict[str, EstimatorEncoder] = {
    "minilm": EstimatorEncoder(name="all-MiniLM-L6-v2", hidden_size=384, intermediate_size=1536, num_layers=6,
                               vocab_size=30522, max_position_embeddings=512, type_vocab_size=2, max_length=256),
    # 2 random layers of width 32 over UTF-8 bytes (256 bytes + 4 special ids), 128 bytes read.
    "tiny": EstimatorEncoder(name="tiny", hidden_size=32, intermediate_size=128, num_layers=2, vocab_size=260,
                             max_position_embeddings=128, type_vocab_size=2, max_length=128),
}
# fp32 weights (4 bytes), gradients (4) and AdamW's two moments (8): what the estimator keeps on rank 0's GPU.
ESTIMATOR_STATE_BYTES_PER_PARAMETER = 16


@dataclass(kw_only=True, slots=True, frozen=True)
class EstimatorWorkload:
    """What DEPO's estimator does in one rl step, on global rank 0's GPU (``pipeline/rl/sampling.py``)."""

    encoder: EstimatorEncoder
    source: str  # where the encoder's dimensions come from (printed with the plan)
    candidates: int  # ⌈oversample·B⌉ prompts scored, one forward each, before generation
    minibatches: int  # AdamW updates after the step's update
    minibatch_size: int  # prompts per update (forward + backward: 3 forwards)
    question_tokens: int  # T̄: encoder tokens a question takes
    question_tokens_source: str

    @property
    def trained_prompts(self) -> int:
        return self.minibatches * self.minibatch_size

    @property
    def state_bytes(self) -> int:
        """Weights, gradients and AdamW state in fp32: 361 MB (344 MiB) for all-MiniLM-L6-v2."""
        return ESTIMATOR_STATE_BYTES_PER_PARAMETER * self.encoder.num_parameters()


def estimator_step_flops(estimator: EstimatorWorkload) -> tuple[float, float]:
    """(scoring, training) FLOPs of the estimator's step by ``pipeline.stats.flops.estimator_flops``:
    ``2·N·T̄·⌈oversample·B⌉`` and ``2·N·T̄·3·minibatches·minibatch_size``.

    At the staged H100 default (MiniLM, N = 10,616,832, T̄ = 256, 256 candidates, 4 × 32 trained):
    1.39e12 + 2.09e12 = 3.48e12 FLOPs, 0.17 s at 30% of an H100's 67 TFLOPS fp32.
    """
    cost, tokens = estimator.encoder.forward_cost(), estimator.question_tokens
    return (estimator_flops(cost, {"inference": estimator.candidates * tokens}),
            estimator_flops(cost, {"train": estimator.trained_prompts * tokens}))


def estimator_from_rl(cfg: Any, *, campaign: Any | None = None) -> EstimatorWorkload | None:
    """An ``RLConfig``'s DEPO estimator step; None when its ``algorithm.prompt_filter`` is not ``depo``.

    The encoder is, in order: a fresh one of ``algorithm.depo.encoder`` without ``estimator_dir``;
    the encoder a ``train-estimator`` stage of ``campaign`` trains into ``estimator_dir``; the one
    ``estimator_dir``'s ``estimator.json`` describes; else (a folder not readable here)
    ``algorithm.depo.encoder``'s, and the source says so. ``T̄`` is the encoder's ``max_length``:
    an upper bound (the planner reads no questions, and a batch is padded to its longest).
    """
    if cfg.algorithm.prompt_filter != "depo":
        return None
    depo = cfg.algorithm.depo
    encoder, source = _depo_encoder(depo, campaign)
    return EstimatorWorkload(
        encoder=encoder, source=source, candidates=math.ceil(cfg.prompts_per_step * depo.oversample),
        minibatches=depo.minibatches, minibatch_size=depo.minibatch_size, question_tokens=encoder.max_length,
        question_tokens_source="the estimator's max_length: an upper bound, the planner reads no questions")


def _depo_encoder(depo: Any, campaign: Any | None) -> tuple[EstimatorEncoder, str]:
    fresh = ESTIMATOR_ENCODERS[depo.encoder]
    if depo.estimator_dir is None:
        return fresh, f"fresh: algorithm.depo.encoder={depo.encoder}"
    trainer = _estimator_trainer(campaign, depo.estimator_dir) if campaign is not None else None
    if trainer is not None:
        trained = ESTIMATOR_ENCODERS[trainer.config.encoder]
        return replace(trained, max_length=trainer.config.max_length), f"trained by stage {trainer.name}"
    try:
        return EstimatorEncoder.load(depo.estimator_dir), f"read from {depo.estimator_dir}"
    except (ValueError, OSError) as error:  # json's decode errors are ValueErrors
        return fresh, (f"{depo.estimator_dir} cannot be read here ({error}): sized as "
                       f"algorithm.depo.encoder={depo.encoder}")


def _estimator_trainer(campaign: Any, estimator_dir: str) -> Any | None:
    """The ``train-estimator`` stage of ``campaign`` that writes ``estimator_dir``, if any."""
    from pipeline.stages.train_estimator import ESTIMATOR_DIR

    target = Path(estimator_dir).expanduser().absolute()
    for stage in campaign.stages:
        if stage.kind == "train-estimator":
            written = (Path(stage.config.output_dir) / ESTIMATOR_DIR).expanduser().absolute()
            if written == target:
                return stage
    return None


# ----------------------------------------------------------------------- response lengths


# Quantiles that stand for a stated shape: E[max of 2,048] within 0.3% of the continuous shape's even when
# almost no response reaches the cap (1,000 quantiles: 15% low).
SHAPE_POINTS = 20_000
_Z90 = NormalDist().inv_cdf(0.9)


@lru_cache(maxsize=1)
def _shape_z() -> np.ndarray:
    """(SHAPE_POINTS,) standard normal quantiles at the midpoints (j + ½)/SHAPE_POINTS."""
    return np.array([NormalDist().inv_cdf((j + 0.5) / SHAPE_POINTS) for j in range(SHAPE_POINTS)])


@dataclass(kw_only=True, slots=True, frozen=True)
class ResponseLengths:
    """A step's response lengths, in generated tokens, as equally likely values: measured lengths, or the
    ``SHAPE_POINTS`` quantiles of a stated shape. ``source`` says which (the plan prints it)."""

    source: str
    values: tuple[float, ...]  # ascending, each in [1, max_new_tokens]
    max_new_tokens: int

    @classmethod
    def of(cls, values: Iterable[float], *, max_new_tokens: int, source: str) -> ResponseLengths:
        """``values`` cut to [1, max_new_tokens] (the cap truncates a response) and sorted."""
        cut = sorted(min(float(max_new_tokens), max(1.0, float(value))) for value in values)
        if not cut:
            raise ValueError(f"response lengths ({source}): no values")
        return cls(source=source, values=tuple(cut), max_new_tokens=max_new_tokens)

    @property
    def mean(self) -> float:
        return math.fsum(self.values) / len(self.values)

    def quantile(self, q: float) -> float:
        """The smallest value with at least a share ``q`` of the values at or below it."""
        return self.values[max(0, math.ceil(q * len(self.values)) - 1)]

    def expected_max(self, draws: int) -> float:
        """E[the longest of ``draws`` independent lengths]: with the k values sorted,
        ``Σᵢ vᵢ·((i/k)ⁿ − ((i−1)/k)ⁿ)`` (the chance that the i-th is the largest of n draws)."""
        values = np.asarray(self.values)  # (k,)
        at_or_below = (np.arange(1, values.size + 1) / values.size) ** draws  # (k,) P(max ≤ vᵢ)
        return float(values @ np.diff(at_or_below, prepend=0.0))


def long_tail_lengths(max_new_tokens: int, *, median: float, p90: float, mean: float | None = None) -> ResponseLengths:
    """The stated shape: log-normal lengths with median ``median``·C and 90th percentile ``p90``·C
    (C = ``max_new_tokens``), so σ = ln(p90/median)/z₀.₉, each cut at C as the cap cuts a response.

    Why this shape: RL responses are right-skewed with a tail that reaches the cap, the problem
    "DAPO: An Open-Source LLM Reinforcement Learning System at Scale" addresses with its overlong
    reward shaping; the default median 30% and p90 75% put 4.6% of responses at the cap and the mean at
    37%, between the mean generation lengths NeMo RL publishes for GRPO at 4,096 tokens (25% for
    Llama-3.1-8B-Instruct, 78% for Qwen3-30B-A3B; docs/parallel.md). ``mean`` (a fraction of C)
    moves the log-normal's location, σ kept, until the cut lengths' mean is mean·C; 1.0 puts
    every response at the cap.
    """
    if not 0 < median < p90:
        raise ValueError(f"response lengths: need 0 < median < p90, got median {median}, p90 {p90}")
    if mean is not None and not 0 < mean <= 1:
        raise ValueError(f"response lengths: the mean fraction must be in (0, 1], got {mean}")
    cap = float(max_new_tokens)
    sigma = math.log(p90 / median) / _Z90
    source = f"stated shape: log-normal, median {median:.0%} and p90 {p90:.0%} of max_new_tokens, cut at it"

    def values(location: float) -> np.ndarray:
        return np.minimum(cap, np.exp(np.minimum(location + sigma * _shape_z(), 700.0)))  # (SHAPE_POINTS,)

    location = math.log(median * cap)
    if mean is not None:
        source = f"{source}, moved to a mean of {mean:.0%}"
        if mean >= 1:
            return ResponseLengths.of([cap], max_new_tokens=max_new_tokens, source=source)
        low, high = -sigma * 10, math.log(cap) + sigma * 10  # the cut mean rises with the location
        for _ in range(100):
            location = (low + high) / 2
            if values(location).mean() < mean * cap:
                low = location
            else:
                high = location
    return ResponseLengths.of(values(location).tolist(), max_new_tokens=max_new_tokens, source=source)


def curation_lengths(output_dir: str | Path, *, max_new_tokens: int) -> ResponseLengths:
    """The response lengths a finished curation measured (``pipeline.stats.curation.load_response_lengths``),
    cut at this stage's ``max_new_tokens``. A curation sampled with a shorter cap cut its responses
    there, so its tail is then understated; the source says at which cap it measured."""
    from pipeline.stats.curation import load_response_lengths

    measured = load_response_lengths(output_dir)
    prompts = f"{measured.num_prompts:,} {'kept' if measured.kept_only else 'sampled'} prompts"
    what = (f"{measured.lengths.size:,} responses of {prompts}" if measured.per_response
            else f"{prompts}' mean response lengths (the curation stores no per-response lengths)")
    return ResponseLengths.of(measured.lengths.tolist(), max_new_tokens=max_new_tokens,
                              source=f"curation {output_dir}: {what}, sampled at max_new_tokens "
                                     f"{measured.max_new_tokens}")


# ------------------------------------------------------------------------------- memory


def stage_parameters(dims: ModelDims, layout: Layout) -> list[int]:
    """Parameters one TP rank of each pipeline stage holds.

    Layers split evenly (megatron's ``get_num_layers_to_build``; winnow's factory requires
    ``L % p == 0``); the embedding on the first stage, final norm and output layer on the
    last, a tied embedding's copy on the last stage too when ``p > 1`` (megatron keeps it as
    ``output_layer.weight``). Vocabulary rows split over TP.
    """
    tp, pp = layout.tensor_parallel, layout.pipeline_parallel
    layers = dims.num_layers // pp * dims.layer_parameters(tp)
    vocab_rows = math.ceil(dims.vocab_size / tp) * dims.hidden_size
    stages = []
    for stage in range(pp):
        params = layers
        if stage == 0:
            params += vocab_rows
        if stage == pp - 1:
            params += dims.hidden_size
            if not dims.tie_embeddings or pp > 1:
                params += vocab_rows
        stages.append(params)
    return stages


def model_state_bytes(num_params: int, *, trainer: TrainerSettings, data_parallel: int) -> tuple[int, int, int]:
    """(weights, gradients, optimizer state) bytes of ``num_params`` local parameters.

    bf16: 2 + ``grad_bytes`` + 12 (fp32 master, Adam m and v); fp32: 4 + ``grad_bytes`` + 8.
    The distributed optimizer divides the optimizer state by ``data_parallel`` (ZeRO §5.1
    P_os; megatron-core's distributed-optimizer table: 6 + 12/d for bf16 with fp32 grads).
    """
    weight_bytes = 2 if trainer.precision == "bf16" else 4
    optimizer_bytes = 12 if trainer.precision == "bf16" else 8
    optimizer = num_params * optimizer_bytes
    if trainer.distributed_optimizer:
        optimizer = math.ceil(optimizer / data_parallel)
    return num_params * weight_bytes, num_params * trainer.grad_bytes, optimizer


def korthikanti_gpt_layer_bytes(*, s: int, b: int, h: int, a: int, t: int = 1, sequence_parallel: bool = False,
                                recompute: Recompute = "none") -> int:
    """The paper's per-layer activation bytes for GPT-3's layer at 16 bits (Korthikanti et al.).

    Eq. 1 (t = 1): ``sbh(34 + 5as/h)``; Eq. 2 (TP): ``sbh(10 + 24/t + 5as/(ht))``;
    Eq. 4 (TP + SP): ``sbh(34/t + 5as/(ht))``; Eq. 6 / §5 selective recompute drops the
    ``5as/h`` term; full recompute stores ``2sbh`` (the layer input, /t with SP).
    """
    if recompute == "full":
        return 2 * s * b * h // (t if sequence_parallel else 1)
    scores = 0.0 if recompute == "selective" else 5 * a * s / (h * t)
    linear = 34 / t if sequence_parallel else 10 + 24 / t
    return int(s * b * h * (linear + scores))


def layer_activation_bytes(dims: ModelDims, *, tokens: int, seq_length: int, tp: int, trainer: TrainerSettings
                           ) -> int:
    """Bytes one decoder layer saves for backward on one TP rank for a micro-batch of ``tokens``.

    Korthikanti §4.1's count applied to megatron-core 0.16.1's RMSNorm/RoPE/GQA/SwiGLU layer
    (``w`` = 2 bytes for bf16, 4 for fp32; ``q = a·d``, ``k = g·d``, ``F`` the SwiGLU width;
    replicated over TP without sequence parallelism, ``/t`` with it; the rest ``/t``):

    * te (Transformer Engine): fused RMSNorm+linear saves the input and the normalized
      output, ``2wh`` + 4 (rstd), twice; attention saves the fused QKV output (V is a view of
      it), RoPE'd Q and K, the output (also ``linear_proj``'s input) and a float32
      log-sum-exp, ``w(3q + 3k) + 4a/… ``; fused SwiGLU saves ``fc1``'s output and ``fc2``'s
      input, ``3wF``.
    * local (megatron local modules with torch RMSNorm and SDPA, the CPU path): torch's
      RMSNorm upcasts to float32 and saves the float32 input and normalized tensor and rstd,
      ``8h + 4``, twice, plus the two linear inputs ``2wh``; attention as above; the unfused
      GLU saves ``fc1``'s output, ``silu(x_glu)``, ``x_linear + 0`` and the product, ``5wF``;
      RoPE's cos/sin tables, ``4·w·d`` per position.

    Qwen3's per-head q/k RMSNorm (``dims.qk_norm``, before RoPE) adds, over ``a + g`` heads:
    local, torch's RMSNorm's float32 input and normalized copies and a float32 rstd per head,
    ``8(q + k) + 4(a + g)`` (measured exactly by ``tools.bench.plan_memory``'s qwen3 case);
    te, the norm's input and its rstd, ``w(q + k) + 4(a + g)`` (assumed, not measured: no TE
    on the CPU). At Qwen3-4B (q = 4,096, k = 1,024, 40 heads) on the local spec that is 41 kB
    per token and layer, 12 GB for 8,192 tokens × 36 layers.

    Recompute: "selective" (megatron's ``core_attn`` module) drops the log-sum-exp (and the
    ``s²`` scores with ``attention="unfused"``); "full" keeps the layer input, ``wh``.
    """
    w = 2 if trainer.precision == "bf16" else 4
    h, d, a = dims.hidden_size, dims.head_dim, dims.num_attention_heads
    q, k, f = dims.q_width, dims.kv_width, dims.ffn_hidden_size
    sp = tp if trainer.sequence_parallel else 1
    if trainer.recompute == "full":
        return tokens * w * h // sp
    attention = w * (3 * q + 3 * k) // tp
    lse = 0 if trainer.recompute == "selective" else 4 * a // tp
    if trainer.backend == "te":
        norms = (4 * w * h + 8) // sp
        mlp = 3 * w * f // tp
        rope = 0
    else:
        norms = (16 * h + 8 + 2 * w * h) // sp
        mlp = 5 * w * f // tp
        rope = 4 * w * d * seq_length  # per sequence position, once per micro-batch
    qk_norms = 0
    if dims.qk_norm:
        qk_norms = ((w if trainer.backend == "te" else 8) * (q + k) + 4 * (a + dims.num_kv_heads)) // tp
    scores = 0
    if trainer.attention == "unfused" and trainer.recompute != "selective":
        # Korthikanti Eq. 1's 5as²b for softmax output, dropout mask and dropout output, in
        # bytes per token: 5·a·s/t (16-bit; the mask is 1 byte).
        scores = 5 * a * seq_length // tp
    return tokens * (norms + attention + qk_norms + lse + mlp + scores) + rope


def _non_layer_activation_bytes(dims: ModelDims, *, tokens: int, tp: int, trainer: TrainerSettings,
                                first: bool, last: bool) -> int:
    """Token ids (first stage); final norm and the head's saved hidden states and statistics (last)."""
    w = 2 if trainer.precision == "bf16" else 4
    h = dims.hidden_size
    total = 8 * tokens if first else 0
    if last:
        norm = w * h + 4 if trainer.backend == "te" else 8 * h + 4
        # hidden (N, h), targets int64, ownership bool, three float32 statistics.
        total += tokens * (norm + w * h + 8 + 1 + 12)
    return total


def head_buffer_bytes(dims: ModelDims, *, tokens: int, tp: int, trainer: TrainerSettings) -> int:
    """Peak transient bytes of the chunked log-prob head on the last stage (its outputs excluded).

    The actor's chunk is ``logprob_buffer_mib`` MiB of float32 ``(chunk, V/t)`` rows; the
    working buffer (``_working_buffer``) holds ``min(chunk − chunk/16, tokens)`` logit rows
    plus ``min(chunk/16, logit rows)`` scratch rows. A bf16 weight adds a bf16 copy of the
    logit rows (the matmul output in forward, the logit gradient cast for ``grad_hidden`` in
    backward); backward adds the float32 ``(V/t, h)`` weight-gradient accumulator.
    """
    vocab_local = math.ceil(dims.vocab_size / tp)
    chunk = max(2, (trainer.logprob_buffer_mib << 20) // (4 * vocab_local))
    scratch_rows = max(1, chunk // 16)
    logit_rows = min(chunk - scratch_rows, tokens)
    scratch_rows = min(scratch_rows, max(1, logit_rows))
    block = (logit_rows + scratch_rows) * vocab_local * 4
    low_precision_rows = logit_rows * vocab_local * 2 if trainer.precision == "bf16" else 0
    return block + low_precision_rows + vocab_local * dims.hidden_size * 4


def micro_batch_tokens(inputs: PlanInputs) -> int:
    """Tokens of the largest micro-batch the trainer can pack: ``trainer.micro_batch_tokens``, or one row of
    ``seq_length`` when a row is longer.

    The trainer packs rows while rows × longest ≤ ``micro_batch_tokens``
    (``pipeline.trainer.batch.plan_micro_batches``; with pipeline stages, as many rows of the
    batch's longest as fit), and responses are shorter than ``max_new_tokens``: at 1,024 prompt
    + 4,096 new tokens under an 8,192-token budget, one full-length row is 5,120 tokens but
    three rows of 2,700 are 8,100. Planning whole rows of ``seq_length`` under-planned such
    layouts by up to 60%. Activations are planned at this many tokens, with attention's
    per-row terms at ``seq_length`` (an upper bound for rows that are shorter).
    """
    return max(inputs.trainer.micro_batch_tokens, inputs.seq_length)


def num_micro_batches(inputs: PlanInputs) -> int:
    """Micro-batches per step on one data-parallel rank (the trainer pads rows to the longest)."""
    rows = inputs.workload.prompts_per_step * inputs.workload.trained_per_prompt
    rows_per_rank = math.ceil(rows / inputs.layout.data_parallel)
    rows_per_micro = max(1, inputs.trainer.micro_batch_tokens // inputs.seq_length)
    return max(1, math.ceil(rows_per_rank / rows_per_micro))


def pipeline_bubble(pipeline_parallel: int, num_micro: int) -> float:
    """1F1B's idle share of a step: ``(p − 1)/(m + p − 1)`` (Narayanan et al. §2.2.1)."""
    return (pipeline_parallel - 1) / (num_micro + pipeline_parallel - 1)


@dataclass(kw_only=True, slots=True, frozen=True)
class MemoryBreakdown:
    """Bytes on one GPU of one pipeline stage."""

    stage: int
    weights: int
    gradients: int
    optimizer: int
    activations: int
    activations_no_recompute: int
    activations_full_recompute: int
    head_buffer: int
    reference_weights: int
    # Without rollout nodes, global rank 0 (pipeline stage 0) generates with an in-process copy of
    # the policy (the local rollout backend's ``trainer_engine``: float32 Hugging Face weights,
    # 4 bytes a parameter, 28.4 GiB at 7.6B), beside its share of the trainer. Its KV cache
    # (at most ``rollout.max_batch_rows`` sequences) is not planned.
    generator_weights: int
    in_flight_micro_batches: int
    # With DEPO, global rank 0 (pipeline stage 0) holds the estimator's fp32 weights, gradients and AdamW
    # state (``EstimatorWorkload.state_bytes``). Its activations are not planned: it trains after the
    # actor's update has freed the actor's, and a minibatch's (0.5 to 3 GiB for MiniLM) fit in what that frees.
    estimator_state: int = 0

    @property
    def total(self) -> int:
        return (self.weights + self.gradients + self.optimizer + self.activations + self.head_buffer
                + self.reference_weights + self.generator_weights + self.estimator_state)


def memory_plan(inputs: PlanInputs) -> list[MemoryBreakdown]:
    """Every pipeline stage's per-GPU memory; the worst is what must fit."""
    dims, layout, trainer = inputs.dims, inputs.layout, inputs.trainer
    tp, pp = layout.tensor_parallel, layout.pipeline_parallel
    tokens = micro_batch_tokens(inputs)
    num_micro = num_micro_batches(inputs)
    layers_per_stage = dims.num_layers // pp
    weight_bytes = 2 if trainer.precision == "bf16" else 4
    stages = []
    for stage, params in enumerate(stage_parameters(dims, layout)):
        weights, grads, optimizer = model_state_bytes(params, trainer=trainer, data_parallel=layout.data_parallel)
        first, last = stage == 0, stage == pp - 1
        in_flight = min(pp - stage, num_micro)

        def activations(recompute: Recompute, *, stage_first: bool = first, stage_last: bool = last,
                        micro: int = in_flight) -> int:
            per_layer = layer_activation_bytes(dims, tokens=tokens, seq_length=inputs.seq_length, tp=tp,
                                               trainer=replace(trainer, recompute=recompute))
            extra = _non_layer_activation_bytes(dims, tokens=tokens, tp=tp, trainer=trainer, first=stage_first,
                                                last=stage_last)
            stored = micro * (layers_per_stage * per_layer + extra)
            if recompute == "full":
                # One layer's full activations exist while it is recomputed for its backward.
                stored += layer_activation_bytes(dims, tokens=tokens, seq_length=inputs.seq_length, tp=tp,
                                                 trainer=replace(trainer, recompute="none"))
            return stored

        stages.append(MemoryBreakdown(
            stage=stage, weights=weights, gradients=grads, optimizer=optimizer,
            activations=activations(trainer.recompute), activations_no_recompute=activations("none"),
            activations_full_recompute=activations("full"),
            head_buffer=head_buffer_bytes(dims, tokens=tokens, tp=tp, trainer=trainer) if last else 0,
            reference_weights=params * weight_bytes if trainer.reference_model else 0,
            generator_weights=4 * dims.num_parameters() if stage == 0 and not inputs.cluster.rollout_nodes else 0,
            in_flight_micro_batches=in_flight,
            estimator_state=inputs.estimator.state_bytes if stage == 0 and inputs.estimator is not None else 0,
        ))
    return stages


# --------------------------------------------------------------------------- checkpoint


@dataclass(kw_only=True, slots=True, frozen=True)
class CheckpointWrite:
    bytes_per_rank: int  # what the busiest rank writes: first DP rank of the largest pipeline stage
    total_bytes: int  # the whole checkpoint (every shard once)
    seconds: float  # the busiest rank's write time, with the safety factor and fixed cost

    @property
    def signal_s(self) -> int:
        """Whole seconds of warning a job needs to finish this write before its time limit."""
        return math.ceil(self.seconds)


def checkpoint_write_plan(dims: ModelDims, *, layout: Layout, trainer: TrainerSettings,
                          assumptions: Assumptions = Assumptions()) -> CheckpointWrite:
    """Bytes and seconds of one checkpoint save (see the module docstring).

    7B (Qwen2.5-7B, 7.6e9 parameters) on 8×H100, TP = PP = 1, DP = 8, bf16 with the
    distributed optimizer: the first DP rank writes 2 + 12/8 bytes per parameter, 26.7 GB,
    in 2 × 26.7 s + 60 s ≈ 113 s at 1 GB/s; the whole checkpoint is 14 bytes per
    parameter, 107 GB.
    """
    per_rank, total = 0, 0
    for params in stage_parameters(dims, layout):
        weights, _, optimizer = model_state_bytes(params, trainer=trainer, data_parallel=layout.data_parallel)
        per_rank = max(per_rank, weights + optimizer)
        full = replace(trainer, distributed_optimizer=False)
        weights, _, optimizer = model_state_bytes(params, trainer=full, data_parallel=1)
        total += layout.tensor_parallel * (weights + optimizer)
    seconds = (per_rank / (assumptions.checkpoint_write_gbps * 1e9) * assumptions.checkpoint_safety
               + assumptions.checkpoint_fixed_s)
    return CheckpointWrite(bytes_per_rank=per_rank, total_bytes=total, seconds=seconds)


# ------------------------------------------------------------------------------ rollout


@dataclass(kw_only=True, slots=True, frozen=True)
class KVCachePlan:
    bytes_per_token: int  # one server GPU's share
    server_weights: int  # one server GPU's share
    capacity_tokens: int  # per server
    in_flight_tokens: int  # per server, one sampling round of a step, every sequence at full length
    num_servers: int

    @property
    def waves(self) -> int:
        """Rounds SGLang needs when a step's sequences do not all fit at once (1: they do)."""
        if self.capacity_tokens <= 0:
            return 0
        return max(1, math.ceil(self.in_flight_tokens / self.capacity_tokens))


def kv_cache_plan(inputs: PlanInputs) -> KVCachePlan | None:
    """KV-cache capacity of one SGLang server GPU against the tokens a step keeps in flight."""
    cluster, dims = inputs.cluster, inputs.dims
    if cluster.rollout_nodes == 0:
        return None
    tp = cluster.server_tensor_parallel
    kv_heads_local = max(1, dims.num_kv_heads // tp)  # fewer KV heads than ranks: replicated
    bytes_per_token = 2 * dims.num_layers * kv_heads_local * dims.head_dim * 2  # bf16 K and V
    weights = math.ceil(dims.num_parameters() * inputs.assumptions.server_bytes_per_param / tp)
    budget = int(cluster.gpu.memory_gib * GIB * inputs.assumptions.mem_fraction_static) - weights
    num_servers = cluster.rollout_nodes * cluster.servers_per_node
    sequences = inputs.workload.prompts_per_step * inputs.workload.in_flight_per_prompt
    in_flight = math.ceil(sequences / num_servers) * inputs.seq_length
    return KVCachePlan(bytes_per_token=bytes_per_token, server_weights=weights,
                       capacity_tokens=max(0, budget // bytes_per_token), in_flight_tokens=in_flight,
                       num_servers=num_servers)


# ---------------------------------------------------------------------------------- time


@dataclass(kw_only=True, slots=True, frozen=True)
class GenerationBatches:
    """How one step's sequences reach the generators: ``rounds`` sampling rounds, each spread over
    ``generators`` (SGLang servers, or the in-process engine), each running up to ``batch`` sequences at
    once, ``waves`` one after another in each slot."""

    generators: int
    gpus_per_generator: int
    on_servers: bool  # False: global rank 0's in-process engine
    rounds: int
    per_generator: int  # one round's sequences on the busiest generator
    waves: int
    batch: int


def generation_batches(inputs: PlanInputs) -> GenerationBatches:
    """A round's ``prompts × in_flight_per_prompt`` sequences, split evenly over the servers; a server
    runs at once what the client keeps in flight on it (``in_flight``) and what its KV cache holds at
    full length (``KVCachePlan.waves``), and starts the rest as those finish. Without servers,
    global rank 0's engine decodes the round on its one GPU as one batch (its chunks of 256 rows
    one after another take as long when each chunk's longest response reaches the cap)."""
    workload, cluster = inputs.workload, inputs.cluster
    rounds = math.ceil(workload.sampled_per_prompt / workload.in_flight_per_prompt)
    sequences = workload.prompts_per_step * workload.in_flight_per_prompt
    if cluster.rollout_nodes:
        generators, gpus = cluster.rollout_nodes * cluster.servers_per_node, cluster.server_tensor_parallel
        per_generator = math.ceil(sequences / generators)
        concurrent = per_generator
        if inputs.in_flight is not None:
            concurrent = min(concurrent, inputs.in_flight.per_server,
                             math.ceil(inputs.in_flight.sequences / generators))
        kv = kv_cache_plan(inputs)
        waves = max(math.ceil(per_generator / concurrent), kv.waves if kv is not None else 1)
    else:
        generators, gpus, per_generator, waves = 1, 1, sequences, 1
    waves = max(1, waves)
    return GenerationBatches(generators=generators, gpus_per_generator=gpus, on_servers=bool(cluster.rollout_nodes),
                             rounds=rounds, per_generator=per_generator, waves=waves,
                             batch=math.ceil(per_generator / waves))


def generation_seconds(inputs: PlanInputs, lengths: ResponseLengths, batches: GenerationBatches) -> float:
    """Decode time of one step (prefill apart) with responses drawn from ``lengths``.

    A generator runs ``b`` sequences at once, and each decode step is the forward of ``b`` tokens at
    the mean context (prompt + half the mean response), at the rollout MFU on its GPUs: decode is
    memory-bound, so a step costs about the same while a batch's short responses are done and its
    long ones still run. SGLang's continuous batching starts a queued sequence as soon as a slot
    frees, so each of the ``b`` slots runs ``w`` (waves) sequences back to back; the round ends when
    the slot holding the round's longest response does: ``(w − 1)·r̄ + E[max of G·b] − 1`` steps
    (``r̄`` the mean response, ``G·b`` the slots of all ``G`` generators, the first token made by
    the prefill). Every response at the cap gives the all-max bound (the FLOPs of every response
    at full length); every response at the mean gives the mean-length time; any distribution lies
    between the two.
    """
    cost, workload = inputs.dims.forward_cost(), inputs.workload
    step = batches.batch * cost.token(workload.prompt_tokens + lengths.mean / 2)
    steps = (batches.waves - 1) * lengths.mean + lengths.expected_max(batches.generators * batches.batch) - 1
    throughput = batches.gpus_per_generator * inputs.cluster.gpu.peak_tflops * 1e12 * inputs.assumptions.rollout_mfu
    return batches.rounds * steps * step / throughput


@dataclass(kw_only=True, slots=True, frozen=True)
class TimePlan:
    train_flops: float
    rollout_flops: float
    train_s: float
    prefill_s: float
    generation_s: float  # at the round's expected longest response (``generation_seconds``)
    generation_mean_s: float  # every response at the mean length: what the FLOPs alone would give
    generation_max_s: float  # every response at max_new_tokens: the all-max bound
    bubble: float
    lengths: ResponseLengths
    batches: GenerationBatches
    recompute_s: float = 0.0  # the part of ``train_s`` that activation recompute redoes
    sync_s: float = 0.0  # the weight push to the servers, which nothing overlaps
    overlapped: bool = False  # generation of step t+1 runs beside step t's update (docs/rl.md)
    # DEPO's estimator on rank 0's GPU (``estimator_step_flops``): 0 without DEPO.
    estimator_score_flops: float = 0.0
    estimator_train_flops: float = 0.0
    estimator_score_s: float = 0.0
    estimator_train_s: float = 0.0

    @property
    def rollout_s(self) -> float:
        return self.prefill_s + self.generation_s

    @property
    def estimator_flops(self) -> float:
        return self.estimator_score_flops + self.estimator_train_flops

    @property
    def estimator_s(self) -> float:
        return self.estimator_score_s + self.estimator_train_s

    @property
    def estimator_added_s(self) -> float:
        """What the estimator adds to ``step_s``: all of it, but for training hidden beside a longer generation."""
        return self.step_s - replace(self, estimator_score_s=0.0, estimator_train_s=0.0).step_s

    @property
    def step_s(self) -> float:
        """One step's wall time: generation then update, or, overlapped, the longer of the two; then the
        weight push (made only when no batch is in flight, so never overlapped).

        DEPO's estimator runs on rank 0 while the other ranks wait for it at the next collective
        (``pipeline/stages/rl.py``): its scoring, in the step's planning before its batch is launched,
        adds to the step either way; its training, after the update, adds to the update's side (beside
        the next batch's generation when overlapped).
        """
        trainer = self.train_s + self.estimator_train_s
        work = max(trainer, self.rollout_s) if self.overlapped else trainer + self.rollout_s
        return work + self.estimator_score_s + self.sync_s


def sync_seconds(inputs: PlanInputs) -> float:
    """One weight push to the SGLang servers (0 without server nodes: the in-process engine's copy
    is device to device, 0.011 s at 1.5B on an H200).

    ``distributed``: the HF-layout model (2 bytes per parameter) broadcast once over the update
    group; 15.2 GB at 7.6B, 0.76 s at the assumed 20 GB/s. ``disk``: each pipeline stage's rank
    writes its share in parallel, then every server reads the whole export, 15.2 s + 7.6 s at 7.6B
    and PP = 1 with the assumed 1 and 2 GB/s.
    """
    if inputs.cluster.rollout_nodes == 0:
        return 0.0
    gb = inputs.dims.num_parameters() * inputs.assumptions.server_bytes_per_param / 1e9
    if inputs.workload.sync == "disk":
        write = gb / inputs.layout.pipeline_parallel / inputs.assumptions.checkpoint_write_gbps
        return write + gb / inputs.assumptions.server_load_gbps
    return gb / inputs.assumptions.sync_broadcast_gbps


def step_flops(inputs: PlanInputs, lengths: ResponseLengths | None = None) -> tuple[float, float]:
    """(trainer, rollout) FLOPs of one step at the mean response length of ``lengths`` (``inputs.lengths()``
    when None), by ``pipeline.stats.flops``.

    Trainer: every trained row's update plus one forward of it per extra log-prob pass. Rollout: each
    prompt's prefill once per sampling round (both engines prefill a prompt once for all the samples
    of a request), and every sampled response's decode.
    """
    cost, workload, trainer = inputs.dims.forward_cost(), inputs.workload, inputs.trainer
    prompt = workload.prompt_tokens
    response = (lengths or inputs.lengths()).mean
    rows = workload.prompts_per_step * workload.trained_per_prompt
    forwards = int(trainer.old_logprob_forward) + int(trainer.reference_model)
    train = rows * (update_flops(cost, prompt + response, recompute=trainer.recompute)
                    + forwards * sequence_forward_flops(cost, prompt + response))
    rounds = math.ceil(workload.sampled_per_prompt / workload.in_flight_per_prompt)
    rollout = (workload.prompts_per_step * rounds * prefill_flops(cost, prompt)
               + workload.prompts_per_step * workload.sampled_per_prompt
               * generation_flops(cost, prompt_tokens=prompt, generated_tokens=response))
    return float(train), float(rollout)


def time_plan(inputs: PlanInputs) -> TimePlan:
    """Step time: the update at the trainer MFU over the trainer GPUs (stretched by the pipeline bubble),
    the prefill at the rollout MFU over the generators' GPUs, generation by ``generation_seconds``, the
    weight push by ``sync_seconds``, DEPO's estimator (``estimator_step_flops``) at the estimator MFU
    of one GPU's fp32 peak."""
    lengths = inputs.lengths()
    train, rollout = step_flops(inputs, lengths)
    peak = inputs.cluster.gpu.peak_tflops * 1e12
    bubble = pipeline_bubble(inputs.layout.pipeline_parallel, num_micro_batches(inputs))
    trainer_rate = inputs.cluster.trainer_gpus * peak * inputs.assumptions.mfu * (1 - bubble)
    # What recompute adds: full, a forward of every trained row; selective, its attention scores.
    cost, workload = inputs.dims.forward_cost(), inputs.workload
    row = workload.prompt_tokens + lengths.mean
    rows = workload.prompts_per_step * workload.trained_per_prompt
    recompute = rows * (update_flops(cost, row, recompute=inputs.trainer.recompute) - update_flops(cost, row))
    # Servers generate on the rollout nodes' GPUs; without any, global rank 0 generates alone with its
    # in-process copy while the other trainer ranks wait (``MemoryBreakdown.generator_weights``).
    batches = generation_batches(inputs)
    rounds = batches.rounds
    generator_rate = batches.generators * batches.gpus_per_generator * peak * inputs.assumptions.rollout_mfu
    prefill = workload.prompts_per_step * rounds * prefill_flops(cost, workload.prompt_tokens)

    def at(value: float) -> ResponseLengths:
        return ResponseLengths.of([value], max_new_tokens=workload.max_new_tokens, source="one length")

    # Only servers on GPUs of their own generate while the trainer updates; a generator that
    # shares the trainer's GPUs takes its time from the update.
    overlapped = inputs.workload.max_staleness > 0 and inputs.cluster.rollout_gpus > 0
    score, train_estimator = estimator_step_flops(inputs.estimator) if inputs.estimator is not None else (0.0, 0.0)
    estimator_rate = inputs.cluster.gpu.peak_fp32_tflops * 1e12 * inputs.assumptions.estimator_mfu
    return TimePlan(train_flops=train, rollout_flops=rollout, train_s=train / trainer_rate,
                    recompute_s=recompute / trainer_rate, prefill_s=prefill / generator_rate,
                    generation_s=generation_seconds(inputs, lengths, batches),
                    generation_mean_s=generation_seconds(inputs, at(lengths.mean), batches),
                    generation_max_s=generation_seconds(inputs, at(workload.max_new_tokens), batches),
                    bubble=bubble, lengths=lengths, batches=batches, sync_s=sync_seconds(inputs),
                    overlapped=overlapped, estimator_score_flops=score, estimator_train_flops=train_estimator,
                    estimator_score_s=score / estimator_rate, estimator_train_s=train_estimator / estimator_rate)


# ---------------------------------------------------------------------------------- plan


@dataclass(kw_only=True, slots=True, frozen=True)
class Plan:
    inputs: PlanInputs
    stages: list[MemoryBreakdown]
    kv: KVCachePlan | None
    time: TimePlan
    problems: list[str]  # every reason the job will not run as configured
    smallest_layout: Layout | None  # the smallest TP×PP that fits on this cluster (None: none does)

    @property
    def worst(self) -> MemoryBreakdown:
        return max(self.stages, key=lambda stage: stage.total)

    @property
    def margin_bytes(self) -> int:
        """Usable per-GPU memory minus the worst stage's need (negative: short by that much)."""
        return self.inputs.cluster.usable_bytes - self.worst.total

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def gpu_hours(self) -> float:
        gpus = self.inputs.cluster.trainer_gpus + self.inputs.cluster.rollout_gpus
        return self.time.step_s * self.inputs.workload.steps * self.inputs.workload.num_runs * gpus / 3600


def layout_problems(dims: ModelDims, layout: Layout, cluster: Cluster) -> list[str]:
    """What megatron-core and winnow's factory refuse for this layout on this cluster."""
    tp, pp = layout.tensor_parallel, layout.pipeline_parallel
    problems = []
    if layout.model_parallel * layout.data_parallel != cluster.trainer_gpus:
        problems.append(f"layout: TP×PP×DP = {layout.model_parallel * layout.data_parallel} ranks, the trainer has "
                        f"{cluster.trainer_gpus} GPUs")
    if tp > cluster.gpus_per_node:
        problems.append(f"tensor_parallel: {tp} spans nodes ({cluster.gpus_per_node} GPUs per node)")
    for name, count in (("num_attention_heads", dims.num_attention_heads), ("num_key_value_heads", dims.num_kv_heads),
                        ("intermediate_size", dims.ffn_hidden_size), ("vocab_size", dims.vocab_size)):
        if count % tp:
            problems.append(f"tensor_parallel: {tp} does not divide {name}={count}")
    if dims.num_layers % pp:
        problems.append(f"pipeline_parallel: {pp} does not divide num_hidden_layers={dims.num_layers}")
    return problems


def _memory_problems(inputs: PlanInputs, stages: list[MemoryBreakdown]) -> list[str]:
    worst = max(stages, key=lambda stage: stage.total)
    usable = inputs.cluster.usable_bytes
    if worst.total <= usable:
        return []
    return [f"memory: stage {worst.stage} needs {worst.total / GIB:.1f} GiB per GPU, "
            f"{(worst.total - usable) / GIB:.1f} GiB more than the {usable / GIB:.1f} GiB usable"]


def candidate_layouts(dims: ModelDims, cluster: Cluster) -> list[Layout]:
    """Valid TP×PP layouts on the trainer GPUs, smallest model-parallel size first (TP before PP)."""
    found = []
    for tp in (1, 2, 4, 8, 16):
        for pp in range(1, dims.num_layers + 1):
            if cluster.trainer_gpus % (tp * pp):
                continue
            layout = Layout(tensor_parallel=tp, pipeline_parallel=pp, data_parallel=cluster.trainer_gpus // (tp * pp))
            if not layout_problems(dims, layout, cluster):
                found.append(layout)
    return sorted(found, key=lambda layout: (layout.model_parallel, layout.pipeline_parallel))


def smallest_fitting_layout(inputs: PlanInputs) -> Layout | None:
    """The first candidate layout whose worst stage fits the usable memory."""
    for layout in candidate_layouts(inputs.dims, inputs.cluster):
        trial = replace(inputs, layout=layout)
        if not _memory_problems(trial, memory_plan(trial)):
            return layout
    return None


def plan(inputs: PlanInputs) -> Plan:
    """The verdict: memory per stage, KV cache, context, step time, and every problem found."""
    problems = layout_problems(inputs.dims, inputs.layout, inputs.cluster)
    stages = memory_plan(inputs)
    problems += _memory_problems(inputs, stages)
    context = context_problem(inputs.dims, max_new_tokens=inputs.workload.max_new_tokens,
                              prompt_tokens=inputs.workload.prompt_tokens)
    if context is not None:
        problems.append(f"context: {context}")
    kv = kv_cache_plan(inputs)
    if kv is not None:
        server_gpus = inputs.cluster.servers_per_node * inputs.cluster.server_tensor_parallel
        if server_gpus > inputs.cluster.gpus_per_node:
            problems.append(f"rollout: {inputs.cluster.servers_per_node} servers × TP "
                            f"{inputs.cluster.server_tensor_parallel} need {server_gpus} GPUs per node, a node has "
                            f"{inputs.cluster.gpus_per_node}")
        if kv.capacity_tokens < inputs.seq_length:
            problems.append(f"rollout: a server's KV cache holds {kv.capacity_tokens} tokens, less than one "
                            f"{inputs.seq_length}-token sequence (weights {kv.server_weights / GIB:.1f} GiB per GPU)")
    smallest = smallest_fitting_layout(inputs)
    return Plan(inputs=inputs, stages=stages, kv=kv, time=time_plan(inputs), problems=problems,
                smallest_layout=smallest)


# ------------------------------------------------------------------------ from configs


def load_model_dims(path: str | Path) -> ModelDims:
    """A ``config.json``, a Hugging Face folder, or a winnow checkpoint (its manifest's spec)."""
    path = Path(path)
    if path.is_file() or (path / "config.json").is_file():
        return ModelDims.from_hf_config(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    from pipeline.checkpoint.artifact import LATEST_FILE, MANIFEST_FILE, checkpoint_spec, resolve_checkpoint

    run_dir = path
    nested = path / "checkpoints"  # a bootstrap cache entry keeps its run one level down
    if nested.is_dir() and not (path / MANIFEST_FILE).is_file() and not (path / LATEST_FILE).is_file():
        run_dir = nested
    step_dir = resolve_checkpoint(run_dir)
    return ModelDims.from_spec(checkpoint_spec(step_dir), name=path.name)


def workload_from_rl(cfg: Any, *, prompt_tokens: int, num_runs: int = 1) -> Workload:
    """An ``RLConfig``'s step shape, worst case per sampling method.

    ``single``: G samples per prompt, all at once; ``ada_seq``: rounds of ``round_size`` up to
    ``max_samples`` per prompt, down-sampled to G for the update; ``dynamic`` (DAPO): up to
    ``max_rounds`` rounds of G; Ada-Est budgets average G per prompt (the batch total is fixed).
    """
    algorithm = cfg.algorithm
    group = cfg.group_size
    sampled, in_flight = group, group
    if algorithm.sampling == "ada_seq":
        sampled, in_flight = algorithm.ada_seq.max_samples, algorithm.ada_seq.round_size
    elif algorithm.sampling == "dynamic":
        sampled = group * algorithm.dynamic.max_rounds
    return Workload(prompts_per_step=cfg.prompts_per_step, trained_per_prompt=group, sampled_per_prompt=sampled,
                    in_flight_per_prompt=in_flight, prompt_tokens=prompt_tokens, max_new_tokens=cfg.max_new_tokens,
                    steps=cfg.steps, num_runs=num_runs, max_staleness=cfg.rollout.max_staleness,
                    sync=cfg.rollout.sync)


def in_flight_from_rl(cfg: Any, cluster: Cluster) -> InFlightLimit | None:
    """The sequences an ``RLConfig``'s SGLang client keeps in flight on ``cluster``'s servers (None: none),
    by the rule the client itself follows (``pipeline.config.rollout_in_flight_limit``)."""
    num_servers = cluster.rollout_nodes * cluster.servers_per_node
    return rollout_in_flight_limit(cfg.rollout, num_servers=num_servers) if num_servers else None


def trainer_settings_from_rl(cfg: Any, *, distributed_optimizer: bool, recompute: Recompute,
                             backend: Backend = "te") -> TrainerSettings:
    """The trainer as an ``RLConfig`` runs it, with the two options the trainer does not have yet
    (``distributed_optimizer``, ``recompute``) given explicitly."""
    return TrainerSettings(
        precision=cfg.trainer.precision, distributed_optimizer=distributed_optimizer, recompute=recompute,
        backend=backend, micro_batch_tokens=cfg.trainer.micro_batch_tokens,
        logprob_buffer_mib=cfg.trainer.logprob_buffer_mib, reference_model=cfg.algorithm.kl_coef > 0,
        old_logprob_forward=cfg.trainer.old_logprobs == "recompute",
    )


def layout_from_rl(cfg: Any, *, trainer_gpus: int) -> Layout:
    """``parallel.tensor_parallel`` × ``parallel.pipeline_parallel``; data parallel takes the rest."""
    tp, pp = cfg.parallel.tensor_parallel, cfg.parallel.pipeline_parallel
    return Layout(tensor_parallel=tp, pipeline_parallel=pp, data_parallel=max(1, trainer_gpus // (tp * pp)))


# ---------------------------------------------------------------- context of every generating stage


# The longest templated prompt the planner assumes for a Hugging Face model (``--prompt-tokens``):
# a competition math problem under a chat template, with room to spare.
DEFAULT_PROMPT_TOKENS = 1024


def prompt_allowance(dims: ModelDims, prompt_tokens: int | None = None) -> int:
    """The prompt length every generating stage must leave room for: ``prompt_tokens`` when given,
    else ``DEFAULT_PROMPT_TOKENS`` or a quarter of the model's positions, whichever is smaller.

    The quarter covers the models winnow builds itself: the CPU bootstrap policy has 128 positions
    (an allowance of 32) and its arithmetic prompts take at most 18 of its tokens (difficulty 5,
    raw template). For 4,096 positions and more the allowance is the full 1,024.
    """
    if prompt_tokens is not None:
        return prompt_tokens
    return min(DEFAULT_PROMPT_TOKENS, dims.max_position_embeddings // 4)


def context_problem(dims: ModelDims, *, max_new_tokens: int, prompt_tokens: int,
                    field: str = "max_new_tokens") -> str | None:
    """Why ``max_new_tokens`` after a ``prompt_tokens``-token prompt overflows the model, naming ``field``
    and the longest length that fits; None when it fits."""
    positions = dims.max_position_embeddings
    if prompt_tokens + max_new_tokens <= positions:
        return None
    room = positions - prompt_tokens
    fix = f"{field} ≤ {room} fits" if room >= 1 else "the prompt alone fills the context"
    return (f"{field}: {max_new_tokens} new tokens + a ~{prompt_tokens}-token prompt exceed {dims.name}'s "
            f"{positions} positions ({fix})")


def bootstrap_model_dims(cfg: Any) -> ModelDims:
    """A ``BootstrapConfig``'s policy before it exists: its ``model`` section. The vocabulary is the
    configured size padded to ``vocab_multiple``, an upper bound (the trained tokenizer may hold fewer)."""
    vocab_size = math.ceil(cfg.vocab_size / cfg.vocab_multiple) * cfg.vocab_multiple
    return ModelDims.from_spec(ModelSpec.from_model_config(cfg.model, vocab_size=vocab_size),
                               name="the bootstrap policy")


@dataclass(kw_only=True, slots=True, frozen=True)
class StageContext:
    """One generating stage of a campaign: its generation length and the model that bounds it."""

    stage: str
    kind: str
    field: str  # the dotted option holding max_new_tokens (``StageKind.generation_length_option``)
    max_new_tokens: int
    source: str  # what the model's dimensions are read from: a path, or a bootstrap's model section
    dims: ModelDims | None = None
    unreadable: str | None = None  # why ``dims`` could not be read here (then None)

    @property
    def option(self) -> str:
        """``<stage>.<field>``: the override that sets this stage's length."""
        return f"{self.stage}.{self.field}"

    def problem(self, prompt_tokens: int | None = None) -> str | None:
        """The context refusal at the given prompt allowance (``prompt_allowance``'s default when None)."""
        assert self.dims is not None, "an unreadable model has no context to check"
        return context_problem(self.dims, max_new_tokens=self.max_new_tokens,
                               prompt_tokens=prompt_allowance(self.dims, prompt_tokens), field=self.option)


def stage_generation(stage: Any) -> tuple[str, int]:
    """(the dotted option, its value) of a generating stage's ``max_new_tokens`` (``StageKind.generation_length_option``)."""
    field_name = stage.stage_kind.generation_length_option
    value: Any = stage.config
    for part in field_name.split("."):
        value = getattr(value, part)
    return field_name, int(value)


def stage_contexts(campaign: Any) -> list[StageContext]:
    """Every rl, curate and evaluate stage of a ``CampaignPlan`` with the model config it generates with.

    A stage's model is, in order: its SGLang servers' ``resources.rollout.model_path`` (the
    servers' context is that folder's); for an rl stage without a policy, its ``bootstrap``
    section; else its ``policy``. A path that an earlier stage of the campaign writes is
    resolved through that stage, so nothing has to exist yet: a bootstrap's cache entry is its
    ``model`` section, a ``convert`` stage's run is its ``hf`` folder, an rl stage's checkpoint
    directory (what evaluation and export read) is the model that rl stage trains, an export
    is the checkpoint it converts. Anything else is read from disk here (``load_model_dims``);
    when that fails the stage comes back with ``unreadable`` set.
    """
    found = []
    for stage in campaign.stages:
        if stage.stage_kind.generation_length_option is None:
            continue
        field_name, max_new_tokens = stage_generation(stage)
        source, dims, unreadable = _stage_model(campaign, stage, seen=frozenset({stage.name}))
        found.append(StageContext(stage=stage.name, kind=stage.kind, field=field_name, max_new_tokens=max_new_tokens,
                                  source=source, dims=dims, unreadable=unreadable))
    return found


_ModelSource = tuple[str, ModelDims | None, str | None]  # (source, dims, why unreadable)


def _stage_model(campaign: Any, stage: Any, *, seen: frozenset[str]) -> _ModelSource:
    cfg, kind = stage.config, stage.kind
    if kind == "bootstrap":
        return f"{stage.name}.model", bootstrap_model_dims(cfg), None
    if kind == "convert":
        return _path_model(campaign, cfg.hf, seen=seen)
    if kind == "export":
        return _path_model(campaign, cfg.checkpoint, seen=seen)
    rollout = stage.resources.rollout
    if rollout is not None and rollout.model_path:
        return _path_model(campaign, rollout.model_path, seen=seen)
    if kind == "rl" and cfg.policy is None:
        return f"{stage.name}.bootstrap.model", bootstrap_model_dims(cfg.bootstrap), None
    if not cfg.policy:
        return f"{stage.name}.policy", None, "no policy is set"
    return _path_model(campaign, cfg.policy, seen=seen)


def _path_model(campaign: Any, path: str, *, seen: frozenset[str]) -> _ModelSource:
    producer = _producer(campaign, Path(path), exclude=seen)
    if producer is not None:
        return _stage_model(campaign, producer, seen=seen | {producer.name})
    try:
        return path, load_model_dims(path), None
    except (ValueError, OSError) as error:  # UserError and CheckpointError are ValueErrors
        return path, None, str(error)


def _producer(campaign: Any, path: Path, *, exclude: frozenset[str]) -> Any | None:
    """The stage of ``campaign`` that writes ``path`` (or a folder holding it), if any."""
    target = path.expanduser().absolute()
    for stage in campaign.stages:
        if stage.name in exclude:
            continue
        written = _written_model_dir(stage)
        if written is not None and target.is_relative_to(written.expanduser().absolute()):
            return stage
    return None


def _written_model_dir(stage: Any) -> Path | None:
    """Where a stage writes a model: a bootstrap's cache entry, a conversion's or export's output, an rl
    stage's checkpoints; None for stages that write none."""
    cfg = stage.config
    if stage.kind == "bootstrap":
        from pipeline.io import resolve_cache_dir
        from pipeline.stages.bootstrap import config_hash

        return resolve_cache_dir(cfg.cache_dir) / config_hash(cfg)
    if stage.stage_kind.converts_model:
        return Path(cfg.out)
    if stage.kind == "rl":
        return Path(cfg.checkpoint.directory)
    return None
