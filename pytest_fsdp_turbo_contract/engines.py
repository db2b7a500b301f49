"""The engine catalog: which module serves which backend, known without importing any engine.

The pytest side builds it once (built-ins, the `pytest_fsdp_turbo.engines` entry points, the ini
`fsdp_turbo_engine_modules`, ppo_run's `engine_modules` and PYTEST_FSDP_TURBO_ENGINE_MODULES), validates
case backends against it and hands it to the ranks in their spec; the ranks import exactly what it
names for the backend they run. An entry is `MODULE` or `BACKEND = MODULE`: a declared backend is
known before any rank starts (a typo in a case is one line at collection); a bare module may
register any backend, which only its ranks can tell.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from pytest_fsdp_turbo_contract.errors import ConfigError
from pytest_fsdp_turbo_contract.vocab import VERL_PREFIX, Env

ENTRY_POINT_GROUP = "pytest_fsdp_turbo.engines"
BACKEND_NAME = re.compile(r"[A-Za-z0-9_]+")
MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
BUILT_IN = "built in"
INI = "ini fsdp_turbo_engine_modules"
GIVEN = "ppo_run engine_modules"
ANNOUNCED_WHERE = (
    f"engines are announced by the {ENTRY_POINT_GROUP} entry points, the ini "
    f"fsdp_turbo_engine_modules or {Env.ENGINE_MODULES}"
)


@dataclass(frozen=True)
class EngineEntry:
    module: str
    backend: str | None = None  # None: whatever the module registers (its ranks can tell)
    where: str = ""  # how it was announced, for messages

    @classmethod
    def parse(cls, text: str, where: str) -> EngineEntry:
        """`MODULE` or `BACKEND = MODULE`, or one line naming `where` and what was expected."""
        name, equals, module = text.rpartition("=") if "=" in text else ("", "", text)
        name, module = name.strip(), module.strip()
        if not MODULE_NAME.fullmatch(module) or (equals and not BACKEND_NAME.fullmatch(name)):
            raise ConfigError(
                f"{where}: expected MODULE or BACKEND = MODULE (a dotted module name, a backend "
                f"of letters, digits and '_'); got {text!r}"
            )
        return cls(module, name or None, where)

    @property
    def text(self) -> str:
        return f"{self.backend} = {self.module}" if self.backend else self.module


BUILT_INS = (
    EngineEntry("pytest_fsdp_turbo_engine.fsdp_engine", "fsdp", BUILT_IN),
    EngineEntry("pytest_fsdp_turbo_engine.fsdp_turbo_engine", "fsdp_turbo", BUILT_IN),
)


@dataclass(frozen=True)
class EngineCatalog:
    entries: tuple[EngineEntry, ...] = BUILT_INS

    @property
    def backends(self) -> tuple[str, ...]:
        """The backends known before any rank starts."""
        return tuple(dict.fromkeys(e.backend for e in self.entries if e.backend is not None))

    @property
    def is_open(self) -> bool:
        """A bare module may register backends only its ranks can see."""
        return any(e.backend is None for e in self.entries)

    def accepts(self, backend: str) -> bool:
        if backend.startswith(VERL_PREFIX):
            return True  # verl's own registry decides, in the ranks
        return backend in self.backends or (self.is_open and bool(BACKEND_NAME.fullmatch(backend)))

    def serving(self, backend: str) -> list[EngineEntry]:
        """What a rank imports to run `backend`: the entries declaring it, and every bare module
        (it may register it). Built-ins other than the backend's own stay unimported."""
        return [e for e in self.entries if e.backend in (backend, None)]

    def for_ranks(self) -> tuple[str, ...]:
        """The entries beyond the built-ins, as spec.json carries them."""
        return tuple(e.text for e in self.entries if e.where != BUILT_IN)

    @classmethod
    def from_ranks(cls, texts: Iterable[str]) -> EngineCatalog:
        return cls((*BUILT_INS, *(EngineEntry.parse(t, "spec engine_modules") for t in texts)))


def engine_catalog(
    announced: Iterable[tuple[str, Iterable[str]]] = (),
    env: Mapping[str, str] | None = None,
) -> EngineCatalog:
    """Built-ins, installed entry points (their name is the backend), then `announced`
    ((origin, entries) pairs: the ini's, ppo_run's), then the variable's comma-separated entries."""
    from importlib import metadata

    env = os.environ if env is None else env
    entries = list(BUILT_INS)
    for point in metadata.entry_points(group=ENTRY_POINT_GROUP):
        where = f"entry point {point.name}"
        entries.append(EngineEntry.parse(f"{point.name} = {point.module}", where))
    variable = [t for t in env.get(Env.ENGINE_MODULES, "").split(",") if t.strip()]
    for origin, texts in (*announced, (Env.ENGINE_MODULES, variable)):
        entries += [EngineEntry.parse(t, origin) for t in texts if t.strip()]
    unique: dict[tuple[str, str | None], EngineEntry] = {}
    for entry in entries:  # an entry announced twice keeps its first announcement
        unique.setdefault((entry.module, entry.backend), entry)
    return EngineCatalog(tuple(unique.values()))
