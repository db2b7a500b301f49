"""Per-session state shared by hooks, fixtures and the CLI: settings and the detected hardware."""

from __future__ import annotations

import pytest

from pytest_fsdp_turbo.devices import Accelerator, detect
from pytest_fsdp_turbo.settings import Settings

SETTINGS_KEY = pytest.StashKey[Settings]()
ACCELERATOR_KEY = pytest.StashKey[Accelerator]()


def settings_of(config: pytest.Config) -> Settings:
    return config.stash[SETTINGS_KEY]


def accelerator_of(config: pytest.Config) -> Accelerator:
    """Detected on first use, then cached: a suite that never asks pays nothing."""
    if ACCELERATOR_KEY not in config.stash:
        settings = settings_of(config)
        origin = (
            "--fsdp-turbo-device"
            if config.getoption("fsdp_turbo_device")
            else ("PYTEST_FSDP_TURBO_DEVICE")
        )
        config.stash[ACCELERATOR_KEY] = detect(settings.device, override_origin=origin)
    return config.stash[ACCELERATOR_KEY]
