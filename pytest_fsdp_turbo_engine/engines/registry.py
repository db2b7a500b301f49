"""Engine registry: (model_type, backend, device) -> engine class.

Which modules a rank imports comes from the engine catalog in its spec
(pytest_fsdp_turbo_contract/engines.py): the entries serving its backend, nothing else.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable

from pytest_fsdp_turbo_contract.engines import EngineCatalog
from pytest_fsdp_turbo_contract.vocab import VERL_PREFIX

ANY = "*"

_REGISTRY: dict[tuple[str, str, str], type] = {}


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


def load_engines(catalog: EngineCatalog, backend: str) -> None:
    """Import what the catalog names for `backend`; an entry that declares it must register it."""
    for entry in catalog.serving(backend):
        importlib.import_module(entry.module)
        if backend.startswith(VERL_PREFIX):
            continue  # it registers in verl's EngineRegistry, which names what is missing
        if entry.backend is not None and not any(key[1] == backend for key in _REGISTRY):
            raise RegistryError(
                f"{entry.where} declares backend {backend!r}, but importing {entry.module} "
                f"registered no engine for it; registered backends: {_backends() or 'none'}"
            )


def _backends() -> str:
    return ", ".join(sorted({key[1] for key in _REGISTRY}))


def lookup(model_type: str, backend: str, device: str) -> type:
    device = str(device)  # a DeviceKind reads as its value in keys and messages
    if backend.startswith(VERL_PREFIX):  # verl's registry decides; ours only adapts
        from pytest_fsdp_turbo_engine.engines.verl_adapter import VerlEngineAdapter

        return VerlEngineAdapter
    for key in ((model_type, backend, device), (ANY, backend, device)):
        if key in _REGISTRY:
            return _REGISTRY[key]
    known = "; ".join(f"{m}/{b}/{d} -> {c}" for m, b, d, c in registered()) or "nothing"
    raise RegistryError(
        f"no engine for model_type={model_type!r}, backend={backend!r}, device={device!r}; "
        f"registered: {known}"
    )
