"""``ProcessEngine``: the local Hugging Face engine in a spawned process of its own.

With ``rollout.max_staleness=1`` the next step's batch is generated while the trainer
updates. In one Python process the two would share the interpreter and torch's thread
pool; in two processes the overlap is real, and each gets its own share of the cores.

The trainer talks to the child through two ``torch.multiprocessing`` queues, one command
at a time, in order (so a weight push is never interleaved with a generation):

* ``update``: the trainer copies the actor's HF-named tensors into one shared-memory state
  dict, allocated at the first push and reused after that (its handles cross the queue
  once), and the child copies it into its model (``LocalEngine.update_weights``) under the
  new version;
* ``generate``: the requests and sampling parameters go over, the completions come back
  packed as three tensors (token ids, log-probs, lengths) plus their per-sample fields, so a
  batch costs a few shared-memory handles, not two per sample.

Sizes: the shared state dict is one copy of the policy (the child's model a second one);
the local engine serves tiny CPU policies, and at 7B the rollouts come from SGLang servers.
Pushing a 7B policy this way would copy its 15.2 GB of bf16 weights once per step.

``ProcessSyncedEngine`` is the weight-sync transport ``pipeline.rollout.weight_sync`` calls
(``plan``/``consume``): its in-process ``LocalSyncedEngine`` with the cores split.
"""

from __future__ import annotations

import os
import queue
import signal
import traceback
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from pipeline.models.spec import ModelSpec
from pipeline.parallel.lifetime import exit_with_parent
from pipeline.rollout.types import Completion, GenerationRequest, RolloutError, SamplingParams
from pipeline.rollout.weight_sync import LocalSyncedEngine

__all__ = ["PROCESS_NAME", "ProcessEngine", "ProcessSyncedEngine", "split_threads"]

# How often a wait on the child checks that it is still alive (and the child its parent).
_POLL_S = 1.0
PROCESS_NAME = b"winnow-rollout"  # the child's name in ps/top (/proc/<pid>/comm)


def _name_process(name: bytes) -> None:
    """Linux's prctl(PR_SET_NAME): every spawned child is otherwise just "python"."""
    import ctypes

    try:
        ctypes.CDLL(None).prctl(15, name, 0, 0, 0)
    except (AttributeError, OSError):  # not Linux: the name is cosmetic
        pass


def split_threads(num_cores: int | None = None) -> tuple[int, int]:
    """``(trainer threads, engine threads)`` that share the cores this process may use.

    The two processes run at the same time only while the engine generates ahead of an
    update; half the cores each (the trainer gets the odd one) keeps them from
    oversubscribing the machine.
    """
    cores = num_cores if num_cores is not None else len(os.sched_getaffinity(0))
    engine = max(1, cores // 2)
    return max(1, cores - engine), engine


def _pack(completions: Sequence[Completion]) -> dict[str, Any]:
    lengths = torch.tensor([c.num_tokens for c in completions], dtype=torch.int64)  # (S,)
    return {
        "prompt_ids": [c.prompt_id for c in completions],
        "sample_indices": [c.sample_index for c in completions],
        "finish_reasons": [c.finish_reason for c in completions],
        "weight_versions": [c.weight_version for c in completions],
        "lengths": lengths,
        "token_ids": torch.cat([c.token_ids for c in completions]) if completions else torch.zeros(0, dtype=torch.long),
        "logprobs": torch.cat([c.logprobs for c in completions]) if completions else torch.zeros(0),
    }


def _unpack(packed: dict[str, Any]) -> list[Completion]:
    sizes = packed["lengths"].tolist()
    tokens = packed["token_ids"].split(sizes)
    logprobs = packed["logprobs"].split(sizes)
    return [Completion(prompt_id=prompt_id, sample_index=index, token_ids=t.clone(), logprobs=lp.clone(),
                       finish_reason=reason, weight_version=version)
            for prompt_id, index, reason, version, t, lp in zip(
                packed["prompt_ids"], packed["sample_indices"], packed["finish_reasons"],
                packed["weight_versions"], tokens, logprobs)]


def _serve(spec: dict[str, Any], engine_kwargs: dict[str, Any], num_threads: int, commands, replies,
           parent_pid: int) -> None:
    """The child's loop: build the engine, then answer commands until ``close`` (or the parent's death)."""
    # The trainer killed (kill -9) takes this process with it at once, also mid-generation.
    exit_with_parent(parent_pid=parent_pid)
    # Signals for the run (Ctrl-C, SLURM's SIGTERM/SIGUSR1 to the whole step) are the trainer's to
    # handle: it checkpoints, which needs this process alive, then closes it.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    _name_process(PROCESS_NAME)
    torch.set_num_threads(num_threads)
    try:
        from pipeline.rollout.local import LocalEngine
        from pipeline.rollout.weight_sync import build_hf_model

        engine = LocalEngine(build_hf_model(ModelSpec(**spec)), show_progress=False, **engine_kwargs)
        weights: dict[str, torch.Tensor] = {}
        replies.put(("ready", None))
    except BaseException:  # noqa: BLE001 - every failure reaches the parent as a RolloutError
        replies.put(("error", traceback.format_exc()))
        return
    while True:
        kind, payload = commands.get()
        if kind == "close":
            return
        try:
            if kind == "weights":
                weights = payload
                reply = None
            elif kind == "update":
                engine.update_weights(weights.items(), version=payload)
                reply = None
            else:
                requests, params = payload
                reply = _pack(engine.generate(requests, params))
            replies.put(("ok", reply))
        except BaseException:  # noqa: BLE001
            replies.put(("error", traceback.format_exc()))


class ProcessEngine:
    """A ``RolloutEngine`` whose ``LocalEngine`` runs in a spawned child process.

    Same contract as ``LocalEngine`` (same completions for the same weights, requests,
    parameters and seed, up to the thread count's effect on float sums). ``num_threads``
    is the child's torch thread count (``split_threads``).
    """

    def __init__(self, spec: ModelSpec, *, eos_token_ids: int | Sequence[int] | None, pad_token_id: int | None,
                 num_threads: int, start_timeout_s: float = 300.0) -> None:
        context = torch.multiprocessing.get_context("spawn")
        self._commands = context.Queue()
        self._replies = context.Queue()
        engine_kwargs = {"eos_token_ids": eos_token_ids, "pad_token_id": pad_token_id}
        self._process = context.Process(target=_serve, name="winnow-rollout", daemon=True,
                                        args=(spec.to_dict(), engine_kwargs, num_threads, self._commands,
                                              self._replies, os.getpid()))
        self._process.start()
        self._weights: dict[str, torch.Tensor] | None = None
        self._weight_version = 0
        self._wait(timeout_s=start_timeout_s)

    @property
    def weight_version(self) -> int:
        return self._weight_version

    def _wait(self, *, timeout_s: float | None = None) -> Any:
        waited = 0.0
        while True:
            try:
                kind, payload = self._replies.get(timeout=_POLL_S)
                break
            except queue.Empty:
                waited += _POLL_S
                if not self._process.is_alive():
                    raise RolloutError(f"the rollout process exited with code {self._process.exitcode}") from None
                if timeout_s is not None and waited >= timeout_s:
                    raise RolloutError(f"the rollout process did not answer within {timeout_s:.0f} s") from None
        if kind == "error":
            raise RolloutError(f"the rollout process failed:\n{payload}")
        return payload

    def update_weights(self, named_tensors: Iterator[tuple[str, torch.Tensor]], *, version: int) -> None:
        """Copy HF-named CPU tensors into the shared state dict, then have the child load it as ``version``."""
        if version <= self._weight_version:
            raise ValueError(f"version must exceed the current weight version {self._weight_version}, got {version}")
        if self._weights is None:
            self._weights = {name: tensor.detach().clone().share_memory_() for name, tensor in named_tensors}
            self._commands.put(("weights", self._weights))
            self._wait()
        else:
            given = set()
            for name, tensor in named_tensors:
                if name not in self._weights:
                    raise ValueError(f"update_weights: {name!r} was not in the first push")
                self._weights[name].copy_(tensor)
                given.add(name)
            if given != set(self._weights):
                raise ValueError(f"update_weights: {len(set(self._weights) - given)} tensors of the first push missing")
        self._commands.put(("update", version))
        self._wait()
        self._weight_version = version

    def generate(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> list[Completion]:
        self._commands.put(("generate", (list(requests), params)))
        return _unpack(self._wait())

    def close(self) -> None:
        if self._process.is_alive():
            self._commands.put(("close", None))
            self._process.join(timeout=30)
        if self._process.is_alive():
            self._process.terminate()
            self._process.join()


class ProcessSyncedEngine(LocalSyncedEngine):
    """``ProcessEngine`` as a weight-sync transport: the in-process engine's, each sync streaming the
    actor's buckets into it, plus the thread share.

    While it is open the trainer's process runs ``trainer_threads`` torch threads (its share of
    the cores, ``split_threads``); ``close`` restores the count it found.
    """

    def __init__(self, engine: ProcessEngine, *, bucket_bytes: int, trainer_threads: int) -> None:
        super().__init__(engine, bucket_bytes=bucket_bytes)
        self._previous_threads = torch.get_num_threads()
        torch.set_num_threads(trainer_threads)

    def close(self) -> None:
        super().close()
        torch.set_num_threads(self._previous_threads)
