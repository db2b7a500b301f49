"""Repository root conftest: the plugin itself arrives through its pytest11 entry point."""

import os
from pathlib import Path

import pytest

NO_HYDRA = "-p no:hydra_pytest"


def pytest_configure(config):
    """Inner pytest sessions (pytester) get a fresh HOME; pinning the cache root here lets them
    reuse the tiny models this session built instead of rebuilding each (about 6 s a family).
    Tests that need an empty cache still set XDG_CACHE_HOME themselves."""
    os.environ.setdefault("XDG_CACHE_HOME", str(Path.home() / ".cache"))
    # hydra-core (verl brings it) registers a pytest plugin that costs about 0.6 s at every start;
    # nothing here uses it, and inner sessions inherit the variable
    addopts = os.environ.get("PYTEST_ADDOPTS", "")
    if NO_HYDRA not in addopts:
        os.environ["PYTEST_ADDOPTS"] = f"{addopts} {NO_HYDRA}".strip()


@pytest.fixture(autouse=True)
def _every_test_restores_env_and_cwd(fsdp_turbo_env_guard):
    """This repository holds all of its own tests to the harness's env/cwd guard."""


@pytest.fixture(scope="session", autouse=True)
def _warm_parent_up_front(request):
    """Under xdist (how the whole suite runs), start each worker's warm parent before its first
    test, not at its first case: the CLI runs, inner sessions and helpers of earlier tests then
    fork from it instead of importing torch. A single-file run stays light (no 5 s start)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    from pytest_fsdp_turbo.warm import warm_parent

    warm_parent(request.getfixturevalue("fsdp_turbo_lease_book").state_dir)
