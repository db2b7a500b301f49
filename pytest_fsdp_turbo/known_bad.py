"""Combinations known to fail, told before any case runs (`pytest-fsdp-turbo doctor`): read from
the installed versions and the case file, torch-free."""

from __future__ import annotations

from collections.abc import Iterable

from packaging.version import Version

from pytest_fsdp_turbo.cases import Case
from pytest_fsdp_turbo_contract.turbo_config import model_family
from pytest_fsdp_turbo_contract.vocab import Capability, Dtype, SyncPolicy

# FSDP2 reads the unsharded parameters of units whose forward never ran when gradients are held
# across micro-batches under a mixed-precision policy; torch 2.15.0 guards the read
GUARDED_FROM = Version("2.15")
IDLE_UNITS = {"qwen3_5": "its vision tower, which a text batch never runs"}


def idle_unit_crashes(cases: Iterable[Case], torch_version: str) -> list[str]:
    """One line per case and device kind that holds bf16 gradients of FSDP units that never run
    forward (deferred sync) on a torch without the guard, under an engine that declares none."""
    if Version(Version(torch_version).base_version) >= GUARDED_FROM:
        return []
    found = []
    for case in cases:
        idle = IDLE_UNITS.get(model_family(case.model) or "")
        if (
            idle is None
            or case.engine.gradient_sync != SyncPolicy.DEFERRED
            or Capability.GUARDS_IDLE_UNITS in case.capabilities
        ):
            continue
        for kind in case.devices:
            if case.engine.dtype_on(kind) == Dtype.BF16:
                found.append(
                    f"case {case.id} on {kind}: torch {torch_version} (< {GUARDED_FROM}) with "
                    f"deferred sync in bf16 and FSDP units that never run forward ({idle}), "
                    f"and backend {case.engine.backend} declares no {Capability.GUARDS_IDLE_UNITS}: "
                    "FSDP2's post-backward fails on them (pytorch#194058; for verl 0.9.1, "
                    "verl PR #7475)"
                )
    return found
