"""GPU smoke test of the paths CPU CI cannot run: the actor on CUDA, TP=2 over NCCL, Transformer Engine (bf16,
FP8), a weight sync from a TE actor, a converted checkpoint loaded by a TE actor, and a real SGLang server.

Run on a machine with an NVIDIA GPU (H100 for FP8) with the GPU install (``make install-gpu``,
docs/gpu.md), through the shell wrapper, which takes the Python to use:

    bash tools/gpu_smoke.sh --python .venv-gpu/bin/python --fp8 delayed
    bash tools/gpu_smoke.sh --python python3 --fp8 off --skip-sglang   # an NGC container's Python

Each check prints one line, PASS / FAIL / SKIP with its numbers, and a failing check never
stops the others (its traceback goes to ``<workdir>/<check>.log``); checks that need what an
earlier one failed to provide are skipped with the reason. Exit status: 0 when nothing
failed, 1 otherwise. docs/gpu.md says what each result means.

1. ``environment``: CUDA device and capability, torch, megatron-core, Transformer Engine, APEX, SGLang;
2. ``local-bf16``: the local-spec actor trains in bf16 on CUDA (loss falls, no step skipped, weights
   and batches on the GPU, log-probs back on the CPU);
3. ``tp2``: with two GPUs, the actor (TE spec where TE imports, else the local one) at TP=2 over NCCL
   (two processes) trains as the TP=1 actor on one GPU does from the same weights: loss and grad norm
   agree in fp32 (``tensor_parallel_parity``); with fewer GPUs it is skipped;
4. ``te-bf16``: ``local-bf16`` with the Transformer Engine spec the presets use;
5. ``te-weight-sync``: the TE actor's weights through ``actor_hf_state`` into an HF model: every
   parameter mapped, and the HF model's log-probs agree with the actor's (TE↔HF agreement);
6. ``te-load-converted``: ``winnow convert hf-to-megatron`` (megatron's local spec) of a small Llama
   and a small Qwen3 HF model loads into a TE-spec actor, as an rl stage starts: the TE norms'
   extra states the checkpoint lacks keep the actor's own, and its log-probs agree with the HF model's;
7. ``fp8``: a TE + FP8 actor (``--fp8 delayed|current``) trains on one odd-shaped micro-batch
   (3 rows × 37 tokens, padded to a multiple of 16 tokens) and on the full batch;
8. ``sglang``: a bf16 export served by a real SGLang server (``--dtype bfloat16``,
   ``--enable-deterministic-inference`` so ``sampling_seed`` is honoured): its log-probs of its
   own samples match the actor's, and ``/update_weights_from_disk`` moves it to version 2;
9. ``sglang-update-group``: an rl stage's weight push over SGLang's update group (``rollout.sync=distributed``,
   NCCL): the trainer engine from the backend table, ``sync_actor_to_engine``, and the server then serves the
   trained weights (its log-probs match the actor's).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

RESULTS: dict[str, str] = {}


def report(name: str, status: str, detail: str) -> None:
    RESULTS[name] = status
    print(f"{status:<4}  {name}: {detail}", flush=True)


def run_check(name: str, workdir: Path, check: Callable[[], str], *, needs: tuple[str, ...] = ()) -> None:
    """Run one check; any exception is its FAIL (traceback to a log), never the end of the smoke."""
    missing = [need for need in needs if RESULTS.get(need) != "PASS"]
    if missing:
        report(name, "SKIP", f"needs {', '.join(missing)} to pass first")
        return
    try:
        report(name, "PASS", check())
    except _Skip as skip:
        report(name, "SKIP", str(skip))
    except Exception as error:  # noqa: BLE001 - every failure is this check's result
        log = workdir / f"{name}.log"
        log.write_text(traceback.format_exc())
        report(name, "FAIL", f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''} "
                             f"(traceback: {log})")


class _Skip(Exception):
    pass


class CheckFailed(AssertionError):
    pass


def _require_te() -> None:
    from pipeline.models.layer_spec import transformer_engine_available

    if not transformer_engine_available():
        raise _Skip("transformer_engine.pytorch does not import here (docs/gpu.md: the GPU install)")


def expect(ok: bool, detail: str) -> None:
    if not ok:
        raise CheckFailed(detail)


def require_gpus(count: int, purpose: str) -> None:
    """SKIP (not FAIL) a check that needs ``count`` GPUs on a machine with fewer."""
    available = torch.cuda.device_count()
    if available < count:
        raise _Skip(f"{available} GPU{'' if available == 1 else 's'}: {purpose} needs {count}")


# ----------------------------------------------------------------------------- TP=2 against TP=1

# fp32, not bf16: in fp32 a correct TP=2 step differs from the TP=1 one only by the order of its sums (the
# row-parallel partial products summed across ranks, other GEMM shapes), ~1e-6 relative. In bf16 every weight
# and the summed partial outputs are rounded to 8 bits of mantissa, and a correct layout already differs by
# ~1e-3..1e-2, as much as a subtle layout bug would (one replicated parameter's gradient not reduced). The bf16
# path on CUDA is local-bf16's. The first step is pure rounding (the CPU parity tests hold 1e-5 there); Adam's
# m/(sqrt(v)+eps) then turns rounding in near-zero gradient coordinates into visible weight differences (2e-4
# after three steps on CPU), so the later steps get 1e-3. On two gloo ranks this function's step 1 differs by < 1e-7.
TP_PARITY_STEPS = 3
TP_FIRST_STEP_RTOL = 1e-4
TP_LATER_STEPS_RTOL = 1e-3


def _tensor_parallel_rank(rank: int, result_dir: str, tensor_parallel: int, backend: str, port: int, spec, batch,
                          weights: str, steps: int) -> None:
    """One spawned rank of ``tensor_parallel_parity``: the trainer's own actor at ``tensor_parallel`` ranks.

    The TP=1 run writes its initial weights to ``weights``; the TP=2 ranks load them (each its shard,
    ``Actor.load_full_state_dict``). Each rank leaves its step results in ``result_dir``.
    """
    from safetensors.torch import load_file, save_file

    from pipeline.config import OptimConfig, TrainerConfig
    from pipeline.parallel.context import ParallelContext
    from pipeline.trainer.actor import Actor
    from pipeline.trainer.losses import CrossEntropyLoss

    # fp32 means fp32 GEMMs: an image may turn TF32 on for them (NGC's TORCH_ALLOW_TF32_CUBLAS_OVERRIDE),
    # whose 10-bit products would differ between the layouts by more than the tolerance.
    torch.set_float32_matmul_precision("highest")
    if backend == "gloo":
        torch.set_num_threads(1)  # CPU ranks share few cores: more threads per rank only adds contention
    context = ParallelContext.initialize(tensor_parallel=tensor_parallel, pipeline_parallel=1, seed=0, rank=rank,
                                         world_size=tensor_parallel, local_rank=rank, master_addr="127.0.0.1",
                                         master_port=port, backend=backend)
    try:
        actor = Actor(spec=spec, context=context, optim=OptimConfig(lr=1e-3), seed=0,
                      trainer=TrainerConfig(micro_batch_tokens=8192, precision="fp32"))
        if tensor_parallel == 1:
            save_file({name: value.detach().cpu().contiguous() for name, value in actor.module.state_dict().items()
                       if not name.endswith("_extra_state")}, weights)
        else:
            actor.load_full_state_dict(load_file(weights))
        results = [actor.train_step(batch, CrossEntropyLoss()) for _ in range(steps)]
        outcome = {"losses": [float(r.loss) for r in results], "grad_norms": [float(r.grad_norm) for r in results],
                   "skipped": [r.skipped for r in results], "spec": actor.layer_spec_choice.name,
                   "device": str(next(actor.module.parameters()).device)}
    finally:
        context.destroy()
    # JSON, not pickle: the smoke's own rule for files it reads back (floats, bools and strings only).
    (Path(result_dir) / f"rank{rank}.json").write_text(json.dumps(outcome))


def tensor_parallel_parity(spec, batch, *, backend: str, workdir: Path, steps: int = TP_PARITY_STEPS,
                           timeout_s: float = 300.0) -> str:
    """The actor at TP=1 on one rank, then at TP=2 on two, from the same weights; loss and grad norm must agree.

    Each layout runs in processes of its own (``run_ranks``: a fresh process group and megatron state), on
    ``backend``: ``nccl`` puts rank r on GPU r (the smoke's ``tp2``), ``gloo`` on the CPU (its CPU test).
    Returns the check's detail; raises ``CheckFailed`` naming the first step and rank that disagree.
    """
    from pipeline.parallel.launch import RankFailure, run_ranks
    from pipeline.parallel.rendezvous import reserved_port

    weights = workdir / "tp-parity-weights.safetensors"
    weights.unlink(missing_ok=True)
    runs: dict[int, list[dict]] = {}
    for tensor_parallel in (1, 2):
        try:
            with reserved_port() as port, run_ranks(
                _tensor_parallel_rank, args=(tensor_parallel, backend, port, spec, batch, str(weights), steps),
                num_ranks=tensor_parallel, timeout_s=timeout_s, description=f"TP={tensor_parallel} on {backend}",
            ) as result_dir:
                runs[tensor_parallel] = [json.loads((result_dir / f"rank{rank}.json").read_text())
                                         for rank in range(tensor_parallel)]
        except RankFailure as failure:
            raise CheckFailed(f"{failure}\n{failure.detail}") from None
    return compare_tensor_parallel(runs[1][0], runs[2])


def compare_tensor_parallel(reference: dict, ranks: list[dict]) -> str:
    """Every TP rank's losses and grad norms against the TP=1 run's, within ``TP_*_RTOL``; the check's detail."""
    expect(not any(reference["skipped"]), f"TP=1 skipped steps {reference['skipped']}")
    worst = {"loss": 0.0, "grad norm": 0.0}
    for rank, result in enumerate(ranks):
        expect(not any(result["skipped"]), f"TP=2 rank {rank} skipped steps {result['skipped']}")
        for step, values in enumerate(zip(result["losses"], reference["losses"], result["grad_norms"],
                                          reference["grad_norms"], strict=True)):
            rtol = TP_FIRST_STEP_RTOL if step == 0 else TP_LATER_STEPS_RTOL
            for what, got, expected in (("loss", *values[:2]), ("grad norm", *values[2:])):
                relative = abs(got - expected) / max(abs(expected), 1e-12)
                expect(math.isfinite(got) and relative <= rtol,
                       f"step {step + 1}, TP=2 rank {rank}: {what} {got:.6g} vs TP=1 {expected:.6g} "
                       f"(relative |Δ| {relative:.1e} > {rtol:g})")
                worst[what] = max(worst[what], relative)
    devices = sorted({result["device"] for result in ranks})
    return (f"spec {reference['spec']}, fp32, TP=2 on {', '.join(devices)} vs TP=1 on {reference['device']}: "
            f"loss {reference['losses'][0]:.4f} → {reference['losses'][-1]:.4f} in {len(reference['losses'])} "
            f"steps, grad norm {reference['grad_norms'][0]:.4g}; largest relative |Δ| loss {worst['loss']:.1e}, "
            f"grad norm {worst['grad norm']:.1e} (limits {TP_FIRST_STEP_RTOL:g} at step 1, "
            f"{TP_LATER_STEPS_RTOL:g} after)")


# ----------------------------------------------------------------------------- checks


def probe_environment(args: argparse.Namespace) -> str:
    from importlib import metadata

    from pipeline.models.layer_spec import apex_fused_wgrad_available, transformer_engine_available

    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "absent"

    facts = [f"python {sys.executable}", f"torch {torch.__version__} (CUDA {torch.version.cuda})",
             f"megatron-core {version('megatron-core')}", f"transformer-engine {version('transformer-engine')}",
             f"sglang {version('sglang')}", f"APEX wgrad kernel {'yes' if apex_fused_wgrad_available() else 'no'}"]
    expect(torch.cuda.is_available(), "no CUDA device: run with the GPU install's Python (--python), "
                                      f"not a CPU venv; {'; '.join(facts)}")
    capability = torch.cuda.get_device_capability()
    facts.insert(1, f"{torch.cuda.get_device_name()} sm_{capability[0]}{capability[1]}")
    if not transformer_engine_available():
        # The local-spec checks still run; the TE ones say SKIP with this reason.
        facts.append("transformer_engine.pytorch does not import: the te-* and fp8 checks are skipped")
    if args.fp8 != "off" and capability < (8, 9):
        facts.append("FP8 needs sm_89 or newer: the fp8 check will fail")
    return "; ".join(facts)


class Smoke:
    """Shared state of the checks: one process group, the tokenizer, the data."""

    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        from pipeline.models.spec import ModelSpec
        from pipeline.models.tokenizer import save_tokenizer, train_tokenizer
        from pipeline.parallel.rendezvous import initialize_process_context
        from pipeline.stages.bootstrap import encode_example, make_batch

        self.args, self.workdir = args, workdir
        texts = [f"What is {a} + {b}? {a} + {b} = {a + b}. \\boxed{{{a + b}}}" for a in range(30) for b in range(30)]
        self.tokenizer = train_tokenizer(texts, vocab_size=128)
        self.tokenizer_dir = save_tokenizer(self.tokenizer, workdir / "tokenizer")
        vocab = ((len(self.tokenizer) + 15) // 16) * 16  # FP8 GEMMs want multiples of 16
        self.spec = ModelSpec(family="llama", vocab_size=vocab, hidden_size=256, ffn_hidden_size=704, num_layers=4,
                              num_attention_heads=8, num_query_groups=4, max_position_embeddings=128)
        examples = [encode_example(self.tokenizer, t.split("?")[0] + "?", t.split("? ", 1)[1]) for t in texts[:256]]
        self.batch = make_batch(examples, pad_id=self.tokenizer.pad_token_id)
        self.context = initialize_process_context(seed=0)
        self.actors: dict[str, object] = {}

    def actor(self, *, fp8: str = "off", prefer_te: bool = True, spec=None):
        from pipeline.config import OptimConfig, TrainerConfig
        from pipeline.models import layer_spec
        from pipeline.trainer import actor as actor_module

        # The actor always prefers TE; the local-spec check asks for the local spec explicitly.
        select = functools.partial(layer_spec.select_layer_spec, prefer_te=prefer_te)
        original, actor_module.select_layer_spec = actor_module.select_layer_spec, select
        try:
            return actor_module.Actor(
                spec=spec or self.spec, context=self.context, optim=OptimConfig(lr=1e-3), seed=0,
                trainer=TrainerConfig(micro_batch_tokens=8192, precision="bf16", fp8=fp8))
        finally:
            actor_module.select_layer_spec = original

    def train(self, actor, *, steps: int = 20) -> str:
        from pipeline.trainer.losses import CrossEntropyLoss

        results = [actor.train_step(self.batch, CrossEntropyLoss()) for _ in range(steps)]
        expect(not any(r.skipped for r in results), f"{sum(r.skipped for r in results)} of {steps} steps skipped")
        expect(results[-1].loss < results[0].loss, f"loss did not fall: {results[0].loss:.3f} → {results[-1].loss:.3f}")
        devices = {p.device.type for p in actor.module.parameters()}
        expect(devices == {"cuda"}, f"parameters on {devices}")
        logprobs = actor.compute_logprobs(self.batch)
        expect(logprobs.device.type == "cpu" and bool(torch.isfinite(logprobs).all()), "log-probs not finite on CPU")
        return (f"spec {actor.layer_spec_choice.name}, loss {results[0].loss:.3f} → {results[-1].loss:.3f} "
                f"in {steps} steps, grad norm {results[-1].grad_norm:.3g}")

    def local_bf16(self) -> str:
        actor = self.actor(prefer_te=False)
        expect(actor.layer_spec_choice.name == "local", str(actor.layer_spec_choice))
        return self.train(actor)

    def tp2(self) -> str:
        """TP=2 over NCCL on GPUs 0 and 1 against TP=1 on GPU 0 (``tensor_parallel_parity``)."""
        require_gpus(2, "TP=2")
        return tensor_parallel_parity(self.spec, self.batch, backend="nccl", workdir=self.workdir)

    def te_bf16(self) -> str:
        _require_te()
        actor = self.actor()
        expect(actor.layer_spec_choice.name == "te", f"layer spec {actor.layer_spec_choice.to_dict()}")
        fused = actor.module.config.gradient_accumulation_fusion
        detail = self.train(actor)
        self.actors["te"] = actor
        return f"{detail}, gradient_accumulation_fusion={fused}"

    def te_weight_sync(self) -> str:
        from pipeline.checkpoint.convert import copy_into_model
        from pipeline.rollout.weight_sync import actor_hf_state, build_hf_model

        actor = self.actors["te"]
        names = [k for k in actor.module.state_dict() if not k.endswith("_extra_state")]
        expect(any(".layer_norm_weight" in k for k in names), "the TE actor has no fused-norm names")
        hf = build_hf_model(self.spec, dtype=torch.float32).cuda()
        copy_into_model(hf, actor_hf_state(actor))  # every parameter exactly once, or it raises
        delta = self.logprob_delta(hf, actor)
        # bf16 TE actor vs an fp32 HF copy of its weights: bf16 activations, ~1e-2.
        expect(float(delta.mean()) < 0.05, f"mean |Δ| {float(delta.mean()):.4f} ≥ 0.05 (max {float(delta.max()):.3f})")
        return f"{len(names)} TE parameters mapped; TE↔HF log-probs mean |Δ| {float(delta.mean()):.4f}, " \
               f"max {float(delta.max()):.3f}"

    def logprob_delta(self, hf, actor) -> torch.Tensor:
        """|Δ| between the HF model's and the actor's log-probs of the batch's response tokens (CPU, 1-D)."""
        tokens = self.batch.tokens.to(next(hf.parameters()).device)
        with torch.no_grad():
            logits = hf(tokens).logits.float()[:, :-1]
        hf_logprobs = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1).cpu()
        actor_logprobs = actor.compute_logprobs(self.batch)[:, 1:]
        return (hf_logprobs - actor_logprobs).abs()[self.batch.response_mask[:, 1:]]

    def te_load_converted(self) -> str:
        import dataclasses

        from megatron.core.dist_checkpointing import ShardedObject
        from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

        from pipeline.checkpoint.artifact import WEIGHTS_DIR, load_weights, resolve_checkpoint
        from pipeline.rollout.weight_sync import build_hf_model

        _require_te()
        details = []
        # Llama: the TE final norm's extra state; Qwen3: its q/k norms' too.
        for spec in (self.spec, dataclasses.replace(self.spec, family="qwen3")):
            hf = build_hf_model(spec, dtype=torch.float32, device=self.context.device)
            with torch.no_grad():  # HF starts norms at one: randomize them so a norm that is not loaded shows
                for name, param in hf.named_parameters():
                    if name.endswith("norm.weight"):
                        param.uniform_(0.5, 1.5)
            hf_dir, run_dir = self.workdir / f"convert-{spec.family}-hf", self.workdir / f"convert-{spec.family}-run"
            hf.save_pretrained(hf_dir)
            # The convert stage's own command, in a process of its own (it writes the local spec).
            log = self.workdir / f"convert-{spec.family}.log"
            with log.open("w") as output:
                code = subprocess.run([sys.executable, "-m", "pipeline.cli", "convert", "hf-to-megatron", "--hf",
                                       str(hf_dir), "--out", str(run_dir), "--overwrite"],
                                      stdout=output, stderr=subprocess.STDOUT).returncode
            expect(code == 0, f"{spec.family}: winnow convert hf-to-megatron exited {code} (its output: {log})")
            actor = self.actor(spec=spec)
            expect(actor.layer_spec_choice.name == "te", f"layer spec {actor.layer_spec_choice.to_dict()}")
            # What the TE actor asks for and the converter does not write: the TE norms' extra states.
            weights = resolve_checkpoint(run_dir) / WEIGHTS_DIR
            saved = {entry.key for entry in load_sharded_metadata(str(weights)).values()}
            absent = sorted({value.key for value in actor.module.sharded_state_dict().values()
                             if isinstance(value, ShardedObject) and value.key not in saved})
            expect(bool(absent), f"{spec.family}: the converted checkpoint holds every extra state the TE actor asks "
                                 "for: this check no longer covers the case")
            load_weights(run_dir, actor.module)  # an rl stage's start: a CheckpointError here is its exit 2
            delta = self.logprob_delta(hf, actor)
            # bf16 TE actor vs the fp32 HF model it was converted from: bf16 activations, ~1e-2.
            expect(float(delta.mean()) < 0.05, f"{spec.family}: TE actor vs HF log-probs mean |Δ| "
                                               f"{float(delta.mean()):.4f} ≥ 0.05 (max {float(delta.max()):.3f})")
            details.append(f"{spec.family}: kept the actor's own {', '.join(absent)}; "
                           f"log-probs vs HF mean |Δ| {float(delta.mean()):.4f}")
            del actor, hf
        return "; ".join(details)

    def fp8(self) -> str:
        from pipeline.trainer.batch import TrainBatch
        from pipeline.trainer.losses import CrossEntropyLoss

        if self.args.fp8 == "off":
            raise _Skip("--fp8 off")
        _require_te()
        actor = self.actor(fp8=self.args.fp8)
        expect(actor.layer_spec_choice.fp8_recipe == self.args.fp8 and actor.token_multiple == 16,
               f"{actor.layer_spec_choice.to_dict()}, token multiple {actor.token_multiple}")
        length = 37  # 3 × 37 = 111 tokens: runs as 3 × 48
        generator = torch.Generator().manual_seed(0)
        odd = TrainBatch(tokens=torch.randint(1, len(self.tokenizer), (3, length), generator=generator),
                         response_mask=(torch.arange(length) >= 5).expand(3, length).clone())
        first = actor.train_step(odd, CrossEntropyLoss())
        expect(not first.skipped and first.loss == first.loss, f"3×{length} micro-batch: {first}")
        detail = self.train(actor)
        return f"recipe {self.args.fp8}: 3×{length} micro-batch loss {first.loss:.3f}; {detail}"

    def _require_sglang(self) -> None:
        if self.args.skip_sglang:
            raise _Skip("--skip-sglang")
        try:
            import sglang  # noqa: F401
        except Exception as error:  # noqa: BLE001
            raise _Skip(f"sglang does not import here ({type(error).__name__}); install its stack or pass "
                        "--skip-sglang") from None

    def export(self, actor, step: int) -> Path:
        """A bf16 Hugging Face folder of ``actor`` (as ``winnow convert megatron-to-hf`` writes it)."""
        from pipeline.checkpoint.manager import CheckpointManager

        run_dir = self.workdir / f"run{step}"
        CheckpointManager(run_dir, keep_last=1).save(step, actor=actor)
        out = self.workdir / f"hf{step}"
        # bf16 on disk: an fp32 export with --dtype auto is served in float16.
        subprocess.run([sys.executable, "-m", "pipeline.cli", "convert", "megatron-to-hf", "--ckpt", str(run_dir),
                        "--out", str(out), "--tokenizer", str(self.tokenizer_dir), "--overwrite", "--dtype", "bf16",
                        "--atol", "0.05"], check=True)
        return out

    def launch_server(self, model: Path, *, port: int, log_dir: str):
        from pipeline.rollout.sglang.generation import SGLangEngine
        from pipeline.rollout.sglang.protocol import SGLangServerSpec

        server = SGLangServerSpec(model_path=str(model), port=port, host="127.0.0.1", weight_version=1,
                                  dtype="bfloat16", random_seed=0, enable_deterministic_inference=True)
        return SGLangEngine.launch([server], log_dir=self.workdir / log_dir)

    def engine_mismatch(self, engine, actor) -> float:
        """Mean |Δ| between the engine's log-probs of its own samples and the actor's."""
        from pipeline.models.tokenizer import encode_prompt
        from pipeline.rl.rollouts import to_train_batch
        from pipeline.rollout.mismatch import logprob_mismatch
        from pipeline.rollout.types import GenerationRequest, SamplingParams

        prompts = [encode_prompt(self.tokenizer, f"What is {a} + {a + 1}?") for a in range(8)]
        requests = [GenerationRequest(prompt_id=str(i), prompt_token_ids=p, num_samples=2)
                    for i, p in enumerate(prompts)]
        completions = engine.generate(requests, SamplingParams(max_new_tokens=16, temperature=1.0, seed=1))
        batch, engine_logprobs = to_train_batch(prompts, completions, torch.arange(len(prompts)).repeat_interleave(2),
                                                pad_id=self.tokenizer.pad_token_id)
        _, metrics = logprob_mismatch(engine_logprobs, actor.compute_logprobs(batch), mask=batch.response_mask)
        return float(metrics["mean_abs_diff"])

    def sglang(self) -> str:
        from pipeline.rollout.sglang.weights import SGLangWeights
        from pipeline.trainer.losses import CrossEntropyLoss

        self._require_sglang()
        actor = self.actors["te"]
        engine = self.launch_server(self.export(actor, 1), port=self.args.port, log_dir="sglang")
        try:
            before = self.engine_mismatch(engine, actor)
            expect(before < 0.1, f"SGLang vs actor log-probs mean |Δ| {before:.4f} ≥ 0.1")
            for _ in range(2):
                actor.train_step(self.batch, CrossEntropyLoss())
            SGLangWeights(engine.pool).load_from_disk(str(self.export(actor, 2)), version=2)
            after = self.engine_mismatch(engine, actor)
            expect(engine.weight_version == 2 and after < 0.1, f"version {engine.weight_version}, mean |Δ| {after:.4f}")
            return f"mean |Δ| {before:.4f}; after /update_weights_from_disk to version 2: {after:.4f}"
        finally:
            engine.close()

    def sglang_update_group(self) -> str:
        """An rl stage's weight push over the update group (``rollout.sync=distributed``), as the loop does it.

        The trainer's engine comes from the backend table (``trainer_engine``: the SGLang client in its
        ``DistributedSyncedEngine``) and the push is ``sync_actor_to_engine``: begin the server's update
        session, join the NCCL group, broadcast every bucket, end the session. The server must then serve
        the trained weights: its log-probs of its own samples match the actor's after two updates.
        """
        from pipeline import configlib
        from pipeline.config import RolloutConfig
        from pipeline.rollout.backends import ROLLOUT_BACKENDS
        from pipeline.rollout.weight_sync import sync_actor_to_engine
        from pipeline.trainer.losses import CrossEntropyLoss

        self._require_sglang()
        actor = self.actors["te"]
        port = self.args.port + 1
        server = self.launch_server(self.export(actor, 3), port=port, log_dir="sglang-update-group")
        synced = None
        try:
            rollout = configlib.load(RolloutConfig, overrides=[
                "engine=sglang", f"servers=[http://127.0.0.1:{port}]", "sync=distributed", "server_tensor_parallel=1",
                f"weights_dir={self.workdir / 'weights'}"])
            synced = ROLLOUT_BACKENDS.get("sglang").trainer_engine(rollout, spec=self.spec, tokenizer=self.tokenizer,
                                                                   tokenizer_dir=self.tokenizer_dir)
            for _ in range(2):
                actor.train_step(self.batch, CrossEntropyLoss())
            stale = self.engine_mismatch(synced, actor)
            sync_actor_to_engine(actor, synced, version=2)
            after = self.engine_mismatch(synced, actor)
            expect(synced.weight_version == 2 and after < 0.1,
                   f"version {synced.weight_version}, mean |Δ| {after:.4f} after the push (before it {stale:.4f})")
            return (f"before the push (served weights two updates old) mean |Δ| {stale:.4f}; after the update-group "
                    f"push to version 2: {after:.4f}")
        finally:
            if synced is not None:
                synced.close()
            server.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="/tmp/winnow-gpu-smoke")
    parser.add_argument("--port", type=int, default=30123)
    parser.add_argument("--fp8", choices=["off", "delayed", "current"], default="delayed",
                        help="the FP8 recipe of the fp8 check (off: skip it)")
    parser.add_argument("--skip-sglang", action="store_true", help="skip the SGLang server check")
    args = parser.parse_args(argv)
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)

    run_check("environment", workdir, functools.partial(probe_environment, args))
    smoke: list[Smoke] = []

    def setup() -> str:
        smoke.append(Smoke(args, workdir))
        return f"one-rank {smoke[0].context.backend} group on {smoke[0].context.device}"

    run_check("setup", workdir, setup, needs=("environment",))
    for name, method, needs in (
        ("local-bf16", "local_bf16", ("setup",)),
        ("tp2", "tp2", ("setup",)),
        ("te-bf16", "te_bf16", ("setup",)),
        ("te-weight-sync", "te_weight_sync", ("te-bf16",)),
        ("te-load-converted", "te_load_converted", ("setup",)),
        ("fp8", "fp8", ("setup",)),
        ("sglang", "sglang", ("te-bf16",)),
        ("sglang-update-group", "sglang_update_group", ("sglang",)),
    ):
        run_check(name, workdir, lambda method=method: getattr(smoke[0], method)(), needs=needs)
    counts = {status: [n for n, s in RESULTS.items() if s == status] for status in ("PASS", "SKIP", "FAIL")}
    print(f"{len(counts['PASS'])} passed, {len(counts['SKIP'])} skipped, {len(counts['FAIL'])} failed"
          + (f": {', '.join(counts['FAIL'])}" if counts["FAIL"] else ""), flush=True)
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
