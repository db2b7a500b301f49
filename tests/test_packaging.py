"""The wheel carries every package of the checkout: a subpackage missing from pyproject's list
works in an editable install and is gone from the wheel (seen: the trainer packages)."""

from __future__ import annotations

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("pytest_fsdp_turbo", "pytest_fsdp_turbo_contract", "pytest_fsdp_turbo_engine")


def test_every_package_of_the_checkout_is_in_the_wheel_list():
    listed = set(
        tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = {
        ".".join(init.parent.relative_to(REPO).parts)
        for root in ROOTS
        for init in (REPO / root).rglob("__init__.py")
    }
    assert found - listed == set()
    assert {"pytest_fsdp_turbo.trainer", "pytest_fsdp_turbo_engine.trainer"} <= found
