"""The SGLang HTTP contract as data: launch command lines, request bodies, response parsing.

No I/O here, so every body the client sends and every response it accepts is checked
by the tests against SGLang's own schema: ``sglang/api/v1/api_types.py`` (the
``/generate`` contract the server enforces with HTTP 400, e.g. for an unknown
``sampling_params`` key) and the ``*ReqInput`` structs of
``sglang/srt/managers/io_struct.py`` (the weight-update endpoints). Facts this module
relies on, from SGLang 0.5.23:

* ``/generate`` takes ``input_ids`` and ``sampling_params``; a list of ``input_ids``
  with a list of ``sampling_params`` is a batch and returns a JSON list, one object
  per element, in order. ``return_logprob`` adds ``meta_info.output_token_logprobs``
  as ``[logprob, token_id, text_or_null]`` triples; ``meta_info.finish_reason`` is
  ``{"type": "stop" | "length" | "abort", ...}``; ``meta_info.weight_version`` is a
  string (``"default"`` unless the server got ``--weight-version`` or an update named one).
* The seed field is ``sampling_params.sampling_seed`` and it is honoured only by
  servers started with ``--enable-deterministic-inference``; such servers give every
  unseeded request the seed 42, so ``n`` unseeded samples of one prompt would be
  identical. Every sample therefore gets its own seed (``sample_seed``), derived from
  the call's seed (a random one when ``SamplingParams.seed`` is None), the prompt id
  and the sample index: a sample re-sent to another server after a failure asks for
  the same draw.
* Weight-update endpoints take JSON objects whose unknown keys are *ignored* (a typo
  would silently do nothing), answer ``{"success": bool, "message": str}``, and take
  ``weight_version`` to relabel the server's weights.
* Tensor and distributed (NCCL) weight updates must run inside a weight-update session:
  ``/begin_weight_update`` (``BeginWeightUpdateReqInput``: ``selector`` of the runners,
  default ``"all"``), the updates, then ``/end_weight_update`` (``EndWeightUpdateReqInput``,
  no fields), which finalizes the loaded weights. Outside a session the server answers
  ``success: false`` ("... must run between begin_weight_update() and
  end_weight_update()"); a second begin, or an end without a begin, is refused too.
  ``/update_weights_from_disk`` needs no session.
* ``GET /health`` answers 200 once the server is up (503 while it starts); ``GET
  /health_generate`` also runs a one-token generation through the scheduler and answers 503
  when that gets no answer within ``SGLANG_HEALTH_CHECK_TIMEOUT`` (20 s), so it sees a hung
  scheduler behind a live HTTP front end. A stopped process answers neither. ``GET
  /model_info`` (``GetModelInfoResponse``) reports the served ``weight_version``.
* ``GET /server_info`` (``/get_server_info`` is its deprecated alias) reports the resolved
  ``ServerArgs`` as one flat object, ``tp_size`` among them: the GPUs of the server, each of
  which joins an update group as rank ``rank_offset + tp_rank``.
* No endpoint aborts a weight-update session: ``/end_weight_update`` closes it, whatever was
  loaded in it. A session left open (its client died, or gave up on the server) refuses every
  later ``/begin_weight_update`` until it is closed.
"""

from __future__ import annotations

import hashlib
import math
import sys
from dataclasses import dataclass
from typing import Any, Sequence

from pipeline.rollout.types import FINISH_REASONS, SamplingParams

__all__ = [
    "DEFAULT_WEIGHT_VERSION",
    "GENERATE_PATH",
    "HEALTH_PATH",
    "MalformedResponse",
    "SGLangServerSpec",
    "SampleOutput",
    "begin_weight_update_body",
    "end_weight_update_body",
    "generate_body",
    "init_weights_update_group_body",
    "destroy_weights_update_group_body",
    "launch_command",
    "parse_generate_response",
    "parse_model_info_version",
    "parse_server_info_tp_size",
    "parse_update_response",
    "parse_weight_version",
    "sample_seed",
    "sampling_params_body",
    "update_weights_from_disk_body",
    "update_weights_from_distributed_body",
]

GENERATE_PATH = "/generate"
HEALTH_PATH = "/health"
HEALTH_GENERATE_PATH = "/health_generate"
MODEL_INFO_PATH = "/model_info"
SERVER_INFO_PATH = "/server_info"
FLUSH_CACHE_PATH = "/flush_cache"
UPDATE_FROM_DISK_PATH = "/update_weights_from_disk"
UPDATE_FROM_DISTRIBUTED_PATH = "/update_weights_from_distributed"
INIT_UPDATE_GROUP_PATH = "/init_weights_update_group"
DESTROY_UPDATE_GROUP_PATH = "/destroy_weights_update_group"
BEGIN_WEIGHT_UPDATE_PATH = "/begin_weight_update"
END_WEIGHT_UPDATE_PATH = "/end_weight_update"

# What a server reports before any versioned update or --weight-version.
DEFAULT_WEIGHT_VERSION = "default"
_MAX_I64 = 2**63 - 1


class MalformedResponse(ValueError):
    """A server answered 200 with a body that breaks SGLang's response contract."""


@dataclass(kw_only=True, slots=True, frozen=True)
class SGLangServerSpec:
    """One ``python -m sglang.launch_server`` process. ``host`` defaults to loopback.

    Binding another address (e.g. ``0.0.0.0`` so trainer nodes can reach the server) must
    be asked for: the server's admin endpoints (weight updates, memory release) are
    open unless SGLang is given ``--api-key``. ``extra_args`` are appended verbatim.
    """

    model_path: str
    port: int
    host: str = "127.0.0.1"
    tp_size: int = 1
    base_gpu_id: int = 0
    mem_fraction_static: float | None = None
    dtype: str | None = None
    random_seed: int | None = None
    weight_version: int = 0
    enable_deterministic_inference: bool = False
    python: str = sys.executable
    extra_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.model_path:
            raise ValueError("SGLangServerSpec.model_path is empty")
        if not (1 <= self.port <= 65535):
            raise ValueError(f"SGLangServerSpec.port must lie in [1, 65535], got {self.port}")
        if not self.host:
            raise ValueError("SGLangServerSpec.host is empty")
        if self.tp_size < 1 or self.base_gpu_id < 0:
            raise ValueError(f"tp_size must be >= 1 and base_gpu_id >= 0, got {self.tp_size}, {self.base_gpu_id}")
        if self.mem_fraction_static is not None and not (0.0 < self.mem_fraction_static < 1.0):
            raise ValueError(f"mem_fraction_static must lie in (0, 1), got {self.mem_fraction_static}")
        object.__setattr__(self, "extra_args", tuple(self.extra_args))

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


def launch_command(spec: SGLangServerSpec) -> list[str]:
    """The argv that starts ``spec``'s server (flag names as SGLang's ``arg_groups`` derive them)."""
    command = [
        spec.python,
        "-m",
        "sglang.launch_server",
        "--model-path",
        spec.model_path,
        "--host",
        spec.host,
        "--port",
        str(spec.port),
        "--tp-size",
        str(spec.tp_size),
        "--base-gpu-id",
        str(spec.base_gpu_id),
        "--weight-version",
        str(spec.weight_version),
    ]
    if spec.mem_fraction_static is not None:
        command += ["--mem-fraction-static", repr(float(spec.mem_fraction_static))]
    if spec.dtype is not None:
        command += ["--dtype", spec.dtype]
    if spec.random_seed is not None:
        command += ["--random-seed", str(spec.random_seed)]
    if spec.enable_deterministic_inference:
        command.append("--enable-deterministic-inference")
    return command + list(spec.extra_args)


# ----------------------------------------------------------------------------- /generate


def sample_seed(base_seed: int, prompt_id: str, sample_index: int) -> int:
    """A seed in ``[0, 2**63)`` for one sample, stable across processes and retries."""
    digest = hashlib.blake2b(f"{base_seed}\x00{prompt_id}\x00{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _MAX_I64


def sampling_params_body(params: SamplingParams, *, sampling_seed: int) -> dict[str, Any]:
    """SGLang ``sampling_params`` for one sample (only keys SGLang's schema declares)."""
    body: dict[str, Any] = {
        "max_new_tokens": params.max_new_tokens,
        "temperature": float(params.temperature),
        "top_p": float(params.top_p),
        "ignore_eos": params.ignore_eos,
        "sampling_seed": sampling_seed,
    }
    if params.stop_token_ids:
        body["stop_token_ids"] = list(params.stop_token_ids)
    if params.stop_strings:
        body["stop"] = list(params.stop_strings)
    return body


def generate_body(
    prompt_token_ids: Sequence[int],
    *,
    sampling_seeds: Sequence[int],
    params: SamplingParams,
) -> dict[str, Any]:
    """A batch ``/generate`` body: one element per sample of one prompt, each with its seed."""
    if not sampling_seeds:
        raise ValueError("generate_body needs at least one sample")
    ids = list(prompt_token_ids)
    return {
        "input_ids": [ids for _ in sampling_seeds],
        "sampling_params": [sampling_params_body(params, sampling_seed=seed) for seed in sampling_seeds],
        "return_logprob": True,
    }


@dataclass(frozen=True, slots=True)
class SampleOutput:
    """One sample parsed from a ``/generate`` response."""

    token_ids: list[int]  # (T,)
    logprobs: list[float]  # (T,)
    finish_reason: str
    weight_version: int


def parse_weight_version(value: Any, *, initial_version: int, current_version: int) -> int:
    """SGLang's string version → int.

    ``"default"`` is what a server started without ``--weight-version`` reports before
    any versioned update: the client's ``initial_version``. An absent field (servers
    older than the pinned 0.5.23) is taken to be the version the client last set,
    ``current_version``.
    """
    if value is None:
        return current_version
    if value == DEFAULT_WEIGHT_VERSION:
        return initial_version
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    raise MalformedResponse(f"meta_info.weight_version {value!r} is neither an integer nor {DEFAULT_WEIGHT_VERSION!r}")


def _parse_sample(item: Any, *, initial_version: int, current_version: int) -> SampleOutput:
    if not isinstance(item, dict) or not isinstance(item.get("meta_info"), dict):
        raise MalformedResponse("a /generate result must be an object with a meta_info object")
    meta = item["meta_info"]
    finish = meta.get("finish_reason")
    if not isinstance(finish, dict) or finish.get("type") not in FINISH_REASONS:
        raise MalformedResponse(f"meta_info.finish_reason must be {{type: stop|length|abort}}, got {finish!r}")
    entries = meta.get("output_token_logprobs")
    if not isinstance(entries, list):
        raise MalformedResponse("meta_info.output_token_logprobs is missing (was return_logprob sent?)")
    token_ids: list[int] = []
    logprobs: list[float] = []
    for entry in entries:
        if not isinstance(entry, list) or len(entry) != 3:
            raise MalformedResponse(f"output_token_logprobs entries are [logprob, token_id, text], got {entry!r}")
        logprob, token_id = entry[0], entry[1]
        if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
            raise MalformedResponse(f"bad token id {token_id!r} in output_token_logprobs")
        # log(softmax) can exceed 0 by rounding, never by more than float noise.
        numeric = isinstance(logprob, (int, float)) and not isinstance(logprob, bool)
        if not numeric or not math.isfinite(logprob) or logprob > 1e-3:
            raise MalformedResponse(f"bad log-probability {logprob!r} for token {token_id}")
        token_ids.append(token_id)
        logprobs.append(float(logprob))
    output_ids = item.get("output_ids")
    if output_ids is not None and output_ids != token_ids:
        raise MalformedResponse("output_ids disagree with the token ids of output_token_logprobs")
    completion_tokens = meta.get("completion_tokens")
    if completion_tokens is not None and completion_tokens != len(token_ids):
        raise MalformedResponse(
            f"meta_info.completion_tokens {completion_tokens} != {len(token_ids)} output_token_logprobs"
        )
    return SampleOutput(
        token_ids=token_ids,
        logprobs=logprobs,
        finish_reason=finish["type"],
        weight_version=parse_weight_version(
            meta.get("weight_version"), initial_version=initial_version, current_version=current_version
        ),
    )


def parse_generate_response(
    payload: Any, *, num_samples: int, initial_version: int, current_version: int
) -> list[SampleOutput]:
    """Parse a decoded ``/generate`` JSON value holding ``num_samples`` results, in request order."""
    items = payload if isinstance(payload, list) else [payload]
    if len(items) != num_samples:
        raise MalformedResponse(f"expected {num_samples} results from /generate, got {len(items)}")
    return [
        _parse_sample(item, initial_version=initial_version, current_version=current_version) for item in items
    ]


# ------------------------------------------------------------------------ weight updates


def update_weights_from_disk_body(
    model_path: str,
    *,
    version: int,
    load_format: str | None = None,
    flush_cache: bool = True,
    abort_all_requests: bool = False,
) -> dict[str, Any]:
    """``UpdateWeightFromDiskReqInput``: load an HF export directory the server can read."""
    body: dict[str, Any] = {
        "model_path": model_path,
        "weight_version": str(version),
        "flush_cache": flush_cache,
        "abort_all_requests": abort_all_requests,
    }
    if load_format is not None:
        body["load_format"] = load_format
    return body


def update_weights_from_distributed_body(
    names: Sequence[str],
    *,
    dtypes: Sequence[str],
    shapes: Sequence[Sequence[int]],
    version: int,
    group_name: str = "weight_update_group",
    flush_cache: bool = True,
) -> dict[str, Any]:
    """``UpdateWeightsFromDistributedReqInput``: metadata of tensors the trainer then broadcasts.

    ``dtypes`` are torch attribute names (``"bfloat16"``): the server resolves them with
    ``getattr(torch, dtype)``.
    """
    if not (len(names) == len(dtypes) == len(shapes)) or not names:
        raise ValueError(
            "names, dtypes and shapes must be non-empty and of one length, "
            f"got {len(names)}, {len(dtypes)}, {len(shapes)}"
        )
    return {
        "names": list(names),
        "dtypes": [str(d).removeprefix("torch.") for d in dtypes],
        "shapes": [[int(s) for s in shape] for shape in shapes],
        "group_name": group_name,
        "weight_version": str(version),
        "flush_cache": flush_cache,
    }


def init_weights_update_group_body(
    *,
    master_address: str,
    master_port: int,
    rank_offset: int,
    world_size: int,
    group_name: str = "weight_update_group",
    backend: str = "nccl",
) -> dict[str, Any]:
    """``InitWeightsUpdateGroupReqInput``: join the trainer's broadcast group at ``rank_offset``."""
    return {
        "master_address": master_address,
        "master_port": int(master_port),
        "rank_offset": int(rank_offset),
        "world_size": int(world_size),
        "group_name": group_name,
        "backend": backend,
    }


def destroy_weights_update_group_body(group_name: str) -> dict[str, Any]:
    """``DestroyWeightsUpdateGroupReqInput``: leave (and free) the broadcast group ``group_name``."""
    return {"group_name": group_name}


def begin_weight_update_body(selector: str = "all") -> dict[str, Any]:
    """``BeginWeightUpdateReqInput``: open a weight-update session on the ``selector`` runners."""
    if selector not in ("target", "draft", "all"):
        raise ValueError(f"selector must be 'target', 'draft' or 'all', got {selector!r}")
    return {"selector": selector}


def end_weight_update_body() -> dict[str, Any]:
    """``EndWeightUpdateReqInput``: close the session (it has no fields)."""
    return {}


def parse_update_response(payload: Any) -> tuple[bool, str]:
    """``(success, message)`` of a weight-update answer; a body without ``success`` is malformed."""
    if not isinstance(payload, dict) or not isinstance(payload.get("success"), bool):
        raise MalformedResponse(f"a weight-update answer must be {{success: bool, message: str}}, got {payload!r}")
    return payload["success"], str(payload.get("message", ""))


def parse_model_info_version(payload: Any, *, initial_version: int, current_version: int) -> int:
    """The weight version a ``/model_info`` answer reports; a body without one is malformed.

    Unlike a ``/generate`` answer, an absent version is not taken to be the current one: this is
    the check a recovered server must pass before it gets requests again.
    """
    if not isinstance(payload, dict) or not isinstance(payload.get("weight_version"), str):
        raise MalformedResponse(f"/model_info must report weight_version as a string, got {payload!r}")
    return parse_weight_version(payload["weight_version"], initial_version=initial_version,
                                current_version=current_version)


def parse_server_info_tp_size(payload: Any) -> int:
    """The ``tp_size`` a ``/server_info`` answer reports; an answer without a positive integer one is malformed."""
    tp_size = payload.get("tp_size") if isinstance(payload, dict) else None
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise MalformedResponse(f"/server_info must report tp_size as a positive integer, got {tp_size!r}")
    return tp_size
