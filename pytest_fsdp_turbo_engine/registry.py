"""Engine registry: (model_type, backend, device) -> engine class.

Downstream repos add engines through the `pytest_fsdp_turbo.engines` entry-point group or by naming
modules in PYTEST_FSDP_TURBO_ENGINE_MODULES (comma-separated); ranks import both before the lookup.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Iterable
from importlib import metadata

from pytest_fsdp_turbo_contract.vocab import VERL_PREFIX, Env

ENTRY_POINT_GROUP = "pytest_fsdp_turbo.engines"
MODULES_VAR = Env.ENGINE_MODULES
ANY = "*"

_REGISTRY: dict[tuple[str, str, str], type] = {}
_BUILTIN_MODULES = ("pytest_fsdp_turbo_engine.fsdp_engine",)
_LAZY_BACKENDS = {"fsdp_turbo": "pytest_fsdp_turbo_engine.fsdp_turbo_engine"}


class RegistryError(LookupError):
    pass


def _as_list(value: str | Iterable[str]) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


def register(
    *,
    model_type: str | Iterable[str] = ANY,
    backend: str | Iterable[str],
    device: str | Iterable[str],
) -> Callable[[type], type]:
    """Class decorator; registering a key twice is an error, not a silent override."""

    def decorate(cls: type) -> type:
        keys = [
            (m, b, d)
            for m in _as_list(model_type)
            for b in _as_list(backend)
            for d in _as_list(device)
        ]
        for key in keys:
            if key in _REGISTRY and _REGISTRY[key] is not cls:
                raise RegistryError(
                    f"engine for model_type={key[0]!r}, backend={key[1]!r}, device={key[2]!r} "
                    f"is already registered: {_REGISTRY[key].__qualname__}"
                )
        for key in keys:
            _REGISTRY[key] = cls
        return cls

    return decorate


def registered() -> list[tuple[str, str, str, str]]:
    return sorted((*key, cls.__qualname__) for key, cls in _REGISTRY.items())


def load_engine_plugins(extra_modules: Iterable[str] = ()) -> None:
    """Import built-in engines, entry-point engines and modules named by the env var."""
    for name in _BUILTIN_MODULES:
        importlib.import_module(name)
    for entry in metadata.entry_points(group=ENTRY_POINT_GROUP):
        entry.load()
    names = [m.strip() for m in os.environ.get(MODULES_VAR, "").split(",") if m.strip()]
    for name in [*names, *extra_modules]:
        importlib.import_module(name)


def lookup(model_type: str, backend: str, device: str) -> type:
    device = str(device)  # a DeviceKind reads as its value in keys and messages
    if backend.startswith(VERL_PREFIX):  # verl's registry decides; ours only adapts
        from pytest_fsdp_turbo_engine.verl_adapter import VerlEngineAdapter

        return VerlEngineAdapter
    if backend in _LAZY_BACKENDS:
        importlib.import_module(_LAZY_BACKENDS[backend])  # imported only when selected
    for key in ((model_type, backend, device), (ANY, backend, device)):
        if key in _REGISTRY:
            return _REGISTRY[key]
    known = "; ".join(f"{m}/{b}/{d} -> {c}" for m, b, d, c in registered()) or "nothing"
    raise RegistryError(
        f"no engine for model_type={model_type!r}, backend={backend!r}, device={device!r}; "
        f"registered: {known}"
    )
