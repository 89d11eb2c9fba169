"""Layer-spec selection: Transformer Engine (optionally FP8) on GPUs, megatron's local modules otherwise.

``select_layer_spec`` picks the Transformer Engine spec only when
``transformer_engine`` imports *and* CUDA is present; otherwise it builds an
explicit local spec from megatron-core's own modules (torch ``RMSNorm`` via
``WrappedTorchNorm``, ``ColumnParallelLinear``/``RowParallelLinear``) and
``SDPADotProductAttention`` (megatron's ``DotProductAttention`` computed by
torch's fused ``scaled_dot_product_attention``, see ``local_modules``). The
local spec is assembled here rather than taken from ``get_gpt_layer_local_spec``
because that function (and ``TransformerBlock`` for a bare layer spec) picks
TE's norm whenever TE is installed, which cannot run without CUDA. The final norm is chosen alongside
(``final_norm_module``) for the same reason.

The decision is returned as a ``LayerSpecChoice`` whose ``to_dict()`` goes into
checkpoint metadata, and logged.

FP8 needs the TE spec; asking for FP8 where TE or CUDA is missing is a
``ValueError``, never a silent fallback to bf16.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from pipeline.models.local_modules import SDPADotProductAttention
from pipeline.models.spec import ModelSpec

__all__ = [
    "FP8Options",
    "LayerSpecChoice",
    "apex_fused_wgrad_available",
    "cuda_available",
    "final_norm_module",
    "local_layer_spec",
    "select_layer_spec",
    "te_layer_spec",
    "transformer_engine_available",
]

logger = logging.getLogger(__name__)

# megatron's name for per-tensor current scaling is "tensorwise".
_MEGATRON_FP8_RECIPE = {"delayed": "delayed", "current": "tensorwise"}


@dataclass(kw_only=True, slots=True, frozen=True)
class FP8Options:
    """FP8 training through Transformer Engine, mapped onto ``TransformerConfig``'s ``fp8*`` fields.

    ``format``: ``"hybrid"`` (E4M3 forward, E5M2 gradients) or ``"e4m3"``.
    ``recipe``: ``"delayed"`` scaling from an amax history, or ``"current"``
    (per-tensor current scaling, megatron's ``"tensorwise"``). ``margin``,
    ``amax_history_len`` and ``amax_compute_algo`` configure delayed scaling
    (TE's recommended history of 1024 with ``"max"``). ``wgrad=False`` computes
    weight gradients in high precision; ``param=True`` keeps weights in FP8.
    """

    enabled: bool = False
    format: Literal["hybrid", "e4m3"] = "hybrid"
    recipe: Literal["delayed", "current"] = "delayed"
    margin: int = 0
    amax_history_len: int = 1024
    amax_compute_algo: Literal["max", "most_recent"] = "max"
    wgrad: bool = True
    param: bool = False

    def __post_init__(self) -> None:
        if self.format not in ("hybrid", "e4m3"):
            raise ValueError(f"fp8.format: expected 'hybrid' or 'e4m3', got {self.format!r}")
        if self.recipe not in _MEGATRON_FP8_RECIPE:
            raise ValueError(f"fp8.recipe: expected 'delayed' or 'current', got {self.recipe!r}")
        if self.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(
                f"fp8.amax_compute_algo: expected 'max' or 'most_recent', got {self.amax_compute_algo!r}"
            )
        if self.amax_history_len < 1:
            raise ValueError(f"fp8.amax_history_len: expected >= 1, got {self.amax_history_len}")
        if self.margin < 0:
            raise ValueError(f"fp8.margin: expected >= 0, got {self.margin}")

    @property
    def token_multiple(self) -> int:
        """What a micro-batch's flattened token count must be a multiple of.

        Transformer Engine 2.11 (``transformer_engine.pytorch.utils.assert_dim_for_fp8_exec``)
        needs the leading dimensions of an FP8 GEMM operand to multiply to a multiple of 8
        and its last dimension to be a multiple of 16; the weight-gradient GEMM puts the
        tokens last, so 16. Without FP8, 1.
        """
        return 16 if self.enabled else 1

    def transformer_config_fields(self) -> dict[str, Any]:
        """The ``TransformerConfig`` keyword arguments for these options."""
        if not self.enabled:
            return {"fp8": None, "fp8_param": False}
        return {
            "fp8": self.format,
            "fp8_recipe": _MEGATRON_FP8_RECIPE[self.recipe],
            "fp8_margin": self.margin,
            "fp8_amax_history_len": self.amax_history_len,
            "fp8_amax_compute_algo": self.amax_compute_algo,
            "fp8_wgrad": self.wgrad,
            "fp8_param": self.param,
        }


@dataclass(kw_only=True, slots=True, frozen=True)
class LayerSpecChoice:
    """Which layer implementation was built and why; saved with checkpoints."""

    name: Literal["te", "local"]
    reason: str
    fp8_recipe: Literal["delayed", "current"] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def transformer_engine_available() -> bool:
    """Whether ``transformer_engine.pytorch`` imports (a broken install counts as absent)."""
    try:
        importlib.import_module("transformer_engine.pytorch")
    except Exception as error:  # noqa: BLE001 - TE raises OSError/RuntimeError for missing CUDA libs
        logger.debug("transformer_engine unavailable: %r", error)
        return False
    return True


def apex_fused_wgrad_available() -> bool:
    """Whether APEX's ``fused_weight_gradient_mlp_cuda`` extension imports.

    megatron-core's ``ColumnParallelLinear`` (always the output layer, whatever the layer
    spec) refuses ``gradient_accumulation_fusion=True`` without it. Neither pip nor
    Transformer Engine installs it; NGC PyTorch containers ship it.
    """
    try:
        importlib.import_module("fused_weight_gradient_mlp_cuda")
    except Exception as error:  # noqa: BLE001 - a broken CUDA extension raises more than ImportError
        logger.debug("APEX fused weight-gradient kernel unavailable: %r", error)
        return False
    return True


def cuda_available() -> bool:
    return torch.cuda.is_available()


def te_layer_spec(*, qk_layernorm: bool = False) -> ModuleSpec:
    """megatron's TE layer spec (norms fused into the following linear layers).

    With ``qk_layernorm`` the q/k norms are separate ``TENorm`` modules
    (``self_attention.q_layernorm`` / ``k_layernorm``), which honour
    ``normalization="RMSNorm"`` like the fused ones.
    """
    return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm)


def local_layer_spec(*, qk_layernorm: bool = False) -> ModuleSpec:
    """A pre-norm decoder layer from megatron-core's local (non-TE) modules, torch RMSNorm, SDPA attention.

    With ``qk_layernorm`` ``SelfAttention`` builds a torch RMSNorm of ``head_dim`` weights for
    queries and one for keys and applies them to the ``(T, B, heads, head_dim)`` tensors
    before RoPE, as Qwen3 does (megatron-core 0.16.1 ``get_query_key_value_tensors``).
    """
    qk_norm = WrappedTorchNorm if qk_layernorm else IdentityOp
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=WrappedTorchNorm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=ColumnParallelLinear,
                    core_attention=SDPADotProductAttention,
                    linear_proj=RowParallelLinear,
                    q_layernorm=qk_norm,
                    k_layernorm=qk_norm,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=WrappedTorchNorm,
            mlp=ModuleSpec(
                module=MLP,
                submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
            ),
            mlp_bda=get_bias_dropout_add,
            # Checkpoint keys as the TE spec names them (norms fused into the next linear),
            # so a distributed checkpoint moves between TE and local runs.
            sharded_state_dict_keys_map={
                "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
            },
        ),
    )


def final_norm_module(choice: LayerSpecChoice) -> type:
    """The norm after the last layer, matching the layer implementation."""
    if choice.name == "te":
        from megatron.core.extensions.transformer_engine import TENorm

        return TENorm
    return WrappedTorchNorm


def select_layer_spec(
    spec: ModelSpec, *, prefer_te: bool = True, fp8: FP8Options | None = None
) -> tuple[ModuleSpec, LayerSpecChoice]:
    """Pick the layer spec for this machine; see the module docstring for the rule.

    The supported families share one layer layout (RMSNorm, GQA attention with
    optional q/k/v bias, SwiGLU MLP) plus, for Qwen3, per-head q/k norms; the other
    differences live in ``TransformerConfig``.
    """
    fp8_enabled = fp8 is not None and fp8.enabled
    fp8_recipe = fp8.recipe if fp8_enabled else None
    if not prefer_te:
        if fp8_enabled:
            raise ValueError("fp8.enabled: FP8 needs the Transformer Engine spec, but prefer_te=False")
        choice = LayerSpecChoice(name="local", reason="prefer_te=False")
    else:
        has_te = transformer_engine_available()
        has_cuda = cuda_available()
        if has_te and has_cuda:
            choice = LayerSpecChoice(
                name="te",
                reason="transformer_engine importable and CUDA available",
                fp8_recipe=fp8_recipe,
            )
        else:
            missing = " and ".join(
                what for what, present in (("transformer_engine", has_te), ("CUDA", has_cuda)) if not present
            )
            if fp8_enabled:
                raise ValueError(f"fp8.enabled: FP8 needs Transformer Engine and CUDA; missing {missing}")
            choice = LayerSpecChoice(name="local", reason=f"{missing} not available")
    build = te_layer_spec if choice.name == "te" else local_layer_spec
    layer_spec = build(qk_layernorm=spec.qk_layernorm)
    logger.info(
        "%s layer spec: %s (%s), fp8 recipe: %s", spec.family, choice.name, choice.reason, choice.fp8_recipe
    )
    return layer_spec, choice
