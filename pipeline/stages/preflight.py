"""Validate before spending: every input of a stage is checked before any training or generation.

A stage that trains the bootstrap policy for minutes and then finds its data file missing
has wasted those minutes; on a cluster it has also wasted the queue wait. ``preflight(cfg)``
runs the checks registered for the config's type and raises one ``PreflightError`` listing
every problem (each names the input: the dotted config field or the flag), so the user
fixes them all at once. The CLI calls it once before a stage runs
(``pipeline.cli.common.run_handler`` prints each problem as an ``error:`` line, exit 2), and
a campaign runner calls it before each stage, once the stages it depends on are done.

Every check is cheap and read-only; nothing here creates a file or a folder:

* a data source: the spec parses, and the first ``PREFLIGHT_ROWS`` prompts load (a file is
  opened and its first rows parsed; a synthetic source generates that many; a benchmark
  reads its first rows), with the split and bad-row policy the stage will use;
* a policy: ``resolve_checkpoint`` (it hashes only the files under
  ``artifact.HASHED_FILE_LIMIT``: manifests and small shards, so a 7B checkpoint is checked
  by sizes in well under a second) or a Hugging Face folder, and its tokenizer is found by
  the same lookup the stage uses;
* an output folder: it, or its nearest existing ancestor, is a folder this process may
  write into;
* rollout servers: each answers ``GET /health`` within ``SERVER_TIMEOUT_S``;
* a generation length: ``max_new_tokens`` leaves at least one of the policy's positions for the
  prompt (``config.json``'s ``max_position_embeddings``, a checkpoint's spec, or the bootstrap's
  ``model`` section); curation and evaluation would otherwise drop every prompt as too long.
  Only this certain failure is refused here: ``winnow plan`` and ``winnow launch`` also ask room
  for a whole prompt (``pipeline.launch.plan.context_problem``).

The checks are picked by the config's type from ``PREFLIGHTS`` (``register_preflight``); a
type with no entry has nothing to check. Checks return informational notes (the cache root a
stage will use) for the caller to print. A campaign checks its later stages up front too:
``produced`` says which paths earlier stages will create (a policy, a curation), and those
inputs are left for the check that runs before the stage itself.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.config import (
    BootstrapConfig,
    CurateConfig,
    DemoConfig,
    EvaluateConfig,
    RLConfig,
    TrainEstimatorConfig,
)
from pipeline.errors import UserError
from pipeline.io import CACHE_ENV, cache_root, resolve_cache_dir

__all__ = [
    "PREFLIGHTS",
    "PREFLIGHT_ROWS",
    "SERVER_TIMEOUT_S",
    "CheckpointInputs",
    "DataInspectInputs",
    "HfFolderInputs",
    "Preflight",
    "PreflightError",
    "StatsInputs",
    "preflight",
    "register_preflight",
]

PREFLIGHT_ROWS = 4  # prompts read per data source: enough to catch a wrong format or field mapping
SERVER_TIMEOUT_S = 5.0  # a server that does not answer /health in this long is not ready for rollouts


class PreflightError(UserError):
    """One or more inputs of a stage are missing or malformed; ``problems`` holds one line per input."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = list(problems)


def _nothing_produced(path: Path) -> bool:
    return False


@dataclass(slots=True)
class Preflight:
    """What the checks of one stage found: ``problems`` (each names its input) and ``notes`` to print.

    ``produced(path)``: true for a path an earlier stage of the same campaign will create; an
    input there is not checked yet.
    """

    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    produced: Callable[[Path], bool] = _nothing_produced

    def problem(self, name: str, message: str) -> None:
        self.problems.append(f"{name}: {message}")


Check = Callable[[Any, Preflight], None]
PREFLIGHTS: dict[type, Check] = {}


def register_preflight(config_type: type) -> Callable[[Check], Check]:
    """Register ``check(cfg, found)`` as the preflight of ``config_type`` (one per type)."""

    def register(check: Check) -> Check:
        if config_type in PREFLIGHTS:
            raise ValueError(f"{config_type.__name__} already has a preflight check")
        PREFLIGHTS[config_type] = check
        return check

    return register


def preflight(cfg: Any, *, produced: Callable[[Path], bool] = _nothing_produced) -> list[str]:
    """Run the checks registered for ``type(cfg)``; raise ``PreflightError`` on any problem, else return the notes.

    ``produced``: see ``Preflight``; a campaign runner checking the stage it is about to
    run passes nothing (by then every input must exist).
    """
    check = PREFLIGHTS.get(type(cfg))
    found = Preflight(produced=produced)
    if check is not None:
        check(cfg, found)
    if found.problems:
        raise PreflightError(found.problems)
    return found.notes


# ================================================================ the checks of one input


def _message(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0] if isinstance(error, UserError) else text.replace("\n", " ")


def check_source(found: Preflight, name: str, spec: str, *, split: str | None = None,
                 on_bad_row: str = "fail", max_field_chars: int | None = None, spec_split_wins: bool = False) -> None:
    """``spec`` parses and its first ``PREFLIGHT_ROWS`` prompts load.

    ``split``: the split the stage passes (``None`` for files); ``spec_split_wins``: the
    stage passes no split when the spec names its own (the RL held-out set, evaluation).
    """
    from pipeline.data import load_prompts, parse_spec

    if found.produced(Path(spec)) and not Path(spec).exists():
        return  # a file an earlier stage writes (a curation's kept prompts)
    try:
        parsed = parse_spec(spec)
        if parsed.kind == "file" or (spec_split_wins and parsed.split is not None):
            split = None
        options = {} if max_field_chars is None else {"max_field_chars": max_field_chars}
        _, report = load_prompts(parsed, split=split, limit=PREFLIGHT_ROWS, on_bad_row=on_bad_row, **options)
    except (ValueError, OSError, UnicodeError) as error:
        found.problem(name, _message(error))
        return
    except Exception as error:  # pyarrow raises its own types for a corrupt Parquet file
        if type(error).__module__.startswith("pyarrow"):
            found.problem(name, f"{spec}: not a readable Parquet file ({_message(error)})")
            return
        raise
    if parsed.kind == "file" and report.num_rows == 0:
        found.problem(name, f"{spec} holds no rows")


def check_sources(found: Preflight, name: str, specs: Iterable[str], **options: Any) -> None:
    specs = list(specs)
    if not specs:
        found.problem(name, "needs at least one source")
    for index, spec in enumerate(specs):
        check_source(found, f"{name}[{index}]", spec, **options)


def check_writable(found: Preflight, name: str, path: str | os.PathLike[str]) -> None:
    """``path`` is a folder this process may create files in, or can be created (nothing is created here)."""
    folder = Path(path).expanduser()
    if folder.exists() and not folder.is_dir():
        found.problem(name, f"{folder} exists and is not a folder")
        return
    existing = folder
    while not existing.exists():
        if existing.parent == existing:
            break
        existing = existing.parent
    if not existing.is_dir():
        found.problem(name, f"{folder} cannot be created: {existing} is not a folder")
    elif not os.access(existing, os.W_OK | os.X_OK):
        found.problem(name, f"{folder} is not writable ({existing} does not let this user create files)")


def check_generation(found: Preflight, name: str, max_new_tokens: int, *, positions: int | None, model: str) -> None:
    """``max_new_tokens`` (option ``name``) leaves a position for the prompt in ``model``'s ``positions``."""
    if positions is not None and max_new_tokens >= positions:
        found.problem(name, f"{max_new_tokens} new tokens leave no room for a prompt in the {positions} positions of "
                            f"{model}; every prompt would be dropped as too long (lower {name} to leave the prompt "
                            "its positions)")


def _hf_positions(folder: Path) -> int | None:
    """``max_position_embeddings`` of a Hugging Face folder's ``config.json`` (None: not stated or unreadable)."""
    import json

    try:
        value = json.loads((folder / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) else None


def check_policy(found: Preflight, name: str, path: str | None, *, tokenizer: str | None = None,
                 tokenizer_name: str = "tokenizer", generates: tuple[str, int] | None = None) -> None:
    """``path`` is a Hugging Face folder or a winnow checkpoint (a run, a step, a bootstrap cache entry), with a
    tokenizer.

    ``generates``: (option, value) of the stage's ``max_new_tokens``, checked against the policy's
    positions (``check_generation``).
    """
    from pipeline.checkpoint.artifact import (
        checkpoint_spec,
        find_tokenizer_dir,
        is_hf_folder,
        resolve_checkpoint,
        tokenizer_candidates,
    )

    if not path:
        found.problem(name, "required: a Hugging Face folder or a winnow checkpoint directory")
        return
    folder = Path(path).expanduser()
    if found.produced(folder):
        return
    if not folder.is_dir():
        found.problems.append(f"{name} {folder} does not exist or is not a folder")  # as the stage would say it
        return
    if is_hf_folder(folder):
        candidates = [folder]
        positions = _hf_positions(folder)
    else:
        nested = folder / "checkpoints"  # a bootstrap cache entry keeps its run one level down
        run_dir = nested if nested.is_dir() and not (folder / "manifest.json").is_file() \
            and not (folder / "latest").is_file() else folder
        try:
            step_dir = resolve_checkpoint(run_dir)
            candidates = tokenizer_candidates(step_dir)
            positions = checkpoint_spec(step_dir).max_position_embeddings
        except UserError as error:
            found.problem(name, f"{folder} is not a Hugging Face folder (no config.json with weights) and not a "
                                f"usable winnow checkpoint: {_message(error)}")
            return
    if generates is not None:
        check_generation(found, generates[0], generates[1], positions=positions, model=f"{name}={folder}")
    try:
        located = find_tokenizer_dir(tokenizer, candidates=candidates)
    except UserError as error:
        found.problem(tokenizer_name, _message(error))
        return
    if located is None:
        found.problem(tokenizer_name, f"no tokenizer files next to {name}={folder} (looked in "
                                      f"{', '.join(map(str, candidates))}); set {tokenizer_name}=DIR")


def check_servers(found: Preflight, name: str, urls: Iterable[str], *, health_path: str) -> None:
    """Every URL answers ``GET health_path`` with a 2xx status within ``SERVER_TIMEOUT_S``."""
    import httpx

    for url in urls:
        try:
            response = httpx.get(url.rstrip("/") + health_path, timeout=SERVER_TIMEOUT_S)
        except httpx.HTTPError as error:
            found.problem(name, f"{url} does not answer {health_path} ({type(error).__name__}: {error})")
            continue
        if not response.is_success:
            found.problem(name, f"{url}{health_path} answered HTTP {response.status_code}; the server is not ready")


def check_trackers(found: Preflight, name: str, trackers: Iterable[str]) -> None:
    """Each experiment tracker's library is installed (found, not imported: wandb and mlflow take seconds)."""
    import importlib.util

    for tracker in trackers:
        if importlib.util.find_spec(tracker) is None:
            found.problem(name, f"{tracker} is not installed; pip install 'winnow[tracking]'")


def check_curation(found: Preflight, name: str, path: str | None) -> None:
    """``path`` is a finished `winnow curate` output folder (its manifest is written last)."""
    if not path:
        found.problem(name, "required: the output_dir of a finished `winnow curate`")
    elif found.produced(Path(path)):
        return
    elif not Path(path).is_dir():
        found.problem(name, f"{path} does not exist or is not a folder")
    elif not (Path(path) / "manifest.json").is_file():
        found.problem(name, f"{path}: no complete curation here (manifest.json is missing; run `winnow curate` "
                            "to finish it)")


def check_cache(found: Preflight, name: str, cache_dir: str) -> None:
    folder = resolve_cache_dir(cache_dir)
    check_writable(found, name, folder)
    origin = f"${CACHE_ENV}" if os.environ.get(CACHE_ENV, "").strip() else "the user cache folder"
    where = "an absolute path" if Path(cache_dir).expanduser().is_absolute() else f"cache root {cache_root()}, {origin}"
    found.notes.append(f"{name}: {folder} ({where})")


# ================================================================ stage configs


@register_preflight(BootstrapConfig)
def _bootstrap(cfg: BootstrapConfig, found: Preflight, prefix: str = "") -> None:
    check_sources(found, f"{prefix}sources", cfg.sources, split="train")
    check_cache(found, f"{prefix}cache_dir", cfg.cache_dir)


@register_preflight(RLConfig)
def _rl(cfg: RLConfig, found: Preflight) -> None:
    data = cfg.data
    check_sources(found, "data.train", data.train, split=data.split, on_bad_row=data.on_bad_row,
                  max_field_chars=data.max_field_chars)
    check_source(found, "eval_set", cfg.eval_set, split="test", spec_split_wins=True)
    if cfg.policy is None:
        _bootstrap(cfg.bootstrap, found, prefix="bootstrap.")
        check_generation(found, "max_new_tokens", cfg.max_new_tokens,
                         positions=cfg.bootstrap.model.max_position_embeddings, model="the bootstrap policy")
    else:
        check_policy(found, "policy", cfg.policy, tokenizer=cfg.tokenizer,
                     generates=("max_new_tokens", cfg.max_new_tokens))
    if cfg.curation_dir is not None:
        check_curation(found, "curation_dir", cfg.curation_dir)
    estimator_dir = cfg.algorithm.depo.estimator_dir
    if (cfg.algorithm.prompt_filter == "depo" and estimator_dir is not None and not found.produced(Path(estimator_dir))
            and not Path(estimator_dir).is_dir()):
        found.problem("algorithm.depo.estimator_dir", f"{estimator_dir} does not exist or is not a folder")
    check_writable(found, "logging.output_dir", cfg.logging.output_dir)
    check_writable(found, "checkpoint.directory", cfg.checkpoint.directory)
    check_trackers(found, "logging.trackers", cfg.logging.trackers)
    from pipeline.rollout.backends import rollout_backend

    servers = rollout_backend(cfg.rollout.engine).servers
    if servers is not None:
        if cfg.rollout.weights_dir is not None:
            check_writable(found, "rollout.weights_dir", cfg.rollout.weights_dir)
        check_servers(found, "rollout.servers", cfg.rollout.servers, health_path=servers.health_path)


@register_preflight(CurateConfig)
def _curate(cfg: CurateConfig, found: Preflight) -> None:
    check_sources(found, "sources", cfg.sources, split=cfg.split, on_bad_row=cfg.on_bad_row)
    check_policy(found, "policy", cfg.policy, tokenizer=cfg.tokenizer, generates=("max_new_tokens", cfg.max_new_tokens))
    check_writable(found, "output_dir", cfg.output_dir)


@register_preflight(TrainEstimatorConfig)
def _train_estimator(cfg: TrainEstimatorConfig, found: Preflight) -> None:
    check_curation(found, "curation_dir", cfg.curation_dir)
    if cfg.encoder == "minilm":
        check_cache(found, "cache_dir", cfg.cache_dir)
    check_writable(found, "output_dir", cfg.output_dir)


@register_preflight(EvaluateConfig)
def _evaluate(cfg: EvaluateConfig, found: Preflight) -> None:
    check_policy(found, "policy", cfg.policy, tokenizer=cfg.tokenizer,
                 generates=("eval.max_new_tokens", cfg.eval.max_new_tokens))
    check_sources(found, "eval.benchmarks", cfg.eval.benchmarks, split=cfg.eval.split, spec_split_wins=True)
    check_writable(found, "output_dir", cfg.output_dir)


@register_preflight(DemoConfig)
def _demo(cfg: DemoConfig, found: Preflight) -> None:
    check_sources(found, "benchmarks", cfg.benchmarks, split="test", spec_split_wins=True)
    check_writable(found, "output_dir", cfg.output_dir)


# ================================================================ commands whose inputs are flags


@dataclass(frozen=True, kw_only=True, slots=True)
class DataInspectInputs:
    """`winnow data inspect SOURCE`: the source and how the command reads it."""

    source: str
    split: str | None
    on_bad_row: str
    max_field_chars: int


@register_preflight(DataInspectInputs)
def _data_inspect(inputs: DataInspectInputs, found: Preflight) -> None:
    check_source(found, "source", inputs.source, split=inputs.split, on_bad_row=inputs.on_bad_row,
                 max_field_chars=inputs.max_field_chars)


@dataclass(frozen=True, kw_only=True, slots=True)
class HfFolderInputs:
    """`winnow convert hf-to-megatron`: a Hugging Face folder in, a run folder out."""

    hf: str
    out: str


@register_preflight(HfFolderInputs)
def _hf_to_megatron(inputs: HfFolderInputs, found: Preflight) -> None:
    from pipeline.checkpoint.artifact import is_hf_folder

    if not is_hf_folder(Path(inputs.hf)):
        found.problem("--hf", f"{inputs.hf} is not a Hugging Face model folder (config.json beside its weights)")
    check_writable(found, "--out", Path(inputs.out).parent)


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointInputs:
    """`winnow convert megatron-to-hf` (and a campaign's export): a winnow checkpoint in, a folder out."""

    checkpoint: str
    out: str
    tokenizer: str | None = None
    step: int | None = None


@register_preflight(CheckpointInputs)
def _megatron_to_hf(inputs: CheckpointInputs, found: Preflight) -> None:
    from pipeline.checkpoint.artifact import find_tokenizer_dir, resolve_checkpoint, tokenizer_candidates

    check_writable(found, "--out", Path(inputs.out).parent)
    if found.produced(Path(inputs.checkpoint)):
        return
    try:
        step_dir = resolve_checkpoint(inputs.checkpoint, step=inputs.step)
    except UserError as error:
        found.problem("--ckpt", _message(error))
    else:
        try:  # none found is fine: the export then holds the weights only
            find_tokenizer_dir(inputs.tokenizer, candidates=tokenizer_candidates(step_dir))
        except UserError as error:
            found.problem("--tokenizer", _message(error))


@dataclass(frozen=True, kw_only=True, slots=True)
class StatsInputs:
    """`winnow stats show RUN`: a run folder holding the statistics store, or the Parquet file."""

    run: str
    stats_file: str


@register_preflight(StatsInputs)
def _stats(inputs: StatsInputs, found: Preflight) -> None:
    path = Path(inputs.run)
    if path.is_dir():
        path = path / inputs.stats_file
    if not path.is_file():
        found.problem("RUN", f"{inputs.run}: no such run directory or stats file"
                             if not Path(inputs.run).is_dir() else
                             f"{inputs.run}: no {inputs.stats_file} in this run directory (the RL stage writes it "
                             "at the end)")
        return
    import pyarrow.parquet as pq

    try:
        pq.read_schema(path)
    except Exception as error:  # pyarrow's ArrowInvalid and OSError: not a Parquet file
        found.problem("RUN", f"{path} is not a readable Parquet file ({_message(error)})")
