"""A CPU stand-in for ``python -m sglang.launch_server``: the rollout server of a campaign rehearsal.

``python -m pipeline.cli.standin --model-path DIR --host H --port P [--tp-size N] ...``
takes the command line the ``serve`` role gives SGLang (unknown SGLang flags are accepted
and ignored, as they tune GPU kernels), loads the Hugging Face folder with ``transformers``
(``trust_remote_code`` off) and decodes it with winnow's own ``LocalEngine``. It speaks the
part of SGLang 0.5.23's HTTP protocol that winnow's client uses, with SGLang's answers:

* ``POST /generate``: a batch of ``input_ids`` with one ``sampling_params`` each; the
  samples of one prompt with the same options decode as one batch (one prefill, as SGLang's
  radix cache shares it), drawn from a seed of their ``sampling_seed`` values, so the same
  request gets the same samples whichever server answers it (what an exact resume needs);
  ``meta_info.output_token_logprobs`` are the engine's log-probs of the temperature-scaled
  distribution, the quantity the trainer recomputes.
* ``POST /update_weights_from_disk``: loads an HF export (safetensors) into the model.
* ``POST /init_weights_update_group``, ``/update_weights_from_distributed``,
  ``/destroy_weights_update_group``: joins the trainer's update group (gloo on a CPU) at
  ``rank_offset`` and copies each broadcast bucket into the model. It is one process, so it
  plays one rank: it starts only with ``--tp-size 1`` (a rehearsal runs SGLang's TP servers as
  TP-1 stand-ins and says so). Distributed updates only inside a
  ``/begin_weight_update`` … ``/end_weight_update`` session, with the scheduler's refusals.
* ``GET /health``, ``/health_generate`` (a one-token generation through the model, so it waits
  while a weight update holds the model, as SGLang's scheduler does), ``/model_info`` (the served
  ``weight_version``), ``/server_info`` (``tp_size`` 1, the rank it plays), ``POST /flush_cache``,
  ``/release_memory_occupation``, ``/resume_memory_occupation``.

Every weight push changes what the server generates: the pushed tensors are the model's
parameters. Requests are served one at a time (the model is not thread-safe), which a
CPU rehearsal's tiny model makes cheap. ``--request-log FILE`` appends one JSON line per
request (path, weight version, port, process id, time): the rehearsal reads it to check that a
restarted server was re-synced before it served again.

Memory: one fp32 copy of the model (the rehearsal's models are a few tens of MB); a
distributed update holds one bucket at a time.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

DEFAULT_WEIGHT_VERSION = "default"
REQUEST_LOG_ENV = "WINNOW_STANDIN_LOG"  # the request log of every stand-in a rehearsal starts
# SGLang's uvicorn listens with a backlog of 2048; the stdlib's 5 resets connections when the
# client opens one per request in flight.
LISTEN_BACKLOG = 256
# sglang/srt/managers/scheduler_components/weight_updater.py (0.5.23): the scheduler's refusals.
OUTSIDE_SESSION = "{name} must run between begin_weight_update() and end_weight_update()"
SESSION_OPEN = "a weight-update session is already open; call end_weight_update() first"
NO_SESSION = "no weight-update session is open; call begin_weight_update() first"


class StandinModel:
    """The served model, its weight version and the update groups it belongs to (one lock for all)."""

    def __init__(self, model_path: str, *, port: int, weight_version: str, request_log: str | None) -> None:
        from transformers import AutoModelForCausalLM

        from pipeline.rollout.local import LocalEngine

        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, local_files_only=True,
                                                          trust_remote_code=False)
        self.engine = LocalEngine(self.model, max_batch_rows=64, show_progress=False)
        self.params = dict(self.model.named_parameters(remove_duplicate=False))
        self.port = port
        self.weight_version = weight_version
        self.lock = threading.Lock()
        self.session_open = False
        self.groups: dict[str, Any] = {}  # group name → UpdateGroup
        self._engine_version = 0  # LocalEngine's own counter: it wants a larger int each update
        self._log = open(request_log, "a", encoding="utf-8") if request_log else None

    def record(self, path: str) -> None:
        if self._log is not None:
            self._log.write(json.dumps({"path": path, "weight_version": self.weight_version,
                                        "port": self.port, "pid": os.getpid(), "time": time.time()}) + "\n")
            self._log.flush()

    # ------------------------------------------------------------------ generation
    def generate(self, body: dict[str, Any]) -> tuple[int, Any]:
        from pipeline.rollout.types import GenerationRequest, SamplingParams

        input_ids = body.get("input_ids")
        if not input_ids or not body.get("return_logprob"):
            return 400, {"error": {"message": "the stand-in server needs input_ids and return_logprob", "code": 400}}
        batched = isinstance(input_ids[0], list)
        prompts = input_ids if batched else [input_ids]
        params = body.get("sampling_params") or {}
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            return 400, {"error": {"message": "sampling_params and input_ids differ in length", "code": 400}}
        # One row per sample, in request order; rows of one prompt with the same options decode as one batch.
        rows = [(tuple(prompt), sampling, int(sampling.get("sampling_seed", 42)) + copy)
                for prompt, sampling in zip(prompts, params) for copy in range(int(sampling.get("n") or 1))]
        groups: dict[tuple, list[int]] = {}
        for row, (prompt, sampling, _) in enumerate(rows):
            options = {key: value for key, value in sampling.items() if key not in ("sampling_seed", "n")}
            groups.setdefault((prompt, json.dumps(options, sort_keys=True)), []).append(row)
        results: list[dict[str, Any] | None] = [None] * len(rows)
        for (prompt, _), members in groups.items():
            sampling = rows[members[0]][1]
            # The batch's noise is drawn from a seed of all its samples' seeds: the same request (what a
            # resumed run sends) gets the same samples; a sample sent alone gets another valid draw.
            digest = hashlib.blake2b(repr([rows[row][2] for row in members]).encode(), digest_size=8).digest()
            try:
                options = SamplingParams(
                    max_new_tokens=int(sampling.get("max_new_tokens", 128)),
                    temperature=float(sampling.get("temperature", 1.0)),
                    top_p=float(sampling.get("top_p", 1.0)),
                    stop_token_ids=tuple(sampling.get("stop_token_ids") or ()),
                    stop_strings=tuple(sampling.get("stop") or ()),
                    ignore_eos=bool(sampling.get("ignore_eos", False)),
                    seed=int.from_bytes(digest, "little") >> 1,
                )
                completions = self.engine.generate(
                    [GenerationRequest(prompt_id="batch", prompt_token_ids=prompt, num_samples=len(members))], options)
            except ValueError as error:  # SGLang answers a request it refuses (e.g. too long) with 400
                return 400, {"error": {"message": str(error), "code": 400}}
            for row, completion in zip(members, completions):
                tokens = completion.token_ids.tolist()
                logprobs = completion.logprobs.tolist()
                finish = ({"type": "stop", "matched": tokens[-1]} if completion.finish_reason == "stop"
                          else {"type": "length", "length": len(tokens)})
                results[row] = {
                    "text": "", "output_ids": tokens,
                    "meta_info": {"id": f"{os.getpid()}-{row}", "prompt_tokens": len(prompt),
                                  "completion_tokens": len(tokens), "finish_reason": finish,
                                  "output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, tokens)],
                                  "weight_version": self.weight_version},
                }
        return 200, results if (batched or len(results) > 1) else results[0]

    def health_generate(self) -> bool:
        from pipeline.rollout.types import GenerationRequest, SamplingParams

        self.engine.generate([GenerationRequest(prompt_id="health", prompt_token_ids=(0,), num_samples=1)],
                             SamplingParams(max_new_tokens=1, temperature=0.0))
        return True

    # ------------------------------------------------------------------ weights
    def update_from_disk(self, body: dict[str, Any]) -> tuple[bool, str]:
        from pipeline.checkpoint.hf_io import HFCheckpointReader
        from pipeline.errors import CheckpointError

        try:
            reader = HFCheckpointReader.open(body["model_path"])
            self._engine_version += 1
            self.engine.update_weights(reader.iter_tensors(), version=self._engine_version)
        except (CheckpointError, ValueError, KeyError) as error:
            return False, f"Failed to update weights: {error}"
        self._relabel(body)
        return True, "Succeeded to update model weights."

    def join_group(self, body: dict[str, Any]) -> tuple[bool, str]:
        from pipeline.parallel.weight_transfer import UpdateGroup

        try:
            member = UpdateGroup.join(master_address=body["master_address"], master_port=int(body["master_port"]),
                                      rank=int(body["rank_offset"]), world_size=int(body["world_size"]),
                                      name=body["group_name"], backend=body.get("backend", "nccl"), timeout_s=600.0)
        except (RuntimeError, ValueError) as error:
            return False, f"Failed to initialize custom process group: {error}"
        self.groups[body["group_name"]] = member
        return True, "Succeeded to initialize custom process group."

    def destroy_group(self, body: dict[str, Any]) -> tuple[bool, str]:
        member = self.groups.pop(body.get("group_name", ""), None)
        if member is None:
            return False, "The group to be destroyed does not exist."
        member.destroy()
        return True, "Succeeded to destroy custom process group."

    def receive(self, body: dict[str, Any]) -> tuple[bool, str]:
        member = self.groups.get(body["group_name"])
        if member is None:
            return False, f"no update group {body['group_name']!r}"
        names, dtypes, shapes = body["names"], body["dtypes"], body["shapes"]
        unknown = [name for name in names if name not in self.params]
        if unknown:
            return False, f"Failed to update parameter online: unknown parameters {unknown[:3]}"
        received = [torch.empty(shape, dtype=getattr(torch, dtype)) for dtype, shape in zip(dtypes, shapes)]
        try:
            member.broadcast(received)
        except RuntimeError as error:
            self.groups.pop(body["group_name"]).destroy()
            return False, f"Failed to update parameter online: {error}"
        with torch.no_grad():
            for name, tensor in zip(names, received):
                self.params[name].copy_(tensor)
        self._relabel(body)
        return True, "Succeeded to update parameter online."

    def _relabel(self, body: dict[str, Any]) -> None:
        if body.get("weight_version") is not None:
            self.weight_version = str(body["weight_version"])


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: ThreadingHTTPServer

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's signature
        pass

    @property
    def served(self) -> StandinModel:
        return self.server.served  # type: ignore[attr-defined]

    def _send(self, status: int, payload: Any = None, *, text: str | None = None) -> None:
        data = text.encode() if text is not None else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain" if text is not None else "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        served = self.served
        if self.path == "/health":
            self._send(200, text="")
        elif self.path == "/health_generate":
            with served.lock:
                served.health_generate()
            self._send(200, text="")
        elif self.path == "/model_info":
            self._send(200, {"model_path": "standin", "is_generation": True,
                             "weight_version": served.weight_version})
        elif self.path == "/server_info":
            # SGLang's resolved ServerArgs, of which the client reads tp_size; a stand-in plays one rank.
            self._send(200, {"tp_size": 1, "pp_size": 1, "version": "standin"})
        else:
            self._send(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        served = self.served
        length = int(self.headers.get("Content-Length") or 0)
        try:
            body = json.loads(self.rfile.read(length)) if length else {}
        except json.JSONDecodeError as error:
            self._send(400, {"error": {"message": f"body is not JSON: {error}", "code": 400}})
            return
        path = self.path.split("?")[0]
        if path == "/generate":
            with served.lock:
                served.record(path)
                status, payload = served.generate(body)
            self._send(status, payload)
            return
        if path == "/flush_cache":
            self._send(200, text="Cache flushed.\n")
            return
        if path in ("/release_memory_occupation", "/resume_memory_occupation"):
            self._send(200, None)
            return
        handlers = {
            "/update_weights_from_disk": served.update_from_disk,
            "/init_weights_update_group": served.join_group,
            "/destroy_weights_update_group": served.destroy_group,
            "/update_weights_from_distributed": served.receive,
        }
        if path == "/begin_weight_update":
            ok, message = (False, SESSION_OPEN) if served.session_open else (True, "Success")
            served.session_open = True
        elif path == "/end_weight_update":
            ok, message = (True, "Success") if served.session_open else (False, NO_SESSION)
            served.session_open = False
        elif path == "/update_weights_from_distributed" and not served.session_open:
            ok, message = False, OUTSIDE_SESSION.format(name="update_weights_from_distributed")
        elif path in handlers:
            # Joining blocks until every member of the group joined: never under the generation lock's
            # holder's feet, but one weight operation at a time (SGLang's model-update lock).
            with served.lock:
                served.record(path)
                ok, message = handlers[path](body)
        else:
            self._send(404, {"detail": "Not Found"})
            return
        self._send(200 if ok else 400, {"success": ok, "message": message})


def serve_standin(*, model_path: str, host: str, port: int, weight_version: str = DEFAULT_WEIGHT_VERSION,
                  request_log: str | None = None, listen_backlog: int = LISTEN_BACKLOG, out=print) -> None:
    """Load ``model_path`` and answer SGLang's protocol on ``host:port`` until the process is killed.

    ``listen_backlog``: connections the kernel holds for the server; at least the calls the client
    keeps in flight to it (``--max-running-requests``), or some would be reset.
    """
    torch.set_num_threads(1)  # one core per server: a rehearsal runs several beside the trainer ranks
    served = StandinModel(model_path, port=port, weight_version=weight_version, request_log=request_log)
    ThreadingHTTPServer.request_queue_size = listen_backlog
    server = ThreadingHTTPServer((host, port), _Handler)
    server.daemon_threads = True
    server.served = served  # type: ignore[attr-defined]
    out(f"stand-in server for {model_path} on http://{host}:{port}")
    server.serve_forever()
