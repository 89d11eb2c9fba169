"""A small fake SGLang server for failover tests: real HTTP on 127.0.0.1, deterministic fake tokens.

Run as a subprocess (``python -m tests.rollout.fake_sglang --port-file F ...`` from the
repository root) so a test can SIGKILL it mid-batch or SIGSTOP it (a hung process:
the kernel still accepts connections, nothing ever answers). ``FakeServer`` starts one
and waits until it listens.

It keeps SGLang's contract on both sides: every ``/generate`` body goes through
``GenerateRequest.from_json_value`` from SGLang's ``api_types.py`` (HTTP 400 with
SGLang's message on a violation, as the real server does), weight-update bodies are
decoded with the strict mirrors of io_struct's ``*ReqInput`` structs, and responses are
built from ``api_types`` structs and encoded with SGLang's own ``to_json_value``. Like
SGLang 0.5.23's scheduler, it refuses tensor and distributed updates outside a
``/begin_weight_update`` … ``/end_weight_update`` session, a second begin, and an end
without a begin, with the scheduler's messages (HTTP 400, ``success: false``).

Tokens depend only on (prompt ids, ``sampling_seed``, weight version), so a test can
recompute what any sample must be (``expected_sample``) whichever server produced it.

With ``--join-groups``, distributed weight updates are played for real: ``/init_weights_update_group`` joins the
trainer's update group (gloo) at the given rank, as SGLang's scheduler does, and
``/update_weights_from_distributed`` receives the announced tensors by broadcast from group
rank 0 into a name → tensor store, one update at a time (SGLang's model-update lock). After
every ``/end_weight_update`` the store is written to ``--weights-out`` (safetensors), so a test
can compare what the server holds with the trainer's weights (without the flag both requests
are validated and answered, nothing is received). ``--die-on-bucket N``:
``os._exit`` when the N-th distributed update arrives, before it receives anything.

``--die-on-bucket N`` has a variant: ``--hang-on-bucket N`` stops the process (``SIGSTOP``) instead, a
server that stops answering in the middle of a broadcast. ``--fail-begin`` refuses every
``/begin_weight_update``. ``--load-delay-s S``: each ``/update_weights_from_disk`` takes S seconds,
during which ``/health_generate`` answers 503, as a scheduler busy loading weights does.

``GET /model_info`` answers SGLang's ``GetModelInfoResponse`` with the served weight version;
``GET /server_info`` reports ``--tp-size`` (default 1) as ``tp_size``.
``--vocab-size V`` keeps the tokens below V, so a real (tiny) policy can train on them.
``--port P`` binds a fixed port (default: any free one), so a supervisor can restart the server at
the URL the client knows; every line of ``--log`` names the process id that wrote it.

Modes: ``ok``; ``http500`` (every /generate → 500); ``http400`` (every /generate → 400,
as SGLang answers a request it refuses); ``malformed`` (200 with a body
that is not JSON); ``hang_generate`` (/generate never answers, /health does);
``die_after`` (``os._exit`` when the ``--die-after``-th /generate arrives, before answering).
In any mode, ``--die-after-updates K`` exits at the first /generate after the K-th
``/update_weights_from_disk``: while it generates with version K's weights.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import msgspec

REPO_ROOT = Path(__file__).resolve().parents[2]
FAKE_VOCAB = 1000
MODES = ("ok", "http500", "http400", "malformed", "hang_generate", "die_after")


def expected_sample(
    prompt_ids: list[int], *, sampling_seed: int, weight_version: str, max_new_tokens: int, stop_token_ids: list[int],
    vocab_size: int = FAKE_VOCAB,
) -> tuple[list[int], list[float], str]:
    """The fake model: ``(token_ids, logprobs, finish type)`` of one sample, tokens below ``vocab_size``."""
    rng = random.Random(f"{prompt_ids}|{sampling_seed}|{weight_version}")
    tokens: list[int] = []
    logprobs: list[float] = []
    for _ in range(max_new_tokens):
        token = rng.randrange(vocab_size)
        tokens.append(token)
        logprobs.append(-round(rng.random() * 4.0, 6))
        if token in stop_token_ids:
            return tokens, logprobs, "stop"
    return tokens, logprobs, "length"


class _State:
    def __init__(self, args: argparse.Namespace) -> None:
        from tests.rollout import sglang_schema

        self.args = args
        self.api = sglang_schema.api_types()
        self.schema = sglang_schema
        self.lock = threading.Lock()
        self.weight_version = args.weight_version
        self.num_generate = 0
        self.num_updates = 0  # /update_weights_from_disk requests answered
        self.session_open = False
        self.log = open(args.log, "a") if args.log else None
        self.update_lock = threading.Lock()  # SGLang applies one weight update at a time
        self.groups: dict[str, Any] = {}  # group name → UpdateGroup
        self.weights: dict[str, Any] = {}  # name → tensor received by broadcast
        self.num_buckets = 0
        self.loading = 0  # /update_weights_from_disk requests in progress

    def join_group(self, request: Any) -> tuple[bool, str]:
        from pipeline.parallel.weight_transfer import UpdateGroup

        try:
            self.groups[request.group_name] = UpdateGroup.join(
                master_address=request.master_address, master_port=request.master_port, rank=request.rank_offset,
                world_size=request.world_size, name=request.group_name, backend=request.backend,
                timeout_s=self.args.group_timeout_s)
        except (RuntimeError, ValueError) as error:
            return False, f"fake: joining {request.group_name} failed: {error}"
        return True, "Succeeded to initialize custom process group."

    def receive(self, request: Any) -> tuple[bool, str]:
        import torch

        group = self.groups.get(request.group_name)
        if group is None:
            return False, f"fake: no update group {request.group_name!r}"
        tensors = [torch.empty(shape, dtype=getattr(torch, dtype)) for dtype, shape in zip(request.dtypes, request.shapes)]
        try:
            group.broadcast(tensors)
        except RuntimeError as error:
            self.groups.pop(request.group_name).destroy()
            return False, f"fake: broadcast in {request.group_name} failed: {error}"
        self.weights.update(zip(request.names, tensors))
        return True, "Succeeded to update parameter online."

    def dump_weights(self) -> None:
        if not self.args.weights_out or not self.weights:
            return
        from safetensors.torch import save_file

        target = Path(self.args.weights_out)
        tmp = target.with_suffix(".tmp")
        save_file(dict(self.weights), str(tmp))
        tmp.rename(target)  # atomic: the test never reads half a file

    def record(self, path: str, body: Any) -> None:
        if self.log is not None:
            with self.lock:
                self.log.write(json.dumps({"path": path, "body": body, "pid": os.getpid()}) + "\n")
                self.log.flush()


def _generate(state: _State, body: Any) -> tuple[int, Any]:
    api = state.api
    try:
        request = api.GenerateRequest.from_json_value(body)
    except api.JsonContractError as error:
        return 400, {"error": {"message": str(error), "type": "BadRequestError", "code": 400}}
    if request.input_ids is None or not request.return_logprob:
        return 400, {"error": {"message": "the fake server needs input_ids and return_logprob", "code": 400}}
    batched = bool(request.input_ids) and isinstance(request.input_ids[0], list)
    prompts = request.input_ids if batched else [request.input_ids]
    params = request.sampling_params
    if not isinstance(params, list):
        params = [params or api.SamplingParams()] * len(prompts)
    if len(params) != len(prompts):
        return 400, {"error": {"message": "sampling_params and input_ids differ in length", "code": 400}}
    results = []
    for prompt, sampling in zip(prompts, params):
        for copy in range(sampling.n or 1):
            seed = sampling.sampling_seed if sampling.sampling_seed is not None else 42
            tokens, logprobs, finish = expected_sample(
                list(prompt),
                sampling_seed=seed + copy,
                weight_version=state.weight_version,
                max_new_tokens=sampling.max_new_tokens,
                stop_token_ids=list(sampling.stop_token_ids or []),
                vocab_size=state.args.vocab_size,
            )
            finish_reason = (
                api.FinishStop(matched=tokens[-1]) if finish == "stop" else api.FinishLength(length=len(tokens))
            )
            response = api.GenerateResponse(
                text="",
                output_ids=tokens,
                meta_info=api.GenerateMetaInfo(
                    id=uuid.uuid4().hex,
                    prompt_tokens=len(prompt),
                    completion_tokens=len(tokens),
                    finish_reason=finish_reason,
                    output_token_logprobs=[api.LogprobEntry(logprob=lp, token_id=t) for lp, t in zip(logprobs, tokens)],
                    weight_version=state.weight_version,
                    e2e_latency=state.args.delay_s,
                ),
            )
            results.append(response.to_json_value())
    return 200, results if (batched or len(results) > 1) else results[0]


_UPDATE_STRUCTS = {
    "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
    "/update_weights_from_tensor": "UpdateWeightsFromTensorReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
    "/release_memory_occupation": "ReleaseMemoryOccupationReqInput",
    "/resume_memory_occupation": "ResumeMemoryOccupationReqInput",
    "/begin_weight_update": "BeginWeightUpdateReqInput",
    "/end_weight_update": "EndWeightUpdateReqInput",
}
# sglang/srt/managers/scheduler_components/weight_updater.py (0.5.23)
_SESSION_ONLY = {
    "/update_weights_from_tensor": "update_weights_from_tensor must run between begin_weight_update() and "
                                   "end_weight_update()",
    "/update_weights_from_distributed": "update_weights_from_distributed must run between begin_weight_update() "
                                        "and end_weight_update()",
}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: ThreadingHTTPServer

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    @property
    def state(self) -> _State:
        return self.server.state  # type: ignore[attr-defined]

    def _send(
        self, status: int, payload: Any = None, *, raw: bytes | None = None, content_type: str = "application/json"
    ) -> None:
        data = raw if raw is not None else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/health_generate" and self.state.loading:
            self._send(503, raw=b"")  # SGLang's scheduler is inside the load: the probe's generation never runs
        elif self.path in ("/health", "/health_generate"):
            self._send(200, raw=b"")
        elif self.path == "/server_info":
            self._send(200, {"tp_size": self.state.args.tp_size, "pp_size": 1, "version": "fake"})
        elif self.path == "/model_info":
            state = self.state
            info = state.api.GetModelInfoResponse(model_path="fake", is_generation=True,
                                                  weight_version=state.weight_version)
            self._send(200, info.to_json_value())
        else:
            self._send(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        state = self.state
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        body = json.loads(raw) if raw else None
        state.record(self.path, body)
        mode = state.args.mode
        if self.path == "/generate":
            with state.lock:
                state.num_generate += 1
                count = state.num_generate
            if mode == "die_after" and count > state.args.die_after:
                os._exit(3)
            if 0 < state.args.die_after_updates <= state.num_updates:
                os._exit(3)
            if mode == "hang_generate":
                threading.Event().wait()
            time.sleep(state.args.delay_s)
            if mode == "http500":
                self._send(500, {"error": {"message": "Internal Server Error"}})
            elif mode == "http400":
                message = "The input (4242 tokens) is longer than the model's context length"
                self._send(400, {"error": {"message": message}})
            elif mode == "malformed":
                self._send(200, raw=b'{"text": "", "meta_info": {"finish_reason": ', content_type="application/json")
            else:
                status, payload = _generate(state, body)
                self._send(status, payload)
        elif self.path.startswith("/flush_cache"):
            self._send(200, raw=b"Cache flushed.\n", content_type="text/plain")
        elif self.path in _UPDATE_STRUCTS:
            struct = state.schema.io_struct(_UPDATE_STRUCTS[self.path])
            try:
                decoded = msgspec.json.decode(raw or b"{}", type=struct)
            except msgspec.ValidationError as error:
                self._send(400, {"success": False, "message": f"contract: {error}"})
                return
            if self.path in ("/release_memory_occupation", "/resume_memory_occupation"):
                self._send(200, None)
            elif self.path == "/begin_weight_update" and state.args.fail_begin:
                self._send(400, {"success": False, "message": "fake: refusing to begin a weight-update session"})
            elif self.path == "/begin_weight_update":
                if state.session_open:
                    self._send(400, {"success": False, "message": "a weight-update session is already open; "
                                                                  "call end_weight_update() first"})
                else:
                    state.session_open = True
                    self._send(200, {"success": True, "message": "Success"})
            elif self.path == "/end_weight_update":
                if not state.session_open:
                    self._send(400, {"success": False, "message": "no weight-update session is open; "
                                                                  "call begin_weight_update() first"})
                else:
                    state.session_open = False
                    with state.update_lock:
                        state.dump_weights()
                    self._send(200, {"success": True, "message": "Success"})
            elif self.path in _SESSION_ONLY and not state.session_open:
                self._send(400, {"success": False, "message": _SESSION_ONLY[self.path]})
            elif state.args.fail_updates:
                self._send(400, {"success": False, "message": "fake: refusing the update"})
            elif self.path == "/init_weights_update_group" and state.args.join_groups:
                with state.update_lock:
                    success, message = state.join_group(decoded)
                self._send(200, {"success": success, "message": message})
            elif self.path == "/destroy_weights_update_group" and state.args.join_groups:
                with state.update_lock:  # SGLang's answers (model_runner weight_updater.py, 0.5.23)
                    group = state.groups.pop(decoded.group_name, None)
                    if group is not None:
                        group.destroy()
                if group is None:
                    self._send(400, {"success": False, "message": "The group to be destroyed does not exist."})
                else:
                    self._send(200, {"success": True, "message": "Succeeded to destroy custom process group."})
            elif self.path == "/update_weights_from_distributed" and state.args.join_groups:
                with state.lock:
                    state.num_buckets += 1
                    count = state.num_buckets
                if count == state.args.die_on_bucket:
                    os._exit(3)
                if count == state.args.hang_on_bucket:
                    os.kill(os.getpid(), signal.SIGSTOP)
                with state.update_lock:
                    success, message = state.receive(decoded)
                if success and decoded.weight_version is not None:
                    state.weight_version = decoded.weight_version
                self._send(200, {"success": success, "message": message})
            else:
                if getattr(decoded, "weight_version", None) is not None:
                    state.weight_version = decoded.weight_version
                if self.path == "/update_weights_from_disk":
                    state.num_updates += 1
                    if state.args.load_delay_s:
                        with state.lock:
                            state.loading += 1
                        time.sleep(state.args.load_delay_s)
                        with state.lock:
                            state.loading -= 1
                self._send(200, {"success": True, "message": "Succeeded to update model weights."})
        else:
            self._send(404, {"detail": "Not Found"})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port-file", required=True)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--mode", choices=MODES, default="ok")
    parser.add_argument("--delay-s", type=float, default=0.0)
    parser.add_argument("--die-after", type=int, default=0)
    parser.add_argument("--weight-version", default="default")
    parser.add_argument("--fail-updates", action="store_true")
    parser.add_argument("--log", default="")
    parser.add_argument("--join-groups", action="store_true")
    parser.add_argument("--die-on-bucket", type=int, default=0)
    parser.add_argument("--group-timeout-s", type=float, default=10.0)
    parser.add_argument("--weights-out", default="")
    parser.add_argument("--vocab-size", type=int, default=FAKE_VOCAB)
    parser.add_argument("--die-after-updates", type=int, default=0)
    parser.add_argument("--hang-on-bucket", type=int, default=0)
    parser.add_argument("--fail-begin", action="store_true")
    parser.add_argument("--load-delay-s", type=float, default=0.0)
    parser.add_argument("--tp-size", type=int, default=1)
    args = parser.parse_args()
    if args.join_groups:
        # Ready only once it can join a group at once (torch loaded), as a started SGLang server can: a first
        # join must not spend the client's admin timeout on an import.
        import pipeline.parallel.weight_transfer  # noqa: F401
    # SGLang's uvicorn listens with a backlog of 2048; the stdlib default of 5 resets connections
    # when the engine opens one per request in flight to a single server.
    ThreadingHTTPServer.request_queue_size = 256
    server = ThreadingHTTPServer(("127.0.0.1", args.port), _Handler)
    server.daemon_threads = True
    server.state = _State(args)  # type: ignore[attr-defined]
    port_file = Path(args.port_file)
    port_file.with_suffix(".tmp").write_text(str(server.server_address[1]))
    port_file.with_suffix(".tmp").rename(port_file)  # atomic: the parent never reads half a number
    server.serve_forever()


class FakeServer:
    """A fake SGLang server in a subprocess; ``url`` is set by ``wait_ready``."""

    def __init__(self, tmp_path: Path, name: str, *, mode: str = "ok", delay_s: float = 0.0, die_after: int = 0,
                 weight_version: str = "default", fail_updates: bool = False, join_groups: bool = False,
                 die_on_bucket: int = 0, group_timeout_s: float = 10.0, vocab_size: int = FAKE_VOCAB,
                 die_after_updates: int = 0, hang_on_bucket: int = 0, fail_begin: bool = False,
                 load_delay_s: float = 0.0, tp_size: int = 1) -> None:
        self.weights_path = tmp_path / f"{name}.weights.safetensors"
        self.port_file = tmp_path / f"{name}.port"
        self.log_path = tmp_path / f"{name}.jsonl"
        command = [
            sys.executable, "-m", "tests.rollout.fake_sglang",
            "--port-file", str(self.port_file),
            "--mode", mode,
            "--delay-s", str(delay_s),
            "--die-after", str(die_after),
            "--weight-version", weight_version,
            "--log", str(self.log_path),
            "--die-on-bucket", str(die_on_bucket),
            "--group-timeout-s", str(group_timeout_s),
            "--weights-out", str(self.weights_path),
            "--vocab-size", str(vocab_size),
            "--die-after-updates", str(die_after_updates),
            "--hang-on-bucket", str(hang_on_bucket),
            "--load-delay-s", str(load_delay_s),
            "--tp-size", str(tp_size),
        ] + (["--fail-updates"] if fail_updates else []) + (["--join-groups"] if join_groups else []) + (
            ["--fail-begin"] if fail_begin else [])
        self.name = name
        self.process = subprocess.Popen(command, cwd=REPO_ROOT, stdin=subprocess.DEVNULL)
        self.url = ""

    def wait_ready(self, timeout_s: float = 30.0) -> FakeServer:
        deadline = time.monotonic() + timeout_s
        while not self.port_file.exists():
            if self.process.poll() is not None:
                raise RuntimeError(f"fake server {self.name} exited with {self.process.returncode}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"fake server {self.name} did not start")
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{int(self.port_file.read_text())}"
        return self

    def weights(self) -> dict[str, Any]:
        """What the server received by broadcast, as of its last ``/end_weight_update``."""
        from safetensors.torch import load_file

        return load_file(str(self.weights_path))

    def generate_bodies(self) -> list[dict[str, Any]]:
        return [r["body"] for r in self.requests() if r["path"] == "/generate"]

    def requests(self) -> list[dict[str, Any]]:
        if not self.log_path.exists():
            return []
        return [json.loads(line) for line in self.log_path.read_text().splitlines() if line.strip()]

    def stop(self) -> None:
        """SIGSTOP: the process hangs; connections are still accepted by the kernel."""
        os.kill(self.process.pid, signal.SIGSTOP)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()  # SIGKILL also ends a stopped process
        self.process.wait(timeout=10)



def start_fake_servers(tmp_path: Path, configs: list[dict[str, Any]]) -> list[FakeServer]:
    """Start several fake servers in parallel (``configs`` are FakeServer keyword arguments)."""
    servers = [FakeServer(tmp_path, f"server{i}", **config) for i, config in enumerate(configs)]
    try:
        return [server.wait_ready() for server in servers]
    except BaseException:
        for server in servers:
            server.kill()
        raise


if __name__ == "__main__":
    main()
