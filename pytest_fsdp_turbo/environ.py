"""The environment one group of ranks needs: rendezvous, visible devices, and a per-backend profile.

Pure functions over plain dicts: the pytest process hands the result to child processes and never
mutates its own os.environ.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import psutil

from pytest_fsdp_turbo.settings import (
    GLOO_INTERFACES,
    collective_timeout_override,
    xdist_workers,
)
from pytest_fsdp_turbo_contract.device_profiles import profile_of
from pytest_fsdp_turbo_contract.errors import ConfigError
from pytest_fsdp_turbo_contract.vocab import Env

COLLECTIVE_TIMEOUT_VAR = Env.COLLECTIVE_TIMEOUT_S
DEFAULT_COLLECTIVE_TIMEOUT_S = 120.0
DEFAULT_CASE_TIMEOUT_S = 600.0
DEFAULT_HCCL_CONNECT_TIMEOUT_S = 1500
_SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|KEY|CREDENTIAL|AUTH", re.IGNORECASE)
_MASK = "***"


@dataclass(frozen=True)
class Timeouts:
    """A collective must time out (and name its rank) before the launcher's watchdog kills the case."""

    collective_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S
    case_s: float = DEFAULT_CASE_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.collective_s <= 0 or self.case_s <= 0:
            raise ConfigError(
                f"timeouts: expected positive seconds; got collective={self.collective_s}, "
                f"case={self.case_s}"
            )
        if self.collective_s >= self.case_s:
            raise ConfigError(
                f"timeouts: collective timeout ({self.collective_s:g}s, {COLLECTIVE_TIMEOUT_VAR}) "
                f"must be shorter than the case timeout ({self.case_s:g}s) so a hang is reported "
                "with its rank before the case is killed"
            )


@dataclass(frozen=True)
class CollectiveEnv:
    """Variables for every rank of one group; `from_user` lists the ones the user's env decided."""

    env: dict[str, str]
    from_user: tuple[str, ...] = field(default=())
    device_ids: tuple[int, ...] = ()
    master_port: int = 0
    world_size: int = 1
    collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S  # handed to the ranks in the spec

    def gloo_interfaces(self) -> list[str]:
        """The interfaces gloo is told to use (the user's, or the profile's lo on CPU)."""
        return [name for name in self.env.get(GLOO_INTERFACES, "").split(",") if name]

    def child_env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        merged = dict(os.environ if base is None else base)
        merged.update(self.env)
        return merged


def parse_port_range(value: str, name: str) -> tuple[int, int]:
    low_text, sep, high_text = value.strip().partition("-")
    if sep and low_text.isdigit() and high_text.isdigit():
        low, high = int(low_text), int(high_text)
        if 1024 <= low <= high <= 65535:
            return low, high
    raise ConfigError(f"{name}: expected LOW-HIGH with 1024 <= LOW <= HIGH <= 65535; got {value!r}")


def _profile(
    kind: str,
    world_size: int,
    timeouts: Timeouts,
    port_ranges: tuple[tuple[int, int], tuple[int, int]] | None,
    cpu_count: int,
) -> dict[str, str]:
    device = profile_of(kind)
    profile = {
        "OMP_NUM_THREADS": str(max(1, cpu_count // max(1, world_size))),
        **device.collective_env,
    }
    if device.collective_backend == "hccl":  # HCCL's own timeouts, in its variables
        profile["HCCL_CONNECT_TIMEOUT"] = str(DEFAULT_HCCL_CONNECT_TIMEOUT_S)
        profile["HCCL_EXEC_TIMEOUT"] = str(max(1, int(timeouts.collective_s)))
        if port_ranges is not None:
            (host_lo, host_hi), (npu_lo, npu_hi) = port_ranges
            profile["HCCL_HOST_SOCKET_PORT_RANGE"] = f"{host_lo}-{host_hi}"
            profile["HCCL_NPU_SOCKET_PORT_RANGE"] = f"{npu_lo}-{npu_hi}"
    else:
        profile["GLOO_SOCKET_IFNAME"] = "lo"
    return profile


def collective_timeout_s(timeouts: Timeouts, override: float | None) -> float:
    """The collective timeout the ranks get (through their spec): the case's, or the user's
    variable's (settings.collective_timeout_override), held below the case timeout so a hang is
    reported with its rank."""
    if override is None:
        return timeouts.collective_s
    Timeouts(override, timeouts.case_s)
    return override


def build_collective_env(
    kind: str,
    device_ids: Sequence[int],
    master_port: int,
    *,
    world_size: int,
    timeouts: Timeouts | None = None,
    master_addr: str = "127.0.0.1",
    port_ranges: tuple[tuple[int, int], tuple[int, int]] | None = None,
    user_env: Mapping[str, str],
    cpu_count: int | None = None,
) -> CollectiveEnv:
    """Rendezvous and visible devices come from the lease; profile variables the user set win
    (`user_env`: the environment the ranks start from, as the caller has it)."""
    timeouts = timeouts or Timeouts()
    collective_s = collective_timeout_s(timeouts, collective_timeout_override(user_env))
    timeouts = Timeouts(collective_s, timeouts.case_s)
    if cpu_count is None:  # the box is shared with the other xdist workers' ranks
        cpu_count = max(1, (os.cpu_count() or 1) // xdist_workers(user_env))
    profile = _profile(kind, world_size, timeouts, port_ranges, cpu_count)
    from_user = []
    for name in list(profile):
        if name in user_env:
            profile[name] = user_env[name]
            from_user.append(name)
    for name in ("HCCL_HOST_SOCKET_PORT_RANGE", "HCCL_NPU_SOCKET_PORT_RANGE"):
        if name in profile:
            parse_port_range(profile[name], name)
    env = {
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "WORLD_SIZE": str(world_size),
        **profile,
    }
    var = profile_of(kind).visible_devices_var
    if var:
        env[var] = ",".join(str(i) for i in device_ids)
    return CollectiveEnv(
        env, tuple(from_user), tuple(device_ids), master_port, world_size, collective_s
    )


def is_secret_name(name: str) -> bool:
    return bool(_SECRET_NAME.search(name))


def mask_secrets(env: Mapping[str, str]) -> dict[str, str]:
    """Credentials never reach logs, reports or the doctor's output."""
    return {k: (_MASK if is_secret_name(k) and v else v) for k, v in env.items()}


@contextmanager
def restored_environ() -> Iterator[None]:
    """Leave os.environ exactly as found, whatever the body did to it."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def interface_of(ip: str) -> str | None:
    """The network interface that holds `ip` on this machine (None: none does)."""
    for name, addresses in psutil.net_if_addrs().items():
        if any(address.address == ip for address in addresses):
            return name
    return None


def node_env(kind: str, ip: str, user_env: Mapping[str, str]) -> dict[str, str]:
    """The per-node part of the collective environment for a rank whose node has address `ip`:
    the same for every rank of that node, built on the node itself (Ray's rank actors) and shown
    by `pytest-fsdp-turbo doctor --node-ip`. A variable the user set on that node wins."""
    interface = interface_of(ip)
    values = {"HCCL_IF_IP": ip}
    if interface is not None:
        values.update(
            HCCL_SOCKET_IFNAME=interface, GLOO_SOCKET_IFNAME=interface, NCCL_SOCKET_IFNAME=interface
        )
    return {
        name: values[name]
        for name in profile_of(kind).node_vars
        if name in values and name not in user_env
    }
