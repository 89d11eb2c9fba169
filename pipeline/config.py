"""winnow's typed configuration: one dataclass per concern, composed per stage.

Every default lives here, once. Recipes (``recipes/``) are functions that start
from these dataclasses and change what differs; YAML files and dotted CLI
overrides (``algorithm.d3s.keep_ratio_init=0.05``) load into them through
:mod:`pipeline.configlib`, which rejects unknown keys, wrong types and values
out of range with the dotted field path in the message.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any, Literal

from pipeline.configlib import ConfigError, option, section
from pipeline.registry import Registry

logger = logging.getLogger(__name__)


def _require(condition: bool, field: str, message: str) -> None:
    if not condition:
        raise ConfigError(f"{field}: {message}")


@dataclass(kw_only=True, slots=True)
class DataConfig:
    train: list[str] = option(
        default_factory=lambda: ["arith?difficulty=3&size=4000"],
        help="training prompt sources: benchmark names, synthetic specs or .jsonl/.parquet paths",
    )
    split: str | None = option(
        None, help="split for every source that names none (null: each source's default, train for synthetic)"
    )
    template: Literal["raw", "plain", "chat"] = option(
        "plain", help="prompt template: raw problem, plain instruction, or the tokenizer's chat template"
    )
    on_bad_row: Literal["fail", "skip"] = option(
        "fail", help="malformed rows: fail naming file and line, or skip and report counts"
    )
    max_field_chars: int = option(20_000, ge=1, help="rows with a longer problem or answer are bad rows")
    limit: int | None = option(None, ge=1, help="use at most this many prompts per source")
    seed: int = option(0, help="seed of the synthetic generators and of the data order")


@dataclass(kw_only=True, slots=True)
class RewardConfig:
    """Maps one to one onto ``pipeline.rewards.GradingPool``."""

    num_workers: int = option(2, ge=1, help="grading worker processes")
    deadline_s: float = option(5.0, gt=0, help="wall-clock limit per graded item; a stuck worker is killed")
    memory_limit_mb: int = option(1024, ge=64, help="address-space cap of each grading worker")
    chunk_size: int = option(8, ge=1, help="items sent to a worker at a time (the deadline stays per item)")
    format_reward: float = option(
        0.0, ge=0.0, le=1.0, help="added when the response has a complete \\boxed{} answer, subtracted when not"
    )
    max_response_chars: int = option(8192, ge=1, help="only this many trailing characters of a response are searched")
    max_answer_chars: int = option(1024, ge=1, help="longer extracted or gold answers are parse errors")
    numeric_answers: Literal["literal", "symbolic"] = option(
        "literal", help="literal: a numeric gold needs a number, not an unevaluated expression "
        "(closes a reward hack, see pipeline/rewards/answer_rules.py); symbolic: plain math-verify equality"
    )

    def pool_kwargs(self) -> dict[str, object]:
        return {
            "num_workers": self.num_workers, "deadline_s": self.deadline_s,
            "memory_limit_mb": self.memory_limit_mb, "chunk_size": self.chunk_size,
            "format_reward": self.format_reward, "max_response_chars": self.max_response_chars,
            "max_answer_chars": self.max_answer_chars, "numeric_answers": self.numeric_answers,
        }


@dataclass(kw_only=True, slots=True)
class EvalConfig:
    benchmarks: list[str] = option(
        default_factory=lambda: ["arith?difficulty=3&size=500"],
        help="benchmarks to evaluate: math500, gsm8k, math, minerva, or synthetic specs",
    )
    split: str = option("test", help="split of each benchmark")
    num_samples: int = option(32, ge=1, help="samples per problem (n of the unbiased pass@k)")
    ks: list[int] = option(
        default_factory=lambda: [1, 2, 4, 8, 16, 32], help="k values of pass@k; each ≤ num_samples"
    )
    temperature: float = option(0.6, ge=0.0, help="sampling temperature")
    top_p: float = option(0.95, gt=0.0, le=1.0, help="nucleus sampling threshold")
    max_new_tokens: int = option(512, ge=1, help="generation length limit")
    max_skipped_fraction: float = option(
        0.05, ge=0.0, le=1.0, help="largest fraction of a benchmark's problems that may be skipped for not fitting "
        "the model's context with max_new_tokens; above it the evaluation fails, since its score would describe "
        "another set of problems (1: any fraction)"
    )
    limit: int | None = option(None, ge=1, help="evaluate at most this many problems per benchmark")
    bootstrap_samples: int = option(1000, ge=0, help="bootstrap resamples for confidence intervals")
    seed: int = option(1234, help="sampling seed")

    def __post_init__(self) -> None:
        _require(bool(self.ks), "ks", "needs at least one k")
        bad = [k for k in self.ks if not 1 <= k <= self.num_samples]
        _require(not bad, "ks", f"{bad} outside [1, num_samples={self.num_samples}]")


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    tensor_parallel: int = option(1, ge=1, help="tensor-parallel size")
    pipeline_parallel: int = option(1, ge=1, help="pipeline-parallel size")
    backend: Literal["auto", "nccl", "gloo"] = option(
        "auto", help="torch.distributed backend; auto picks nccl with CUDA and gloo without"
    )
    collective_timeout_min: int | None = option(
        None, ge=1, help="how long a rank waits in a collective before the job fails (null: derived from the "
        "rollout timeouts by collective_timeout_minutes; a value below that is refused)"
    )


# The collective timeout when nothing longer is needed (torch's own NCCL default is 10 min).
DEFAULT_COLLECTIVE_TIMEOUT_MIN = 30
# A streamed weight sync's limits (the SGLang client's; the tests keep them equal to its own):
# one server's update call (SGLangClientConfig.admin_timeout_s), the update group's collective
# timeout beyond it (so the HTTP limit, which names the server, always fires first), and the
# new groups one sync may form after a member failed before it gives up.
WEIGHT_SYNC_ADMIN_TIMEOUT_S = 900.0
UPDATE_GROUP_TIMEOUT_MARGIN_S = 60.0
MAX_UPDATE_GROUP_REFORMS = 2
# The longest a weight sync may keep rank 0 away from the others: each try of a bucket (the first
# and one per new group) waits at most an update call plus the group's collective timeout.
# 3 × (900 + 960) s = 93 min with the defaults.
WEIGHT_SYNC_ALLOWANCE_S = (1 + MAX_UPDATE_GROUP_REFORMS) * (2 * WEIGHT_SYNC_ADMIN_TIMEOUT_S
                                                            + UPDATE_GROUP_TIMEOUT_MARGIN_S)


def collective_timeout_minutes(*, parallel: ParallelConfig, rollout: RolloutConfig) -> int:
    """The trainer's collective timeout, in whole minutes: long enough for every legitimate wait.

    While global rank 0 generates through SGLang servers, the other ranks wait for it in a
    collective. One generation is bounded by ``rollout.batch_timeout_s`` when set, else by
    ``rollout.request_timeout_s × rollout.max_attempts`` (a work item's tries, each up to the
    request limit; a step's items run at once while they fit the client's 256 calls in flight,
    so set ``batch_timeout_s`` for larger steps), and a weight sync by
    ``WEIGHT_SYNC_ALLOWANCE_S``. The timeout must exceed their sum, else a slow but healthy
    step kills the job. Derived, it is never below ``DEFAULT_COLLECTIVE_TIMEOUT_MIN``; the local
    engine has no timeout to derive from, so the default applies (or any value set).
    ``parallel.collective_timeout_min`` set below the sum is refused, naming the fields.
    """
    needed, wait = 1, ""
    if rollout.engine in ENGINES_WITH_SERVERS:
        if rollout.batch_timeout_s is not None:
            wait_s, source = rollout.batch_timeout_s, "rollout.batch_timeout_s"
        else:
            wait_s = rollout.request_timeout_s * rollout.max_attempts
            source = "rollout.request_timeout_s × rollout.max_attempts"
        # Strictly longer than the wait: a whole minute more than its ceiling.
        needed = -(-int(wait_s + WEIGHT_SYNC_ALLOWANCE_S) // 60) + 1
        wait = f"a rollout of up to {wait_s:g} s ({source}) plus a {WEIGHT_SYNC_ALLOWANCE_S:g} s weight sync"
    if parallel.collective_timeout_min is None:
        return max(DEFAULT_COLLECTIVE_TIMEOUT_MIN, needed)
    _require(parallel.collective_timeout_min >= needed, "parallel.collective_timeout_min",
             f"{parallel.collective_timeout_min} min; the other ranks wait for {wait} in a collective: at least "
             f"{needed} min, or null to derive it, or lower the rollout timeouts")
    return parallel.collective_timeout_min


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    directory: str = option("runs/default/checkpoints", help="where checkpoints are written")
    every_steps: int = option(50, ge=1, help="save a checkpoint every this many steps")
    keep_last: int = option(3, ge=1, help="older checkpoints beyond this count are deleted")
    resume: Literal["auto", "never", "must"] = option(
        "auto", help="resume from `latest` if present (auto), never, or fail when absent (must)"
    )


@dataclass(kw_only=True, slots=True)
class LoggingConfig:
    output_dir: str = option("runs/default", help="run directory: metrics, plots, resolved config")
    trackers: list[Literal["tensorboard", "wandb", "mlflow"]] = option(
        default_factory=lambda: ["tensorboard"],
        help="where metrics go besides metrics.jsonl (wandb and mlflow: `pip install 'winnow[tracking]'`); each gets "
        "the config, git commit, package versions, every step's metrics and the run's files; a resumed run continues "
        "its tracked run; [] for none",
    )
    progress: bool = option(True, help="show progress bars and a live status line")
    log_every: int = option(1, ge=1, help="write metrics every this many steps")


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    lr: float = option(1e-6, gt=0.0, help="peak learning rate (Adam)")
    min_lr_ratio: float = option(0.0, ge=0.0, le=1.0, help="final learning rate as a fraction of lr (cosine decay)")
    decay: Literal["constant", "cosine", "linear"] = option("constant", help="learning-rate shape after warm-up")
    warmup_steps: int = option(0, ge=0, help="linear warm-up steps from 0 to lr")
    total_steps: int = option(1000, ge=1, help="steps over which cosine/linear decay runs")
    weight_decay: float = option(0.0, ge=0.0, help="decoupled weight decay")
    beta1: float = option(0.9, ge=0.0, lt=1.0, help="Adam β1")
    beta2: float = option(0.999, ge=0.0, lt=1.0, help="Adam β2")
    eps: float = option(1e-8, gt=0.0, help="Adam ε")
    clip_grad: float = option(1.0, gt=0.0, help="global gradient-norm clip")

    def __post_init__(self) -> None:
        _require(self.warmup_steps <= self.total_steps, "warmup_steps",
                 f"{self.warmup_steps} exceeds total_steps={self.total_steps}")


@dataclass(kw_only=True, slots=True)
class TrainerConfig:
    micro_batch_tokens: int = option(
        8192, ge=1, help="padded tokens per micro-batch; rows are grouped by length up to this budget"
    )
    logprob_chunk_size: int | None = option(
        None, ge=2, help="tokens per chunk of the vocab-parallel log-prob/entropy head (null: from logprob_buffer_mib)"
    )
    logprob_buffer_mib: int = option(
        256, ge=1, help="float32 logits buffer of the head; a micro-batch that fits one chunk skips the backward recompute"
    )
    max_skipped_steps: int = option(
        3, ge=0, help="consecutive non-finite steps tolerated before the run stops with an error"
    )
    precision: Literal["fp32", "bf16"] = option(
        "fp32", help="model weights and activations; bf16 keeps fp32 master weights in the optimizer"
    )
    fp8: Literal["off", "delayed", "current"] = option(
        "off", help="Transformer Engine FP8 scaling recipe (GPU with TE only; delayed or current scaling)"
    )
    distributed_optimizer: bool | None = option(
        None, help="shard the fp32 master weights and Adam moments over data-parallel ranks (megatron's distributed "
        "optimizer: 12 bytes per parameter / DP); null: on when data_parallel > 1"
    )
    recompute: Literal["none", "selective", "full"] = option(
        "none", help="activation recompute in the backward: none; selective (megatron's core attention: drops the "
        "5·a·s/h term per layer); full (keeps only each layer's input, recomputes the layer)"
    )
    old_logprobs: Literal["recompute", "update_forward"] = option(
        "recompute", help="π_old: a separate forward pass before the update (logs the train/rollout mismatch), or "
        "the update's own forward (one update per batch makes them equal; saves a pass). Methods that weight "
        "tokens by entropy, or E3's temperature, always recompute",
    )


@dataclass(kw_only=True, slots=True)
class DataInspectConfig:
    """What `winnow data inspect` reads; a stage config of its own."""

    data: DataConfig = section(DataConfig, help="data loading options")
    num_examples: int = option(3, ge=0, help="examples to print")


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """A Llama-style decoder built from scratch (the CPU demo); vocab comes from the tokenizer."""

    family: Literal["llama", "qwen2"] = option("llama", help="architecture family (qwen2 adds q/k/v bias)")
    hidden_size: int = option(128, ge=8, help="model width")
    ffn_hidden_size: int = option(352, ge=8, help="SwiGLU inner width")
    num_layers: int = option(4, ge=1, help="transformer layers")
    num_attention_heads: int = option(4, ge=1, help="query heads")
    num_query_groups: int = option(4, ge=1, help="key/value heads (grouped-query attention)")
    max_position_embeddings: int = option(128, ge=8, help="longest sequence (prompt + response)")
    rope_theta: float = option(10000.0, gt=0, help="RoPE base")
    tie_embeddings: bool = option(False, help="share input embedding and output layer")

    def __post_init__(self) -> None:
        _require(self.hidden_size % self.num_attention_heads == 0, "hidden_size",
                 f"{self.hidden_size} is not divisible by num_attention_heads={self.num_attention_heads}")
        _require(self.num_attention_heads % self.num_query_groups == 0, "num_query_groups",
                 f"{self.num_query_groups} does not divide num_attention_heads={self.num_attention_heads}")


@dataclass(kw_only=True, slots=True)
class BootstrapConfig:
    """`winnow bootstrap`: tokenizer + supervised base policy for the CPU demo, cached by config hash."""

    sources: list[str] = option(
        # Difficulty 3 (two 2-digit operands) is where the tiny policy ends up solving ~60% at
        # T=1: the 10-90% band RL learns from. Levels 1-2 hold only ~350 distinct problems.
        default_factory=lambda: [
            "arith?difficulty=1&size=140", "arith?difficulty=2&size=200", "arith?difficulty=3&size=10000",
        ],
        help="worked-solution sources to supervise on (their train split)",
    )
    vocab_size: int = option(320, ge=32, help="BPE vocabulary size of the trained tokenizer")
    vocab_multiple: int = option(
        64, ge=1,
        help="reserved tokens pad the vocabulary to a multiple of this, so the embedding and output "
             "layer split evenly over tensor-parallel sizes dividing it")
    model: ModelConfig = section(ModelConfig, help="the policy architecture")
    # The SFT loss makes a late, sudden drop whose timing is chaotic in float rounding: at 1,500
    # steps and weight decay 0.01 it came in time for one measured (seed, Adam kernel) in four
    # (held-out pass@1 0.10-0.48). 2,500 steps at weight decay 0.1 leave every trajectory time to
    # make it (docs/benchmarks.md, "The base policy": seeds 0-4 x torch's default and fused Adam).
    optim: OptimConfig = option(
        default_factory=lambda: OptimConfig(
            lr=3e-3, warmup_steps=30, decay="cosine", total_steps=2500, min_lr_ratio=0.1, weight_decay=0.1
        ),
        help="optimizer and learning-rate schedule; optim.total_steps is the number of steps",
    )
    trainer: TrainerConfig = section(TrainerConfig, help="micro-batching and the log-prob head")
    batch_size: int = option(64, ge=1, help="sequences per optimizer step")
    seed: int = option(0, help="seed of initialization and data order")
    cache_dir: str = option(
        "bootstrap", help="results live in <cache_dir>/<config hash>/; a relative path is under the cache root "
        "($WINNOW_CACHE, else $XDG_CACHE_HOME/winnow or ~/.cache/winnow), an absolute one is used as given"
    )
    progress: bool = option(True, help="show a progress bar")


@dataclass(kw_only=True, slots=True)
class D3SConfig:
    num_keep_init: int = option(8, ge=1, help="N_s at the start of training (D³S Eq. 9; Table 6: 8 of G=32)")
    num_keep_final: int = option(32, ge=1, help="N_s at the end of the schedule")
    keep_ratio_init: float = option(0.05, gt=0.0, le=1.0, help="K, the kept token fraction, at the start")
    keep_ratio_final: float = option(0.20, gt=0.0, le=1.0, help="K at the end of the schedule")
    dynamic: bool = option(True, help="linear schedule over the run (D³S); false holds the initial values (D¹S/D²S)")
    token_scope: Literal["batch", "group", "sample"] = option("batch", help="pool of the top-K token ranking (Eq. 8)")


@dataclass(kw_only=True, slots=True)
class PodsConfig:
    num_keep: int = option(
        8, ge=1, help="N: samples kept of each group's G (capped at G), fixed for the run; 8 is D³S's N_init, "
        "which the +PODS presets keep of 32"
    )


@dataclass(kw_only=True, slots=True)
class E3TemperatureConfig:
    min_temperature: float = option(0.1, gt=0.0, help="lower clamp of τ")
    max_temperature: float = option(2.0, gt=0.0, help="upper clamp of τ")
    anneal_start_fraction: float | None = option(
        0.5, ge=0.0, lt=1.0, help="start of the cosine annealing of the target entropy (Eq. 5), as a fraction of steps; null: no annealing"
    )
    eta: float = option(0.9, ge=0.0, lt=1.0, help="final target entropy as a fraction of the initial one")


@dataclass(kw_only=True, slots=True)
class E3BudgetConfig:
    min_limit: int = option(4, ge=1, help="lowest G_min reached after widening (E3 §4.1; §5.1: G/2)")
    max_limit: int = option(16, ge=1, help="highest G_max reached after widening (§5.1: 2G)")
    widen_step: int = option(2, ge=0, help="G_min shrinks and G_max grows by this after each pass over the data (§5.1: 2)")


@dataclass(kw_only=True, slots=True)
class AdaEstConfig:
    min_budget: int = option(2, ge=1, help="N_min: fewest samples per prompt (Reinforce-Ada Algorithm 1 line 5)")
    max_budget: int = option(32, ge=1, help="N_max: most samples per prompt")
    rule: Literal["log", "reinforce_baseline", "implicit"] = option(
        "log", help="N ∝ 1/√(p̂+ε) (log objective), √((1−p̂)/p̂) (App. B.1) or 1/p̂ (App. C.2's implicit weighting)"
    )
    ema_decay: float = option(0.9, gt=0.0, le=1.0, help="λ of the Ada-EMA counters N ← λN + n")
    prior_alpha: float = option(1.0, gt=0.0, help="α of the Beta prior p̂ = (N_pos+α)/(N+α+β)")
    prior_beta: float = option(1.0, gt=0.0, help="β of the Beta prior")


@dataclass(kw_only=True, slots=True)
class AdaSeqConfig:
    exit_rule: Literal["pos", "balance"] = option(
        "balance", help="Reinforce-Ada-Seq exit rule (Algorithm 2 lines 8–9): ≥k_pos correct, or also ≥k_neg incorrect"
    )
    k_pos: int = option(2, ge=0, help="correct responses a prompt needs before it exits")
    k_neg: int = option(2, ge=0, help="incorrect responses it also needs under the balance rule")
    round_size: int = option(4, ge=1, help="responses drawn per active prompt per round")
    max_samples: int = option(32, ge=1, help="N_max: cap on responses per prompt over all rounds")


@dataclass(kw_only=True, slots=True)
class DynamicSamplingConfig:
    min_useful_fraction: float = option(
        1.0, gt=0.0, le=1.0, help="DAPO: keep sampling new prompts until this fraction of the batch has reward variance"
    )
    max_rounds: int = option(4, ge=1, help="cap on generation rounds per step (the batch trains on what it has)")


# DEPO ("Difficulty-Estimated Policy Optimization") values shared by the online filter
# (``DepoConfig``) and `winnow train-estimator` (``TrainEstimatorConfig``), defined once.
DEPO_W_DISTILL = 0.5  # §4.1
DEPO_W_RANK = 3.0  # §4.1
DEPO_RANK_MARGIN = 0.5  # the paper gives none; see pipeline.algorithms.depo.pairwise_ranking_loss
DEPO_W_ZERO_VARIANCE = 1.0  # winnow's zero-variance head: as much weight as L_DE
DEPO_FILTER_RATIO = 0.5  # §4.3, Figure 6: the filter ratio "stabilizes at approximately 50%"
DEPO_DROP_THRESHOLD = 0.5  # a dropped prompt is more likely wasted than not
# The online learning rate by encoder kind (``DifficultyEstimator.kind``): a random 2-layer
# encoder needs 1e-3 to separate the CPU pool's prompts within the warm-up; pre-trained MiniLM
# is fine-tuned in BERT's usual range, where larger steps erase what pre-training gave it.
DEPO_ONLINE_LR = {"tiny": 1e-3, "minilm": 5e-5}


@dataclass(kw_only=True, slots=True)
class DepoConfig:
    estimator_dir: str | None = option(
        None, help="a trained estimator (`winnow train-estimator` output_dir/estimator) to warm-start from; "
        "null: a fresh one"
    )
    encoder: Literal["minilm", "tiny"] = option("tiny", help="encoder of a fresh estimator (estimator_dir null)")
    cache_dir: str = option(
        "estimator", help="where the MiniLM zip is unpacked once (relative: under the cache root, see bootstrap.cache_dir)"
    )
    filter_ratio: float = option(
        DEPO_FILTER_RATIO, ge=0.0, le=1.0,
        help="most candidates dropped per step, the most likely zero-variance first (DEPO §4.3 runs at ~50%)"
    )
    threshold: float = option(
        DEPO_DROP_THRESHOLD, ge=0.0, lt=1.0,
        help="drop only candidates whose calibrated P(all G rewards equal) exceeds this (0: by filter_ratio alone)"
    )
    zero_variance_samples: int | None = option(
        None, ge=1, help="the G of the predicted and labelled event P(all G rewards equal) (null: the group size; "
        "under Reinforce-Ada-Seq its pool's most samples, so only prompts no round could rescue are dropped)"
    )
    audit_fraction: float = option(
        0.05, ge=0.0, le=1.0, help="after warm-up, the share of would-be-dropped prompts rolled out anyway, so "
        "depo/precision and depo/recall stay measured"
    )
    warmup_steps: int = option(10, ge=0, help="steps the estimator trains online before it filters (DEPO §3.2)")
    oversample: float = option(
        2.0, ge=1.0, help="candidates drawn per kept prompt; filtered batches top up to prompts_per_step from them"
    )
    lr: float | None = option(
        None, gt=0.0, help="online AdamW learning rate (null: by the estimator's encoder, 1e-3 for the random tiny "
        "one, 5e-5 for pre-trained MiniLM)"
    )
    replay_size: int = option(
        4096, ge=2, help="observed (prompt, avg@k, zero-variance label) entries replayed; the oldest leave first "
        "(48 bytes each)"
    )
    minibatches: int = option(4, ge=1, help="estimator updates per RL step, each on a minibatch from the replay buffer")
    minibatch_size: int = option(
        32, ge=2, help="prompts per estimator update; the step's first update holds the step's new observations"
    )
    calibration_window: int = option(
        512, ge=1, help="newest pre-rollout predictions the Platt calibration of P(all G rewards equal) is fitted on"
    )
    w_distill: float = option(
        DEPO_W_DISTILL, ge=0.0, help="weight of the actor-perplexity distillation loss (DEPO §4.1)"
    )
    w_rank: float = option(DEPO_W_RANK, ge=0.0, help="weight of the pairwise ranking loss (DEPO §4.1)")
    margin: float = option(
        DEPO_RANK_MARGIN, ge=0.0, le=1.0,
        help="ranking margin: the fraction of an observed pass-rate gap the predicted pass rates must reproduce"
    )
    w_zero_variance: float = option(
        DEPO_W_ZERO_VARIANCE, gt=0.0, help="weight of the zero-variance head's loss (the head the filter drops on)"
    )

    def __post_init__(self) -> None:
        _require(self.minibatch_size <= self.replay_size, "minibatch_size",
                 f"{self.minibatch_size} exceeds replay_size={self.replay_size}")
        _require(self.calibration_window <= self.replay_size, "calibration_window",
                 f"{self.calibration_window} exceeds replay_size={self.replay_size}")


@dataclass(kw_only=True, slots=True)
class RolloutCorrectionConfig:
    level: Literal["token", "sequence"] = option(
        "token", help="importance ratio per token, or one per sample (geometric mean over its tokens)"
    )
    upper: float = option(2.0, ge=1.0, help="C: tis truncates ratios above it (Yao et al. use 2); mis masks them")
    lower: float = option(0.0, ge=0.0, le=1.0, help="mis only: also mask ratios below this")


# The rollout engines that generate in servers of their own: the entries of the rollout backends' table with
# ``servers`` (``pipeline.rollout.backends``, which sits above this floor; a test keeps the two in step).
ENGINES_WITH_SERVERS = frozenset({"sglang"})


@dataclass(kw_only=True, slots=True)
class RolloutConfig:
    engine: Literal["local", "sglang"] = option(
        "local", help="local: a Hugging Face model in the trainer process (CPU, tests); sglang: HTTP servers"
    )
    servers: list[str] = option(
        default_factory=list, help="SGLang base URLs (http://host:port); the SLURM launcher fills these in"
    )
    request_timeout_s: float = option(3600.0, gt=0.0, help="per-request limit before a server counts as hung")
    batch_timeout_s: float | None = option(
        None, gt=0.0, help="limit for one step's whole generation (null: none beyond the per-request limit)"
    )
    max_attempts: int = option(4, ge=1, help="tries per request across servers before the step fails")
    weights_dir: str | None = option(
        None, help="sglang: a folder every server can read; each sync exports the policy there and the servers load it"
    )
    sync: Literal["disk", "distributed"] = option(
        "disk", help="how sglang servers get each new policy: disk (every pipeline stage writes its files into "
        "weights_dir, the servers load the folder) or distributed (broadcast over an update group: NCCL on GPU, gloo "
        "on CPU; trainer and servers must share a network); the local engine is always synced in process"
    )
    sync_bucket_mb: int = option(
        512, ge=1, help="weight sync bucket: the most MiB of HF tensors assembled, written or broadcast at once"
    )
    server_tensor_parallel: int = option(
        1, ge=1, help="sync=distributed: GPUs per SGLang server (its --tp-size); each takes one rank of the update group"
    )
    min_servers: int = option(
        1, ge=1, help="sglang: the run fails (RolloutError) once fewer servers than this are left after retirements"
    )
    max_server_failures: int = option(
        3, ge=0, help="sglang: times a server may die or hang and be restarted and re-synced; its next failure "
        "retires it (also the restart budget per server of the serve role)"
    )
    server_recovery_timeout_s: float = option(
        1800.0, gt=0.0, help="sglang: how long after a failure a server has to answer /health again (a restart: "
        "its load time) before it is retired"
    )
    health_timeout_s: float = option(
        30.0, gt=0.0, help="sglang: a health probe unanswered this long counts as a hang (above SGLang's own 20 s "
        "/health_generate limit)"
    )
    max_running_requests_per_server: int = option(
        256, ge=1, help="sglang: sequences one server runs at once: its --max-running-requests (the serve role "
        "passes it) and the client's per-server limit; a 7B server's KV cache on an H100 holds 256 sequences of "
        "~3,600 tokens; the client keeps servers × this in flight (docs/rollout.md, Requests in flight)"
    )
    max_in_flight_sequences: int | None = option(
        None, ge=1, help="sglang: the most sequences in flight over all servers (null: servers × "
        "max_running_requests_per_server)"
    )

    max_staleness: int = option(
        0, ge=0, le=1, help="0: the synchronous loop; 1: the next step's batch is generated (by the SGLang servers, "
        "or the local engine in its own process) while this step updates, with weights one version old (docs/rl.md, "
        "One-step-off-policy rollouts)"
    )

    def __post_init__(self) -> None:
        if self.engine in ENGINES_WITH_SERVERS:
            _require(bool(self.servers), "servers", f"engine={self.engine} needs at least one server URL")
            _require(self.min_servers <= len(self.servers), "min_servers",
                     f"{self.min_servers} exceeds the {len(self.servers)} servers in rollout.servers")
            _require(self.sync != "disk" or self.weights_dir is not None, "weights_dir",
                     f"engine={self.engine} with sync=disk needs a shared folder for weight syncs")
        for url in self.servers:
            _require(url.startswith(("http://", "https://")), "servers", f"{url!r} is not an http(s) URL")


@dataclass(frozen=True, slots=True)
class InFlightLimit:
    """How many sequences the SGLang client keeps in flight (``rollout_in_flight_limit``)."""

    num_servers: int
    per_server: int  # sequences one server runs at once (its --max-running-requests)
    sequences: int  # over all servers
    derived: bool  # True: num_servers × per_server; False: rollout.max_in_flight_sequences set it

    def describe(self) -> str:
        """One line: ``16 servers × 256 = 4,096 sequences (rollout.max_running_requests_per_server)``."""
        servers = f"{self.num_servers} server{'s' if self.num_servers != 1 else ''} × {self.per_server:,}"
        if self.derived:
            return f"{servers} = {self.sequences:,} sequences (rollout.max_running_requests_per_server)"
        return (f"{self.sequences:,} sequences (rollout.max_in_flight_sequences; {servers} = "
                f"{self.num_servers * self.per_server:,} derived)")


def rollout_in_flight_limit(rollout: RolloutConfig, *, num_servers: int) -> InFlightLimit:
    """The sequences the SGLang client keeps in flight on ``num_servers`` servers: the client and the planner.

    Each server runs at most ``rollout.max_running_requests_per_server`` sequences at once (the
    serve role passes it as SGLang's ``--max-running-requests``), so the client sends it no more;
    over all servers, ``num_servers`` times that, or ``rollout.max_in_flight_sequences`` when set
    (capped at the servers' total: a server cannot take more). The client counts calls of up to
    ``max_samples_per_request`` sequences and converts (``SGLangClientConfig.from_rollout``).

    Cost: on the client an in-flight sequence is its request body (the prompt's ids as JSON, about
    6 bytes a token) and, once answered, its response (about 40 bytes of JSON a generated token:
    id, log-prob, text) until it is parsed into token ids and log-probs. At 7B on 16 servers
    (2 nodes × 8 H100s) with the default 256: 4,096 sequences of a 1,024-token prompt and 3,072 new
    tokens hold about 25 MB of requests and at most about 500 MB of answers at once. The servers
    pay the real cost: each running sequence holds its KV cache (Qwen2.5-Math-7B: 56 KiB a token),
    and 256 sequences of 4,096 tokens are 1.05M tokens, a little over the ~920K an H100 holds beside
    the bf16 weights at ``--mem-fraction-static 0.85`` (``winnow plan``); few responses reach the cap
    together, and SGLang queues what does not fit.
    """
    if num_servers < 1:
        raise ValueError(f"the in-flight limit needs at least one server, got {num_servers}")
    per_server = rollout.max_running_requests_per_server
    capacity = num_servers * per_server
    if rollout.max_in_flight_sequences is None:
        return InFlightLimit(num_servers=num_servers, per_server=per_server, sequences=capacity, derived=True)
    return InFlightLimit(num_servers=num_servers, per_server=per_server,
                         sequences=min(rollout.max_in_flight_sequences, capacity), derived=False)


@dataclass(kw_only=True, slots=True)
class AlgorithmConfig:
    """Which registered method runs at each point of the loop, and their options."""

    advantage: Literal["grpo", "dr_grpo", "rloo", "global_baseline"] = option("grpo", help="ADVANTAGES entry")
    baseline_weight: Literal["none", "inv_mean", "inv_sqrt_mean", "bernoulli_std"] = option(
        "none", help="global_baseline only: A = w(r̄)·(r − r̄) with w = 1, 1/p̂ (Ada §3.2), 1/√p̂ (Ada-Est), 1/σ"
    )
    loss: Literal["grpo", "gspo"] = option("grpo", help="POLICY_LOSSES entry")
    eps_low: float = option(0.2, gt=0.0, lt=1.0, help="lower clip range of the ratio")
    eps_high: float = option(0.28, gt=0.0, help="upper clip range of the ratio (clip-higher)")
    aggregation: Literal["token_mean", "seq_mean_token_mean", "d3s", "dr_grpo"] = option(
        "token_mean", help="loss aggregation (d3s: 1/|Ŝ|·Σ 1/|𝒯ᵢ|, D³S Eq. 10; dr_grpo: Σ tokens / (G·L_max), "
        "L_max = max_new_tokens)"
    )
    kl_coef: float = option(0.0, ge=0.0, help="k3 KL penalty to the initial policy (> 0 loads a frozen reference copy)")
    entropy_coef: float = option(0.0, ge=0.0, help="entropy bonus")
    sample_selector: Literal["none", "d3s_intra", "d3s_cross", "pods", "balanced"] = option(
        "none", help="SAMPLE_SELECTORS entry applied after the advantages"
    )
    token_weights: list[Literal["d3s_topk", "cw_grpo"]] = option(
        default_factory=list, help="TOKEN_WEIGHTS entries, applied in order and multiplied"
    )
    d3s: D3SConfig = section(D3SConfig, help="D³S sample/token schedule")
    pods: PodsConfig = section(PodsConfig, help="PODS max-variance down-sampling (sample_selector=pods)")
    cw_grpo_scope: Literal["group", "batch"] = option("group", help="CW-GRPO covariance statistics scope")
    temperature: Literal["fixed", "e3"] = option("fixed", help="TEMPERATURES entry: the run's fixed temperature, or E3's entropy controller starting from it")
    e3: E3TemperatureConfig = section(E3TemperatureConfig, help="E3 temperature scheduler (Eq. 4–5)")
    rollout_correction: Literal["none", "tis", "mis"] = option(
        "none", help="ROLLOUT_CORRECTIONS entry: correct the engine/trainer log-prob gap by truncated (tis) or "
        "masked (mis) importance ratios π_old/π_rollout; at rollout.max_staleness=1 none becomes tis when the "
        "config loads (the saved config says tis): samples one update old always get a correction"
    )
    correction: RolloutCorrectionConfig = section(RolloutCorrectionConfig, help="rollout correction thresholds")
    prompt_filter: Literal["none", "depo"] = option("none", help="PROMPT_FILTERS entry: drop prompts before rollout")
    depo: DepoConfig = section(DepoConfig, help="DEPO estimator, filter and online updates")
    budget: Literal["uniform", "e3", "ada_est"] = option(
        "uniform", help="BUDGETS entry: samples per prompt (uniform G, E3 ranks, Reinforce-Ada-Est)"
    )
    e3_budget: E3BudgetConfig = section(E3BudgetConfig, help="E3 dynamic rollout budget (Algorithm 1)")
    ada_est: AdaEstConfig = section(AdaEstConfig, help="Reinforce-Ada-Est budgets from EMA/Beta pass rates")
    sampling: Literal["single", "ada_seq", "dynamic"] = option(
        "single", help="SAMPLERS entry: one round, Reinforce-Ada-Seq rounds with exit rules, or DAPO dynamic sampling"
    )
    ada_seq: AdaSeqConfig = section(AdaSeqConfig, help="Reinforce-Ada-Seq multi-round sampling")
    dynamic: DynamicSamplingConfig = section(DynamicSamplingConfig, help="DAPO dynamic sampling")

    def __post_init__(self) -> None:
        _require(len(set(self.token_weights)) == len(self.token_weights), "token_weights", "a method is listed twice")
        _require(self.ada_est.min_budget <= self.ada_est.max_budget, "ada_est.min_budget",
                 f"{self.ada_est.min_budget} exceeds ada_est.max_budget={self.ada_est.max_budget}")
        _require(self.e3_budget.min_limit <= self.e3_budget.max_limit, "e3_budget.min_limit",
                 f"{self.e3_budget.min_limit} exceeds e3_budget.max_limit={self.e3_budget.max_limit}")
        _require(self.ada_seq.round_size <= self.ada_seq.max_samples, "ada_seq.round_size",
                 f"{self.ada_seq.round_size} exceeds ada_seq.max_samples={self.ada_seq.max_samples}")
        _require(not (self.sampling == "ada_seq" and self.budget != "uniform"), "budget",
                 "ada_seq sampling sets its own per-prompt budgets; use budget=uniform with it")


# The fields of AlgorithmConfig that choose a training method: each registry slot's selection
# (``pipeline/rl/methods.py``, ``pipeline/rl/sampling.py``) with its option section, and the loss
# aggregation a method prescribes (D³S Eq. 10, Dr. GRPO). Every other field is shared by the
# methods of a comparison: the clip range, the KL and entropy terms, and the rollout correction,
# which corrects the engine/trainer log-prob gap of the infrastructure whatever the method trains.
METHOD_FIELDS: tuple[str, ...] = (
    "advantage", "baseline_weight", "loss", "aggregation", "sample_selector", "d3s", "pods", "token_weights",
    "cw_grpo_scope", "temperature", "e3", "prompt_filter", "depo", "budget", "e3_budget", "ada_est",
    "sampling", "ada_seq", "dynamic",
)
assert set(METHOD_FIELDS) <= {field.name for field in fields(AlgorithmConfig)}


def plain_grpo(algorithm: AlgorithmConfig) -> AlgorithmConfig:
    """``algorithm`` with every method field (``METHOD_FIELDS``) at its default, plain GRPO, and the
    shared fields as they were: the baseline matched to a method on everything but the method."""
    defaults = AlgorithmConfig()
    return replace(algorithm, **{name: getattr(defaults, name) for name in METHOD_FIELDS})


def stale_sample_correction(algorithm: AlgorithmConfig, *, rollout: RolloutConfig) -> AlgorithmConfig:
    """``algorithm`` as an RL run at ``rollout`` trains with: at ``max_staleness=1``,
    ``rollout_correction=none`` becomes ``tis`` with ``algorithm.correction``'s thresholds.

    A sample generated one version back is off-policy by a whole update, not only by the
    engine/trainer gap: truncated importance weights min(π_old/π_rollout, C), with π_old
    recomputed at the current weights, correct it while keeping every token (masking, MIS,
    would discard generated tokens). tis and mis chosen explicitly stay as they are. Resolved
    when the config is built, so the run's saved config is the one its methods are built from;
    a config cannot tell an unset ``none`` from one written out, so both become tis.
    """
    if rollout.max_staleness == 0 or algorithm.rollout_correction != "none":
        return algorithm
    logger.info("rollout.max_staleness=%d: stale samples are corrected by truncated importance sampling "
                "(algorithm.rollout_correction=tis, level %s, C=%g)", rollout.max_staleness,
                algorithm.correction.level, algorithm.correction.upper)
    return replace(algorithm, rollout_correction="tis")


@dataclass(kw_only=True, slots=True)
class RLConfig:
    """`winnow rl`: the RL loop (see docs/rl.md)."""

    bootstrap: BootstrapConfig = section(BootstrapConfig, help="the base policy (built or reused from the cache)")
    data: DataConfig = option(
        default_factory=lambda: DataConfig(train=["arith?difficulty=3&size=4000"], template="raw"),
        help="training prompts",
    )
    eval_set: str = option(
        "arith?difficulty=3&size=400",
        help="held-out set scored at the start and the end: a benchmark or synthetic spec (its test split unless "
             "the spec names one) or a .jsonl/.parquet file (read whole)",
    )
    eval_samples: int = option(4, ge=1, help="samples per held-out problem (sampled pass@1 = avg over them)")
    eval_limit: int | None = option(
        None, ge=1, help="score a seeded random subset of this many held-out problems (null: all of them)"
    )
    eval_every: int = option(0, ge=0, help="also score the held-out set every this many steps (0: start and end only)")
    prompts_per_step: int = option(16, ge=1, help="prompts per RL step (B)")
    group_size: int = option(8, ge=1, help="samples per prompt (G)")
    max_new_tokens: int = option(48, ge=1, help="generation length limit")
    temperature: float = option(1.0, gt=0.0, help="sampling temperature (initial τ for E3)")
    top_p: float = option(1.0, gt=0.0, le=1.0, help="nucleus sampling threshold")
    steps: int = option(100, ge=1, help="RL steps")
    algorithm: AlgorithmConfig = section(AlgorithmConfig, help="methods and their options")
    optim: OptimConfig = option(
        default_factory=lambda: OptimConfig(lr=1e-4, total_steps=100), help="actor optimizer"
    )
    trainer: TrainerConfig = section(TrainerConfig, help="micro-batching and the log-prob head")
    parallel: ParallelConfig = section(
        ParallelConfig, help="trainer layout; data parallel = world size / (TP·PP) under torchrun"
    )
    reward: RewardConfig = section(RewardConfig, help="grading pool")
    checkpoint: CheckpointConfig = option(
        default_factory=lambda: CheckpointConfig(directory="runs/rl/checkpoints", every_steps=25),
        help="checkpoints and resume",
    )
    logging: LoggingConfig = option(default_factory=lambda: LoggingConfig(output_dir="runs/rl"), help="outputs")
    seed: int = option(0, help="seed of data order and sampling")
    curation_dir: str | None = option(
        None, help="a finished `winnow curate` output_dir: its pass rates seed the statistics store, E3 ranks and Ada-Est"
    )
    policy: str | None = option(
        None, help="initial policy: a Hugging Face folder or a winnow checkpoint directory (null: the bootstrap policy)"
    )
    tokenizer: str | None = option(None, help="tokenizer folder for `policy` (null: the policy's own)")
    rollout: RolloutConfig = section(RolloutConfig, help="the rollout engine")

    def __post_init__(self) -> None:
        collective_timeout_minutes(parallel=self.parallel, rollout=self.rollout)  # refuses one too short
        self.algorithm = stale_sample_correction(self.algorithm, rollout=self.rollout)
        algorithm = self.algorithm
        if algorithm.budget == "e3":
            _require(algorithm.e3_budget.min_limit <= self.group_size <= algorithm.e3_budget.max_limit,
                     "algorithm.e3_budget", f"need min_limit ≤ group_size={self.group_size} ≤ max_limit")
        if algorithm.budget == "ada_est":
            _require(algorithm.ada_est.min_budget <= self.group_size <= algorithm.ada_est.max_budget,
                     "algorithm.ada_est", f"need min_budget ≤ group_size={self.group_size} ≤ max_budget")


def _fixed_policy_rollout(rollout: RolloutConfig) -> None:
    """Curation and evaluation score one fixed policy: the servers load it once, and
    ``weights_dir`` is where a winnow checkpoint is exported for them; nothing is synced."""
    _require(rollout.weights_dir is None or bool(rollout.weights_dir.strip()), "rollout.weights_dir",
             "an empty path; give a folder every server can read, or null")


@dataclass(kw_only=True, slots=True)
class EvaluateConfig:
    """`winnow evaluate`: sampled pass@k of one policy on benchmarks, sharded and resumable."""

    policy: str = option(
        "", help="the policy: a Hugging Face folder, a winnow run/checkpoint directory, or a bootstrap cache entry"
    )
    tokenizer: str | None = option(
        None, help="tokenizer folder (null: the policy's own, or tokenizer/ next to its checkpoints)"
    )
    output_dir: str = option("runs/eval", help="shards, manifest.json, results.json, results.md and plots go here")
    eval: EvalConfig = section(EvalConfig, help="benchmarks, sampling, pass@k values and bootstrap")
    reward: RewardConfig = section(RewardConfig, help="grading pool")
    template: Literal["raw", "plain", "chat"] = option(
        "plain", help="prompt template: raw problem, plain instruction, or the tokenizer's chat template"
    )
    shard_size: int = option(64, ge=1, help="problems per shard, the unit of work saved and resumed")
    max_batch_rows: int = option(256, ge=1, help="sequences per forward pass of the local engine")
    save_responses: int = option(2, ge=0, help="responses kept per problem in the shards (truncated)")
    dtype: Literal["float32", "bfloat16", "float16"] = option("float32", help="dtype the policy runs in")
    device: Literal["auto", "cpu", "cuda"] = option(
        "auto", help="where the local engine runs the policy (auto: CUDA when available)"
    )
    progress: bool = option(True, help="show a progress bar per benchmark")
    rollout: RolloutConfig = section(
        RolloutConfig, help="the engine that generates: local (the policy in this process) or SGLang servers, "
        "which load the policy once (see docs/rollout.md, where curation and evaluation run)"
    )

    def __post_init__(self) -> None:
        _fixed_policy_rollout(self.rollout)


@dataclass(kw_only=True, slots=True)
class CurateRulesConfig:
    """The curation rules, applied in the fixed order of ``pipeline.stages.curate_rules``."""

    verify_reference: bool = option(
        True, help="drop prompts whose reference answer, as \\boxed{answer}, does not grade correct against itself"
    )
    dedup: bool = option(
        True, help="drop later prompts whose normalized problem text (NFKC, case-folded, whitespace) was already kept"
    )
    trivial_threshold: float | None = option(
        0.375, ge=0.0, le=1.0,
        help="drop prompts whose pass rate c/k is above this (Reinforce-Ada: 0.375); null keeps all",
    )
    drop_impossible: bool = option(True, help="drop prompts with no correct sample")
    hard_subset: tuple[int, int] | None = option(
        None,
        help="[min_correct, max_correct]: keep only prompts with this many correct of k (Reinforce-Ada: [1, 2] of 16)",
    )

    def __post_init__(self) -> None:
        if self.hard_subset is not None and not 0 <= self.hard_subset[0] <= self.hard_subset[1]:
            raise ConfigError(f"hard_subset: {list(self.hard_subset)} must be [min, max] with 0 <= min <= max")


@dataclass(kw_only=True, slots=True)
class CurateConfig:
    """`winnow curate`: sample k answers per prompt from the base policy, grade, keep the useful prompts."""

    sources: list[str] = option(
        default_factory=lambda: [f"arith?difficulty={d}&size=500" for d in (2, 3, 4, 5)],
        help="prompt sources: benchmark names, synthetic specs or .jsonl/.parquet paths",
    )
    split: str | None = option(
        None, help="split of every non-file source (null: each source's default, train for synthetic)"
    )
    limit: int | None = option(None, ge=1, help="use at most this many prompts per source")
    on_bad_row: Literal["fail", "skip"] = option(
        "fail", help="malformed rows: fail naming file and line, or skip and count"
    )
    policy: str | None = option(
        None, help="the policy to sample from: a Hugging Face folder or a winnow checkpoint directory (required)"
    )
    tokenizer: str | None = option(None, help="tokenizer folder (null: the policy's own)")
    dtype: Literal["float32", "bfloat16", "float16"] = option("float32", help="dtype the policy is loaded in")
    device: str = option("auto", help="device to generate on: auto (cuda when available), cpu, cuda, cuda:1, ...")
    num_samples: int = option(16, ge=1, help="k: responses sampled per prompt")
    temperature: float = option(1.0, ge=0.0, help="sampling temperature (0: greedy)")
    top_p: float = option(1.0, gt=0.0, le=1.0, help="nucleus sampling threshold")
    max_new_tokens: int = option(
        4096, ge=1, help="generation length limit; prompts longer than the context minus this are dropped (too_long)"
    )
    seed: int = option(
        0, help="seed of the synthetic sources and of sampling (shard i samples with a seed from (seed, i))"
    )
    rules: CurateRulesConfig = section(CurateRulesConfig, help="which prompts to keep")
    reward: RewardConfig = section(RewardConfig, help="grading pool")
    output_dir: str = option("runs/curate", help="where shards, pass rates, kept prompts and the report are written")
    shard_size: int = option(512, ge=1, help="prompts per shard: the unit of generation, atomic writes and resume")
    template: Literal["raw", "plain", "chat"] = option("plain", help="prompt template (see pipeline.data.templates)")
    progress: bool = option(True, help="show progress bars")
    rollout: RolloutConfig = section(
        RolloutConfig, help="the engine that generates: local (the policy in this process) or SGLang servers, "
        "which load the policy once; question log-probs are computed in this process on `device` either way"
    )

    def __post_init__(self) -> None:
        _fixed_policy_rollout(self.rollout)
        if not self.sources:
            raise ConfigError("sources: needs at least one source")
        if self.rules.hard_subset is not None and self.rules.hard_subset[0] > self.num_samples:
            raise ConfigError(f"rules.hard_subset: min_correct {self.rules.hard_subset[0]} exceeds "
                              f"num_samples={self.num_samples}, so no prompt could be kept")


@dataclass(kw_only=True, slots=True)
class DemoConfig:
    """`winnow demo`: the CPU campaign (recipes.campaigns.cpu_campaign) in one process, then a results table."""

    output_dir: str = option("runs/demo", help="campaign root: status.json, every stage's outputs, the final plot")
    steps: int = option(100, ge=1, help="RL steps of each variant (default, grpo and methods)")
    tiny: bool = option(False, help="toy sizes everywhere (tests): a 40-step bootstrap, 2-step RL, tiny evaluations")
    benchmarks: list[str] = option(
        default_factory=lambda: ["arith?difficulty=3&size=400", "arith?difficulty=4&size=400", "gsm8k", "math500"],
        help="held-out sets each variant is evaluated on (their test split)",
    )
    eval_limit: int = option(100, ge=1, help="at most this many problems per benchmark")
    eval_samples: int = option(32, ge=1, help="samples per problem (n of the unbiased pass@k)")
    ks: list[int] = option(default_factory=lambda: [1, 2, 4, 8, 16, 32], help="k values of pass@k")
    question: str = option("What is 30 * 69?", help="asked of the exported model after reloading it with transformers")
    max_new_tokens: int = option(48, ge=1, help="answer length limit for that question")

    def __post_init__(self) -> None:
        bad = [k for k in self.ks if not 1 <= k <= self.eval_samples]
        _require(not bad, "ks", f"{bad} outside [1, eval_samples={self.eval_samples}]")


@dataclass(kw_only=True, slots=True)
class TrainEstimatorConfig:
    """`winnow train-estimator`: pre-train the DEPO difficulty estimator on a curation's pass rates."""

    curation_dir: str | None = option(None, help="output_dir of a finished `winnow curate` (required)")
    encoder: Literal["minilm", "tiny"] = option(
        "minilm", help="minilm: pre-trained all-MiniLM-L6-v2; tiny: a random 2-layer encoder (tests, CPU demos)"
    )
    cache_dir: str = option(
        "estimator", help="where the MiniLM zip is unpacked once (relative: under the cache root, see bootstrap.cache_dir)"
    )
    max_length: int = option(256, ge=3, help="question tokens the encoder reads (longer questions are truncated)")
    epochs: int = option(3, ge=1, help="passes over the training prompts")
    batch_size: int = option(32, ge=2, help="prompts per update (the ranking loss compares pairs within a batch)")
    lr: float = option(2e-5, gt=0.0, help="AdamW learning rate")
    weight_decay: float = option(0.01, ge=0.0, help="AdamW weight decay")
    w_distill: float = option(
        DEPO_W_DISTILL, ge=0.0,
        help="weight of L_distill (DEPO §4.1): the policy's question perplexity, recorded by the curation"
    )
    w_rank: float = option(DEPO_W_RANK, ge=0.0, help="weight of the pairwise ranking loss L_rank (DEPO §4.1)")
    margin: float = option(
        DEPO_RANK_MARGIN, ge=0.0, le=1.0,
        help="ranking margin: the fraction of an observed pass-rate gap the predicted pass rates must reproduce"
    )
    w_zero_variance: float = option(
        DEPO_W_ZERO_VARIANCE, gt=0.0, help="weight of the zero-variance head's loss (labels at group_size)"
    )
    holdout_fraction: float = option(0.1, gt=0.0, lt=1.0, help="fraction of prompts (by id hash) held out")
    group_size: int | None = option(
        None, ge=1, help="G the zero-variance head is trained and scored for; use the RL run's group_size "
        "(null: the curation's k)"
    )
    filter_ratio: float = option(
        DEPO_FILTER_RATIO, ge=0.0, le=1.0, help="the reported drop rule drops at most this fraction of prompts"
    )
    filter_threshold: float = option(
        DEPO_DROP_THRESHOLD, ge=0.0, lt=1.0,
        help="the reported drop rule drops only prompts whose P(all G rewards equal) exceeds this"
    )
    seed: int = option(0, help="seed of the heads' (and tiny encoder's) init and of the batch order")
    output_dir: str = option("runs/estimator", help="where estimator/, calibration.json and calibration.png go")
    progress: bool = option(True, help="show progress bars")

    def __post_init__(self) -> None:
        if self.encoder == "minilm" and self.max_length > 512:
            raise ConfigError(f"max_length: MiniLM has 512 positions, got {self.max_length}")


# ================================================================ campaign stages


@dataclass(kw_only=True, slots=True)
class ExportConfig:
    """The campaign's export stage: ``winnow convert megatron-to-hf`` of one run's checkpoints."""

    checkpoint: str = option(help="a run's checkpoint directory (its `latest`) or one step_* directory")
    out: str = option(help="the Hugging Face folder to create (replaced atomically on a rerun)")
    tokenizer: str | None = option(None, help="tokenizer folder to copy (null: found next to the checkpoint)")
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = option("auto", help="weights dtype of the export")
    verify: bool = option(True, help="compare the export's logits with the checkpoint's before publishing it")


@dataclass(kw_only=True, slots=True)
class ConvertConfig:
    """The campaign's conversion stage: ``winnow convert hf-to-megatron`` of the base model, once.

    The trainer starts from a winnow checkpoint, the SGLang servers from the Hugging Face
    folder: an H100 campaign converts the folder here and hands each side its own format.
    """

    hf: str = option(help="the Hugging Face model folder")
    out: str = option(help="the winnow run directory to create (replaced atomically on a rerun)")
    verify: bool = option(True, help="compare the converted checkpoint's logits with the HF model's")


@dataclass(kw_only=True, slots=True)
class RolloutServers:
    """SGLang servers on nodes of their own, next to the trainer nodes of the same job.

    An rl stage syncs its weights to them every step; a curate or evaluate stage has them
    load the policy it scores once (``pipeline.eval.sharded.policy_engine``), so they may
    start from any Hugging Face folder of the same architecture (``model_path``).
    """

    nodes: int = option(ge=1, help="nodes running SGLang servers (after the trainer nodes of the allocation)")
    servers_per_node: int = option(1, ge=1, help="servers per rollout node (each uses gpus_per_node / this GPUs)")
    tensor_parallel: int = option(1, ge=1, help="SGLang --tp-size of each server")
    port: int = option(30000, ge=1024, le=65000, help="port of a node's first server; the next ones count up")
    extra_args: list[str] = option(default_factory=list, help="more `sglang.launch_server` arguments")
    model_path: str | None = option(
        None, help="the Hugging Face folder the servers load at start (null: the stage's policy, which must "
                   "then be one); an rl trainer's policy is the same weights converted, and an evaluate stage, "
                   "whose policy is usually a checkpoint, needs one"
    )
    startup_timeout_s: float = option(1800.0, gt=0, help="how long the trainer waits for every server's /health")
    server: Literal["sglang", "standin"] = option(
        "sglang", help="the server program: SGLang, or winnow's CPU stand-in for it (`python -m "
                       "pipeline.cli.standin`, what a rehearsal runs: same command line and HTTP protocol)"
    )
    colocated: bool = option(
        False, help="the servers run on the trainer's first node beside its ranks, on the GPUs after the "
                    "trainer's (a node shared by trainer and servers, or a one-node rehearsal); needs nodes=1"
    )

    def __post_init__(self) -> None:
        if self.colocated and self.nodes != 1:
            raise ConfigError(f"rollout.nodes: co-located servers run on the trainer's first node; got "
                              f"nodes={self.nodes}")
        # The client's in-flight limit is derived from the same number: one option sets both.
        if any(arg.split("=", 1)[0] == "--max-running-requests" for arg in self.extra_args):
            raise ConfigError("rollout.extra_args: --max-running-requests is set by the stage's "
                              "config.rollout.max_running_requests_per_server (the client's limit follows it)")


@dataclass(kw_only=True, slots=True)
class Resources:
    """What one stage runs on. Trainer ranks: ``nodes × ranks_per_node`` processes under torchrun."""

    nodes: int = option(1, ge=1, help="trainer nodes")
    ranks_per_node: int = option(1, ge=1, help="processes per trainer node (one per GPU on GPU nodes)")
    gpus_per_node: int = option(0, ge=0, help="GPUs requested per node (0: a CPU stage)")
    rollout: RolloutServers | None = option(
        None, help="SGLang servers for an rl, curate or evaluate stage (null: the local engine)"
    )
    time_limit: str | None = option(None, help="SLURM time limit of the stage's job (null: the profile's)")
    requeues: int = option(
        0, ge=0, help="times the job is requeued after a transient failure (a checkpointed stop, a killed task, "
                      "a lost node); never after a user error (exit 2)"
    )

    @property
    def num_ranks(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def total_nodes(self) -> int:
        return self.nodes + (self.rollout.nodes if self.rollout and not self.rollout.colocated else 0)


def _rl_trainer_layout(name: str, cfg: RLConfig, resources: Resources) -> None:
    """An rl stage's ranks run megatron's trainer: one rank per GPU, in whole TP × PP model replicas."""
    model_parallel = cfg.parallel.tensor_parallel * cfg.parallel.pipeline_parallel
    if resources.gpus_per_node and resources.ranks_per_node != resources.gpus_per_node:
        raise ConfigError(f"stages.{name}.resources.ranks_per_node: {resources.ranks_per_node} rank(s) on "
                          f"{resources.gpus_per_node} GPUs per node; an rl stage runs one rank per GPU")
    if resources.num_ranks % model_parallel:
        raise ConfigError(f"stages.{name}.resources: {resources.num_ranks} rank(s) are not a multiple of "
                          f"TP x PP = {model_parallel} (config.parallel)")


@dataclass(kw_only=True, slots=True, eq=False)
class StageKind:
    """One kind of campaign stage: its config class and what the launcher may give it.

    Every property of a kind lives here, so adding a kind is one entry in ``STAGE_KINDS``
    (and its runner, attached by ``pipeline.launch.campaign.stage_runner``).
    """

    name: str
    config: type  # the stage's config dataclass
    # `winnow <name>` runs the stage alone with these options (export and convert take
    # `winnow convert`'s flags instead): `winnow config show|docs` list it as a command.
    command: bool = False
    multi_rank: bool = False  # may run on more than one rank (torchrun under the node role)
    rollout_servers: bool = False  # generates through its config's `rollout` block, so may use SGLang servers
    # Its policy is usually a winnow checkpoint, which servers cannot start from: they need
    # `resources.rollout.model_path`, a Hugging Face folder of the policy's architecture.
    servers_need_model_path: bool = False
    # Converts a whole model on one process, with its logit gate: a CPU job whose memory
    # follows the model's size (``pipeline.launch.nemo.conversion_memory_bytes``).
    converts_model: bool = False
    # Checkpoints on SIGTERM/SIGUSR1 and resumes from `latest`: its SLURM job gets SIGUSR1
    # ahead of the time limit, and a stop is a requeue, not a failure.
    checkpoints_on_signal: bool = False
    # Generates: the dotted option of its config holding the generation length (what a launch
    # override names, ``<stage>.<option>=N``), checked against the model's context by the planner.
    generation_length_option: str | None = None
    # (stage name, config, resources) → None, or a ConfigError for resources the kind cannot
    # run on beyond the checks every kind gets (None: those only).
    check_resources: Callable[[str, Any, Resources], None] | None = None
    # Runs one stage in this process: (config, *, context, out) → "done" or "stopped". Set where
    # the runners are defined (the launch floor; this floor cannot import them).
    runner: Callable[..., str] | None = None


def _stage_kinds(*kinds: StageKind) -> Registry[StageKind]:
    table: Registry[StageKind] = Registry("stage kind")
    for kind in kinds:
        table.add(kind.name, kind)
    return table


# Every campaign stage kind, the one list of them: the CLI's `winnow launch stage KIND`, a plan's
# validation and campaign.json, the launcher's job shapes and the documentation all read it.
STAGE_KINDS: Registry[StageKind] = _stage_kinds(
    StageKind(name="bootstrap", config=BootstrapConfig, command=True, multi_rank=True),
    StageKind(name="curate", config=CurateConfig, command=True, rollout_servers=True,
              generation_length_option="max_new_tokens"),
    StageKind(name="train-estimator", config=TrainEstimatorConfig, command=True),
    StageKind(name="rl", config=RLConfig, command=True, multi_rank=True, rollout_servers=True,
              checkpoints_on_signal=True, check_resources=_rl_trainer_layout, generation_length_option="max_new_tokens"),
    StageKind(name="evaluate", config=EvaluateConfig, command=True, rollout_servers=True,
              servers_need_model_path=True, generation_length_option="eval.max_new_tokens"),
    StageKind(name="export", config=ExportConfig, converts_model=True),
    StageKind(name="convert", config=ConvertConfig, converts_model=True),
)
