"""One place that turns command-line options, ini values and env vars into a Settings object.

The option wins over the env var, and both over the ini; all are validated here so bad input fails
once, at start-up, with a line that names the option, variable or ini key.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pytest_fsdp_turbo.checkout_request import CheckoutRequest, validate_ref, validate_repo
from pytest_fsdp_turbo.options import DEFAULT_REPO, INI_DEFAULTS, OPTIONS, RETIRED_ENV, option_dest
from pytest_fsdp_turbo_contract.bounds import DAY_S, number_in, seconds
from pytest_fsdp_turbo_contract.device_profiles import PROFILES
from pytest_fsdp_turbo_contract.engines import GIVEN, INI, EngineCatalog, engine_catalog
from pytest_fsdp_turbo_contract.errors import ConfigError
from pytest_fsdp_turbo_contract.faults import FaultSpec, parse_fault
from pytest_fsdp_turbo_contract.vocab import DeviceKind, Env, Launcher
from pytest_fsdp_turbo_contract.warm_protocol import IMPORT_TIME_ENV

LAUNCHERS = tuple(Launcher)
OMP_THREADS = "OMP_NUM_THREADS"
GLOO_INTERFACES = "GLOO_SOCKET_IFNAME"
VERL_EXTERNAL_MODULES = "VERL_USE_EXTERNAL_MODULES"
DEFAULT_RAY_CONNECT_TIMEOUT_S = 30.0


_TRUE = ("1", "true", "yes", "on")
VLLM_MEMORY_DEFAULT = 0.3


@dataclass(frozen=True)
class HarnessEnv:
    """The harness's own variables besides the options' (docs/environment.md), read here and
    nowhere else: each place that needs one asks `HarnessEnv.read()`."""

    state_dir: Path  # leases, warm parent and Ray driver logs
    no_fork: bool  # spawn every rank, never fork one from a warm parent
    cache_home: Path  # tiny models, inspections, cloned checkouts live below it
    warm_socket: str  # an ancestor session's warm parent, advertised to its descendants
    pythonpath: str  # the session's PYTHONPATH: the ranks get it after the case's paths
    verl_external_modules: tuple[str, ...]  # the user's VERL_USE_EXTERNAL_MODULES, for trainers
    import_env: dict[str, str]  # what a warm parent imports under: the user's values, else ours

    @classmethod
    def read(cls, env: Mapping[str, str] | None = None) -> HarnessEnv:
        env = os.environ if env is None else env
        state = env.get(Env.STATE_DIR)
        default_state = Path(tempfile.gettempdir()) / f"pytest-fsdp-turbo-{os.getuid()}"
        external = env.get(VERL_EXTERNAL_MODULES, "")
        return cls(
            state_dir=Path(state) if state else default_state,
            no_fork=_flag(env.get(Env.NO_FORK, ""), Env.NO_FORK),
            cache_home=Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache"),
            warm_socket=env.get(Env.WARM_SOCKET, ""),
            pythonpath=env.get("PYTHONPATH", ""),
            verl_external_modules=tuple(m for m in external.split(",") if m),
            import_env={k: env.get(k, v) for k, v in IMPORT_TIME_ENV.items()},
        )


@dataclass(frozen=True)
class DetectionEnv:
    """The vendors' variables that decide what hardware this process sees, for detection."""

    path: str  # where nvidia-smi and npu-smi are looked for
    visible: dict[str, str]  # CUDA_VISIBLE_DEVICES / ASCEND_RT_VISIBLE_DEVICES, where set
    cann_homes: tuple[str, ...]  # ASCEND_HOME_PATH, then ASCEND_TOOLKIT_HOME, where set

    @classmethod
    def read(cls, env: Mapping[str, str] | None = None) -> DetectionEnv:
        env = os.environ if env is None else env
        visible = [p.visible_devices_var for p in PROFILES.values() if p.visible_devices_var]
        return cls(
            path=env.get("PATH", os.defpath),
            visible={name: env[name] for name in visible if name in env},
            cann_homes=tuple(
                env[name] for name in ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME") if env.get(name)
            ),
        )


def collective_timeout_override(env: Mapping[str, str]) -> float | None:
    """The collective timeout a user's variable asks for (None: the case's own), in seconds."""
    value = env.get(Env.COLLECTIVE_TIMEOUT_S)
    return None if value is None else seconds(value, Env.COLLECTIVE_TIMEOUT_S)


# set by pytest-xdist in each worker: ranks of concurrent cases share the cores, and an OpenMP rank
# with more threads than its share spins against the others' (measured: a 0.25 s train phase took
# 11-22 s under `-n 2` when a one-rank case got both cores' worth of threads)
XDIST_WORKERS_VAR = "PYTEST_XDIST_WORKER_COUNT"


def xdist_workers(env: Mapping[str, str]) -> int:
    """How many pytest-xdist workers share this box's cores (1 without xdist)."""
    return max(1, int(env.get(XDIST_WORKERS_VAR, "1") or 1))


@dataclass(frozen=True)
class RunEnv:
    """What a run's environment (the session's, with ppo_run's extra_env over it) asks of its
    ranks: the spec carries what the ranks read, the rest is checked before any rank starts."""

    vllm_memory_share: float
    fault: FaultSpec | None
    collective_timeout_s: float | None  # the variable's, held below the case timeout later
    omp_threads: str | None  # the user's OMP_NUM_THREADS, checked (None: the collective profile's)
    # where the user's GLOO_SOCKET_IFNAME came from, for the line that refuses an interface this
    # host lacks (None: unset, the collective profile's); the interfaces are the profile's to parse
    gloo_origin: str | None

    @classmethod
    def read(cls, session: Mapping[str, str], extra: Mapping[str, str], world_size: int) -> RunEnv:
        env = {**session, **extra}

        def origin(name: str) -> str:
            return f"{'ppo_run extra_env' if name in extra else 'environment'} {name}"

        share = env.get(Env.VLLM_MEMORY, str(VLLM_MEMORY_DEFAULT))
        threads = env.get(OMP_THREADS)
        if threads is not None and not all(p.isdigit() and int(p) > 0 for p in threads.split(",")):
            # OpenMP's form: a count, or a comma list for nested levels; a rank dies on another
            raise ConfigError(
                f"{origin(OMP_THREADS)}: expected a positive integer (threads per rank); got "
                f"{threads!r}"
            )
        return cls(
            vllm_memory_share=number_in(share, Env.VLLM_MEMORY, 0.0, 1.0, low_open=True),
            fault=parse_fault(env.get(Env.FAULT, ""), world_size, env.get(Env.FAULT_STALL_S, "")),
            collective_timeout_s=collective_timeout_override(env),
            omp_threads=threads,
            gloo_origin=origin(GLOO_INTERFACES) if env.get(GLOO_INTERFACES) else None,
        )


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
        """The engine catalog a run announces: built-ins, entry points, the ini's entries and
        `given` (ppo_run's engine_modules)."""
        return engine_catalog([(INI, self.engine_modules), (GIVEN, given)])


def default_engines() -> EngineCatalog:
    """The catalog without the ini's or ppo_run's entries: built-ins and entry points."""
    return engine_catalog()


def resolve(
    values: Mapping[str, Any],
    env: Mapping[str, str] | None = None,
    ini: Mapping[str, Any] | None = None,
    rootdir: Path | None = None,
) -> Settings:
    """values: option dest -> value (None when not given); env, then the ini, fill the gaps.
    ini: key -> value as pytest's getini gives it (missing keys take their defaults)."""
    env = os.environ if env is None else env
    HarnessEnv.read(env)  # its yes/no variables: a bad value is one line at start-up
    for name, instead in RETIRED_ENV.items():
        if env.get(name, ""):
            raise ConfigError(f"{name} is no longer read; {instead}")
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
                value = _flag(value, opt.env)
        if value is None and opt.ini and ini[opt.ini]:
            value = str((rootdir or Path.cwd()) / ini[opt.ini])
            origin[dest] = f"ini {opt.ini}"
        raw[dest] = value
    device = raw["fsdp_turbo_device"]
    if device:
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
        tiny_models=_folder(raw["fsdp_turbo_tiny_models"], origin["fsdp_turbo_tiny_models"]),
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


MAX_DEVICE_COUNT = 4096  # devices (or CPU rank slots) one machine can offer


def parse_device_override(value: str, origin: str) -> tuple[str, int | None]:
    """`cuda`, `npu:8`, `cpu:4` -> (kind, count or None)."""
    kind, _, count_text = value.strip().partition(":")
    if kind not in tuple(DeviceKind):
        raise ConfigError(f"{origin}: expected one of cpu|cuda|npu[:N]; got {value!r}")
    if not count_text:
        return kind, None
    if not count_text.isdigit() or not 1 <= int(count_text) <= MAX_DEVICE_COUNT:
        raise ConfigError(
            f"{origin}: expected a device count from 1 to {MAX_DEVICE_COUNT} after ':'; got "
            f"{value!r}"
        )
    return kind, int(count_text)


def _flag(value: str, name: str) -> bool:
    """A yes/no variable: 1, true, yes or on; 0, false, no, off or unset. Anything else is one
    line naming it (`false` never turns a thing on)."""
    if value.strip().lower() in _TRUE:
        return True
    if value.strip().lower() in ("", "0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name}: expected 1 or 0; got {value!r}")


def _folder(value: str | None, origin: str) -> Path | None:
    """A folder an option names: a file there is one line, not a silently empty folder."""
    if not value:
        return None
    path = Path(value)
    if path.is_file():
        raise ConfigError(f"{origin}: expected a folder; got {path}, a file")
    return path
