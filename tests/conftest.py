"""Fixtures shared across test directories."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def bootstrap_cache_dir(tmp_path_factory) -> Path:
    """One bootstrap cache for every RL run of the suite, in process or not.

    The bootstrap stage caches its policy under a hash of its config, and the RL tests use the
    tiny bootstrap of ``tests/stages/test_bootstrap.py``: it is trained once per session
    (about 10 s) instead of once per run.
    """
    return tmp_path_factory.mktemp("bootstrap_cache")
