"""``ModelSpec``: the architecture of a Llama/Qwen2/Qwen3 decoder, independent of megatron.

A ``ModelSpec`` is read from (and written back to) a Hugging Face ``config.json``
of ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM``. Qwen3 (dense) is
the Qwen2 layout without q/k/v biases plus an RMSNorm over each query and key head
(``q_norm``/``k_norm``, applied before RoPE), with ``head_dim`` set explicitly (128 for
every published size, which is not ``hidden_size / num_attention_heads`` for 4B or 8B). Only what the megatron
``GPTModel`` built by ``pipeline.models.factory`` reproduces exactly is accepted;
every other feature is rejected with a ``ValueError`` that names the field, so a
checkpoint never silently loads into a different architecture. What differs by family
(Hugging Face names, biases, q/k norms, config defaults, refused switches) is read from the
table in ``pipeline.models.families``.

Both spellings of RoPE settings are read: transformers 4.x (``rope_theta`` +
``rope_scaling``) and transformers 5.x (``rope_parameters`` holding
``rope_theta`` and the scaling keys). ``to_hf_config`` writes the 4.x spelling,
which transformers 5 also reads, so SGLang images pinned to either major
version load the exported config.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Mapping

from pipeline.models.families import Family, model_family

if TYPE_CHECKING:
    from pipeline.config import ModelConfig

__all__ = ["LLAMA3_ROPE_DEFAULTS", "ModelSpec"]

# megatron-core 0.16.1 implements Llama-3 RoPE scaling with these three values
# hard-coded (RotaryEmbedding._apply_scaling); only `factor` reaches it from the
# model constructor. A config with other values would silently get these, so it
# is rejected instead. Version-sensitive: re-check when upgrading megatron-core.
LLAMA3_ROPE_DEFAULTS: dict[str, float] = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

_REQUIRED_HF_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)


@dataclass(kw_only=True, slots=True, frozen=True)
class ModelSpec:
    """Architecture of a pre-norm RMSNorm/SwiGLU/RoPE decoder (Llama, Qwen2 and Qwen3 families).

    ``qk_layernorm`` (derived from the family): an RMSNorm of ``head_dim`` weights over every
    query head and one over every key head, before RoPE (Qwen3's ``q_norm``/``k_norm``).
    ``rope_scaling`` is ``None`` or a Llama-3 scaling dict with keys ``rope_type``
    (``"llama3"``), ``factor``, ``low_freq_factor``, ``high_freq_factor`` and
    ``original_max_position_embeddings``. ``head_dim`` defaults to
    ``hidden_size // num_attention_heads``.
    """

    family: Family
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rope_scaling: Mapping[str, Any] | None = None
    norm_eps: float = 1e-6
    qkv_bias: bool = False
    tie_embeddings: bool = False
    head_dim: int | None = None
    activation: Literal["swiglu"] = "swiglu"

    def __post_init__(self) -> None:
        model_family(self.family, field="family")
        if self.activation != "swiglu":
            raise ValueError(f"activation: only 'swiglu' is supported, got {self.activation!r}")
        for name in (
            "vocab_size",
            "hidden_size",
            "ffn_hidden_size",
            "num_layers",
            "num_attention_heads",
            "num_query_groups",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size: {self.hidden_size} is not divisible by num_attention_heads="
                f"{self.num_attention_heads}; set head_dim explicitly"
            )
        if self.head_dim is not None and (isinstance(self.head_dim, bool) or self.head_dim <= 0):
            raise ValueError(f"head_dim: expected a positive integer, got {self.head_dim!r}")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_query_groups: {self.num_query_groups} does not divide "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if not (math.isfinite(self.rope_theta) and self.rope_theta > 0):
            raise ValueError(f"rope_theta: expected a positive finite number, got {self.rope_theta!r}")
        if not (math.isfinite(self.norm_eps) and self.norm_eps > 0):
            raise ValueError(f"norm_eps: expected a positive finite number, got {self.norm_eps!r}")
        if self.rope_scaling is not None:
            object.__setattr__(self, "rope_scaling", _validated_llama3_scaling(self.rope_scaling))

    @property
    def qk_layernorm(self) -> bool:
        """Whether every query and key head is RMS-normalized before RoPE (Qwen3)."""
        return model_family(self.family).qk_norm

    @property
    def kv_channels(self) -> int:
        """Per-head dimension (megatron's ``kv_channels``)."""
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any] | str | Path) -> ModelSpec:
        """Read a ``LlamaConfig``/``Qwen2Config``/``Qwen3Config`` dict, ``config.json`` path, or model directory."""
        hf = _load_hf_config(config)
        family = model_family(hf.get("model_type"))
        missing = [key for key in _REQUIRED_HF_KEYS if hf.get(key) is None]
        if missing:
            raise ValueError(f"{missing[0]}: required in a {family.model_type} config but missing")
        defaults = family.hf_defaults

        def get(key: str) -> Any:
            value = hf.get(key)
            return defaults[key] if value is None else value

        if get("hidden_act") != "silu":
            raise ValueError(f"hidden_act: only 'silu' (SwiGLU) is supported, got {hf['hidden_act']!r}")
        if float(hf.get("attention_dropout") or 0.0) != 0.0:
            raise ValueError(
                f"attention_dropout: the RL actor trains without dropout, got {hf['attention_dropout']!r}"
            )
        for key, adds in family.unsupported_switches.items():
            if hf.get(key):
                raise ValueError(f"{key}: {adds} are not supported for {family.model_type}")
        layer_types = hf.get("layer_types")
        if layer_types is not None and any(kind != "full_attention" for kind in layer_types):
            raise ValueError("layer_types: only 'full_attention' layers are supported")

        rope_theta, rope_scaling = _read_rope(hf, default_theta=defaults["rope_theta"])
        num_heads = int(hf["num_attention_heads"])
        num_kv_heads = hf.get("num_key_value_heads")
        head_dim = get("head_dim")
        hidden_size = int(hf["hidden_size"])
        return cls(
            family=family.model_type,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden_size,
            ffn_hidden_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_attention_heads=num_heads,
            num_query_groups=int(num_kv_heads) if num_kv_heads is not None else num_heads,
            max_position_embeddings=int(get("max_position_embeddings")),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            norm_eps=float(get("rms_norm_eps")),
            qkv_bias=family.qkv_bias,
            tie_embeddings=bool(get("tie_word_embeddings")),
            # An explicit head_dim equal to the derived one is the common case; store None
            # so that specs compare equal whichever way the config spelled it.
            head_dim=None if head_dim is None or int(head_dim) == hidden_size // num_heads else int(head_dim),
        )

    @classmethod
    def from_model_config(cls, model: ModelConfig, *, vocab_size: int) -> ModelSpec:
        """A from-scratch policy's architecture (a bootstrap's ``model`` section); the tokenizer sets ``vocab_size``."""
        return cls(
            family=model.family, vocab_size=vocab_size, hidden_size=model.hidden_size,
            ffn_hidden_size=model.ffn_hidden_size, num_layers=model.num_layers,
            num_attention_heads=model.num_attention_heads, num_query_groups=model.num_query_groups,
            max_position_embeddings=model.max_position_embeddings, rope_theta=model.rope_theta,
            qkv_bias=model_family(model.family).qkv_bias, tie_embeddings=model.tie_embeddings,
        )

    def to_hf_config(self) -> dict[str, Any]:
        """The ``config.json`` dict of the equivalent Hugging Face model (transformers 4.x keys)."""
        family = model_family(self.family)
        config: dict[str, Any] = {
            "architectures": [family.architecture],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.ffn_hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_query_groups,
            "head_dim": self.kv_channels,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling is not None else None,
            "tie_word_embeddings": self.tie_embeddings,
            "attention_dropout": 0.0,
        }
        config.update(dict.fromkeys(family.unsupported_switches, False))
        return config

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of the fields, for checkpoint metadata."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if self.rope_scaling is not None:
            fields["rope_scaling"] = dict(self.rope_scaling)
        return fields


def _load_hf_config(config: Mapping[str, Any] | str | Path) -> dict[str, Any]:
    if isinstance(config, Mapping):
        return dict(config)
    path = Path(config)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"config: no config.json at {path}")
    with path.open(encoding="utf-8") as f:
        loaded = json.load(f)
    if not isinstance(loaded, dict):
        raise ValueError(f"config: {path} does not hold a JSON object")
    return loaded


def _read_rope(hf: Mapping[str, Any], *, default_theta: float) -> tuple[float, dict[str, Any] | None]:
    """RoPE base and scaling from either the transformers 4.x or 5.x spelling."""
    legacy_theta = hf.get("rope_theta")
    legacy_scaling = hf.get("rope_scaling")
    parameters = hf.get("rope_parameters")
    if parameters is None:
        theta = default_theta if legacy_theta is None else legacy_theta
        return theta, _scaling_or_none(legacy_scaling, field="rope_scaling")
    if not isinstance(parameters, Mapping):
        raise ValueError(f"rope_parameters: expected a mapping, got {parameters!r}")
    parameters = dict(parameters)
    theta = parameters.pop("rope_theta", None)
    if theta is None:
        theta = default_theta if legacy_theta is None else legacy_theta
    elif legacy_theta is not None and float(legacy_theta) != float(theta):
        raise ValueError(
            f"rope_theta: {legacy_theta!r} disagrees with rope_parameters.rope_theta={theta!r}"
        )
    scaling = _scaling_or_none(parameters, field="rope_parameters")
    if legacy_scaling is not None and _scaling_or_none(legacy_scaling, field="rope_scaling") != scaling:
        raise ValueError("rope_scaling: disagrees with rope_parameters")
    return theta, scaling


def _scaling_or_none(scaling: Any, *, field: str) -> dict[str, Any] | None:
    if scaling is None:
        return None
    if not isinstance(scaling, Mapping):
        raise ValueError(f"{field}: expected a mapping, got {scaling!r}")
    # transformers 4.x used "type" before "rope_type".
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type != "llama3":
        raise ValueError(f"{field}.rope_type: only 'llama3' scaling is supported, got {rope_type!r}")
    return _validated_llama3_scaling(scaling, field=field)


def _validated_llama3_scaling(scaling: Mapping[str, Any], *, field: str = "rope_scaling") -> dict[str, Any]:
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type != "llama3":
        raise ValueError(f"{field}.rope_type: only 'llama3' scaling is supported, got {rope_type!r}")
    factor = scaling.get("factor")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor >= 1.0:
        raise ValueError(f"{field}.factor: expected a number >= 1, got {factor!r}")
    validated: dict[str, Any] = {"rope_type": "llama3", "factor": float(factor)}
    for key, supported in LLAMA3_ROPE_DEFAULTS.items():
        value = scaling.get(key)
        if value is None:
            raise ValueError(f"{field}.{key}: required for llama3 scaling but missing")
        if float(value) != float(supported):
            raise ValueError(
                f"{field}.{key}: megatron-core applies llama3 scaling with {key}={supported} only, "
                f"got {value!r}"
            )
        validated[key] = type(supported)(value)
    return validated
