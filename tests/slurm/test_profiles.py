"""Cluster profiles (pipeline.launch.slurm_profiles): no cluster needed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pipeline.configlib import ConfigError
from pipeline.errors import UserError
from pipeline.launch.slurm_profiles import (
    PROFILES_DIR,
    SlurmProfile,
    TunnelProfile,
    available_profiles,
    format_slurm_memory,
    load_profile,
    parse_slurm_memory_mib,
    parse_slurm_time,
)

REPO = Path(__file__).resolve().parents[2]

VALID = """\
description: a test cluster
partition: batch
account: null
nodes: 4
cpus_per_node: 64
mem_per_node: "1000G"
gpus_per_node: 8
time_limit: "04:00:00"
container_image: null
tunnel:
  kind: local
"""


def write(tmp_path: Path, text: str, name: str = "cluster.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_dev_profile_loads_by_name_and_by_path() -> None:
    expected = SlurmProfile(
        description="one-node SLURM cluster on this machine, started by slurm/dev-cluster.sh",
        partition="dev",
        account=None,
        nodes=1,
        cpus_per_node=8,
        mem_per_node="0",
        gpus_per_node=0,
        time_limit="00:30:00",
        container_image=None,
        container_mounts=[],
        slurm_conf="/tmp/winnow-slurm/slurm.conf",
        tunnel=TunnelProfile(kind="local", job_dir=None),
    )
    assert PROFILES_DIR == REPO / "slurm" / "profiles"
    assert "dev" in available_profiles()
    assert load_profile("dev") == expected
    assert load_profile(REPO / "slurm" / "profiles" / "dev.yaml") == expected
    assert expected.time_limit_s == 30 * 60


def test_dev_profile_matches_what_dev_cluster_sh_starts() -> None:
    # The profile describes the script's cluster; a rename on one side must fail here.
    script = (REPO / "slurm" / "dev-cluster.sh").read_text()
    profile = load_profile("dev")
    assert f"PartitionName={profile.partition} " in script
    state_dir = re.search(r"STATE_DIR=\$\{WINNOW_SLURM_STATE_DIR:-([^}]+)\}", script).group(1)
    assert profile.slurm_conf == f"{state_dir}/slurm.conf"
    # Partition, nodes and CPUs are checked against a running cluster in test_dev_cluster.py.
    # The node's memory is 90% of whatever this machine has: the profile asks for all of it, not a size.
    assert "RealMemory=$(node_memory_mb)" in script and "MemTotal" in script
    assert profile.mem_per_node == "0" and profile.mem_per_node_mib is None


def test_every_repository_profile_loads_and_the_h100_example_takes_whole_nodes() -> None:
    profiles = {name: load_profile(name) for name in available_profiles()}
    assert {"dev", "h100-example"} <= set(profiles)
    h100 = profiles["h100-example"]
    assert (h100.cpus_per_node, h100.mem_per_node, h100.gpus_per_node, h100.exclusive) == (112, "0", 8, True)


def test_full_ssh_profile(tmp_path: Path) -> None:
    text = VALID.replace("container_image: null", "container_image: nvcr.io/nvidia/pytorch:25.01-py3\n"
                         "container_mounts: [/lustre:/lustre]").replace(
        "tunnel:\n  kind: local\n",
        "tunnel:\n  kind: ssh\n  host: login.example.org\n  user: alice\n  port: 2222\n"
        "  identity: ~/.ssh/id_ed25519\n  job_dir: /lustre/alice/winnow-jobs\n",
    ).replace("account: null", "account: llm_rl")
    profile = load_profile(write(tmp_path, text))
    assert profile.account == "llm_rl"
    assert profile.container_mounts == ["/lustre:/lustre"]
    assert profile.tunnel == TunnelProfile(
        kind="ssh", host="login.example.org", user="alice", port=2222,
        identity="~/.ssh/id_ed25519", job_dir="/lustre/alice/winnow-jobs",
    )
    assert profile.time_limit_s == 4 * 3600


@pytest.mark.parametrize(
    "old, new, message",
    [
        # unknown keys, top level and nested
        ("partition: batch", "partiton: batch", r"unknown option partiton; known options here: account, "),
        ("  kind: local", "  kind: local\n  hostname: x", r"unknown option tunnel\.hostname; known options here: "),
        # wrong types: nothing is coerced
        ("nodes: 4", 'nodes: "4"', r"nodes: expected an integer, got '4'"),
        ("gpus_per_node: 8", "gpus_per_node: 8.0", r"gpus_per_node: expected an integer, got 8\.0"),
        ("account: null", "account: 7", r"account: 7 is not str or null"),
        ("partition: batch", "partition: [a, b]", r"partition: expected a string"),
        ("tunnel:\n  kind: local\n", "tunnel: local\n", r"tunnel: expected a TunnelProfile section \(a mapping\)"),
        # values out of range or not allowed
        ("nodes: 4", "nodes: 0", r"nodes: 0 is out of range; must be >= 1"),
        ("gpus_per_node: 8", "gpus_per_node: -1", r"gpus_per_node: -1 is out of range; must be >= 0"),
        ("  kind: local", "  kind: sshh", r"tunnel\.kind: 'sshh' is not allowed; expected one of 'local', 'ssh'"),
        ("partition: batch", 'partition: " "', r"partition: must not be empty"),
        ("account: null", 'account: ""', r"account: must not be empty; use null for no account"),
        # missing required fields, including an explicit-null one
        ("partition: batch\n", "", r"partition: required option is missing"),
        ("account: null\n", "", r"account: required option is missing"),
        ("tunnel:\n  kind: local\n", "", r"tunnel: required option is missing"),
        # tunnel consistency
        ("  kind: local", "  kind: ssh\n  user: alice\n  job_dir: /x", r"tunnel\.host: required when kind is 'ssh'"),
        ("  kind: local", "  kind: ssh\n  host: h\n  user: alice", r"tunnel\.job_dir: required when kind is 'ssh'"),
        ("  kind: local", "  kind: local\n  host: h", r"tunnel\.host: only valid when kind is 'ssh'"),
        ("  kind: local", "  kind: local\n  port: 22", r"tunnel\.port: only valid when kind is 'ssh'"),
        ("  kind: local", "  kind: ssh\n  host: h\n  user: u\n  job_dir: /x\n  port: 70000",
         r"tunnel\.port: 70000 is out of range; must be <= 65535"),
        # containers and time limits
        ("container_image: null", "container_image: null\ncontainer_mounts: [/a:/a]",
         r"container_mounts: given without container_image"),
        ('time_limit: "04:00:00"', 'time_limit: "4h"', r"time_limit: '4h' is not a SLURM time \(minutes, MM:SS, "),
        ('time_limit: "04:00:00"', 'time_limit: "00:75:00"', r"time_limit: '00:75:00' has minutes=75 in a HH:MM:SS"),
        ('time_limit: "04:00:00"', 'time_limit: "0"', r"time_limit: '0' is a zero time limit"),
        # YAML 1.1 reads unquoted 4:00:00 (no leading zero) as the base-60 integer 4 * 3600
        ('time_limit: "04:00:00"', "time_limit: 4:00:00", r"time_limit: got the number 14400; quote SLURM times"),
        ('time_limit: "04:00:00"', "time_limit: 240", r"time_limit: got the number 240; quote SLURM times"),
        # a node's memory: a quoted SLURM size, and "0" only where no job shares a GPU node
        ('mem_per_node: "1000G"\n', "", r"mem_per_node: required option is missing"),
        ('mem_per_node: "1000G"', 'mem_per_node: "2TB"', r"mem_per_node: '2TB' is not a SLURM memory size"),
        ('mem_per_node: "1000G"', 'mem_per_node: "1.5T"', r"mem_per_node: '1\.5T' is not a SLURM memory size"),
        ('mem_per_node: "1000G"', 'mem_per_node: "1000g"', r"mem_per_node: '1000g' is not a SLURM memory size"),
        ('mem_per_node: "1000G"', 'mem_per_node: "-1"', r"mem_per_node: '-1' is not a SLURM memory size"),
        ('mem_per_node: "1000G"', "mem_per_node: 512000", r"mem_per_node: got the number 512000; quote it"),
        ('mem_per_node: "1000G"', 'mem_per_node: "0"', r'mem_per_node: "0" \(all of a node\'s memory\) cannot be '
                                                      r"shared: GPU jobs that share a node \(exclusive: false\)"),
        ("gpus_per_node: 8", "gpus_per_node: 8\nexclusive: yes please", r"exclusive: expected true or false"),
        ("gpus_per_node: 8", "gpus_per_node: 0\nexclusive: true", r"exclusive: only GPU jobs take whole nodes, "
                                                                   r"and this cluster's nodes have no GPUs"),
    ],
)
def test_bad_profile_names_file_and_field(tmp_path: Path, old: str, new: str, message: str) -> None:
    assert old in VALID
    path = write(tmp_path, VALID.replace(old, new, 1))
    with pytest.raises(ConfigError) as caught:
        load_profile(path)
    assert str(caught.value).startswith(f"{path}: "), str(caught.value)
    assert re.search(message, str(caught.value)), str(caught.value)


def test_valid_fixture_itself_loads(tmp_path: Path) -> None:
    # Guards the parametrized cases above: each fails only because of its edit.
    profile = load_profile(write(tmp_path, VALID))
    assert (profile.partition, profile.nodes, profile.gpus_per_node, profile.tunnel.kind) == ("batch", 4, 8, "local")


@pytest.mark.parametrize(
    "text, exclusive, mib",
    [
        ('"0"', "true", None),  # all of a node's memory, on whole-node GPU jobs
        ('"1000G"', "false", 1000 * 1024),
        ('"512000"', "false", 512000),  # bare: MiB, as sbatch reads it
        ('"2T"', "false", 2 * 1024 * 1024),
        ('"1025K"', "false", 2),  # K rounds up to whole MiB
    ],
)
def test_node_memory_and_exclusive(tmp_path: Path, text: str, exclusive: str, mib: int | None) -> None:
    profile = load_profile(write(tmp_path, VALID.replace('"1000G"', text) + f"exclusive: {exclusive}\n"))
    assert (profile.mem_per_node, profile.mem_per_node_mib, profile.exclusive) == (
        text.strip('"'), mib, exclusive == "true")


def test_exclusive_defaults_to_shared_nodes(tmp_path: Path) -> None:
    assert load_profile(write(tmp_path, VALID)).exclusive is False


@pytest.mark.parametrize("mib, text", [(1024, "1G"), (88 * 1024, "88G"), (1536, "1536M"), (1, "1M")])
def test_memory_sizes_render_for_sbatch(mib: int, text: str) -> None:
    assert format_slurm_memory(mib) == text
    assert parse_slurm_memory_mib(text, field="mem") == mib


def test_missing_profile_names_path_and_lists_known(tmp_path: Path) -> None:
    write(tmp_path, VALID, name="alpha.yaml")
    write(tmp_path, VALID, name="beta.yaml")
    with pytest.raises(ConfigError, match=re.escape(f"{tmp_path}/gamma.yaml: cluster profile does not exist "
                                                    f"(profiles in {tmp_path}: alpha, beta)")):
        load_profile("gamma", profiles_dir=tmp_path)
    missing = tmp_path / "nested" / "nope.yaml"
    with pytest.raises(ConfigError, match=re.escape(f"{missing}: cluster profile does not exist")):
        load_profile(missing)


@pytest.mark.parametrize(
    "text, message",
    [
        ("partition: [unclosed\n", r": not valid YAML: "),
        ("- a\n- b\n", r": top level must be a mapping of profile fields, got list"),
        ("", r": top level must be a mapping of profile fields, got NoneType"),
    ],
)
def test_unreadable_profile_names_file(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=re.escape(str(path)) + message):
        load_profile(path)


def test_profile_errors_are_user_errors(tmp_path: Path) -> None:
    # The CLI prints UserErrors as one line without a traceback.
    with pytest.raises(UserError):
        load_profile(tmp_path / "absent.yaml")


@pytest.mark.parametrize(
    "text, seconds",
    [
        ("30", 30 * 60),
        ("90", 90 * 60),  # bare minutes may exceed an hour, as in sbatch --time
        ("45:30", 45 * 60 + 30),
        ("01:00:00", 3600),
        ("100:00:00", 100 * 3600),  # leading hours are unbounded too
        ("2-00", 2 * 86_400),
        ("1-02:03", 86_400 + 2 * 3600 + 3 * 60),
        ("1-02:03:04", 86_400 + 2 * 3600 + 3 * 60 + 4),
        ("0:30", 30),
    ],
)
def test_slurm_time_formats(text: str, seconds: int) -> None:
    assert parse_slurm_time(text, field="time_limit") == seconds


@pytest.mark.parametrize("text", ["", "1:2:3:4", "-1", "1-", "1-24", "1-02:60", "00:00:60", "1.5", " 30", "00:00"])
def test_bad_slurm_times(text: str) -> None:
    with pytest.raises(ConfigError, match=r"^time_limit: "):
        parse_slurm_time(text, field="time_limit")
