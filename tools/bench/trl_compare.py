"""winnow's RL step time vs TRL's ``GRPOTrainer`` on the same model, prompts, group size, length and reward.

    .venv/bin/python -m tools.bench.trl_compare                       # 3 rounds x 4 steps each side
    .venv/bin/python -m tools.bench.trl_compare --rounds 5 --steps-per-round 4 --eval-prompts 500

TRL lives only in the benchmark's own virtual environment (``--trl-python``); create it
once, pinning the CPU torch wheel so pip does not fetch a CUDA build:

    python3.11 -m venv cache/bench-trl-venv
    cache/bench-trl-venv/bin/pip install torch==2.13.0 transformers==5.23.0 trl==1.16.0 math-verify==0.9.0 psutil

Both sides train the cached bootstrap policy (exported to a Hugging Face folder for
TRL) with plain GRPO: ``--prompts`` prompts x ``--group-size`` samples x up to
``--new-tokens`` new tokens per step, temperature 1, group-normalized advantages,
clip 0.2/0.28 with token-mean aggregation (TRL ``loss_type="dapo"``), no KL, Adam at a
constant ``--lr``, gradient clip 1, one optimizer step per generation. The prompts are
the RL stage's training prompts in the order winnow's prompt stream serves them
(TRL's dataset is written in that order and not shuffled), tokenized to the same ids
(checked), and both grade with winnow's ``GradingPool`` (the same worker processes
and options).

TRL runs in a subprocess that pauses at round boundaries: the two sides alternate
round by round (``--rounds`` x ``--steps-per-round`` steps each), so load on the shared
machine hits both alike. winnow runs ``run_rl`` one round at a time (resuming from its
checkpoint); its step time is the sum of the step's ``time/*`` phases. TRL's step time
is ``on_step_begin`` → ``on_step_end`` (generation, reward, loss, backward, optimizer
step), with generation and reward timed inside. Neither includes logging or
checkpoints. The first step of every round is dropped on both sides (winnow rebuilds
its run on resume; TRL's first step warms up). The ratio is median winnow step /
median TRL step (target ≤ 0.8, must be ≤ 1.0), with the min–max of the per-round
ratios; the ratio of the fastest steps is reported too, as the estimate least inflated
by other load on a shared machine. Afterwards both final policies (and the base) are scored with the same
held-out evaluation as ``tools/bench/race.py`` (sampled pass@1, pass@8).

Writes ``<out>/trl_compare.json`` and ``<out>/trl_compare.png`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MESSAGE_PREFIX = "@@trl "  # lines of the TRL worker's protocol on its stdout; anything else is TRL's own output


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per side")
    parser.add_argument("--steps-per-round", type=int, default=4, help="steps per round (the first is dropped)")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step")
    parser.add_argument("--group-size", type=int, default=8, help="samples per prompt")
    parser.add_argument("--new-tokens", type=int, default=48, help="generation length limit")
    parser.add_argument("--lr", type=float, default=1e-4, help="constant learning rate of both sides")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each side")
    parser.add_argument("--eval-prompts", type=int, default=500, help="held-out problems (0: skip the evaluation)")
    parser.add_argument("--eval-samples", type=int, default=8, help="samples per held-out problem")
    parser.add_argument("--eval-set", default="arith?difficulty=3&size=1000", help="held-out source (test split)")
    parser.add_argument("--trl-python", default=str(REPO / "cache/bench-trl-venv/bin/python"),
                        help="python of the virtual environment that has TRL")
    parser.add_argument("--winnow", nargs="*", default=["trainer.old_logprobs=update_forward"], metavar="KEY=VALUE",
                        help="RLConfig overrides of the winnow side (default: π_old from the update's own forward, "
                             "as TRL does with one iteration per batch)")
    parser.add_argument("--out", default="runs/bench/trl_compare", help="output directory (replaced)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: run the TRL side
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.steps_per_round < 2:
        parser.error("need --rounds ≥ 1 and --steps-per-round ≥ 2 (each round's first step is dropped)")
    return args


# --------------------------------------------------------------------------- TRL side (TRL's venv)


def _send(message: dict) -> None:
    print(MESSAGE_PREFIX + json.dumps(message), flush=True)


def run_trl_worker(spec_path: Path) -> None:
    """Train with TRL's GRPOTrainer as ``spec`` says; pause before every round until stdin says go.

    Imports only torch, transformers, datasets, trl and ``pipeline.rewards`` (stdlib,
    psutil, math-verify), all of which the TRL environment has.
    """
    spec = json.loads(spec_path.read_text())
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from pipeline.rewards import GradingPool

    torch.set_num_threads(spec["threads"])
    rows = [json.loads(line) for line in Path(spec["prompts_file"]).read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(spec["model"], trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32, trust_remote_code=False)
    step_times: dict[str, float] = {"generate": 0.0, "reward": 0.0}
    original_generate = model.generate

    def timed_generate(*args, **kwargs):
        started = time.perf_counter()
        try:
            return original_generate(*args, **kwargs)
        finally:
            step_times["generate"] += time.perf_counter() - started

    model.generate = timed_generate  # TRL generates with the unwrapped model object on one CPU process
    pool = GradingPool(**spec["reward"])

    def reward(prompts, completions, answer, **kwargs) -> list[float]:  # noqa: ARG001 (TRL's signature)
        started = time.perf_counter()
        grades = pool.grade_batch(list(zip(completions, answer)))
        step_times["reward"] += time.perf_counter() - started
        return [grade.score for grade in grades]

    steps_per_round = spec["steps_per_round"]

    class Rounds(TrainerCallback):
        def __init__(self) -> None:
            self.steps: list[dict[str, float]] = []
            self.started = 0.0

        def _report_round(self) -> None:
            _send({"event": "round", "steps": self.steps})
            self.steps = []

        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step % steps_per_round == 0:
                if state.global_step > 0:
                    self._report_round()
                if sys.stdin.readline().strip() != "go":
                    raise SystemExit("parent asked the TRL worker to stop")
            step_times.update(generate=0.0, reward=0.0)
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.steps.append({"total": time.perf_counter() - self.started, **step_times})

        def on_train_end(self, args, state, control, **kwargs):
            self._report_round()

    config = GRPOConfig(
        output_dir=spec["output_dir"], max_steps=spec["total_steps"], seed=spec["seed"], use_cpu=True,
        per_device_train_batch_size=spec["prompts"] * spec["group_size"], gradient_accumulation_steps=1,
        num_generations=spec["group_size"], max_completion_length=spec["new_tokens"], num_iterations=1,
        temperature=1.0, top_p=1.0, top_k=0, shuffle_dataset=False,
        learning_rate=spec["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0,
        beta=0.0, epsilon=0.2, epsilon_high=0.28, loss_type="dapo", scale_rewards="group",
        logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True, dataloader_num_workers=0,
        bf16=False, fp16=False,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=Dataset.from_list(rows),
                          processing_class=tokenizer, callbacks=[Rounds()])
    try:
        trainer.train()
    finally:
        pool.close()
    model.generate = original_generate
    trainer.save_model(spec["final_dir"])
    tokenizer.save_pretrained(spec["final_dir"])
    _send({"event": "done"})


class TRLWorker:
    """The TRL subprocess and its line protocol."""

    def __init__(self, python: str, spec_path: Path, *, log_path: Path) -> None:
        self._log = log_path.open("w")
        # The TRL venv has no winnow installed: run from the repository root, which `-m` puts on sys.path.
        self.process = subprocess.Popen(
            [python, "-m", "tools.bench.trl_compare", "--worker", str(spec_path)], cwd=REPO,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, bufsize=1,
        )

    def receive(self) -> dict:
        for line in self.process.stdout:
            if line.startswith(MESSAGE_PREFIX):
                return json.loads(line.removeprefix(MESSAGE_PREFIX))
        code = self.process.wait()
        raise RuntimeError(f"the TRL worker exited ({code}) mid-protocol; see {self._log.name}")

    def run_round(self) -> list[dict[str, float]]:
        self.process.stdin.write("go\n")
        self.process.stdin.flush()
        message = self.receive()
        assert message["event"] == "round", message
        return message["steps"]

    def finish(self) -> None:
        message = self.receive()
        assert message["event"] == "done", message
        self.process.wait(timeout=120)
        self._log.close()


# --------------------------------------------------------------------------- winnow side


def winnow_config(args: argparse.Namespace, out: Path):
    from pipeline import configlib
    from pipeline.config import RLConfig
    from recipes.cpu import grpo_cpu

    total_steps = args.rounds * args.steps_per_round
    return configlib.load(RLConfig, base=grpo_cpu(steps=total_steps, group_size=args.group_size), overrides=[
        f"seed={args.seed}", f"prompts_per_step={args.prompts}", f"max_new_tokens={args.new_tokens}",
        f"optim.lr={args.lr}", "optim.decay=constant", "optim.warmup_steps=0",
        f"logging.output_dir={out / 'winnow'}", f"checkpoint.directory={out / 'winnow/checkpoints'}",
        f"checkpoint.every_steps={total_steps}", "checkpoint.keep_last=1", "logging.trackers=[]",
        "logging.progress=false", "eval_samples=1", *args.winnow,
    ])


def export_base_policy(cfg, *, context, directory: Path):
    """The bootstrap policy as a Hugging Face folder (weights, config, tokenizer) for TRL."""
    from pipeline.eval.policy import load_policy
    from pipeline.stages.bootstrap import run_bootstrap

    policy = load_policy(run_bootstrap(cfg.bootstrap, context=context).directory, context=context)
    tokenizer = policy.tokenizer
    generation = policy.hf_model.generation_config
    generation.bos_token_id, generation.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    generation.pad_token_id = tokenizer.pad_token_id
    policy.hf_model.config.pad_token_id = tokenizer.pad_token_id
    policy.hf_model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return policy


def write_prompt_stream(cfg, *, tokenizer, hf_dir: Path, path: Path) -> int:
    """The RL stage's training prompts in winnow's stream order, as TRL dataset rows; returns the row count.

    TRL tokenizes a text prompt as ``tokenizer(text=prompts)``, special tokens added by the
    tokenizer's own settings, and so does winnow (``prompt_token_ids``): the row holds the
    rendered prompt alone (the exported demo tokenizer prepends ``<bos>`` itself). Every row's
    ids are checked against ``prompt_token_ids``, through the exported tokenizer TRL loads.
    """
    from transformers import AutoTokenizer

    from pipeline.data import load_prompts, render_prompt
    from pipeline.data.templates import prompt_token_ids
    from pipeline.rl.stream import PromptStream

    prompts = []
    for source in cfg.data.train:
        loaded, _ = load_prompts(source, split=cfg.data.split, limit=cfg.data.limit, seed=cfg.data.seed,
                                 on_bad_row=cfg.data.on_bad_row, max_field_chars=cfg.data.max_field_chars)
        prompts.extend(loaded)
    stream = PromptStream(len(prompts), seed=cfg.seed)
    order = [i for _ in range(cfg.steps) for i in stream.next(cfg.prompts_per_step)[0].tolist()]
    trl_tokenizer = AutoTokenizer.from_pretrained(hf_dir, trust_remote_code=False)
    rows = []
    for index in order:
        prompt = prompts[index]
        text = render_prompt(prompt, template=cfg.data.template, tokenizer=tokenizer)
        expected = prompt_token_ids(tokenizer, prompt, template=cfg.data.template)
        trl_ids = list(trl_tokenizer(text=[text])["input_ids"][0])
        if trl_ids != expected:
            raise RuntimeError(f"prompt {prompt.id}: TRL would encode {text!r} as {trl_ids[:12]}…, winnow as "
                               f"{expected[:12]}…; the two sides would train on different prompts")
        rows.append({"prompt": text, "answer": prompt.answer})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return len(rows)


def winnow_step_times(metrics_path: Path) -> list[dict[str, float]]:
    """Per trained step: every ``time/*`` phase the RL loop logged, and their sum as ``total``."""
    from pipeline.metrics import read_metrics

    steps = []
    for row in read_metrics(metrics_path):
        if row["step"] >= 1:
            phases = {key.removeprefix("time/"): value for key, value in row.items() if key.startswith("time/")}
            steps.append({"total": sum(phases.values()), **phases})
    return steps


# --------------------------------------------------------------------------- report


def median_of(steps: Sequence[dict[str, float]], key: str) -> float:
    return statistics.median(step[key] for step in steps)


def compare_rounds(winnow_rounds: Sequence[Sequence[dict]], trl_rounds: Sequence[Sequence[dict]]) -> dict:
    """Median step times over every round's steps after its first, their ratio and the per-round ratios."""
    assert len(winnow_rounds) == len(trl_rounds)
    winnow_kept = [step for steps in winnow_rounds for step in steps[1:]]
    trl_kept = [step for steps in trl_rounds for step in steps[1:]]
    per_round = [median_of(w[1:], "total") / median_of(t[1:], "total") for w, t in zip(winnow_rounds, trl_rounds)]
    winnow_median, trl_median = median_of(winnow_kept, "total"), median_of(trl_kept, "total")
    # The fastest step of each side is the one least inflated by other load on a shared machine.
    winnow_best, trl_best = min(step["total"] for step in winnow_kept), min(step["total"] for step in trl_kept)
    return {
        "winnow_step_s": winnow_median, "trl_step_s": trl_median, "ratio": winnow_median / trl_median,
        "winnow_best_step_s": winnow_best, "trl_best_step_s": trl_best, "best_ratio": winnow_best / trl_best,
        "per_round_ratio": per_round, "num_steps_each": len(winnow_kept),
        "winnow_phases_s": {p: median_of(winnow_kept, p) for p in winnow_kept[0] if p != "total"},
        "trl_phases_s": {"generate": median_of(trl_kept, "generate"), "reward": median_of(trl_kept, "reward"),
                         "loss+backward+optimizer": median_of(trl_kept, "total") - median_of(trl_kept, "generate")
                         - median_of(trl_kept, "reward")},
    }


def plot(result: dict, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6, 4))
    FigureCanvasAgg(figure)
    axes = figure.subplots()
    for x, (label, phases) in enumerate((("winnow", result["winnow_phases_s"]), ("TRL", result["trl_phases_s"]))):
        bottom = 0.0
        for phase, seconds in phases.items():
            axes.bar(x, seconds, bottom=bottom, label=f"{label}: {phase}")
            bottom += seconds
    axes.set_xticks([0, 1], ["winnow", f"TRL {result['versions'].get('trl', '')}"])
    axes.set_ylabel("median seconds per step (by phase)")
    axes.set_title(f"RL step time: winnow / TRL = {result['ratio']:.2f}×")
    axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker is not None:
        run_trl_worker(Path(args.worker))
        return
    if not Path(args.trl_python).is_file():
        raise SystemExit(f"--trl-python {args.trl_python} does not exist; create the TRL venv (see --help)")

    import torch

    from pipeline.parallel.rendezvous import initialize_process_context
    from pipeline.stages.rl import run_rl

    torch.set_num_threads(args.threads)
    out = Path(args.out).resolve()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    context = initialize_process_context(seed=args.seed)
    cfg = winnow_config(args, out)
    base = export_base_policy(cfg, context=context, directory=out / "base_hf")
    num_rows = write_prompt_stream(cfg, tokenizer=base.tokenizer, hf_dir=out / "base_hf", path=out / "prompts.jsonl")
    spec = {
        "model": str(out / "base_hf"), "prompts_file": str(out / "prompts.jsonl"), "output_dir": str(out / "trl"),
        "final_dir": str(out / "trl_final"), "total_steps": cfg.steps, "steps_per_round": args.steps_per_round,
        "prompts": args.prompts, "group_size": args.group_size, "new_tokens": args.new_tokens, "lr": args.lr,
        "seed": args.seed, "threads": args.threads, "reward": cfg.reward.pool_kwargs(),
    }
    assert num_rows == cfg.steps * args.prompts
    (out / "trl_spec.json").write_text(json.dumps(spec, indent=1))
    worker = TRLWorker(args.trl_python, out / "trl_spec.json", log_path=out / "trl_worker.log")

    winnow_rounds, trl_rounds = [], []
    for round_index in range(args.rounds):
        trl_rounds.append(worker.run_round())
        run_rl(cfg, context=context, max_steps=args.steps_per_round)
        winnow_rounds.append(winnow_step_times(out / "winnow/metrics.jsonl")[-args.steps_per_round:])
        print(f"round {round_index + 1}/{args.rounds}: winnow {median_of(winnow_rounds[-1][1:], 'total'):.3f} s/step, "
              f"TRL {median_of(trl_rounds[-1][1:], 'total'):.3f} s/step", flush=True)
    worker.finish()

    result = compare_rounds(winnow_rounds, trl_rounds)
    result["versions"] = {"torch": torch.__version__, **_trl_versions(args.trl_python)}
    result["settings"] = {k: v for k, v in vars(args).items() if k != "worker"}
    result["num_parameters"] = sum(p.numel() for p in base.hf_model.parameters())
    result["rounds"] = {"winnow": winnow_rounds, "trl": trl_rounds}
    if args.eval_prompts > 0:
        result["heldout"] = evaluate_policies(args, cfg, context=context, out=out)
    (out / "trl_compare.json").write_text(json.dumps(result, indent=1))
    plot(result, out / "trl_compare.png")
    print_table(result)
    print(f"wrote {out / 'trl_compare.json'} and {out / 'trl_compare.png'}")


def _trl_versions(python: str) -> dict[str, str]:
    code = "import json, trl, transformers; print(json.dumps({'trl': trl.__version__, 'transformers': transformers.__version__}))"
    return json.loads(subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout)


def evaluate_policies(args, cfg, *, context, out: Path) -> dict:
    """The base, winnow's final and TRL's final policy under one held-out evaluation."""
    from pipeline.data import load_prompts
    from pipeline.eval.policy import load_policy
    from pipeline.rewards import GradingPool
    from tools.bench.race import heldout_scores

    prompts, _ = load_prompts(args.eval_set, split="test", limit=args.eval_prompts)
    policies = {"base": out / "base_hf", "winnow": Path(cfg.checkpoint.directory), "trl": out / "trl_final"}
    scores = {}
    with GradingPool(**cfg.reward.pool_kwargs()) as pool:
        for name, path in policies.items():
            # winnow's checkpoint has no tokenizer of its own: it is the base policy's.
            policy = load_policy(path, tokenizer=out / "base_hf", context=context)
            scores[name] = heldout_scores(model=policy.hf_model, tokenizer=policy.tokenizer, prompts=prompts,
                                  num_samples=args.eval_samples, max_new_tokens=cfg.max_new_tokens,
                                  temperature=cfg.temperature, seed=1234, pool=pool, template=cfg.data.template)
    return {"num_prompts": len(prompts), "num_samples": args.eval_samples, "steps": cfg.steps, "scores": scores}


def print_table(result: dict) -> None:
    print(f"model: {result['num_parameters'] / 1e3:.0f}k params; {result['settings']['prompts']} prompts x "
          f"{result['settings']['group_size']} samples x ≤{result['settings']['new_tokens']} tokens; "
          f"{result['num_steps_each']} timed steps each; TRL {result['versions'].get('trl')}")
    print(f"{'phase':<26}{'winnow (s)':>12}")
    for phase, seconds in result["winnow_phases_s"].items():
        print(f"  {phase:<24}{seconds:>12.3f}")
    print(f"{'phase':<26}{'TRL (s)':>12}")
    for phase, seconds in result["trl_phases_s"].items():
        print(f"  {phase:<24}{seconds:>12.3f}")
    rounds = result["per_round_ratio"]
    print(f"step time: winnow {result['winnow_step_s']:.3f} s, TRL {result['trl_step_s']:.3f} s, "
          f"ratio {result['ratio']:.2f}x (rounds {min(rounds):.2f}–{max(rounds):.2f}; target ≤ 0.8, must be ≤ 1.0)")
    print(f"fastest step: winnow {result['winnow_best_step_s']:.3f} s, TRL {result['trl_best_step_s']:.3f} s, "
          f"ratio {result['best_ratio']:.2f}x")
    if "heldout" in result:
        held = result["heldout"]
        print(f"held-out after {held['steps']} steps ({held['num_prompts']} problems x {held['num_samples']} samples):")
        for name, scores in held["scores"].items():
            print(f"  {name:<8}" + "  ".join(f"{k} {v:.4f}" for k, v in scores.items()))


if __name__ == "__main__":
    main()
