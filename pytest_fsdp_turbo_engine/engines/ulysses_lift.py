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

from pytest_fsdp_turbo_contract.turbo_config import ulysses_function_targets, ulysses_size


class CannotLiftPatch(RuntimeError):
    pass


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
        config = turbo_config or {}
        for target in ulysses_function_targets(config) if ulysses_size(config) > 1 else ():
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
