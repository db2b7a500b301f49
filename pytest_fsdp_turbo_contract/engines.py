"""The engine catalog: which module serves which backend, known without importing any engine.

The pytest side builds it once (built-ins, the `pytest_fsdp_turbo.engines` entry points, the ini
`fsdp_turbo_engine_modules` and ppo_run's `engine_modules`), validates case backends against it and hands it to the ranks in their spec; the ranks import exactly what it
names for the backend they run. An entry is `MODULE` or `BACKEND = MODULE [CAPABILITIES]`: a
declared backend is known before any rank starts (a typo in a case is one line at collection), and so
is what its engine can do (`Capability`: sp, turbo_config, packing, always_packs, own_loop, and the
device kinds it runs on, all when none is named), which case validation reads instead of backend
names. A backend `verl:<name>` is an engine a module registers in verl's own EngineRegistry (a
downstream subclass of verl's FSDP-Turbo engine, say). A bare module may register any plain backend,
which only its ranks can tell; such a backend declares no capability.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from dataclasses import dataclass

from pytest_fsdp_turbo_contract.errors import ConfigError
from pytest_fsdp_turbo_contract.vocab import VERL_PREFIX, Capability, DeviceKind

ENTRY_POINT_GROUP = "pytest_fsdp_turbo.engines"
BACKEND_NAME = re.compile(r"[A-Za-z0-9_]+")
DECLARED_BACKEND = re.compile(r"(verl:)?[A-Za-z0-9_]+")
MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
ENTRY = re.compile(
    r"\s*(?:(?P<backend>[^=]*?)\s*=)?\s*(?P<module>[^\s\[]*)\s*(?:\[(?P<caps>[^]]*)\])?\s*"
)
TOKENS = (*Capability, *DeviceKind)
VERL_ENGINES = "verl.workers.engine"  # where verl's own engines register themselves
BUILT_IN = "built in"
INI = "ini fsdp_turbo_engine_modules"
GIVEN = "ppo_run engine_modules"
ANNOUNCED_WHERE = (
    f"engines are announced by the {ENTRY_POINT_GROUP} entry points or the ini "
    "fsdp_turbo_engine_modules; an entry point exists once the repository declaring it is "
    "installed (pip install -e .)"
)


@dataclass(frozen=True)
class EngineEntry:
    module: str
    backend: str | None = None  # None: whatever the module registers (its ranks can tell)
    where: str = ""  # how it was announced, for messages
    declares: frozenset[str] = frozenset()  # capabilities and device kinds (none named: any)

    @classmethod
    def parse(cls, text: str, where: str) -> EngineEntry:
        """`MODULE` or `BACKEND = MODULE [CAPABILITY, ...]`, or one line naming `where` and what
        was expected."""
        found = ENTRY.fullmatch(text)
        backend, module = (found["backend"], found["module"]) if found else (None, "")
        tokens = [t.strip() for t in (found["caps"] or "").split(",")] if found else []
        tokens = [t for t in tokens if t]
        if (
            not MODULE_NAME.fullmatch(module)
            or (backend is not None and not DECLARED_BACKEND.fullmatch(backend))
            or (tokens and backend is None)
            or any(t not in TOKENS for t in tokens)
        ):
            raise ConfigError(
                f"{where}: expected MODULE or BACKEND = MODULE [CAPABILITY, ...] (a dotted module "
                "name; a backend of letters, digits and '_', or verl:<name>; capabilities among "
                f"{', '.join(TOKENS)}); got {text!r}"
            )
        return cls(module, backend, where, frozenset(tokens))

    @property
    def text(self) -> str:
        if self.backend is None:
            return self.module
        declared = f" [{', '.join(sorted(self.declares))}]" if self.declares else ""
        return f"{self.backend} = {self.module}{declared}"


def _built_in(module: str, backend: str, *declares: str) -> EngineEntry:
    return EngineEntry(module, backend, BUILT_IN, frozenset(declares))


_VERL = (Capability.SP, Capability.OWN_LOOP, Capability.ALWAYS_PACKS)
BUILT_INS = (
    _built_in("pytest_fsdp_turbo_engine.engines.fsdp2", "fsdp", Capability.GUARDS_IDLE_UNITS),
    _built_in(
        "pytest_fsdp_turbo_engine.engines.turbo",
        "fsdp_turbo",
        Capability.SP,
        Capability.TURBO_CONFIG,
        Capability.PACKING,
        Capability.GUARDS_IDLE_UNITS,
    ),
    _built_in(VERL_ENGINES, "verl:fsdp", *_VERL),
    _built_in(VERL_ENGINES, "verl:fsdp2", *_VERL),
    _built_in(VERL_ENGINES, "verl:fsdp_turbo", *_VERL, Capability.TURBO_CONFIG),
)
# what the adapter gives any engine of verl's registry that no entry declares
UNDECLARED_VERL = frozenset(_VERL)


@dataclass(frozen=True)
class Capabilities:
    """What a backend's engine can do, from the entries declaring it."""

    declares: frozenset[str] = frozenset()
    announced_by: str = ""  # the entries, for messages
    any_device: bool = False  # an entry declaring the backend names no device kind: all of them

    def __contains__(self, capability: str) -> bool:
        return capability in self.declares

    @property
    def devices(self) -> frozenset[str]:
        named = self.declares & frozenset(DeviceKind)
        return named if named and not self.any_device else frozenset(DeviceKind)

    @property
    def capabilities(self) -> tuple[str, ...]:
        return tuple(sorted(self.declares & frozenset(Capability)))


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

    def capabilities(self, backend: str) -> Capabilities:
        """The union of what the entries declaring `backend` declare; an undeclared verl engine
        gets what the adapter gives every verl engine, an undeclared plain one nothing."""
        declaring = [e for e in self.entries if e.backend == backend]
        if not declaring:
            undeclared = UNDECLARED_VERL if backend.startswith(VERL_PREFIX) else frozenset()
            return Capabilities(undeclared, "no entry declares it")
        declares = frozenset().union(*(e.declares for e in declaring))
        if backend.startswith(VERL_PREFIX):  # what the adapter gives every verl engine stays
            declares |= UNDECLARED_VERL
        any_device = any(not e.declares & frozenset(DeviceKind) for e in declaring)
        said = "; ".join(f"{e.where}: {e.text}" for e in declaring)
        return Capabilities(declares, said, any_device)

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


def engine_catalog(announced: Iterable[tuple[str, Iterable[str]]] = ()) -> EngineCatalog:
    """Built-ins, installed entry points (their name is the backend), then `announced`
    ((origin, entries) pairs: the ini's, ppo_run's)."""
    from importlib import metadata

    entries = list(BUILT_INS)
    for point in metadata.entry_points(group=ENTRY_POINT_GROUP):
        where = f"entry point {point.name}"  # its module (an `:attr` is not ours to read), extras
        declared = f" [{', '.join(point.extras)}]" if point.extras else ""
        entries.append(EngineEntry.parse(f"{point.name} = {point.module}{declared}", where))
    for origin, texts in announced:
        entries += [EngineEntry.parse(t, origin) for t in texts if t.strip()]
    unique: dict[tuple[str, str | None], EngineEntry] = {}
    for entry in entries:  # announced twice: its first announcement, with both declarations
        first = unique.setdefault((entry.module, entry.backend), entry)
        if first is not entry and entry.declares - first.declares:
            unique[(entry.module, entry.backend)] = dataclasses.replace(
                first, declares=first.declares | entry.declares
            )
    return EngineCatalog(tuple(unique.values()))
