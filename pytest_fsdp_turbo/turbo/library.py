"""What the harness knows about an FSDPTurbo checkout before any rank starts (torch-free here):
its config layout and schema and the loaded model's module plan (read by a subprocess, so the
pytest process never imports torch), the exact turbo_config for a case, and whether the installed
torch / torch_npu are inside the range the library supports.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import warnings
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import Version

from pytest_fsdp_turbo.models import default_model_cache
from pytest_fsdp_turbo.private_dirs import private_dir, write_private
from pytest_fsdp_turbo.processes.warm import run_module
from pytest_fsdp_turbo.turbo.schema import published_schema
from pytest_fsdp_turbo_contract.errors import ConfigError, Unavailable
from pytest_fsdp_turbo_contract.turbo_config import (
    NEWEST,
    ModulePlan,
    build_turbo_config,
    entry_problems,
    not_modelled,
    schema_problems,
    target_problems,
)

INSPECT_MODULE = "pytest_fsdp_turbo_engine.engines.turbo_inspect"
INSPECT_TIMEOUT_S = 300
# The library's README: Python >= 3.11, torch / torch_npu >= 2.9, < 2.12. A checkout that declares
# its own torch requirement (requirements.txt) is taken at its word instead.
DOCUMENTED_TORCH = ">=2.9,<2.12"
TORCH_PACKAGES = ("torch", "torch_npu")

if TYPE_CHECKING:
    from pytest_fsdp_turbo.cases import Case


@dataclass(frozen=True)
class Inspection:
    layout: str | None  # None: no checkout to read
    schema: dict | None
    modules: ModulePlan | None
    not_modelled: tuple = ()  # settings a stand-in checkout declares it cannot apply


class TurboConfigProblems(ConfigError):
    def __init__(self, case_id: str, problems: list[str]):
        self.problems = problems
        super().__init__(
            f"case {case_id}: turbo_config does not fit the FSDPTurbo checkout:\n"
            + "\n".join(problems)
        )


def _inspection_key(model_dir: Path | None, checkout: Path | None) -> str:
    """Everything an inspection depends on: the model's config, the checkout's package source,
    the inspecting code and the torch / transformers that run it."""
    digest = hashlib.sha256()
    inspector = importlib.util.find_spec(INSPECT_MODULE)
    parts = [Path(inspector.origin)] if inspector and inspector.origin else []
    if model_dir is not None:
        parts.append(model_dir / "config.json")
    if checkout is not None:  # a stand-in's config module also imports from the folder above
        parts += sorted((checkout / "fsdp_turbo").rglob("*.py"))
        parts += sorted(checkout.parent.glob("*.py"))
    for part in parts:
        digest.update(str(part).encode())
        with contextlib.suppress(OSError):
            digest.update(part.read_bytes())
    for dist in ("torch", "transformers"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            digest.update(f"{dist}=={metadata.version(dist)}".encode())
    return digest.hexdigest()[:24]


@functools.lru_cache(maxsize=32)
def inspect(model_dir: Path | None, checkout: Path | None) -> Inspection:
    """Read in a subprocess (it imports torch and transformers) once per model config, checkout
    source and library versions; the answer is kept on disk, so the next pytest process, CLI call
    or xdist worker asking the same does not pay the imports again."""
    cache = private_dir(
        default_model_cache().parent / "inspections", "inspection cache", "XDG_CACHE_HOME"
    )
    cached = cache / f"{_inspection_key(model_dir, checkout)}.json"
    try:
        data = json.loads(cached.read_text())
    except (OSError, json.JSONDecodeError):
        data = _inspect_now(model_dir, checkout)
        write_private(cached, json.dumps(data))
    modules = ModulePlan.from_json(data["modules"]) if data["modules"] else None
    refused = tuple(data.get("not_modelled") or ())
    return Inspection(data["layout"], data["schema"], modules, refused)


def _inspect_now(model_dir: Path | None, checkout: Path | None) -> dict:
    argv = []
    if model_dir is not None:
        argv += ["--model", str(model_dir)]
    if checkout is not None:
        argv += ["--checkout", str(checkout)]
    done = run_module(INSPECT_MODULE, argv, timeout_s=INSPECT_TIMEOUT_S)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise ConfigError(
            f"reading the FSDPTurbo schema (checkout {checkout}) and model {model_dir} failed: {tail}"
        )
    return json.loads(done.stdout.strip().splitlines()[-1])


def turbo_config_for(case: Case, kind: str, model_dir: Path | None, checkout: Path | None) -> dict:
    """The exact turbo_config a rank hands the library; raises TurboConfigProblems when the
    checkout's schema (without a checkout: the layout's published schema) would drop a key or
    misses a required field."""
    found = inspect(model_dir, checkout)
    layout = found.layout or NEWEST
    try:
        config = build_turbo_config(case.engine, kind, case.model, layout, found.modules)
    except ConfigError as exc:
        raise ConfigError(f"case {case.id!r}: {exc}") from None
    problems = schema_problems(found.schema or published_schema(layout), config)
    problems += entry_problems(config)
    if found.modules is not None:
        problems += target_problems(config, found.modules)
    if problems:
        raise TurboConfigProblems(case.id, problems)
    if refused := not_modelled(found.not_modelled, config, kind):
        raise Unavailable(f"case {case.id}: {'; '.join(refused)}")
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


class StandInOutsideTorchRange(UserWarning):
    """A stand-in of the library ran on a torch the library does not support."""


def torch_gate(case_id: str, checkout) -> None:
    """A case built on the library runs only on the torch its checkout declares: Unavailable
    otherwise, naming both. A stand-in (checkout.stand_in) runs anyway, with a warning, since what
    it proves is the harness's plumbing, never the library on that torch."""
    outside = torch_outside_range(checkout.path)
    if outside and not checkout.stand_in:
        raise Unavailable(f"case {case_id}: {outside}")
    if outside:
        warnings.warn(
            f"case {case_id}: {outside}; running on the {checkout.source} anyway: no evidence "
            "for the library on this torch",
            StandInOutsideTorchRange,
            stacklevel=2,
        )


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
