"""The trainer entry: `python -m pytest_fsdp_turbo_engine.trainer.main RUN_DIR` runs verl's own
`main_ppo`, unedited, with the case's overrides and the harness's, in this process (the harness's
supervisor owns its process group). What it adds: one training step, Hydra's output (the resolved
config) in the run folder, the observer verl imports in every process, and on CPU the shims of
cpu.py. The case's placeholders ({model}, {data}, {reward}) are filled here."""

from __future__ import annotations

import faulthandler
import os
import runpy
import signal
import sys
from pathlib import Path

from pytest_fsdp_turbo_contract.trainer_files import TrainerFolder
from pytest_fsdp_turbo_contract.trainer_spec import (
    OBSERVER_MODULE,
    RUN_DIR_VARIABLE,
    TrainerSpec,
)
from pytest_fsdp_turbo_contract.vocab import DeviceKind


def harness_overrides(spec: TrainerSpec, folder: TrainerFolder) -> list[str]:
    """One step; Hydra's output and verl's checkpoints in the run folder; Ray's session where the
    harness keeps its logs; the lease's collective environment on every Ray worker."""
    env = "+ray_kwargs.ray_init.runtime_env.env_vars"
    return [
        f"trainer.total_training_steps={spec.total_training_steps}",
        f"hydra.run.dir={folder.hydra}",
        f"trainer.default_local_dir={folder.path / 'checkpoints'}",
        *([f"+ray_kwargs.ray_init._temp_dir={spec.ray_temp_dir}"] if spec.ray_temp_dir else []),
        *(f"{env}.{name}='{value}'" for name, value in sorted(spec.worker_env.items())),
    ]


def filled(spec: TrainerSpec, folder: TrainerFolder) -> list[str]:
    from pytest_fsdp_turbo_engine.trainer import data, reward

    overrides = spec.overrides
    values = {"{model}": spec.model_path, "{reward}": reward.__file__}
    if any("{data}" in o for o in overrides):
        values["{data}"] = str(data.write_parquet(folder.data))
    out = []
    for override in overrides:
        for placeholder, value in values.items():
            override = override.replace(placeholder, value)
        out.append(os.path.expandvars(override))  # $HOME and ${VAR}, as the script's shell did
    return out


def argv(spec: TrainerSpec, folder: TrainerFolder) -> list[str]:
    args = [*filled(spec, folder), *harness_overrides(spec, folder)]
    if spec.device_kind == DeviceKind.CPU:
        from pytest_fsdp_turbo_engine.trainer import cpu

        args += cpu.overrides(spec.world_size, spec.cores)
    return args


def external_modules(spec: TrainerSpec) -> str:
    """What verl imports in every process: the harness's observer first, then the spec's (the
    user's, then the case's), each once."""
    return ",".join(dict.fromkeys([OBSERVER_MODULE, *spec.external_modules]))


def main() -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the supervisor's stack dump
    folder = TrainerFolder(Path(sys.argv[1]).resolve())
    spec = TrainerSpec.read(folder.spec)
    os.environ[RUN_DIR_VARIABLE] = str(folder.path)
    os.environ["VERL_USE_EXTERNAL_MODULES"] = external_modules(spec)
    if spec.device_kind == DeviceKind.CPU:
        from pytest_fsdp_turbo_engine.trainer import cpu

        os.environ.update(cpu.ENVIRONMENT)
    sys.argv = ["verl.trainer.main_ppo", *argv(spec, folder)]
    print("main_ppo " + " ".join(sys.argv[1:]), flush=True)
    runpy.run_module("verl.trainer.main_ppo", run_name="__main__", alter_sys=True)
    if spec.reference:  # every step the observer captured, through the harness's own reference
        from pytest_fsdp_turbo_engine.trainer import replay

        print(replay.run_safely(folder, spec).summary(), flush=True)


if __name__ == "__main__":
    main()
