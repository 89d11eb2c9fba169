"""The rehearsal's model: the recipe's own architecture, scaled down in width and depth only.

A campaign rehearsal (:mod:`pipeline.launch.rehearse`) must exercise every context and token
check at full size, so the model it builds from the recipe's ``config.json`` keeps its
positions, RoPE (theta and scaling), vocabulary rows, special-token ids, tied or untied
head, biases and q/k norms; only ``hidden_size``, ``intermediate_size``, the layer count
and the head counts shrink (heads stay divisible by the recipe's tensor-parallel size).

Where the model folder is not readable here (it lives on the cluster), the published
``config.json`` of that model shipped in ``pipeline/models/published`` stands in, with the
family's shipped tokenizer: a small byte-level BPE that carries the family's real special
tokens, post-processor and chat template; its ids differ from the real ones, and the
report says so. The real folder's tokenizer is copied when the folder is readable.

A random model answers nothing correctly, so every reward would be 0: curation would keep
no prompt and no rl step would have a gradient. :func:`fit_answers` therefore fits the
tiny model briefly to answer the campaign's first prompts as ``\\boxed{gold}`` and stop,
each prompt seen a different number of times, so that sampled pass rates spread from 0
to 1 and the rehearsal's curation, rl and evaluation see the mixed rewards a real base
model gives. It also makes answers short, so a 3,072-token budget costs a few tokens.

Size: at Qwen2.5's 152,064 vocabulary rows and width 64 the untied embedding and head are
2 × 9.7M parameters (78 MB in fp32); the layers are a few hundred thousand more.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pipeline.errors import UserError
from pipeline.models.families import FAMILIES

PUBLISHED_DIR = Path(__file__).resolve().parents[1] / "models" / "published"
CONFIGS_DIR = PUBLISHED_DIR / "configs"
TOKENIZERS_DIR = PUBLISHED_DIR / "tokenizers"
# Models whose published config is another one's (same architecture and dimensions).
CONFIG_ALIASES = {
    "Llama-3.1-8B-Instruct": "Llama-3.1-8B",
    "OpenMath2-Llama3.1-8B": "Llama-3.1-8B",
    "Qwen2.5-Math-7B-Instruct": "Qwen2.5-Math-7B",
    "Qwen3-4B-Instruct-2507": "Qwen3-4B",
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "tokenizer.model")
HEAD_DIM = 8
MIN_KV_HEADS = 2


@dataclass(slots=True)
class RehearsalModel:
    folder: Path  # a Hugging Face folder: config.json, model.safetensors, tokenizer files
    source: str  # where its config came from
    changes: list[str] = field(default_factory=list)  # what differs from the recipe's model, for the report


def published_config(model_dir: str) -> tuple[dict[str, Any], str]:
    """The model folder's own ``config.json``, else the shipped published one of the same name."""
    folder = Path(model_dir)
    if (folder / "config.json").is_file():
        return json.loads((folder / "config.json").read_text()), f"{folder}/config.json"
    name = CONFIG_ALIASES.get(folder.name, folder.name)
    shipped = CONFIGS_DIR / f"{name}.json"
    if not shipped.is_file():
        known = sorted(p.stem for p in CONFIGS_DIR.glob("*.json"))
        raise UserError(f"--model-dir: {model_dir} is not readable here and no published config is shipped for "
                        f"{folder.name!r} (shipped: {', '.join(known)}); pass --model-dir with the model's folder")
    return json.loads(shipped.read_text()), f"the published config of {name}"


def _special_ids(tokenizer_dir: Path) -> dict[str, int]:
    added = json.loads((tokenizer_dir / "tokenizer.json").read_text()).get("added_tokens", [])
    return {token["content"]: token["id"] for token in added}


def scaled_config(config: dict[str, Any], *, tensor_parallel: int) -> tuple[dict[str, Any], list[str]]:
    """``config`` with width, depth and heads scaled down; every other field kept. (config, changes)."""
    kv_heads = max(MIN_KV_HEADS, tensor_parallel)
    heads = 2 * kv_heads
    hidden = HEAD_DIM * heads
    scaled = {"hidden_size": hidden, "intermediate_size": 2 * hidden, "num_hidden_layers": 2,
              "num_attention_heads": heads, "num_key_value_heads": kv_heads}
    if "head_dim" in config:
        scaled["head_dim"] = HEAD_DIM
    if "max_window_layers" in config:
        scaled["max_window_layers"] = 2
    if "layer_types" in config:  # Qwen3 lists one attention type per layer
        scaled["layer_types"] = config["layer_types"][:2]
    changes = [f"{key} {config.get(key)} -> {value}" for key, value in scaled.items()
               if key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                          "num_key_value_heads")]
    out = {**config, **scaled, "torch_dtype": "float32"}
    return out, changes


def build_rehearsal_model(model_dir: str, out: Path, *, tensor_parallel: int, seed: int = 0) -> RehearsalModel:
    """A random same-family model of ``model_dir``'s architecture at ``out`` (an HF folder)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config, source = published_config(model_dir)
    scaled, changes = scaled_config(config, tensor_parallel=tensor_parallel)
    out.mkdir(parents=True, exist_ok=True)
    real = Path(model_dir)
    if (real / "config.json").is_file() and (real / "tokenizer.json").is_file():
        tokenizer_dir = real
        note = f"tokenizer: {real}'s own"
    else:
        family = FAMILIES.get(config.get("model_type", ""))
        if family is None:
            raise UserError(f"--model-dir: no tokenizer is shipped for model_type {config.get('model_type')!r}")
        tokenizer_dir = TOKENIZERS_DIR / family.tokenizer_fixture
        ids = _special_ids(tokenizer_dir)
        # The shipped BPE's ids of the family's special tokens replace the published ones.
        if scaled.get("bos_token_id") is not None:
            scaled["bos_token_id"] = ids[family.bos_token]
        eos_ids = [ids[token] for token in family.eos_tokens]
        scaled["eos_token_id"] = eos_ids if isinstance(config.get("eos_token_id"), list) else eos_ids[0]
        shipped_ids = len(json.loads((tokenizer_dir / "tokenizer.json").read_text())["model"]["vocab"])
        note = (f"tokenizer: the shipped {family.tokenizer_fixture} BPE ({shipped_ids} "
                f"ids; real special tokens and chat template, other ids differ); "
                f"vocabulary rows kept at {scaled['vocab_size']}")
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copyfile(tokenizer_dir / name, out / name)
    (out / "config.json").write_text(json.dumps(scaled, indent=2) + "\n")
    hf_config = AutoConfig.from_pretrained(str(out), local_files_only=True, trust_remote_code=False)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    model.save_pretrained(str(out), safe_serialization=True)
    (out / "config.json").write_text(json.dumps(scaled, indent=2) + "\n")  # ours, not transformers' rewrite
    return RehearsalModel(folder=out, source=source, changes=[*changes, note])


def fit_answers(folder: Path, *, problems: list[tuple[str, str]], template: str, steps: int = 80,
                lr: float = 1e-2) -> dict[str, float]:
    """Fit the model at ``folder`` to answer ``(problem, gold)`` pairs as ``\\boxed{gold}`` + EOS; saved in place.

    Problem ``i`` of ``P`` is in ``ceil(steps · (i + 1) / P)`` of the ``steps`` batches, so the
    first prompts are barely learned and the last ones well: sampled pass rates spread.
    The loss is computed on the answer tokens only, and over the ids the tokenizer has: the
    head rows of the other ids (151,552 of Qwen2.5's 151,936 rows beside the shipped 384-id
    BPE) are set to zero first and stay zero (no gradient reaches them, and AdamW without
    weight decay leaves a zero-gradient row alone), so each of their logits is exactly 0 and
    their ``n`` copies of ``e⁰`` in the softmax's sum are one extra logit ``ln n``. The loss is
    then the full-vocabulary cross-entropy, at the cost of the head over the tokenizer's ids
    instead of every row: the fit took 29 CPU-seconds over all 151,936 rows of the 1.5B
    rehearsal model. Returns the first and last loss.

    The fit is bitwise reproducible: it runs on one thread with torch's deterministic kernels.
    On several threads the backward of the row gather below (``index_put_`` with accumulation)
    adds with atomics, and a busy machine gives the matrix products fewer threads than an idle
    one (a different summation order): two fits of the same model then differed in their last
    bits, and so did what the model samples and what a rehearsal's curation keeps (3, 6 and 8 of
    16 prompts in three rehearsals of the same code). One thread costs little: the fit is small.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.data.templates import prompt_token_ids

    config_text = (folder / "config.json").read_text()
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, local_files_only=True,
                                                 trust_remote_code=False)
    eos = model.generation_config.eos_token_id if model.generation_config is not None else None
    eos = eos if eos is not None else model.config.eos_token_id
    eos_id = eos[0] if isinstance(eos, list) else eos
    examples = []
    for problem, gold in problems:
        prompt = prompt_token_ids(tokenizer, problem, template=template)
        answer = tokenizer(f"The answer is \\boxed{{{gold}}}.", add_special_tokens=False)["input_ids"] + [eos_id]
        examples.append((prompt, answer))
    output, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    tied = output.weight is embedding.weight
    known = torch.tensor(sorted({i for i in tokenizer.get_vocab().values() if i < output.weight.shape[0]}))  # (U,)
    others = output.weight.shape[0] - known.numel()
    # Only the known ids' rows train, as parameters of their own: (U, H) instead of (V, H) in the
    # backward and in AdamW (the full rows' dense gradients and moments cost 2-3× the rest of the fit).
    head_rows = torch.nn.Parameter(output.weight.detach()[known].clone())  # (U, H)
    input_rows = head_rows if tied else torch.nn.Parameter(embedding.weight.detach()[known].clone())  # (U, H)
    head_bias = None if output.bias is None else torch.nn.Parameter(output.bias.detach()[known].clone())  # (U,)
    # Token ids as positions among the known ids; the other rows' summed e⁰ is one logit ln(others).
    position_of = torch.full((output.weight.shape[0],), -1, dtype=torch.long)  # (V,)
    position_of[known] = torch.arange(known.numel())
    others_logit = torch.tensor([math.log(others)]) if others else None  # (1,)
    full_matrices = {id(output.weight), id(embedding.weight)} | ({id(output.bias)} if output.bias is not None else set())
    trained = [p for p in model.parameters() if id(p) not in full_matrices]
    trained += [head_rows] + ([] if tied else [input_rows]) + ([head_bias] if head_bias is not None else [])
    optimizer = torch.optim.AdamW(trained, lr=lr, weight_decay=0.0)
    model.train()
    losses = []
    count = len(examples)
    deterministic_before, threads_before = torch.are_deterministic_algorithms_enabled(), torch.get_num_threads()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    try:
        for step in range(steps):
            # Problem i joins the batches from step steps·(1 − (i+1)/P) on: the later, the fewer.
            batch = [examples[i] for i in range(count) if step >= steps * (1 - (i + 1) / count)]
            if not batch:
                continue
            width = max(len(prompt) + len(answer) for prompt, answer in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)  # (B, T), right-padded
            mask = torch.zeros(len(batch), width, dtype=torch.long)  # (B, T)
            rows, positions, targets = [], [], []
            for row, (prompt, answer) in enumerate(batch):
                sequence = prompt + answer
                ids[row, : len(sequence)] = torch.tensor(sequence)
                mask[row, : len(sequence)] = 1
                rows += [row] * len(answer)
                positions += range(len(prompt) - 1, len(sequence) - 1)  # each predicts the next, an answer token
                targets += answer
            optimizer.zero_grad()
            embedded = input_rows[position_of[ids].clamp(min=0)]  # (B, T, H); padding reads row 0, masked out
            hidden = model.model(inputs_embeds=embedded, attention_mask=mask).last_hidden_state  # (B, T, H)
            answer_hidden = hidden[torch.tensor(rows), torch.tensor(positions)]  # (A, H): answer tokens only
            logits = answer_hidden @ head_rows.T  # (A, U)
            if head_bias is not None:
                logits = logits + head_bias
            if others_logit is not None:
                logits = torch.cat([logits, others_logit.expand(len(rows), 1)], dim=1)  # (A, U + 1)
            loss = torch.nn.functional.cross_entropy(logits, position_of[torch.tensor(targets)])
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
    finally:
        torch.use_deterministic_algorithms(deterministic_before)
        torch.set_num_threads(threads_before)
    with torch.no_grad():  # the other ids' head rows zero, so their logits are the 0 the loss assumed
        output.weight.zero_()
        output.weight[known] = head_rows
        if not tied:
            embedding.weight[known] = input_rows
        if head_bias is not None:
            output.bias.zero_()
            output.bias[known] = head_bias
    model.eval()
    model.save_pretrained(str(folder), safe_serialization=True)
    (folder / "config.json").write_text(config_text)  # the scaled published config, not transformers' rewrite
    return {"first_loss": losses[0] if losses else math.nan, "last_loss": losses[-1] if losses else math.nan}
