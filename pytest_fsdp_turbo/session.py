"""Per-session state shared by hooks, fixtures and the CLI: settings and the detected hardware."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from pytest_fsdp_turbo.devices import Accelerator
    from pytest_fsdp_turbo.settings import Settings

DEFAULT_ARTIFACTS = "fsdp-turbo-artifacts"
SETTINGS_KEY = pytest.StashKey["Settings"]()
ACCELERATOR_KEY = pytest.StashKey["Accelerator"]()


def settings_of(config: pytest.Config) -> Settings:
    """Resolved at start-up when an option or env var was given (bad input fails there); with
    nothing given there is nothing to validate, so the defaults are built on first use."""
    if SETTINGS_KEY not in config.stash:
        from pytest_fsdp_turbo.settings import resolve  # on first use: start stays light

        config.stash[SETTINGS_KEY] = resolve({}, env={}, rootdir=config.rootpath)
    return config.stash[SETTINGS_KEY]


def strict_of(config: pytest.Config) -> bool:
    """Strict needs an option or env var, and those are resolved at start-up: a session with
    neither is not strict, and finding that out builds nothing."""
    settings = config.stash.get(SETTINGS_KEY, None)
    return settings is not None and settings.strict


def accelerator_of(config: pytest.Config) -> Accelerator:
    """Detected on first use, then cached: a suite that never asks pays nothing."""
    if ACCELERATOR_KEY not in config.stash:
        from pytest_fsdp_turbo.devices import detect  # detected on first use: start stays light

        settings = settings_of(config)
        origin = (
            "--fsdp-turbo-device"
            if config.getoption("fsdp_turbo_device")
            else ("PYTEST_FSDP_TURBO_DEVICE")
        )
        config.stash[ACCELERATOR_KEY] = detect(settings.device, override_origin=origin)
    return config.stash[ACCELERATOR_KEY]


def goldens_dir(config: pytest.Config) -> Path:
    """Where goldens are read and recorded: the option, variable or ini, else the rootdir's
    fixtures/goldens; never inside an installed package."""
    return settings_of(config).goldens or config.rootpath / "fixtures" / "goldens"


def cases_path(config: pytest.Config) -> Path:
    from pytest_fsdp_turbo.cases import DEFAULT_CASES  # the case machinery loads on first use

    return settings_of(config).cases or config.rootpath / DEFAULT_CASES


def artifacts_root(config: pytest.Config) -> Path:
    """The option or variable (relative to where pytest started), else the rootdir's
    fsdp-turbo-artifacts, wherever under the rootdir pytest was started."""
    return resolve_artifacts(
        settings_of(config).artifacts, config.invocation_params.dir, config.rootpath
    )


def resolve_artifacts(given: Path | None, invocation_dir: Path, rootdir: Path) -> Path:
    if given is None:
        return rootdir / DEFAULT_ARTIFACTS
    return given if given.is_absolute() else invocation_dir / given
