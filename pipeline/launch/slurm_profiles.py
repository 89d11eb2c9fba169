"""SLURM cluster profiles: one YAML file per cluster in ``slurm/profiles/``.

A profile says where a cluster's jobs go (partition, account), what one node
offers (CPUs, memory, GPUs, and whether GPU jobs take whole nodes), the default
time limit and container, and how to reach the cluster (a local tunnel on a login
node or the dev cluster, or SSH to a login node). It holds no job shape: nodes and
GPUs a job *uses* come from the recipe, bounded by the profile; the CPUs and
memory each job asks for follow from both (``pipeline.launch.nemo.job_resources``).
The schema is documented in ``slurm/README.md``; loading goes through
:mod:`pipeline.configlib`, so unknown keys, wrong types and values out of range
fail at load with the file and the dotted field in the message.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import yaml

from pipeline.configlib import ConfigError, from_dict, option

# The repository's profiles; absent when winnow is installed without its source tree.
PROFILES_DIR = Path(__file__).resolve().parents[2] / "slurm" / "profiles"

# SLURM's time formats (sbatch --time): minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS.
_TIME_FORMS = (
    (re.compile(r"(?P<minutes>\d+)"), "minutes"),
    (re.compile(r"(?P<minutes>\d+):(?P<seconds>\d+)"), "MM:SS"),
    (re.compile(r"(?P<hours>\d+):(?P<minutes>\d+):(?P<seconds>\d+)"), "HH:MM:SS"),
    (re.compile(r"(?P<days>\d+)-(?P<hours>\d+)"), "D-HH"),
    (re.compile(r"(?P<days>\d+)-(?P<hours>\d+):(?P<minutes>\d+)"), "D-HH:MM"),
    (re.compile(r"(?P<days>\d+)-(?P<hours>\d+):(?P<minutes>\d+):(?P<seconds>\d+)"), "D-HH:MM:SS"),
)
_TIME_FORMATS_HELP = "minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS"

# SLURM's memory sizes (sbatch --mem): an integer with an optional K, M, G or T suffix, M when
# bare; the units are binary (1G = 1024M). Zero means all of a node's memory.
_MEMORY_SIZE = re.compile(r"(?P<amount>\d+)(?P<unit>[KMGT]?)")
_KIB_PER_UNIT = {"K": 1, "": 1 << 10, "M": 1 << 10, "G": 1 << 20, "T": 1 << 30}
WHOLE_NODE_MEMORY = "0"


def parse_slurm_time(text: str, *, field: str) -> int:
    """Seconds in a SLURM time string; ConfigError naming ``field`` if malformed or zero.

    Components after the leading one must be below 60 (24 for hours after a day
    count): SLURM would accept ``0:75:00``, but in a profile it is a typo.
    """
    for pattern, form in _TIME_FORMS:
        match = pattern.fullmatch(text)
        if match is None:
            continue
        parts = {name: int(value) for name, value in match.groupdict().items()}
        leading = next(iter(parts))
        limits = {"hours": 24, "minutes": 60, "seconds": 60}
        for name, value in parts.items():
            if name != leading and value >= limits[name]:
                raise ConfigError(f"{field}: {text!r} has {name}={value} in a {form} time; must be < {limits[name]}")
        seconds = (
            parts.get("days", 0) * 86_400
            + parts.get("hours", 0) * 3_600
            + parts.get("minutes", 0) * 60
            + parts.get("seconds", 0)
        )
        if seconds == 0:
            raise ConfigError(f"{field}: {text!r} is a zero time limit")
        return seconds
    raise ConfigError(f"{field}: {text!r} is not a SLURM time ({_TIME_FORMATS_HELP})")


def parse_slurm_memory_mib(text: str, *, field: str) -> int:
    """MiB in a SLURM memory size (``"1900G"``, ``"512000"``); 0 for ``"0"``, all of a node's memory.

    ConfigError naming ``field`` for anything else (``"2TB"``, ``"1.5T"``, ``"-1"``, lowercase units).
    """
    match = _MEMORY_SIZE.fullmatch(text)
    if match is None:
        raise ConfigError(f"{field}: {text!r} is not a SLURM memory size (an integer with an optional K, M, G or "
                          f'T suffix, MiB when bare, e.g. "1900G"; "0" for all of a node\'s memory)')
    return -(-int(match["amount"]) * _KIB_PER_UNIT[match["unit"]] // 1024)  # K rounds up to whole MiB


def format_slurm_memory(mib: int) -> str:
    """A positive MiB count as an ``sbatch --mem`` value: whole GiB as ``<n>G``, else ``<n>M``."""
    assert mib > 0, mib
    return f"{mib // 1024}G" if mib % 1024 == 0 else f"{mib}M"


@dataclass(kw_only=True, slots=True)
class TunnelProfile:
    """How the launcher reaches the cluster's ``sbatch``: nemo-run's LocalTunnel or SSHTunnel."""

    kind: Literal["local", "ssh"] = option(
        help="local: SLURM commands run on this machine (a login node, the dev cluster); ssh: on a login node over SSH"
    )
    job_dir: str | None = option(
        None,
        help="ssh tunnels: cluster-side directory for job scripts and logs (local tunnels use <campaign>/launch)",
    )
    host: str | None = option(None, help="ssh: login node host name")
    user: str | None = option(None, help="ssh: user name on the login node")
    port: int | None = option(None, ge=1, le=65535, help="ssh: port (null: 22 or ~/.ssh/config)")
    identity: str | None = option(None, help="ssh: private key file (null: the SSH agent or default keys)")

    def __post_init__(self) -> None:
        if self.kind == "ssh":
            # A remote tunnel has no sensible default directory on the other side.
            for name in ("host", "user", "job_dir"):
                if not getattr(self, name):
                    raise ConfigError(f"{name}: required when kind is 'ssh'")
            return
        for name in ("host", "user", "port", "identity"):
            if getattr(self, name) is not None:
                raise ConfigError(f"{name}: only valid when kind is 'ssh' (kind is {self.kind!r})")


@dataclass(kw_only=True, slots=True)
class SlurmProfile:
    """One SLURM cluster: where jobs go, what a node offers, how to reach it."""

    description: str = option(help="one line: what this cluster is and who runs it")
    partition: str = option(help="partition jobs are submitted to (sbatch --partition)")
    account: str | None = option(help="account jobs are charged to (sbatch --account); null: none")
    nodes: int = option(ge=1, help="most nodes one job may use")
    cpus_per_node: int = option(
        ge=1, help="CPUs one node offers to a job, as SLURM counts them (hardware threads where ThreadsPerCore "
                   "is 2): what a job on all of a node's GPUs asks for (--cpus-per-task)"
    )
    mem_per_node: str = option(
        help='memory one node offers to a job, a SLURM size quoted in YAML ("1900G", "512000" MiB), or "0": all '
             "of the node's memory (sbatch --mem=0); a size lets a job on part of a node ask for its share"
    )
    gpus_per_node: int = option(ge=0, help="GPUs one node offers to a job (0: a CPU-only cluster)")
    exclusive: bool = option(
        False, help="GPU jobs take whole nodes (sbatch --exclusive, all of a node's CPUs and memory), even a "
                    "one-GPU job; false: a GPU job asks for its GPUs' share of the node's CPUs and memory"
    )
    time_limit: str = option(help=f"default wall-clock limit of a job, quoted in YAML ({_TIME_FORMATS_HELP})")
    container_image: str | None = option(help="pyxis container image jobs run in (null: on the host, no pyxis needed)")
    container_mounts: list[str] = option(
        default_factory=list, help="pyxis mounts, src:dst[:flags] (only with container_image)"
    )
    slurm_conf: str | None = option(
        None, help="SLURM_CONF for the SLURM commands the launcher runs (null: the cluster's default config)"
    )
    tunnel: TunnelProfile = option(help="how the launcher reaches the cluster")
    python: str = option("python", help="the interpreter with winnow installed, on the nodes or in the container")
    workdir: str | None = option(
        None, help="winnow's checkout on the nodes or in the container (null: the launching checkout, local tunnels)"
    )
    env: dict[str, str] = option(default_factory=dict, help="environment variables exported in every job")
    srun_args: list[str] = option(
        default_factory=list, help="extra srun flags of every task, e.g. pyxis' --container-writable"
    )
    signal_s: int = option(
        300, ge=60, help="rl jobs get SIGUSR1 this many seconds before their time limit, checkpoint and requeue"
    )

    def __post_init__(self) -> None:
        for name in ("description", "partition"):
            if not getattr(self, name).strip():
                raise ConfigError(f"{name}: must not be empty")
        if self.account is not None and not self.account.strip():
            raise ConfigError("account: must not be empty; use null for no account")
        parse_slurm_time(self.time_limit, field="time_limit")
        parse_slurm_memory_mib(self.mem_per_node, field="mem_per_node")
        if self.exclusive and self.gpus_per_node == 0:
            raise ConfigError("exclusive: only GPU jobs take whole nodes, and this cluster's nodes have no GPUs "
                              "(gpus_per_node: 0)")
        if self.gpus_per_node > 0 and not self.exclusive and self.mem_per_node_mib is None:
            raise ConfigError('mem_per_node: "0" (all of a node\'s memory) cannot be shared: GPU jobs that share '
                              "a node (exclusive: false) ask for their GPUs' share of it; give the node's memory "
                              'as a size (e.g. "1900G") or set exclusive: true')
        if self.container_mounts and self.container_image is None:
            raise ConfigError("container_mounts: given without container_image")

    @property
    def time_limit_s(self) -> int:
        return parse_slurm_time(self.time_limit, field="time_limit")

    @property
    def mem_per_node_mib(self) -> int | None:
        """A node's memory in MiB, or None when the profile says ``"0"`` (all of it, size unstated)."""
        return parse_slurm_memory_mib(self.mem_per_node, field="mem_per_node") or None


def available_profiles(profiles_dir: Path = PROFILES_DIR) -> list[str]:
    """Names of the profiles in ``profiles_dir`` (file names without ``.yaml``)."""
    return sorted(path.stem for path in profiles_dir.glob("*.yaml"))


def profile_path(name_or_path: str | Path, *, profiles_dir: Path = PROFILES_DIR) -> Path:
    """A bare name (``dev``) means ``profiles_dir/dev.yaml``; anything path-like is used as is."""
    text = str(name_or_path)
    if "/" in text or text.endswith((".yaml", ".yml")):
        return Path(text)
    return profiles_dir / f"{text}.yaml"


def load_profile(name_or_path: str | Path, *, profiles_dir: Path = PROFILES_DIR) -> SlurmProfile:
    """Load and validate a profile; every ConfigError message starts with the file's path."""
    path = profile_path(name_or_path, profiles_dir=profiles_dir)
    try:
        text = path.read_text()
    except FileNotFoundError:
        known = ", ".join(available_profiles(profiles_dir)) or "none"
        raise ConfigError(f"{path}: cluster profile does not exist (profiles in {profiles_dir}: {known})") from None
    except OSError as error:
        raise ConfigError(f"{path}: cannot read cluster profile: {error.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML: {error}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of profile fields, got {type(data).__name__}")
    if isinstance(data.get("time_limit"), int) and not isinstance(data["time_limit"], bool):
        # YAML 1.1 reads unquoted 4:00:00 as the base-60 integer 14400, and a bare
        # number is ambiguous (SLURM reads minutes): both must be written as strings.
        raise ConfigError(
            f"{path}: time_limit: got the number {data['time_limit']}; quote SLURM times in YAML "
            f'(time_limit: "4:00:00"): unquoted H:M:S without a leading zero reads as a base-60 integer'
        )
    if isinstance(data.get("mem_per_node"), int) and not isinstance(data["mem_per_node"], bool):
        # A bare YAML number would be MiB to SLURM and GiB to most readers: it must be a quoted size.
        raise ConfigError(
            f"{path}: mem_per_node: got the number {data['mem_per_node']}; quote it with its unit "
            f'(mem_per_node: "1900G"), or "0" for all of a node\'s memory'
        )
    try:
        return from_dict(SlurmProfile, data)
    except ConfigError as error:
        raise ConfigError(f"{path}: {error}") from None
