"""The harness's external module for verl's trainer (VERL_USE_EXTERNAL_MODULES): verl imports it in
every process it starts."""

from __future__ import annotations

import os
from pathlib import Path

from pytest_fsdp_turbo_contract.trainer_spec import RUN_DIR_VARIABLE, TrainerSpec
from pytest_fsdp_turbo_contract.vocab import DeviceKind


def _spec() -> TrainerSpec | None:
    run = os.environ.get(RUN_DIR_VARIABLE)
    return TrainerSpec.read(Path(run) / "trainer_spec.json") if run else None


SPEC = _spec()
if SPEC is not None and SPEC.device_kind == DeviceKind.CPU:
    from pytest_fsdp_turbo_engine.trainer import cpu

    cpu.install()
