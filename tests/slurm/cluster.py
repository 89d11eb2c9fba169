"""Driving a dev cluster (slurm/dev-cluster.sh) from tests: start, submit, wait, stop."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "slurm" / "dev-cluster.sh"
# Installing the Debian packages took ~20 s on our build machines; a slow mirror
# may take minutes. Bounds the script's `start` and every test's pytest-timeout,
# since the session fixture's setup counts against the first test that uses it.
START_BUDGET_S = 300
STOP_BUDGET_S = 120


def skip_reason() -> str | None:
    """Why the cluster tests cannot run here, or None (CI is root on Debian: they run)."""
    if os.geteuid() != 0:
        return "dev-cluster.sh must run as root (slurmd starts jobs as their submitters); CI runs as root"
    if not Path("/etc/debian_version").exists():
        return "dev-cluster.sh installs SLURM and munge with apt-get; this machine is not Debian"
    return None


def new_state_dir() -> Path:
    """A fresh state directory for a private cluster."""
    # Not under pytest's tmp_path: that is 0700 root, and munged runs as the
    # munge user, which must reach its key and socket inside the state directory.
    state_dir = Path(tempfile.mkdtemp(prefix="winnow-slurm-test-", dir="/tmp"))
    state_dir.chmod(0o755)
    return state_dir


def free_port_pair() -> int:
    """A port p such that p and p + 1 (slurmctld, slurmd) are free on 127.0.0.1.

    Drawn below the ephemeral range (32768+), where outgoing connections would
    otherwise take ports between this check and the daemons' bind.
    """
    rng = random.Random()
    for _ in range(100):
        port = rng.randrange(20_000, 30_000)
        try:
            with socket.socket() as first, socket.socket() as second:
                first.bind(("127.0.0.1", port))
                second.bind(("127.0.0.1", port + 1))
        except OSError:
            continue
        return port
    raise RuntimeError("found no two adjacent free ports in [20000, 30000) on 127.0.0.1")


def parse_scontrol_record(text: str) -> dict[str, str]:
    """``scontrol show -o`` output (one line of key=value tokens) as a dict."""
    record = {}
    for token in text.split():
        key, sep, value = token.partition("=")
        if sep:
            record.setdefault(key, value)
    return record


@dataclass
class DevCluster:
    """One cluster started by dev-cluster.sh, addressed through its own SLURM_CONF."""

    state_dir: Path
    port: int
    start_s: float = 0.0

    @property
    def slurm_conf(self) -> Path:
        return self.state_dir / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.slurm_conf)}

    def script(self, command: str, *, timeout_s: float) -> subprocess.CompletedProcess[str]:
        """Run ``dev-cluster.sh <command>`` for this cluster; never raises on exit status."""
        args = [str(SCRIPT), command, "--state-dir", str(self.state_dir)]
        if command == "start":
            args += ["--port", str(self.port)]
        return subprocess.run(args, capture_output=True, text=True, timeout=timeout_s, check=False)

    def start(self) -> subprocess.CompletedProcess[str]:
        began = time.monotonic()
        result = self.script("start", timeout_s=START_BUDGET_S)
        self.start_s = time.monotonic() - began
        return result

    def slurm(self, *args: str, cwd: Path | None = None, timeout_s: float = 30) -> str:
        """Run a SLURM client command against this cluster; its stdout."""
        result = subprocess.run(
            list(args), capture_output=True, text=True, env=self.env, cwd=cwd, timeout=timeout_s, check=False
        )
        if result.returncode != 0:
            raise AssertionError(f"{' '.join(args)} exited {result.returncode}:\n{result.stdout}{result.stderr}")
        return result.stdout

    def sbatch(self, script: str, *, cwd: Path, args: tuple[str, ...] = ()) -> int:
        """Submit a batch script (its text) from ``cwd``; the job id."""
        path = cwd / f"job-{time.monotonic_ns()}.sh"
        path.write_text(script)
        return int(self.slurm("sbatch", "--parsable", *args, str(path), cwd=cwd).strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job``: without accounting storage the only record of a
        job, kept for MinJobAge (600 s) after it ends."""
        return parse_scontrol_record(self.slurm("scontrol", "-o", "show", "job", str(job_id)))

    def wait_for_job(
        self, job_id: int, until: Callable[[dict[str, str]], bool], *, timeout_s: float, what: str
    ) -> dict[str, str]:
        """Poll the job's record until ``until(record)``; fail with the record and logs after ``timeout_s``.

        A failed ``scontrol`` call is retried until the deadline: on a loaded machine a poll
        sometimes dies (SIGPIPE from its connection to a busy slurmctld) while the job runs on.
        """
        deadline = time.monotonic() + timeout_s
        record: dict[str, str] = {}
        while True:
            try:
                record = self.job(job_id)
            except AssertionError as error:
                if time.monotonic() > deadline:
                    raise
                print(f"retrying a failed poll of job {job_id}: {error}")
            else:
                if until(record):
                    return record
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"job {job_id} not {what} after {timeout_s:.0f} s; last record:\n{record}\n{self.log_tails()}"
                )
            time.sleep(0.25)

    def cancel(self, *job_ids: int) -> None:
        subprocess.run(["scancel", *map(str, job_ids)], env=self.env, capture_output=True, timeout=30, check=False)

    def log_tails(self, num_lines: int = 30) -> str:
        parts = []
        for name in ("log/slurmctld.log", "log/slurmd.log"):
            path = self.state_dir / name
            if path.exists():
                tail = path.read_text(errors="replace").splitlines()[-num_lines:]
                parts.append(f"--- {path} (last {num_lines} lines) ---\n" + "\n".join(tail))
        return "\n".join(parts)

    def daemon_pids(self) -> dict[str, int | None]:
        """The pid of each daemon whose pid file names a live process of that name."""
        pid_files = {
            "munged": self.state_dir / "munge" / "munged.pid",
            "slurmctld": self.state_dir / "run" / "slurmctld.pid",
            "slurmd": self.state_dir / "run" / "slurmd.pid",
        }
        pids: dict[str, int | None] = {}
        for name, pid_file in pid_files.items():
            pids[name] = None
            if not pid_file.exists():
                continue
            pid = int(pid_file.read_text().strip())
            comm = Path(f"/proc/{pid}/comm")
            if comm.exists() and comm.read_text().strip() == name:
                pids[name] = pid
        return pids


def listening_addresses(port: int) -> set[str]:
    """Addresses with a TCP socket listening on ``port`` (from /proc/net/tcp and tcp6)."""
    addresses = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        path = Path(table)
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            local, state = fields[1], fields[3]
            address_hex, port_hex = local.split(":")
            if state != "0A" or int(port_hex, 16) != port:  # 0A: TCP_LISTEN
                continue
            assert len(address_hex) == width, line
            if width == 8:
                # IPv4 is stored as one little-endian 32-bit word.
                addresses.add(socket.inet_ntop(socket.AF_INET, bytes.fromhex(address_hex)[::-1]))
            else:
                # IPv6: four little-endian 32-bit words.
                raw = bytes.fromhex(address_hex)
                words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
                addresses.add(socket.inet_ntop(socket.AF_INET6, words))
    return addresses
