"""What pytest reads from the plugin on every start, harness used or not: the command-line options
with the env vars behind them, the e2e markers and the report property the summary collects. Kept
free of dataclasses and enums (settings.py builds Settings only when something was given)."""

from __future__ import annotations

import os
from collections.abc import Mapping

import pytest

from pytest_fsdp_turbo_contract.errors import ConfigError

DEFAULT_REPO = "https://gitcode.com/Ascend/FSDPTurbo.git"
KIND_BY_MARKER = {"cpu_e2e": "cpu", "gpu_e2e": "cuda", "npu_e2e": "npu"}
MARKER_BY_KIND = {kind: marker for marker, kind in KIND_BY_MARKER.items()}
SUMMARY_PROPERTY = "fsdp_turbo_run"  # a test report's user property carrying one run's row
PENDING_ROWS = pytest.StashKey[list]()  # a test's runs whose summary rows are not written yet


class Option:
    """A public option: its flag, the env var read when the flag is absent, and its help."""

    __slots__ = ("flag", "env", "help", "is_flag", "ini")

    def __init__(
        self, flag: str, env: str | None, help: str, is_flag: bool = False, ini: str | None = None
    ) -> None:
        self.flag, self.env, self.help, self.is_flag, self.ini = flag, env, help, is_flag, ini

    @property
    def dest(self) -> str:
        return option_dest(self.flag)


OPTIONS = (
    Option(
        "--fsdp-turbo-device", "PYTEST_FSDP_TURBO_DEVICE", "override detection: cpu|cuda|npu[:N]"
    ),
    Option(
        "--fsdp-turbo-strict",
        "PYTEST_FSDP_TURBO_STRICT",
        "fail the session when selected e2e tests cannot run here or FSDPTurbo is missing, "
        "or when every selected test skipped",
        is_flag=True,
    ),
    Option(
        "--fsdp-turbo-require",
        "PYTEST_FSDP_TURBO_REQUIRE",
        "extras this job installed, comma-separated (e.g. verl): one that is not importable "
        "fails the session instead of skipping the tests that need it",
    ),
    Option("--fsdp-turbo-path", "FSDP_TURBO_PATH", "an existing FSDPTurbo checkout"),
    Option("--fsdp-turbo-repo", "FSDP_TURBO_REPO", f"FSDPTurbo git URL (default {DEFAULT_REPO})"),
    Option("--fsdp-turbo-ref", "FSDP_TURBO_REF", "FSDPTurbo branch, tag or full commit id"),
    Option(
        "--fsdp-turbo-cases",
        None,
        "the e2e case file (default e2e/cases.toml)",
        ini="fsdp_turbo_cases",
    ),
    Option(
        "--fsdp-turbo-models",
        "PYTEST_FSDP_TURBO_MODELS",
        "folder holding local real-model directories",
    ),
    Option(
        "--fsdp-turbo-tiny-models",
        "PYTEST_FSDP_TURBO_TINY_MODELS",
        "folder of your own tiny model specs (<name>.json), looked up before the built-in ones",
        ini="fsdp_turbo_tiny_models",
    ),
    Option(
        "--fsdp-turbo-artifacts",
        "PYTEST_FSDP_TURBO_ARTIFACTS",
        "folder for per-case logs and metrics (default <rootdir>/fsdp-turbo-artifacts)",
    ),
    Option(
        "--fsdp-turbo-record-golden", None, "write goldens instead of checking them", is_flag=True
    ),
    Option(
        "--fsdp-turbo-goldens",
        "PYTEST_FSDP_TURBO_GOLDENS",
        "folder of hardware-keyed goldens, read and recorded (default <rootdir>/fixtures/goldens)",
        ini="fsdp_turbo_goldens",
    ),
    Option(
        "--fsdp-turbo-launcher",
        "PYTEST_FSDP_TURBO_LAUNCHER",
        "how ranks start: local (forked from a warm parent) | spawn (fresh interpreters) | ray",
    ),
    Option(
        "--fsdp-turbo-ray-address", "RAY_ADDRESS", "join this Ray cluster instead of a local one"
    ),
    Option(
        "--fsdp-turbo-ray-connect-timeout",
        "PYTEST_FSDP_TURBO_RAY_CONNECT_TIMEOUT_S",
        "seconds to wait for the Ray cluster to answer (default 30)",
    ),
)


class IniKey:
    """An ini key with no command-line option: its pytest type and default."""

    __slots__ = ("name", "help", "type", "default")

    def __init__(self, name: str, help: str, type: str, default: object) -> None:
        self.name, self.help, self.type, self.default = name, help, type, default


INI_KEYS = (
    IniKey(
        "fsdp_turbo_engine_modules",
        "modules the ranks import before the engine lookup (downstream engines)",
        "linelist",
        [],
    ),
    IniKey(
        "fsdp_turbo_stall_share",
        "warn when a rank stays in one phase longer than this share of the case timeout",
        "string",
        "0.5",
    ),
    IniKey(
        "fsdp_turbo_quiet_s",
        "seconds a case runs before its live status line shows (a quicker case prints none)",
        "string",
        "10",
    ),
    IniKey(
        "fsdp_turbo_env_guard",
        "fail a test that leaves os.environ or the working directory changed",
        "bool",
        True,
    ),
)
# every ini key the plugin reads, option-backed ones included (their default: unset)
INI_DEFAULTS = {
    **{opt.ini: "" for opt in OPTIONS if opt.ini},
    **{key.name: key.default for key in INI_KEYS},
}


def ini_values(config) -> dict[str, object]:
    """Every ini key the plugin reads, as pytest's getini gives it (`config`: a pytest.Config);
    a value pytest cannot read as its type (`maybe` for a bool) is one line naming the key."""
    values = {}
    for name in INI_DEFAULTS:
        try:
            values[name] = config.getini(name)
        except (ValueError, pytest.UsageError) as exc:  # pytest names the value, not the key
            kind = next((k.type for k in INI_KEYS if k.name == name), "string")
            expected = "true or false" if kind == "bool" else f"a {kind}"
            raise ConfigError(f"ini {name}: expected {expected} ({exc})") from None
    return values


def ini_given(ini: Mapping[str, object]) -> bool:
    """Whether any ini key differs from its default: settings are then validated at start-up."""
    return any(ini.get(name, default) != default for name, default in INI_DEFAULTS.items())


def option_dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def option_or_env(config, flag: str) -> tuple[str, str]:
    """An option's value (`config`: a pytest.Config), else its env var's, with which of the two
    gave it: for an option read where it is used rather than kept in Settings."""
    opt = next(o for o in OPTIONS if o.flag == flag)
    value = config.getoption(opt.dest)
    if value or not opt.env:
        return value or "", flag
    return os.environ.get(opt.env, ""), opt.env


# variables no longer read, each with what replaced it: resolve() refuses one that is set, in one
# line, rather than ignore it (the name is vocab's Env.ENGINE_MODULES, spelled out: no enum here)
RETIRED_ENV = {
    "PYTEST_FSDP_TURBO_ENGINE_MODULES": "announce engines in the ini fsdp_turbo_engine_modules "
    "(one entry a line), by a pytest_fsdp_turbo.engines entry point or in ppo_run(engine_modules=...)",
}


# yes/no variables read where they are used (settings.HarnessEnv), checked at start-up all the same
CHECKED_ENV = ("PYTEST_FSDP_TURBO_NO_FORK",)


def env_given(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The options' env vars, the checked and the retired ones, that are set (non-empty): what
    resolve() will read, check, or refuse."""
    env = os.environ if env is None else env
    names = [*(opt.env for opt in OPTIONS if opt.env), *CHECKED_ENV, *RETIRED_ENV]
    return {name: env[name] for name in names if env.get(name, "") != ""}
