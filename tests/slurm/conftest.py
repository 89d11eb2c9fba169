"""A real one-node SLURM cluster for the tests of this directory.

The session fixture starts a private cluster with ``slurm/dev-cluster.sh``, in
its own state directory on its own ports, so a developer's running dev cluster
is neither reused nor stopped; it stops the cluster at the end of the session.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from tests.slurm.cluster import STOP_BUDGET_S, DevCluster, free_port_pair, new_state_dir, skip_reason


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[DevCluster]:
    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)
    cluster = DevCluster(state_dir=new_state_dir(), port=free_port_pair())
    started = cluster.start()
    if started.returncode != 0:
        cluster.script("stop", timeout_s=STOP_BUDGET_S)
        pytest.fail(
            f"dev-cluster.sh start exited {started.returncode} after {cluster.start_s:.1f} s:\n{started.stderr}",
            pytrace=False,
        )
    # The script's contract: its only stdout line is the one users eval.
    assert started.stdout == f"export SLURM_CONF={cluster.slurm_conf}\n", started.stdout
    print(f"\ndev cluster in {cluster.state_dir} started in {cluster.start_s:.1f} s")
    yield cluster
    stopped = cluster.script("stop", timeout_s=STOP_BUDGET_S)
    assert stopped.returncode == 0, f"dev-cluster.sh stop exited {stopped.returncode}:\n{stopped.stderr}"
    assert cluster.daemon_pids() == {"munged": None, "slurmctld": None, "slurmd": None}
    shutil.rmtree(cluster.state_dir)


@pytest.fixture
def launch_profile(slurm_cluster: DevCluster):
    """The dev profile pointed at the session's cluster, this interpreter and this checkout."""
    import dataclasses
    import sys

    from pipeline.launch.slurm_profiles import load_profile
    from tests.slurm.cluster import REPO

    return dataclasses.replace(load_profile("dev"), slurm_conf=str(slurm_cluster.slurm_conf), python=sys.executable,
                               workdir=str(REPO))


@pytest.fixture
def launch_profile_file(launch_profile, tmp_path_factory: pytest.TempPathFactory):
    """``launch_profile`` as a profile file, for ``winnow launch ... --profile FILE``."""
    from pipeline import configlib

    path = tmp_path_factory.mktemp("profiles") / "session-dev.yaml"
    path.write_text(configlib.dump_yaml(launch_profile))
    return path


@pytest.fixture(autouse=True)
def _no_stdin(monkeypatch):
    """nemo-run's shell calls read stdin; under pytest it is captured."""
    import sys

    monkeypatch.setattr(sys, "stdin", open("/dev/null"))
