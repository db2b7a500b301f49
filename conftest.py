"""Repository root conftest: the plugin itself arrives through its pytest11 entry point."""

import pytest


@pytest.fixture(autouse=True)
def _every_test_restores_env_and_cwd(fsdp_turbo_env_guard):
    """This repository holds all of its own tests to the harness's env/cwd guard."""
