"""Build megatron-core ``TransformerConfig`` and ``GPTModel`` for a ``ModelSpec``.

Two steps, kept apart so the trainer can inspect or adjust the config before
any parameter is allocated:

1. ``build_transformer_config(spec, choice=..., ...)``: the Llama/Qwen2/Qwen3
   architecture (RMSNorm, SwiGLU via ``gated_linear_unit`` + ``F.silu``, GQA,
   optional q/k/v bias, Qwen3's per-head q/k norms through ``qk_layernorm``, no
   other biases, no dropout) plus parallel sizes,
   dtype, FP8 fields and kernel fusions for the chosen layer implementation.
2. ``build_gpt_model(spec, parallel_context=..., ...)``: the ``GPTModel`` with
   RoPE (``rotary_base = rope_theta``; Llama-3 scaling through megatron's
   ``rope_scaling``/``rope_scaling_factor``) and, for tied embeddings,
   ``share_embeddings_and_output_weights``. Logits stay vocab-parallel
   (``parallel_output=True``): losses combine them through a TP reducer.

Fusions (``kernel_fusions``). With Transformer Engine on CUDA the fusions Megatron-LM
enables by default are on, except ``gradient_accumulation_fusion`` without APEX:
megatron's output layer is always a local ``ColumnParallelLinear``, whose constructor
raises when that flag is set and APEX's ``fused_weight_gradient_mlp_cuda`` is missing
(pip-installed TE does not provide it). Without CUDA all are off
(``CPU_DISABLED_FUSIONS`` says why for each); measured on megatron-core 0.16.1.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig

from pipeline.models.layer_spec import (
    FP8Options,
    LayerSpecChoice,
    apex_fused_wgrad_available,
    final_norm_module,
    select_layer_spec,
)
from pipeline.models.spec import ModelSpec
from pipeline.parallel import cpu_compat

if TYPE_CHECKING:
    from pipeline.parallel.context import ParallelContext

__all__ = ["CPU_DISABLED_FUSIONS", "build_gpt_model", "build_transformer_config", "kernel_fusions", "model_device"]

_COMPILED = (
    "wrapped in torch.compile (megatron.core.jit.jit_fuser): seconds of inductor compile "
    "per process on CPU for no speed-up"
)
CPU_DISABLED_FUSIONS: dict[str, str] = {
    "gradient_accumulation_fusion": "needs the fused_weight_gradient_mlp_cuda kernel (APEX or TE)",
    "persist_layer_norm": "needs APEX's persistent LayerNorm kernel; torch norms assert it is off",
    "apply_rope_fusion": "needs TE/APEX fused RoPE kernels",
    "masked_softmax_fusion": "CUDA-only kernel; megatron falls back to torch on CPU anyway",
    "bias_activation_fusion": _COMPILED,
    "bias_dropout_fusion": _COMPILED,
}

# Megatron-LM's training defaults; TE provides every kernel these need except APEX's
# fused weight-gradient accumulation of the output layer (see kernel_fusions).
_TE_FUSIONS: dict[str, bool] = {
    "gradient_accumulation_fusion": True,
    "apply_rope_fusion": True,
    "masked_softmax_fusion": True,
    "bias_activation_fusion": True,
    "bias_dropout_fusion": True,
}

# Local modules on CUDA without TE/APEX: only fusions that are torch.compile'd or
# have a torch fallback.
_LOCAL_CUDA_FUSIONS: dict[str, bool] = {
    "masked_softmax_fusion": True,
    "bias_activation_fusion": True,
    "bias_dropout_fusion": True,
}

def kernel_fusions(choice: LayerSpecChoice, *, has_cuda: bool, has_apex_wgrad: bool) -> dict[str, bool]:
    """The ``TransformerConfig`` fusion flags for a layer implementation on this machine.

    ``gradient_accumulation_fusion`` is one flag for every linear layer: TE's own layers
    would fuse without APEX, but megatron's output ``ColumnParallelLinear`` cannot, so it
    is on only with APEX. Without it TE computes weight gradients into ``.grad`` and
    megatron's DDP hook adds them to ``main_grad``: one more add per weight, same result.
    """
    if not has_cuda:
        return dict.fromkeys(CPU_DISABLED_FUSIONS, False)
    if choice.name == "te":
        return _TE_FUSIONS | {"gradient_accumulation_fusion": has_apex_wgrad}
    return dict.fromkeys(CPU_DISABLED_FUSIONS, False) | _LOCAL_CUDA_FUSIONS


_DTYPE_FLAGS: dict[torch.dtype, dict[str, bool]] = {
    torch.float32: {},
    torch.bfloat16: {"bf16": True},
    torch.float16: {"fp16": True},
}


def build_transformer_config(
    spec: ModelSpec,
    *,
    choice: LayerSpecChoice,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    context_parallel: int = 1,
    sequence_parallel: bool = False,
    params_dtype: torch.dtype = torch.float32,
    fp8: FP8Options | None = None,
    overrides: Mapping[str, Any] | None = None,
    device: torch.device | None = None,
) -> TransformerConfig:
    """The ``TransformerConfig`` for ``spec`` under the given layout and layer implementation.

    ``overrides`` sets any further ``TransformerConfig`` field (recomputation,
    ``variable_seq_lengths``...); it is applied last, and an unknown name is a
    ``ValueError``. ``device`` is where the model will live (a ``ParallelContext``'s
    ``device``); it decides CPU initialization and the kernel fusions. By default
    (``model_device``) the GPU where CUDA exists, unless the CPU layer is on.
    """
    if spec.num_layers % pipeline_parallel:
        raise ValueError(
            f"num_layers: {spec.num_layers} is not divisible by pipeline_parallel={pipeline_parallel}"
        )
    for name, count in (
        ("num_attention_heads", spec.num_attention_heads),
        ("num_query_groups", spec.num_query_groups),
        ("ffn_hidden_size", spec.ffn_hidden_size),
    ):
        if count % tensor_parallel:
            raise ValueError(f"{name}: {count} is not divisible by tensor_parallel={tensor_parallel}")
    if params_dtype not in _DTYPE_FLAGS:
        raise ValueError(f"params_dtype: expected one of {sorted(map(str, _DTYPE_FLAGS))}, got {params_dtype}")
    if sequence_parallel and choice.name != "te":
        raise ValueError(
            "sequence_parallel: not supported by the local layer spec (torch norms assert it is off)"
        )
    fp8 = fp8 or FP8Options()
    if fp8.enabled and choice.name != "te":
        raise ValueError("fp8.enabled: FP8 needs the Transformer Engine layer spec")

    has_cuda = (device if device is not None else model_device()).type == "cuda"
    fusions = kernel_fusions(choice, has_cuda=has_cuda,
                             has_apex_wgrad=has_cuda and choice.name == "te" and apex_fused_wgrad_available())

    fields: dict[str, Any] = {
        "num_layers": spec.num_layers,
        "hidden_size": spec.hidden_size,
        "ffn_hidden_size": spec.ffn_hidden_size,
        "num_attention_heads": spec.num_attention_heads,
        "num_query_groups": spec.num_query_groups,
        "kv_channels": spec.kv_channels,
        "normalization": "RMSNorm",
        "layernorm_epsilon": spec.norm_eps,
        "gated_linear_unit": True,
        "activation_func": F.silu,
        "add_bias_linear": False,
        "add_qkv_bias": spec.qkv_bias,
        # The layer spec builds the q/k norms; the flag makes finalize_model_grads sum their
        # gradients over TP ranks (each rank normalizes only its own heads with the shared
        # weight), which megatron-core 0.16.1 keys on the flag and the parameter names.
        "qk_layernorm": spec.qk_layernorm,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "tensor_model_parallel_size": tensor_parallel,
        "pipeline_model_parallel_size": pipeline_parallel,
        "context_parallel_size": context_parallel,
        "sequence_parallel": sequence_parallel,
        "params_dtype": params_dtype,
        "pipeline_dtype": params_dtype,
        **_DTYPE_FLAGS[params_dtype],
        # A CPU model is initialized on the CPU, where this also makes TP shards slices of
        # one master weight, so TP=1 and TP=2 agree exactly. A GPU model draws its weights
        # on the GPU, never on the host first.
        "use_cpu_initialization": not has_cuda,
        **fusions,
        **fp8.transformer_config_fields(),
    }
    for name, value in (overrides or {}).items():
        if name not in TransformerConfig.__dataclass_fields__:
            raise ValueError(f"overrides.{name}: not a TransformerConfig field")
        fields[name] = value
    if not fields.get("perform_initialization", True):
        # megatron-core 0.16.1 marks tensor-parallel weights (tensor_model_parallel,
        # partition_dim, partition_stride) only inside its weight initializers, so
        # skipping initialization leaves them unmarked: grad norms then drop them on
        # TP ranks > 0 and shard_full_state_dict cannot slice them.
        raise ValueError(
            "overrides.perform_initialization: False leaves tensor-parallel weights unmarked "
            "in megatron-core; initialize, then load the checkpoint over it"
        )
    return TransformerConfig(**fields)


def model_device(parallel_context: ParallelContext | None = None) -> torch.device:
    """Where ``build_gpt_model`` puts the model: the context's device, else this process's default.

    Without a context: the current CUDA device where CUDA exists and the CPU layer is off
    (``pipeline.parallel.cpu_compat``, which a gloo context turns on), else the CPU.
    """
    if parallel_context is not None:
        return parallel_context.device
    if torch.cuda.is_available() and not cpu_compat.is_enabled():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def build_gpt_model(
    spec: ModelSpec,
    *,
    parallel_context: ParallelContext | None = None,
    pre_process: bool | None = None,
    post_process: bool | None = None,
    params_dtype: torch.dtype = torch.float32,
    seed: int | None = None,
    fp8: FP8Options | None = None,
    layer_spec: tuple[ModuleSpec, LayerSpecChoice] | None = None,
    sequence_parallel: bool = False,
    config_overrides: Mapping[str, Any] | None = None,
) -> GPTModel:
    """A megatron ``GPTModel`` for ``spec`` on this rank's pipeline stage and TP shard.

    ``parallel_context`` supplies the layout and pipeline position; without it
    the model is built for TP = PP = CP = 1 (megatron's ``parallel_state``
    must still be initialized, e.g. by a one-rank ``ParallelContext``).
    ``pre_process``/``post_process`` override the pipeline position (embedding
    on the first stage, final norm and output layer on the last).
    ``layer_spec`` is a ``select_layer_spec`` result; pass the one whose
    ``LayerSpecChoice`` you record in the checkpoint. By default
    ``select_layer_spec(spec, fp8=fp8)`` is called. ``seed`` re-seeds the
    initialization RNGs first (the CPU generator, and megatron's CUDA RNG
    tracker when a context is given), making initialization reproducible.
    """
    layout = {"tensor_parallel": 1, "pipeline_parallel": 1, "context_parallel": 1}
    pp_rank = 0
    if parallel_context is not None:
        layout = {
            "tensor_parallel": parallel_context.tensor_parallel,
            "pipeline_parallel": parallel_context.pipeline_parallel,
            "context_parallel": parallel_context.context_parallel,
        }
        pp_rank = parallel_context.pp_rank
        pre_process = parallel_context.is_pipeline_first if pre_process is None else pre_process
        post_process = parallel_context.is_pipeline_last if post_process is None else post_process
    pre_process = True if pre_process is None else pre_process
    post_process = True if post_process is None else post_process
    if spec.vocab_size % layout["tensor_parallel"]:
        raise ValueError(
            f"vocab_size: {spec.vocab_size} is not divisible by tensor_parallel="
            f"{layout['tensor_parallel']}; pad the vocabulary first"
        )

    device = model_device(parallel_context)
    layer, choice = layer_spec if layer_spec is not None else select_layer_spec(spec, fp8=fp8)
    config = build_transformer_config(
        spec,
        choice=choice,
        **layout,
        sequence_parallel=sequence_parallel,
        params_dtype=params_dtype,
        fp8=fp8,
        overrides=config_overrides,
        device=device,
    )
    # An explicit block spec: megatron would otherwise pick TE's final norm whenever
    # TE is installed, even for local layers.
    block = TransformerBlockSubmodules(
        layer_specs=[layer] * get_num_layers_to_build(config, pp_rank=pp_rank),
        layer_norm=final_norm_module(choice),
    )
    if seed is not None:
        if parallel_context is not None:
            parallel_context.reseed(seed)
        else:
            torch.manual_seed(seed)
    # Llama-3 scaling: megatron takes only the factor (the other three values are
    # fixed in megatron-core 0.16.1 and checked by ModelSpec).
    rope_scaling = (
        {"rope_scaling": True, "rope_scaling_factor": spec.rope_scaling["factor"]}
        if spec.rope_scaling is not None
        else {}
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=block,
        vocab_size=spec.vocab_size,
        max_sequence_length=spec.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=spec.tie_embeddings,
        position_embedding_type="rope",
        rotary_base=spec.rope_theta,
        **rope_scaling,
    )
    if device.type == "cuda":
        # megatron allocates its parallel linear and embedding weights on the current CUDA device,
        # but the torch norms of the local spec (no TE or APEX) on torch's default device, the CPU;
        # megatron's optimizer then refuses the mix. Megatron-LM's own get_model moves the whole
        # module the same way (the norms are a few kB: the move copies nothing else).
        model.to(device)
    return model
