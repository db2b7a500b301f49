"""Small builders shared by the unit tests: fake vendor tools and fake device trees."""

from __future__ import annotations

import os
import stat
from pathlib import Path


def fake_tool(bin_dir: Path, name: str, stdout: str, exit_code: int = 0) -> Path:
    """An executable on PATH that prints stdout: the detector, not the tool, is under test."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    script = bin_dir / name
    payload = bin_dir / f"{name}.out"
    payload.write_text(stdout)
    script.write_text(f"#!/bin/sh\ncat '{payload}'\nexit {exit_code}\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return script


def env_with_path(bin_dir: Path, **extra: str) -> dict[str, str]:
    return {"PATH": f"{bin_dir}{os.pathsep}/usr/bin:/bin", **extra}


def nvidia_smi_listing(count: int, name: str = "NVIDIA H200") -> str:
    return "".join(f"GPU {i}: {name} (UUID: GPU-{i:04d}-fake)\n" for i in range(count))


def npu_smi_table(count: int, name: str = "910B3") -> str:
    rows = [
        "+---------------------------+---------------+------------------------------------+",
        "| npu-smi 24.1.0            Version: 24.1.0                                       |",
        "| NPU   Name                | Health        | Power(W)    Temp(C)                |",
        "| Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)       |",
        "+===========================+===============+====================================+",
    ]
    for i in range(count):
        rows.append(f"| {i:<5} {name:<19} | OK            | 93.4        38                     |")
        rows.append(
            f"| 0                         | 0000:C{i:x}:00.0  | 0           0    / 0               |"
        )
        rows.append(
            "+===========================+===============+====================================+"
        )
    return "\n".join(rows) + "\n"


def davinci_nodes(root: Path, count: int) -> Path:
    dev = root / "dev"
    dev.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        (dev / f"davinci{i}").touch()
    for extra in ("davinci_manager", "devmm_svm", "hisi_hdc"):
        (dev / extra).touch()
    return root
