"""The rollout backends: one table, one entry per way of generating rollouts.

``rollout.engine`` names an entry. Each entry says what the rest of winnow asks of a backend,
and its own module (``RolloutBackend.module``, imported on first use) provides the engines:

* ``trainer_engine(cfg, *, spec, tokenizer, tokenizer_dir)``: global rank 0's engine in the RL
  loop, wrapped in its weight-sync transport (``pipeline.rollout.weight_sync``), built once per
  run from the run's ``rollout`` block;
* ``scoring_engine(rollout, policy, *, max_batch_rows, show_progress)``: the engine `winnow
  curate` and `winnow evaluate` sample one fixed policy with (``ScoredPolicy``;
  ``pipeline.eval.sharded.policy_engine``); ``scoring_loads_weights`` says whether it needs the
  policy's weights in the stage's process (else the stage loads only its tokenizer and config);
* ``serve_arguments(launch)``, for a backend that generates in servers of its own (``servers``):
  the flags of one server of a rollout node; ``ServerPrograms`` names the programs that serve
  it (a campaign's ``resources.rollout.server``: SGLang, or winnow's CPU stand-in speaking the
  same protocol) and the path that answers once a server is ready (the preflight's check).

Nothing outside this table and the backends' own modules branches on a backend's name. Adding
a backend: one entry here, its module, and its name in ``RolloutConfig.engine``'s literal
(docs/adding-a-backend.md).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from pipeline.configlib import ConfigError
from pipeline.registry import Registry
from pipeline.rollout.sglang.protocol import HEALTH_PATH

if TYPE_CHECKING:
    from pipeline.config import RolloutConfig
    from pipeline.models.spec import ModelSpec
    from pipeline.rollout.types import RolloutEngine
    from pipeline.rollout.weight_sync import SyncedEngine

__all__ = [
    "ROLLOUT_BACKENDS",
    "BackendModule",
    "RolloutBackend",
    "ScoredPolicy",
    "ServerLaunch",
    "ServerPrograms",
    "register_backend",
    "rollout_backend",
    "serving_backend",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class ScoredPolicy:
    """The fixed policy a scoring engine generates from (``pipeline.eval.sharded.policy_engine`` builds it)."""

    hf_model: Any  # its Hugging Face model in this process; None when the stage loaded no weights
    eos_token_ids: tuple[int, ...]  # the stop tokens (``pipeline.eval.sharded.stop_token_ids``)
    pad_token_id: int | None
    # The Hugging Face folder servers load the policy from, exported on the first call (a winnow checkpoint
    # is converted once); None where the caller has none to give.
    served_folder: Callable[[], Path] | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class ServerLaunch:
    """One server of a rollout node, as the serve role starts it (``pipeline.launch.task.server_commands``)."""

    python: str
    model_path: str  # the Hugging Face folder it loads at start
    tokenizer: str
    host: str  # the node's own name: the address in the URLs the trainer uses
    port: int
    tensor_parallel: int  # its GPUs
    base_gpu_id: int  # the first of them
    max_running_requests: int  # sequences it runs at once: the client's per-server limit too
    extra_args: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class ServerPrograms:
    """How a backend's servers are started and found ready."""

    modules: Mapping[str, str]  # program name (``RolloutServers.server``) → the module `python -m` runs
    health_path: str  # answers GET with a 2xx status once a server takes requests


class BackendModule(Protocol):
    """What a backend's own module provides (``serve_arguments`` only with ``servers``)."""

    def trainer_engine(self, cfg: RolloutConfig, *, spec: ModelSpec, tokenizer: Any,
                       tokenizer_dir: Path) -> SyncedEngine: ...

    def scoring_engine(self, rollout: RolloutConfig, policy: ScoredPolicy, *, max_batch_rows: int,
                       show_progress: bool) -> RolloutEngine: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutBackend:
    """One entry of ``ROLLOUT_BACKENDS`` (see the module docstring)."""

    name: str
    module: str  # the backend's own module: trainer_engine, scoring_engine (and serve_arguments)
    scoring_loads_weights: bool  # the scoring engine needs the policy's weights in the stage's process
    servers: ServerPrograms | None = None  # None: it generates in the trainer's (or the stage's) processes

    def implementation(self) -> BackendModule:
        return importlib.import_module(self.module)  # type: ignore[return-value]

    def trainer_engine(self, cfg: RolloutConfig, *, spec: ModelSpec, tokenizer: Any,
                       tokenizer_dir: Path) -> SyncedEngine:
        """Global rank 0's engine in the RL loop, wrapped in its weight-sync transport."""
        return self.implementation().trainer_engine(cfg, spec=spec, tokenizer=tokenizer, tokenizer_dir=tokenizer_dir)

    def scoring_engine(self, rollout: RolloutConfig, policy: ScoredPolicy, *, max_batch_rows: int = 256,
                       show_progress: bool = True) -> RolloutEngine:
        """The engine curation and evaluation sample ``policy`` with; the caller closes it."""
        return self.implementation().scoring_engine(rollout, policy, max_batch_rows=max_batch_rows,
                                                    show_progress=show_progress)

    def serve_command(self, program: str, launch: ServerLaunch) -> list[str]:
        """The argv of one server of a rollout node, run by ``program`` (one of ``servers.modules``)."""
        if self.servers is None:
            raise ConfigError(f"rollout.engine: {self.name} generates in the trainer's processes; it has no servers")
        if program not in self.servers.modules:
            raise ConfigError(f"resources.rollout.server: {program!r} does not serve the {self.name} backend; "
                              f"choose one of {sorted(self.servers.modules)}")
        arguments = self.implementation().serve_arguments(launch)  # type: ignore[attr-defined]
        return [launch.python, "-m", self.servers.modules[program], *arguments]


ROLLOUT_BACKENDS: Registry[RolloutBackend] = Registry("rollout backend")


def register_backend(backend: RolloutBackend) -> RolloutBackend:
    """Add ``backend`` to the table under its name."""
    return ROLLOUT_BACKENDS.add(backend.name, backend)


# A Hugging Face model in the trainer's process (CPU, tests; a process of its own at rollout.max_staleness=1).
register_backend(RolloutBackend(name="local", module="pipeline.rollout.local_backend", scoring_loads_weights=True))
# SGLang HTTP servers, started by a campaign's serve role (or by hand) and attached to by URL.
register_backend(RolloutBackend(
    name="sglang", module="pipeline.rollout.sglang.backend", scoring_loads_weights=False,
    servers=ServerPrograms(modules={"sglang": "sglang.launch_server", "standin": "pipeline.cli.standin"},
                           health_path=HEALTH_PATH),
))


def rollout_backend(name: str) -> RolloutBackend:
    """The entry ``rollout.engine`` names; an unknown name is a ``ConfigError`` listing the table's."""
    try:
        return ROLLOUT_BACKENDS.get(name)
    except ValueError as error:
        raise ConfigError(f"rollout.engine: {error}") from None


def serving_backend(program: str) -> RolloutBackend:
    """The backend whose servers ``program`` (a campaign's ``resources.rollout.server``) runs."""
    for backend in ROLLOUT_BACKENDS.values():
        if backend.servers is not None and program in backend.servers.modules:
            return backend
    programs = sorted(p for b in ROLLOUT_BACKENDS.values() if b.servers is not None for p in b.servers.modules)
    raise ConfigError(f"resources.rollout.server: no rollout backend is served by {program!r}; "
                      f"choose one of {programs}")
