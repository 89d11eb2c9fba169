"""``LocalEngine``: in-process batched generation with a Hugging Face causal LM (the CPU default).

Our own decoding loop over ``model(...)`` with a ``transformers.DynamicCache``:

1. Rows are the requested samples, grouped by prompt, cut into chunks of at most
   ``max_batch_rows``. Each chunk prefills its *distinct* prompts once — left-padded
   into one ``(U, P)`` batch with an attention mask and position ids
   ``cumsum(mask) − 1`` (what ``generate`` builds) — and then copies each prompt's
   cache row once per sample (``Cache.reorder_cache``), so ``n`` samples of a prompt
   cost one prefill, not ``n``.
2. Every step draws one token per unfinished row with ``sample_next_tokens``
   (temperature, nucleus, Gumbel-max from one seeded ``torch.Generator``) and
   records its log-probability under the temperature-scaled full distribution.
3. A row finishes on a stop token (``stop_token_ids`` plus the model's EOS unless
   ``ignore_eos``), on a completed stop string, or at ``max_new_tokens``. A finished
   row stops growing: its output is masked, it is fed the pad token while it stays
   in the batch, and once at least half the batch has finished the finished rows are
   dropped from the batch and the cache (``Cache.reorder_cache``) so they cost
   nothing more.

Guarantees (tested): greedy output equals ``model.generate(do_sample=False)`` on the
same batch; the reported log-probs equal a fresh fp32 forward pass over
prompt + completion within 1e-5; the same requests, params, seed and
``max_batch_rows`` give identical completions (sampling noise is drawn per batch, so
a different chunking gives different — equally valid — samples).

Stop strings are matched on the decoded tail of each unfinished row, as SGLang does.
The tail is ``4·L + 1`` tokens for the longest stop string of ``L`` characters: a
match of ``L`` characters is at most ``4·L`` UTF-8 bytes, so — as long as every token
decodes to at least one byte, true for byte-level BPE and SentencePiece byte
fallback — at most ``4·L`` tokens overlap it, and the extra token keeps a tokenizer's
start-of-text normalisation (e.g. SentencePiece dropping a leading space) off the
match. Matching strings is inherently per row; it runs only when stop strings are set.
"""

from __future__ import annotations

import inspect
from typing import Iterable, Mapping, Protocol, Sequence

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from pipeline.rollout.sampling import sample_next_tokens
from pipeline.rollout.types import (
    Completion,
    GenerationRequest,
    RolloutError,
    SamplingParams,
    check_requests,
)

__all__ = ["LocalEngine", "TokenDecoder"]

# Finish codes in the per-row reason tensor.
_RUNNING, _STOP, _LENGTH = 0, 1, 2
_REASON_NAMES = {_STOP: "stop", _LENGTH: "length"}


class TokenDecoder(Protocol):
    """What the local engine needs of a tokenizer: a Hugging Face tokenizer satisfies it."""

    def batch_decode(self, sequences: list[list[int]], *, skip_special_tokens: bool = ...) -> list[str]: ...


def _as_id_tuple(value: int | Sequence[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


class LocalEngine:
    """In-process ``RolloutEngine`` over a Hugging Face causal LM; see the module docstring.

    ``model`` is put in eval mode and used in place: ``update_weights`` writes into its
    parameters. ``eos_token_ids`` and ``pad_token_id`` default to the model's
    generation config (then its config; pad falls back to the first EOS, then 0).
    ``tokenizer`` is needed only for stop strings. The progress bar appears when a
    ``generate`` call runs longer than ``progress_delay_s``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        max_batch_rows: int = 256,
        eos_token_ids: int | Sequence[int] | None = None,
        pad_token_id: int | None = None,
        tokenizer: TokenDecoder | None = None,
        weight_version: int = 0,
        show_progress: bool = True,
        progress_delay_s: float = 2.0,
    ) -> None:
        if max_batch_rows < 1:
            raise ValueError(f"max_batch_rows must be >= 1, got {max_batch_rows}")
        config = model.config
        generation_config = getattr(model, "generation_config", None)
        if eos_token_ids is None:
            eos_token_ids = getattr(generation_config, "eos_token_id", None)
            if eos_token_ids is None:
                eos_token_ids = getattr(config, "eos_token_id", None)
        if pad_token_id is None:
            pad_token_id = getattr(generation_config, "pad_token_id", None)
            if pad_token_id is None:
                pad_token_id = getattr(config, "pad_token_id", None)
        self._eos_token_ids = _as_id_tuple(eos_token_ids)
        if pad_token_id is None:
            pad_token_id = self._eos_token_ids[0] if self._eos_token_ids else 0
        self._vocab_size = int(config.vocab_size)
        if not (0 <= pad_token_id < self._vocab_size):
            raise ValueError(f"pad_token_id {pad_token_id} is outside the vocabulary [0, {self._vocab_size})")
        self.model = model.eval()
        # transformers 5.24 renamed forward's `past_key_values` to `cache` (the old name warns, and goes in 5.40);
        # earlier 5.x releases only know the old one.
        self._cache_argument = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self._pad_token_id = int(pad_token_id)
        self._max_positions: int | None = getattr(config, "max_position_embeddings", None)
        self._device = next(model.parameters()).device
        self._tokenizer = tokenizer
        self._max_batch_rows = max_batch_rows
        self._show_progress = show_progress
        self._progress_delay_s = progress_delay_s
        self._weight_version = int(weight_version)
        self._weights_consistent = True

    @property
    def weight_version(self) -> int:
        return self._weight_version

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos_token_ids

    def close(self) -> None:
        """Nothing to release: the model belongs to the caller."""

    # ------------------------------------------------------------------ weights

    @torch.no_grad()
    def update_weights(
        self,
        named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        *,
        version: int,
    ) -> None:
        """Copy HF-named tensors into the model in place and set the weight version.

        A full update: every parameter must be given exactly once (a tied parameter may
        be given under each of its names, with equal values), with its exact shape;
        values are cast to the parameter's dtype. The tensors are consumed one at a
        time, so a streaming ``megatron_to_hf_state`` never holds a second copy of the
        model. ``version`` must exceed the current one, so completions from different
        weights never share a version. If anything is wrong the engine refuses to
        generate until a later update succeeds, because the model may be half-updated.
        """
        if isinstance(version, bool) or not isinstance(version, int) or version <= self._weight_version:
            raise ValueError(
                f"version must be an int > the current weight version {self._weight_version}, got {version!r}"
            )
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        params = dict(self.model.named_parameters(remove_duplicate=False))
        unique_params = {id(p): name for name, p in self.model.named_parameters()}
        given_names: set[str] = set()
        assigned: set[int] = set()
        self._weights_consistent = False
        for name, tensor in items:
            param = params.get(name)
            if param is None:
                raise ValueError(f"update_weights: the model has no parameter {name!r}")
            if name in given_names:
                raise ValueError(f"update_weights: tensor {name!r} given twice")
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(
                    f"update_weights: {name}: tensor shape {tuple(tensor.shape)} "
                    f"!= parameter shape {tuple(param.shape)}"
                )
            given_names.add(name)
            if id(param) in assigned:
                # Tied weights (lm_head ↔ embed_tokens) share one parameter.
                if not torch.equal(param, tensor.to(device=param.device, dtype=param.dtype)):
                    raise ValueError(
                        f"update_weights: {name} is tied to {unique_params[id(param)]} but the given values differ"
                    )
                continue
            param.copy_(tensor)
            assigned.add(id(param))
        missing = sorted(name for key, name in unique_params.items() if key not in assigned)
        if missing:
            raise ValueError(
                f"update_weights: {len(missing)} parameters not given, e.g. {missing[:5]}; "
                "a weight update must be complete"
            )
        self._weights_consistent = True
        self._weight_version = version

    # --------------------------------------------------------------- generation

    @torch.inference_mode()
    def generate(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> list[Completion]:
        """One ``Completion`` per requested sample, ordered by request then sample index."""
        if not self._weights_consistent:
            raise RolloutError("the last update_weights failed part-way; the model weights are inconsistent")
        total = check_requests(requests)
        if params.stop_strings and self._tokenizer is None:
            raise ValueError("stop_strings need a tokenizer: pass tokenizer= to LocalEngine")
        self._check_lengths(requests, params)
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self._eos_token_ids))
        stop_id_tensor = torch.tensor(sorted(stop_ids), dtype=torch.long, device=self._device)
        generator = torch.Generator(device=self._device)
        if params.seed is None:
            generator.seed()
        else:
            generator.manual_seed(params.seed)

        # rows[k] = (request index, sample index), grouped by request.
        rows = [(r, s) for r, request in enumerate(requests) for s in range(request.num_samples)]
        assert len(rows) == total
        completions: list[Completion] = []
        with tqdm(
            total=total,
            desc="rollout",
            unit="sample",
            disable=not self._show_progress,
            delay=self._progress_delay_s,
            leave=False,
        ) as bar:
            for start in range(0, total, self._max_batch_rows):
                chunk = rows[start : start + self._max_batch_rows]
                completions.extend(
                    self._generate_chunk(
                        requests,
                        chunk,
                        params=params,
                        stop_id_tensor=stop_id_tensor,
                        generator=generator,
                        bar=bar,
                    )
                )
        return completions

    def _check_lengths(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> None:
        for request in requests:
            if max(request.prompt_token_ids) >= self._vocab_size:
                raise ValueError(f"prompt {request.prompt_id!r}: token id >= vocab size {self._vocab_size}")
            needed = len(request.prompt_token_ids) + params.max_new_tokens
            if self._max_positions is not None and request.num_samples and needed > self._max_positions:
                raise ValueError(
                    f"prompt {request.prompt_id!r}: {len(request.prompt_token_ids)} prompt tokens + "
                    f"max_new_tokens {params.max_new_tokens} exceed max_position_embeddings {self._max_positions}"
                )

    def _generate_chunk(
        self,
        requests: Sequence[GenerationRequest],
        chunk: list[tuple[int, int]],
        *,
        params: SamplingParams,
        stop_id_tensor: torch.Tensor,
        generator: torch.Generator,
        bar: tqdm,
    ) -> list[Completion]:
        device, pad = self._device, self._pad_token_id
        prompt_indices = sorted({r for r, _ in chunk})
        slot_of_request = {r: slot for slot, r in enumerate(prompt_indices)}
        prompts = [requests[r].prompt_token_ids for r in prompt_indices]
        prompt_len = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), prompt_len), pad, dtype=torch.long)  # (U, P)
        prompt_mask = torch.zeros((len(prompts), prompt_len), dtype=torch.long)  # (U, P)
        for slot, prompt in enumerate(prompts):
            input_ids[slot, prompt_len - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            prompt_mask[slot, prompt_len - len(prompt) :] = 1
        input_ids, prompt_mask = input_ids.to(device), prompt_mask.to(device)
        position_ids = (prompt_mask.cumsum(-1) - 1).clamp_min_(0)  # (U, P)

        cache = DynamicCache(config=self.model.config)
        output = self.model(
            input_ids=input_ids,
            attention_mask=prompt_mask,
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_argument: cache},
        )
        row_to_slot = torch.tensor([slot_of_request[r] for r, _ in chunk], dtype=torch.long, device=device)  # (B,)
        cache.reorder_cache(row_to_slot)
        logits = output.logits[:, -1, :][row_to_slot]  # (B, V)
        attention_mask = prompt_mask[row_to_slot]  # (B, P + t)
        next_position = position_ids[row_to_slot, -1] + 1  # (B,)

        num_rows, max_new = len(chunk), params.max_new_tokens
        tokens_out = torch.full((num_rows, max_new), pad, dtype=torch.long, device=device)  # (B, N)
        logprobs_out = torch.zeros((num_rows, max_new), dtype=torch.float32, device=device)  # (B, N)
        lengths = torch.zeros(num_rows, dtype=torch.long, device=device)  # (B,)
        reasons = torch.zeros(num_rows, dtype=torch.int8, device=device)  # (B,)
        live = torch.arange(num_rows, device=device)  # chunk row of each batch row
        active = torch.ones(num_rows, dtype=torch.bool, device=device)  # over batch rows

        for step in range(max_new):
            tokens, logprobs = sample_next_tokens(
                logits, temperature=params.temperature, top_p=params.top_p, generator=generator
            )
            tokens_out[live, step] = torch.where(active, tokens, pad)
            logprobs_out[live, step] = torch.where(active, logprobs, 0.0)
            lengths[live] += active
            stopped = active & torch.isin(tokens, stop_id_tensor)
            if params.stop_strings:
                stopped |= self._stop_string_hits(tokens_out, live=live, active=active, step=step, params=params)
            reasons[live[stopped]] = _STOP
            newly_finished = int(stopped.sum())
            active = active & ~stopped
            num_active = int(active.sum())
            if step == max_new - 1:
                reasons[live[active]] = _LENGTH
                newly_finished += num_active
                num_active = 0
            bar.update(newly_finished)
            if num_active == 0:
                break
            if 2 * num_active <= live.numel():
                keep = active.nonzero().squeeze(1)
                cache.reorder_cache(keep)
                attention_mask, next_position = attention_mask[keep], next_position[keep]
                tokens, live, active = tokens[keep], live[keep], active[keep]
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones((live.numel(), 1))], dim=1)
            output = self.model(
                input_ids=torch.where(active, tokens, pad)[:, None],
                attention_mask=attention_mask,
                position_ids=next_position[:, None],
                use_cache=True,
                **{self._cache_argument: cache},
            )
            next_position = next_position + 1
            logits = output.logits[:, -1, :]

        assert bool((reasons != _RUNNING).all())
        tokens_cpu, logprobs_cpu = tokens_out.cpu(), logprobs_out.cpu()
        lengths_list, reasons_list = lengths.tolist(), reasons.tolist()
        return [
            Completion(
                prompt_id=requests[r].prompt_id,
                sample_index=s,
                token_ids=tokens_cpu[k, : lengths_list[k]].clone(),
                logprobs=logprobs_cpu[k, : lengths_list[k]].clone(),
                finish_reason=_REASON_NAMES[reasons_list[k]],
                weight_version=self._weight_version,
            )
            for k, (r, s) in enumerate(chunk)
        ]

    def _stop_string_hits(
        self,
        tokens_out: torch.Tensor,
        *,
        live: torch.Tensor,
        active: torch.Tensor,
        step: int,
        params: SamplingParams,
    ) -> torch.Tensor:
        """``(live,)`` bool: unfinished rows whose decoded tail now contains a stop string."""
        assert self._tokenizer is not None
        window = 4 * max(len(s) for s in params.stop_strings) + 1
        batch_rows = active.nonzero().squeeze(1)
        tails = tokens_out[live[batch_rows], max(0, step + 1 - window) : step + 1].tolist()
        texts = self._tokenizer.batch_decode(tails, skip_special_tokens=False)
        found = [any(stop in text for stop in params.stop_strings) for text in texts]
        hits = torch.zeros_like(active)
        hits[batch_rows] = torch.tensor(found, dtype=torch.bool, device=active.device)
        return hits
