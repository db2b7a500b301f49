"""Run an unsharded model in a process where FSDP-Turbo's Ulysses patches are installed.

The library wraps the functions `cp_plan` names in place, where they live: a module's function
(`eager_attention_forward`) or a class's method (`Qwen3_5GatedDeltaNet.forward`), so every model of
that class in the process runs the sequence-sharded version, not only the one FSDPTurbo wrapped. The
harness keeps unsharded models beside the engine (the HF rollout, the single-process reference),
and they see the whole sequence: around them the wrapped functions are swapped back for the
originals the wrappers keep in `__wrapped__` (functools.wraps, as the library's wrappers are
written), and restored after.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator

PATCH_FIELDS = ("ulysses_function_patches", "loss_function_patches")


class CannotLiftPatch(RuntimeError):
    pass


def ulysses_targets(turbo_config: dict | None) -> list[str]:
    distributed = (turbo_config or {}).get("distributed") or {}
    if int(distributed.get("ulysses_parallel_size") or 1) <= 1:
        return []
    cp_plan = distributed.get("cp_plan") or {}
    found = [t for f in PATCH_FIELDS for e in cp_plan.get(f) or [] for t in e["target_functions"]]
    core = cp_plan.get("ulysses_core_attention_function") or []
    return found + ([core] if isinstance(core, str) else list(core))


def _owner(target: str):
    path, _, name = target.rpartition(".")
    try:
        return importlib.import_module(path), name
    except ImportError:
        module, _, cls = path.rpartition(".")
        return getattr(importlib.import_module(module), cls), name


@contextlib.contextmanager
def library_patches_lifted(turbo_config: dict | None) -> Iterator[None]:
    swapped = []
    try:
        for target in ulysses_targets(turbo_config):
            owner, name = _owner(target)
            current = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
            original = getattr(current, "__wrapped__", None)
            if original is None:
                raise CannotLiftPatch(
                    f"Ulysses patch target {target} has no __wrapped__ original: the harness "
                    "cannot run its unsharded rollout and reference models beside it"
                )
            setattr(owner, name, original)
            swapped.append((owner, name, current))
        yield
    finally:
        for owner, name, current in reversed(swapped):
            setattr(owner, name, current)
