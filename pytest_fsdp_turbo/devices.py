"""Accelerator detection from the outside (vendor tools, device nodes, env), never by importing torch.

Importing torch (let alone torch_npu) costs seconds and may initialise a driver in the pytest process;
the vendor CLIs and /dev answer the same question for free.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pytest_fsdp_turbo.options import KIND_BY_MARKER, MARKER_BY_KIND  # noqa: F401
from pytest_fsdp_turbo.settings import DetectionEnv, parse_device_override
from pytest_fsdp_turbo_contract.device_profiles import profile_of
from pytest_fsdp_turbo_contract.errors import ConfigError
from pytest_fsdp_turbo_contract.vocab import DeviceKind

KINDS = tuple(DeviceKind)
TOOL_TIMEOUT_S = 15

_NVIDIA_SMI_LINE = re.compile(r"^GPU (\d+): (.+?) \(UUID: ([^)]+)\)")
_NPU_SMI_ROW = re.compile(r"^\|\s*(\d+)\s+([^\s|]+)\s*\|\s*\w+")
_DAVINCI_NODE = re.compile(r"^davinci(\d+)$")
_CANN_DEFAULT = "usr/local/Ascend/ascend-toolkit"


@dataclass(frozen=True)
class Accelerator:
    """What a group of ranks can run on: the device kind and the devices (or CPU rank slots)."""

    kind: str
    ids: tuple[int, ...]
    names: tuple[str, ...] = ()
    source: str = ""
    notes: tuple[str, ...] = field(default=())

    @property
    def count(self) -> int:
        return len(self.ids)

    @property
    def backend(self) -> str:
        return profile_of(self.kind).collective_backend

    @property
    def visible_devices_var(self) -> str | None:
        return profile_of(self.kind).visible_devices_var

    def describe(self) -> str:
        unit = "rank slots" if self.kind == DeviceKind.CPU else "devices"
        name = f" ({self.names[0]})" if self.names else ""
        return f"{self.kind}: {self.count} {unit}{name}, backend {self.backend}, via {self.source}"


def default_cpu_slots() -> int:
    """CPU ranks are processes, not devices: room for two 4-rank cases side by side even on a
    2-core machine, so a `pytest -n 2` worker never idles waiting for the other one's slots."""
    return max(8, os.cpu_count() or 1)


def parse_visible_devices(
    value: str, var: str, uuids: Mapping[str, int] | None = None
) -> tuple[int, ...]:
    """Indices listed by a visible-devices variable; UUIDs are mapped when the tool gave them."""
    text = value.strip()
    if text in ("", "-1"):
        return ()
    ids: list[int] = []
    for entry in (part.strip() for part in text.split(",")):
        if entry.isdigit():
            ids.append(int(entry))
        elif uuids and entry in uuids:
            ids.append(uuids[entry])
        else:
            raise ConfigError(
                f"{var}: expected comma-separated device indices like 0,1 (or known GPU UUIDs); "
                f"got {value!r}"
            )
    return tuple(ids)


def _run_tool(tool: str, args: list[str], seen: DetectionEnv) -> tuple[str | None, str]:
    exe = shutil.which(tool, path=seen.path)
    if exe is None:
        return None, f"{tool} not on PATH"
    try:  # its own session: a tool cut off at the timeout goes with whatever it started
        tool_process = subprocess.Popen(
            [exe, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    except OSError as exc:
        return None, f"{tool} failed: {exc}"
    try:
        out, err = tool_process.communicate(timeout=TOOL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(OSError):
            os.killpg(tool_process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):  # a helper that left the group
            tool_process.communicate(timeout=5)  # may hold the pipes: not waited on for ever
        return None, f"{tool} did not answer within {TOOL_TIMEOUT_S:g}s"
    # a driver tool may print bytes that are not UTF-8 (a localised name): read, never refused
    stdout, stderr = (data.decode("utf-8", errors="replace") for data in (out, err))
    if tool_process.returncode != 0:
        return None, f"{tool} exited {tool_process.returncode}: {stderr.strip()[:200]}"
    return stdout, f"{tool} {' '.join(args)}"


def _narrow(
    ids: list[int], names: list[str], seen: DetectionEnv, var: str, uuids=None
) -> tuple[tuple[int, ...], tuple[str, ...], str]:
    if var not in seen.visible:
        return tuple(ids), tuple(names), ""
    visible = parse_visible_devices(seen.visible[var], var, uuids)
    by_id = dict(zip(ids, names)) if names else {}
    kept = [i for i in visible if i in ids]
    return tuple(kept), tuple(by_id[i] for i in kept if i in by_id), f", narrowed by {var}"


def detect_cuda(seen: DetectionEnv, root: Path) -> Accelerator | None:
    out, how = _run_tool("nvidia-smi", ["-L"], seen)
    ids: list[int] = []
    names: list[str] = []
    uuids: dict[str, int] = {}
    if out is not None:
        for line in out.splitlines():
            match = _NVIDIA_SMI_LINE.match(line.strip())
            if match:
                ids.append(int(match[1]))
                names.append(match[2])
                uuids[match[3]] = int(match[1])
    if not ids:
        gpus = root / "proc/driver/nvidia/gpus"
        if gpus.is_dir():
            ids = list(range(len([p for p in gpus.iterdir() if p.is_dir()])))
            how = "/proc/driver/nvidia/gpus"
    if not ids:
        return None
    kept, kept_names, narrowed = _narrow(ids, names, seen, "CUDA_VISIBLE_DEVICES", uuids)
    return Accelerator("cuda", kept, kept_names, how + narrowed)


def _cann_home(seen: DetectionEnv, root: Path) -> Path | None:
    for home in seen.cann_homes:
        if Path(home).is_dir():
            return Path(home)
    default = root / _CANN_DEFAULT
    return default if default.is_dir() else None


def detect_npu(seen: DetectionEnv, root: Path) -> Accelerator | None:
    names_by_id: dict[int, str] = {}
    out, smi_how = _run_tool("npu-smi", ["info"], seen)
    if out is not None:
        for line in out.splitlines():
            match = _NPU_SMI_ROW.match(line)
            if match:
                names_by_id.setdefault(int(match[1]), match[2])
    dev = root / "dev"
    nodes = sorted(
        int(m[1])
        for p in (dev.iterdir() if dev.is_dir() else [])
        if (m := _DAVINCI_NODE.match(p.name))
    )
    if nodes:
        ids, how = nodes, "/dev/davinci*" + (f" + {smi_how}" if out is not None else "")
    elif names_by_id:
        ids, how = sorted(names_by_id), smi_how
    else:
        return None
    names = [names_by_id.get(i, names_by_id.get(0, "")) for i in ids] if names_by_id else []
    kept, kept_names, narrowed = _narrow(ids, names, seen, "ASCEND_RT_VISIBLE_DEVICES")
    cann = _cann_home(seen, root)
    notes = (f"CANN at {cann}",) if cann else ("CANN install not found",)
    return Accelerator("npu", kept, kept_names, how + narrowed, notes)


def _cpu(slots: int | None, source: str) -> Accelerator:
    count = slots or default_cpu_slots()
    return Accelerator("cpu", tuple(range(count)), (), f"{source} ({count} rank slots)")


def detect(
    override: str | None = None,
    *,
    override_origin: str = "--fsdp-turbo-device",
    env: Mapping[str, str] | None = None,
    root: Path | str = "/",
    cpu_slots: int | None = None,
) -> Accelerator:
    """CUDA first, then Ascend, then CPU rank slots; an override picks the kind (and count)."""
    seen = DetectionEnv.read(env)  # once, for both detectors
    root = Path(root)
    detectors = {"cuda": detect_cuda, "npu": detect_npu}
    if override:
        kind, count = parse_device_override(override, override_origin)
        if kind == DeviceKind.CPU:
            return _cpu(count or cpu_slots, f"{override_origin}={override}")
        if count is not None:
            return Accelerator(kind, tuple(range(count)), (), f"{override_origin}={override}")
        found = detectors[kind](seen, root)
        if found is None:
            looked = (
                "nvidia-smi -L, /proc/driver/nvidia"
                if kind == DeviceKind.CUDA
                else "npu-smi, /dev/davinci*"
            )
            return Accelerator(kind, (), (), f"{override_origin}={override}; none found ({looked})")
        return found
    for detector in (detect_cuda, detect_npu):
        found = detector(seen, root)
        if found is not None and found.count:
            return found
    return _cpu(cpu_slots, "no nvidia-smi GPUs, no Ascend /dev/davinci* or npu-smi devices")
