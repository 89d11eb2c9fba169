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
