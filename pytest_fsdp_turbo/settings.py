"""One place that turns command-line options, ini values and env vars into a Settings object.

The option wins over the env var, and both over the ini; all are validated here so bad input fails
once, at start-up, with a line that names the option, variable or ini key.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pytest_fsdp_turbo.options import DEFAULT_REPO, INI_DEFAULTS, OPTIONS, option_dest
from pytest_fsdp_turbo.turbo.checkout_request import CheckoutRequest, validate_ref, validate_repo
from pytest_fsdp_turbo_contract.bounds import DAY_S, number_in, seconds
from pytest_fsdp_turbo_contract.engines import GIVEN, INI, EngineCatalog, engine_catalog
from pytest_fsdp_turbo_contract.errors import ConfigError
from pytest_fsdp_turbo_contract.vocab import Launcher

LAUNCHERS = tuple(Launcher)
DEFAULT_RAY_CONNECT_TIMEOUT_S = 30.0


_TRUE = ("1", "true", "yes", "on")


@dataclass(frozen=True)
class Settings:
    device: str | None = None
    strict: bool = False
    checkout: CheckoutRequest = CheckoutRequest()
    cases: Path | None = None
    models: Path | None = None
    tiny_models: Path | None = None  # a downstream's own tiny model specs, beside the built-ins
    artifacts: Path | None = None  # None: <rootdir>/fsdp-turbo-artifacts
    record_golden: bool = False
    goldens: Path | None = None
    launcher: Launcher = Launcher.LOCAL
    ray_address: str | None = None
    ray_connect_timeout_s: float = DEFAULT_RAY_CONNECT_TIMEOUT_S
    rootdir: Path | None = None  # pytest's rootdir: where the ini's relative paths start
    engine_modules: tuple[str, ...] = ()  # ini fsdp_turbo_engine_modules
    stall_share: float = 0.5  # ini fsdp_turbo_stall_share
    quiet_s: float = 10.0  # ini fsdp_turbo_quiet_s
    env_guard: bool = True  # ini fsdp_turbo_env_guard

    def engines(self, given: Iterable[str] = ()) -> EngineCatalog:
        """The engine catalog a run announces: built-ins, entry points, the ini's entries,
        `given` (ppo_run's engine_modules) and PYTEST_FSDP_TURBO_ENGINE_MODULES."""
        return engine_catalog([(INI, self.engine_modules), (GIVEN, given)])


def resolve(
    values: Mapping[str, Any],
    env: Mapping[str, str] | None = None,
    ini: Mapping[str, Any] | None = None,
    rootdir: Path | None = None,
) -> Settings:
    """values: option dest -> value (None when not given); env, then the ini, fill the gaps.
    ini: key -> value as pytest's getini gives it (missing keys take their defaults)."""
    env = os.environ if env is None else env
    ini = {**INI_DEFAULTS, **(ini or {})}
    raw: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for opt in OPTIONS:
        dest = option_dest(opt.flag)
        value = values.get(dest)
        origin[dest] = opt.flag
        if (value is None or value is False) and opt.env and env.get(opt.env, "") != "":
            value = env[opt.env]
            origin[dest] = opt.env
            if opt.is_flag:
                if value.lower() not in (*_TRUE, "0", "false", "no", "off"):
                    raise ConfigError(f"{opt.env}: expected 1 or 0; got {value!r}")
                value = value.lower() in _TRUE
        if value is None and opt.ini and ini[opt.ini]:
            value = str((rootdir or Path.cwd()) / ini[opt.ini])
            origin[dest] = f"ini {opt.ini}"
        raw[dest] = value
    device = raw["fsdp_turbo_device"]
    if device:
        from pytest_fsdp_turbo.devices import parse_device_override  # only when overriding

        parse_device_override(device, origin["fsdp_turbo_device"])
    launcher = launcher_named(raw["fsdp_turbo_launcher"] or "local", origin["fsdp_turbo_launcher"])
    connect = raw["fsdp_turbo_ray_connect_timeout"]
    connect_s = (
        seconds(connect, origin["fsdp_turbo_ray_connect_timeout"], high=DAY_S)
        if connect
        else DEFAULT_RAY_CONNECT_TIMEOUT_S
    )
    repo = raw["fsdp_turbo_repo"] or DEFAULT_REPO
    validate_repo(repo, origin["fsdp_turbo_repo"])
    ref = validate_ref(raw["fsdp_turbo_ref"], origin["fsdp_turbo_ref"])
    return Settings(
        device=device,
        strict=bool(raw["fsdp_turbo_strict"]),
        checkout=CheckoutRequest(path=raw["fsdp_turbo_path"], repo=repo, ref=ref),
        cases=Path(raw["fsdp_turbo_cases"]) if raw["fsdp_turbo_cases"] else None,
        models=Path(raw["fsdp_turbo_models"]) if raw["fsdp_turbo_models"] else None,
        tiny_models=Path(raw["fsdp_turbo_tiny_models"]) if raw["fsdp_turbo_tiny_models"] else None,
        artifacts=Path(raw["fsdp_turbo_artifacts"]) if raw["fsdp_turbo_artifacts"] else None,
        record_golden=bool(raw["fsdp_turbo_record_golden"]),
        goldens=Path(raw["fsdp_turbo_goldens"]) if raw["fsdp_turbo_goldens"] else None,
        launcher=launcher,
        ray_address=raw["fsdp_turbo_ray_address"],
        ray_connect_timeout_s=connect_s,
        rootdir=rootdir,
        engine_modules=tuple(m.strip() for m in ini["fsdp_turbo_engine_modules"] if m.strip()),
        stall_share=number_in(
            ini["fsdp_turbo_stall_share"], "ini fsdp_turbo_stall_share", 0.0, 1.0, low_open=True
        ),
        quiet_s=number_in(ini["fsdp_turbo_quiet_s"], "ini fsdp_turbo_quiet_s", 0.0, DAY_S),
        env_guard=bool(ini["fsdp_turbo_env_guard"]),
    )


def launcher_named(name: str, origin: str) -> Launcher:
    """A launcher name from an option, a variable or ppo_run, or one line naming `origin`."""
    if name not in LAUNCHERS:
        raise ConfigError(f"{origin}: expected one of {', '.join(LAUNCHERS)}; got {name!r}")
    return Launcher(name)
