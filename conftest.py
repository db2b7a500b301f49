"""Repository root conftest: the plugin itself arrives through its pytest11 entry point."""

import os
from pathlib import Path

import pytest


def pytest_configure(config):
    """Inner pytest sessions (pytester) get a fresh HOME; pinning the cache root here lets them
    reuse the tiny models this session built instead of rebuilding each (about 6 s a family).
    Tests that need an empty cache still set XDG_CACHE_HOME themselves."""
    os.environ.setdefault("XDG_CACHE_HOME", str(Path.home() / ".cache"))


@pytest.fixture(autouse=True)
def _every_test_restores_env_and_cwd(fsdp_turbo_env_guard):
    """This repository holds all of its own tests to the harness's env/cwd guard."""
