"""Fixtures shared across test directories."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

# Every cache a test run touches (a bootstrap policy, the unpacked MiniLM) lives in a
# folder of this session, never in the user's cache: set before collection, so configs
# built at import time and every subprocess (they inherit the environment) resolve there.
_SESSION_CACHE = Path(tempfile.mkdtemp(prefix="winnow-test-cache-"))
os.environ["WINNOW_CACHE"] = str(_SESSION_CACHE)

# Under `make test` two xdist workers share the machine's two cores: one intra-op thread each
# (and in every process they start), or each worker's matmuls would fight the other's for both
# cores. Set before torch is first imported, which reads OMP_NUM_THREADS once.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["MKL_NUM_THREADS"] = "1"


SLURM_TESTS = Path(__file__).resolve().parent / "slurm"


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the xdist_group marks
def pytest_collection_modifyitems(config, items) -> None:
    """Under xdist: the SLURM tests as one group, then files with a ``slow`` test, then the rest.

    The tests under ``tests/slurm`` share the session's dev cluster (a session fixture, one per
    worker, and one slurmd per machine): ``--dist loadgroup`` keeps them on one worker, and they go
    first, the SLURM rehearsal first of all, since that worker's queue is the longest. Then
    ``--dist loadfile``/``load`` hand out files in collection order; a 90-s end-to-end file
    handed out last runs alone on one worker while the other idles, which is the whole tail of
    the run. Every worker sorts the same way, as xdist requires of their collections.
    """
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return
    slurm = {item for item in items if SLURM_TESTS in item.path.parents}
    for item in slurm:
        item.add_marker(pytest.mark.xdist_group("slurm-cluster"))
    slow_files = {item.path for item in items if item.get_closest_marker("slow") is not None}
    # stable sort; False sorts first
    items.sort(key=lambda item: (item not in slurm, item.get_closest_marker("rehearsal") is None,
                                 item.path not in slow_files))


def pytest_unconfigure(config) -> None:
    shutil.rmtree(_SESSION_CACHE, ignore_errors=True)


@pytest.fixture(scope="session")
def bootstrap_cache_dir(tmp_path_factory) -> Path:
    """One bootstrap cache for every RL run of the suite, in process or not.

    The bootstrap stage caches its policy under a hash of its config, and the RL tests use the
    tiny bootstrap of ``tests/stages/test_bootstrap.py``: it is trained once per session
    (about 10 s) instead of once per run.
    """
    return tmp_path_factory.mktemp("bootstrap_cache")
