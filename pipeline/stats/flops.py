"""Model FLOPs of the work a campaign does: generation, prefill, update and the difficulty estimator.

The one owner of the per-token FLOPs formula: the planner (``pipeline/launch/plan.py``), each RL
step's metrics (``pipeline/rl/step.py``), the campaign ledger (``pipeline/launch/ledger.py``) and the
default race count with these functions. Pure arithmetic on a model's dimensions; no torch.

**A forward pass.** A token multiplies every weight matrix it passes through once (a multiply and
an add per weight: ``2·N``) and, in each layer, scores its query against the ``c`` keys it attends
to and sums their values (``QKᵀ`` and ``AV``: ``2·a·d·c`` each):

    forward(token at context c) = 2·N + 4·L·a·d·c

``N`` counts the weights a token is multiplied by: every decoder layer's Q/K/V, output, and SwiGLU
gate/up/down projections, and the output head (``V·h``, computed whether or not it is tied to the
input embedding). The input embedding is a lookup, and norms, biases, RoPE, softmax and the
activation are element-wise, so none of them is a matmul FLOP: the accounting of Narayanan et al.,
"Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", §5.1, Eq. 3
(which counts the logit layer but not the embedding lookup), and of Chowdhery et al., "PaLM",
Appendix B (``6N + 12·L·H·Q·T`` per trained token). ``a·d`` is the
query width (heads × head dim); grouped-query attention shrinks K/V projections, not the scores.

**Causal attention.** A token at position ``i`` (1-based) attends to ``i`` keys, itself included, so
a sequence of ``S`` tokens attends ``S(S+1)/2`` (key, query) pairs. Both papers above count the
full ``S²`` for training, as Megatron-LM's logged throughput does; their attention term is twice
this one, which at 7B and 4,096 tokens is about 5% of the step.

**Per stage of a sample** (closed forms of the sums over positions):

* prefill of a ``P``-token prompt: ``P`` forwards at contexts ``1..P``: ``2N·P + 4·L·a·d·P(P+1)/2``.
  It also yields the first response token's logits.
* generation of ``R`` tokens after it: each generated token but the last is fed back, ``R − 1``
  forwards at contexts ``P+1 .. P+R−1``: ``2N·(R−1) + 4·L·a·d·(R−1)(2P+R)/2``. Prefill plus generation
  equal one causal forward over ``P + R − 1`` tokens.
* update of a ``S``-token row (prompt + response): forward and backward, the backward twice the
  forward (the gradients with respect to inputs and to weights), ``3 × forward``; activation
  recompute adds what it recomputes: ``selective`` the attention scores once more
  (``+ 4·L·a·d·S(S+1)/2``), ``full`` a whole forward (``4 × forward``). With recompute on, a
  step's MFU over update FLOPs is what PaLM calls the hardware FLOPs utilization.
* an extra log-prob forward (π_old recomputed before the update, the frozen reference policy for
  the KL term): one forward of the row.

**The estimator** (a BERT encoder, ``L`` layers of width ``h`` and FFN width ``I``): per encoded
token ``2·L·(4h² + 2hI)`` forward, ``3×`` when its update trains on it. Its attention scores are not
counted: the estimator records how many tokens it read, not how long each question was (at the
tiny encoder's ~30-byte questions they would add ~15%, at MiniLM's ~60 tokens ~3%). Its one-unit
heads (a few ``h`` weights each) are left out. The demo's tiny estimator (2 layers, width 32) costs
49,152 FLOPs per token read, 2.9% of the demo policy's 1.69 MFLOPs matmul cost per token.

**MFU.** Model FLOPs per second over the card's dense bf16 peak (``PEAK_BF16_FLOPS``).

Costs: every function is O(1) arithmetic; a step's accounting (``pipeline.rl.step.policy_step_flops``)
is O(samples) Python over lengths on the CPU, no collective, no device memory: 18 ms for a 7B step of
512 prompts × 16 samples of 1,024 + 3,072 tokens (measured on a 2-core CPU). Its metrics row adds 20
floats.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from pipeline.models.spec import ModelSpec

__all__ = [
    "CATEGORIES",
    "PEAK_BF16_FLOPS",
    "FlopCounter",
    "ForwardCost",
    "StepFlops",
    "causal_pairs",
    "decoder_layer_matmul_parameters",
    "estimator_flops",
    "forward_flops",
    "format_flops",
    "generation_flops",
    "mfu",
    "peak_bf16_flops",
    "prefill_flops",
    "sequence_forward_flops",
    "update_flops",
]

Recompute = Literal["none", "selective", "full"]
CATEGORIES = ("generation", "prefill", "update", "estimator")

# Dense (no sparsity) bf16 tensor-core peak in FLOP/s by what ``torch.cuda.get_device_name`` reports,
# matched case-insensitively, first hit wins (so a variant precedes its family). NVIDIA's datasheets
# quote bf16 "with sparsity", twice the dense figure: H100 SXM 1,979 TFLOPS, H100 NVL 1,671, H100 PCIe
# 1,513 (NVIDIA H100 Tensor Core GPU datasheet); H200 SXM 1,979, H200 NVL 1,671 (NVIDIA H200 datasheet);
# A100 624 in every form factor (NVIDIA A100 Tensor Core GPU datasheet). A card not listed gets no MFU.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("H200 NVL", 835e12),
    ("H200", 989e12),
    ("A100", 312e12),
)


def peak_bf16_flops(device_name: str) -> float | None:
    """The dense bf16 peak of a card by its CUDA name (``"NVIDIA H100 80GB HBM3"``); None when unknown."""
    name = device_name.lower()
    return next((peak for pattern, peak in PEAK_BF16_FLOPS if pattern.lower() in name), None)


def mfu(flops: float, *, seconds: float, num_gpus: int, peak_flops: float) -> float:
    """Model FLOPs utilization: ``flops`` done in ``seconds`` on ``num_gpus`` cards of ``peak_flops`` each."""
    return flops / (seconds * num_gpus * peak_flops)


# ------------------------------------------------------------------------------------ one forward


def decoder_layer_matmul_parameters(*, hidden_size: int, ffn_hidden_size: int, q_width: int, kv_width: int) -> int:
    """Weights of one decoder layer's matmuls: Q/K/V ``h·(q + 2k)``, output ``q·h``, SwiGLU ``3·h·F``."""
    h = hidden_size
    return h * (q_width + 2 * kv_width) + q_width * h + 3 * h * ffn_hidden_size


@dataclass(kw_only=True, slots=True, frozen=True)
class ForwardCost:
    """What one token's forward pass costs: ``2·matmul_parameters + 4·num_layers·attention_width·context``."""

    matmul_parameters: int  # the weights a token is multiplied by (embedding lookups and norms excluded)
    num_layers: int
    attention_width: int  # query heads × head dim: QKᵀ and AV cost 2·width per layer and attended key, each

    @classmethod
    def decoder(cls, *, hidden_size: int, ffn_hidden_size: int, num_layers: int, q_width: int, kv_width: int,
                vocab_size: int) -> ForwardCost:
        """A Llama/Qwen decoder: its layers' matmuls and the output head (``V·h``, tied or not)."""
        layer = decoder_layer_matmul_parameters(hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size,
                                                q_width=q_width, kv_width=kv_width)
        return cls(matmul_parameters=num_layers * layer + vocab_size * hidden_size, num_layers=num_layers,
                   attention_width=q_width)

    @classmethod
    def from_spec(cls, spec: ModelSpec) -> ForwardCost:
        """The decoder a trainer ``ModelSpec`` describes (the RL actor's, a checkpoint's manifest's)."""
        return cls.decoder(hidden_size=spec.hidden_size, ffn_hidden_size=spec.ffn_hidden_size,
                           num_layers=spec.num_layers, q_width=spec.num_attention_heads * spec.kv_channels,
                           kv_width=spec.num_query_groups * spec.kv_channels, vocab_size=spec.vocab_size)

    @classmethod
    def from_bert_config(cls, config: Mapping[str, Any]) -> ForwardCost:
        """A BERT encoder from its ``config.json`` dict (the estimator's ``estimator.json`` ``bert_config``):
        per layer Q, K, V and output ``4h²`` and the FFN ``2·h·I``; no output head (the estimator pools)."""
        try:
            h, inner, layers = int(config["hidden_size"]), int(config["intermediate_size"]), \
                int(config["num_hidden_layers"])
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"bert_config: not a BERT config ({error!r})") from error
        return cls(matmul_parameters=layers * (4 * h * h + 2 * h * inner), num_layers=layers, attention_width=h)

    def token(self, context: float) -> float:
        """FLOPs of one token's forward at ``context`` attended keys."""
        return forward_flops(self, tokens=1, attended=context)


def forward_flops(cost: ForwardCost, *, tokens: float, attended: float) -> float:
    """A forward over ``tokens`` tokens that attend ``attended`` (query, key) pairs in all:
    ``2·N·tokens + 4·L·a·d·attended``."""
    return 2.0 * cost.matmul_parameters * tokens + 4.0 * cost.num_layers * cost.attention_width * attended


def causal_pairs(length: float) -> float:
    """(query, key) pairs of one causal sequence of ``length`` tokens: ``length·(length + 1)/2``."""
    return length * (length + 1) / 2


def sequence_forward_flops(cost: ForwardCost, length: float) -> float:
    """One causal forward over a ``length``-token sequence (a log-prob pass: π_old, the reference)."""
    return forward_flops(cost, tokens=length, attended=causal_pairs(length))


def prefill_flops(cost: ForwardCost, prompt_tokens: float) -> float:
    """Reading a ``P``-token prompt: ``P`` forwards at contexts ``1..P``."""
    return sequence_forward_flops(cost, prompt_tokens)


def generation_flops(cost: ForwardCost, *, prompt_tokens: float, generated_tokens: float) -> float:
    """Decoding ``R`` tokens after a ``P``-token prompt: ``R − 1`` forwards at contexts ``P+1 .. P+R−1``
    (the prefill yields the first token; the last is never fed back)."""
    steps = max(generated_tokens - 1, 0.0)
    return forward_flops(cost, tokens=steps, attended=steps * (2 * prompt_tokens + generated_tokens) / 2)


def update_flops(cost: ForwardCost, length: float, *, recompute: Recompute = "none") -> float:
    """Forward + backward (``3×`` the forward) of one ``length``-token row, plus what recompute redoes:
    ``selective`` the attention scores, ``full`` the whole forward."""
    forward = sequence_forward_flops(cost, length)
    if recompute == "full":
        return 4 * forward
    if recompute == "selective":
        return 3 * forward + forward_flops(cost, tokens=0, attended=causal_pairs(length))
    return 3 * forward


# ------------------------------------------------------------------------------ a step, a run


@dataclass(kw_only=True, slots=True)
class StepFlops:
    """One RL step's FLOPs per category, and the tokens each counted beside them.

    generation: the engine's decode forwards (tokens: generated); prefill: forwards over prompts, the
    engine's and the actor's question log-probs when a method needs them (tokens: prompt tokens read);
    update: the actor's forward + backward of the trained rows and its extra log-prob forwards (tokens:
    row tokens the update trained on); estimator: the difficulty estimator's reading (tokens: encoded).
    """

    flops: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0.0))
    tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))

    @property
    def total(self) -> float:
        return sum(self.flops.values())


@dataclass(kw_only=True, slots=True)
class FlopCounter:
    """A run's FLOPs and tokens per category, cumulative and checkpointed with the run.

    ``counted_from_step``: the first step counted. A run resumed from a checkpoint saved before the
    count existed starts counting at its first step after the resume (``load_state_dict(None)``).
    ``estimator_tokens_seen``: the estimator's cumulative (train, inference) counts at the last step,
    from which each step's share is the difference.
    """

    flops: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0.0))
    tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    counted_from_step: int | None = 1
    estimator_tokens_seen: dict[str, int] | None = field(default_factory=lambda: {"train": 0, "inference": 0})

    def estimator_step_tokens(self, cumulative: Mapping[str, int]) -> dict[str, int]:
        """This step's (train, inference) tokens from the estimator's cumulative counts (remembered for the
        next step). Unknown before the first step after a resume without a count: none charged there."""
        now = {kind: int(cumulative.get(kind, 0)) for kind in ("train", "inference")}
        seen = self.estimator_tokens_seen if self.estimator_tokens_seen is not None else now
        self.estimator_tokens_seen = now
        return {kind: now[kind] - seen[kind] for kind in now}

    def add(self, step: int, counted: StepFlops) -> None:
        """Add completed step ``step``'s counts (``step`` as the metrics count it: 1 is the first)."""
        if self.counted_from_step is None:
            self.counted_from_step = step
        for category in CATEGORIES:
            self.flops[category] += counted.flops[category]
            self.tokens[category] += counted.tokens[category]

    def metrics(self, counted: StepFlops) -> dict[str, float]:
        """The row's ``flops/*`` and ``tokens/*``: the step's, then the run's so far (``cumulative/``)."""
        row: dict[str, float] = {}
        for category in CATEGORIES:
            row[f"flops/{category}"] = counted.flops[category]
            row[f"tokens/{category}"] = float(counted.tokens[category])
        row["flops/total"] = counted.total
        for category in CATEGORIES:
            row[f"flops/cumulative/{category}"] = self.flops[category]
            row[f"tokens/cumulative/{category}"] = float(self.tokens[category])
        row["flops/cumulative/total"] = sum(self.flops.values())
        row["flops/counted_from_step"] = float(self.counted_from_step or 0)
        return row

    def state_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def load_state_dict(self, state: Mapping[str, Any] | None) -> None:
        """Restore a checkpoint's counts; None (a checkpoint from before the count): start counting anew."""
        if state is None:
            self.flops, self.tokens = dict.fromkeys(CATEGORIES, 0.0), dict.fromkeys(CATEGORIES, 0)
            self.counted_from_step, self.estimator_tokens_seen = None, None
            return
        self.flops = {category: float(state["flops"][category]) for category in CATEGORIES}
        self.tokens = {category: int(state["tokens"][category]) for category in CATEGORIES}
        self.counted_from_step = state["counted_from_step"]
        seen = state["estimator_tokens_seen"]
        self.estimator_tokens_seen = None if seen is None else {kind: int(n) for kind, n in seen.items()}


def estimator_flops(cost: ForwardCost, tokens: Mapping[str, int]) -> float:
    """The estimator's reading: a forward per ``inference`` token, forward + backward per ``train`` token
    (attention scores not counted: see the module docstring)."""
    per_token = forward_flops(cost, tokens=1, attended=0)
    return per_token * (3 * tokens.get("train", 0) + tokens.get("inference", 0))


def format_flops(value: float | None) -> str:
    """``1.23e12`` (three significant digits), ``0``, or ``n/a`` for None."""
    if value is None:
        return "n/a"
    if value == 0:
        return "0"
    exponent = math.floor(math.log10(abs(value)))
    mantissa = value / 10**exponent
    if round(mantissa, 2) >= 10:  # 9.996e11 rounds to 10.00: carry into the exponent
        mantissa, exponent = mantissa / 10, exponent + 1
    return f"{mantissa:.2f}e{exponent}"
