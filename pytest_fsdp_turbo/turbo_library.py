"""What the harness knows about an FSDPTurbo checkout before any rank starts (torch-free here):
its config layout and schema and the loaded model's module plan (read by a subprocess, so the
pytest process never imports torch), the exact turbo_config for a case, and whether the installed
torch / torch_npu are inside the range the library supports.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import Version

from pytest_fsdp_turbo.errors import ConfigError
from pytest_fsdp_turbo.turbo_config import NEWEST, ModulePlan, build_turbo_config, schema_problems

INSPECT_MODULE = "pytest_fsdp_turbo_engine.turbo_inspect"
INSPECT_TIMEOUT_S = 300
# The library's README: Python >= 3.11, torch / torch_npu >= 2.9, < 2.12. A checkout that declares
# its own torch requirement (requirements.txt) is taken at its word instead.
DOCUMENTED_TORCH = ">=2.9,<2.12"
TORCH_PACKAGES = ("torch", "torch_npu")


@dataclass(frozen=True)
class Inspection:
    layout: str | None  # None: no checkout to read
    schema: dict | None
    modules: ModulePlan | None


class TurboConfigProblems(ConfigError):
    def __init__(self, case_id: str, problems: list[str]):
        self.problems = problems
        super().__init__(
            f"case {case_id}: turbo_config does not fit the FSDPTurbo checkout:\n"
            + "\n".join(problems)
        )


@functools.lru_cache(maxsize=32)
def inspect(model_dir: Path | None, checkout: Path | None) -> Inspection:
    argv = [sys.executable, "-m", INSPECT_MODULE]
    if model_dir is not None:
        argv += ["--model", str(model_dir)]
    if checkout is not None:
        argv += ["--checkout", str(checkout)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=INSPECT_TIMEOUT_S)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise ConfigError(
            f"reading the FSDPTurbo schema (checkout {checkout}) and model {model_dir} failed: {tail}"
        )
    data = json.loads(done.stdout.strip().splitlines()[-1])
    modules = ModulePlan.from_json(data["modules"]) if data["modules"] else None
    return Inspection(data["layout"], data["schema"], modules)


def turbo_config_for(case, kind: str, model_dir: Path | None, checkout: Path | None) -> dict:
    """The exact turbo_config a rank hands the library; raises TurboConfigProblems when the
    checkout's schema (without a checkout: the layout's published schema) would drop a key or
    misses a required field."""
    from pytest_fsdp_turbo.turbo_schema import published_schema

    found = inspect(model_dir, checkout)
    layout = found.layout or NEWEST
    config = build_turbo_config(case, kind, layout, found.modules)
    problems = schema_problems(found.schema or published_schema(layout), config)
    if problems:
        raise TurboConfigProblems(case.id, problems)
    return config


def torch_requirement(checkout: Path | None) -> tuple[str, str]:
    """(specifier, where it comes from): the checkout's requirements.txt, else the README's."""
    requirements = checkout / "requirements.txt" if checkout else None
    if requirements is not None and requirements.is_file():
        for line in requirements.read_text().splitlines():
            text = line.split("#")[0].strip().replace(" ", "")
            if text.startswith("torch") and not text.startswith(
                ("torch_", "torch-", "torchvision")
            ):
                return text[len("torch") :] or ">=0", "the checkout"
    return DOCUMENTED_TORCH, "its README"


def torch_outside_range(checkout: Path | None) -> str | None:
    """One line naming the package, its version and the range, or None when all is inside."""
    wanted, source = torch_requirement(checkout)
    try:
        spec = SpecifierSet(wanted)
    except InvalidSpecifier:
        return f"FSDPTurbo checkout {checkout}: cannot read its torch requirement {wanted!r}"
    for package in TORCH_PACKAGES:
        try:
            installed = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
        if Version(Version(installed).base_version) not in spec:
            return (
                f"fsdp_turbo supports {package} {wanted}; installed {package} {installed} "
                f"(from {source})"
            )
    return None
