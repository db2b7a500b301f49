"""One reader for every case kind's table: its keys, TOML types, closed sets, defaults and bounds
are derived from the kind's dataclass fields, so a field is declared once, where it is used.

A kind's table may spread over several dataclasses (an engine case's keys go to the case, its
`EngineSpec` or its `PPOSpec`); each key belongs to the one whose field it names. Every problem is a
ConfigError naming the file, the case, the field and what was expected.
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from functools import cached_property
from pathlib import Path
from typing import Any, Protocol, TypeVar

from pytest_fsdp_turbo_contract.engines import EngineCatalog
from pytest_fsdp_turbo_contract.errors import ConfigError
from pytest_fsdp_turbo_contract.spec import BOUNDS, RUN
from pytest_fsdp_turbo_contract.vocab import GoldenTier

TINY_PREFIX = "tiny-"
# Ids become test ids and folder names (goldens, artifacts): no separators, no "..", no spaces.
CASE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")  # whole id (fullmatch: no trailing newline)
CASE_ID_MAX = 100  # a folder name under the artifacts and goldens, with room for suffixes
# a model is a folder inside the models folder (an organisation's subfolder allowed), never a path
# out of it; each part starts with a letter or digit, so ".." and hidden folders cannot appear
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)*")
MODEL_MAX = 200
DERIVED = "derived"  # a field validation sets, never a key


class _HasId(Protocol):
    @property
    def id(self) -> str: ...


T = TypeVar("T", bound=_HasId)

_EXPECTED = {
    int: "an integer",
    float: "a number",
    str: "a string",
    bool: "true or false",
    dict: "a table",
    tuple: "a list of strings",
}


def _base_type(annotation: Any) -> type:
    """`int`, `float | None`, `tuple[str, ...]`, `SyncPolicy` -> int, float, tuple, str: the
    field's TOML type."""
    for arg in (annotation, *typing.get_args(annotation)):
        origin = typing.get_origin(arg) or arg
        if origin in _EXPECTED:
            return origin
        if isinstance(origin, type) and issubclass(origin, StrEnum):
            return str
    raise TypeError(f"case field type {annotation!r} has no TOML reading")


def _closed_set(annotation: Any) -> type[StrEnum] | None:
    """The vocabulary enum a field (or each item of a tuple field) takes its values from."""
    for arg in (annotation, *typing.get_args(annotation)):
        if isinstance(arg, type) and issubclass(arg, StrEnum):
            return arg
        if typing.get_origin(arg) is tuple:
            return _closed_set(typing.get_args(arg)[0])
    return None


@dataclass(frozen=True)
class ReadContext:
    """What reading any kind's table needs: the tiny model specs known, the engine catalog."""

    specs: list[str]
    engines: EngineCatalog | None = None


@dataclass(frozen=True)
class Where:
    """Where a value was read: the file (or `ppo_run overrides`), the kind's noun and the case."""

    path: Path | str
    noun: str
    case_id: str

    def error(self, name: str, expected: str, got: Any) -> ConfigError:
        return ConfigError(
            f"{self.path}: {self.noun} {self.case_id!r}: field {name!r}: expected {expected}; "
            f"got {got!r}"
        )


@dataclass(frozen=True)
class TableReader:
    """A kind's table: `parts` maps each part's name to its dataclass, the case's own first.
    `extra` names the keys the kind resolves before reading (a trainer case's `script`)."""

    noun: str
    parts: dict[str, type]
    extra: tuple[str, ...] = ()

    @cached_property
    def declared(self) -> dict[str, dict[str, dataclasses.Field]]:
        """part -> its keys: every field but those validation or a run fills in, or a part."""
        return {
            part: {
                f.name: f
                for f in dataclasses.fields(owner)
                if not f.metadata.get(DERIVED)
                and not f.metadata.get(RUN)
                and f.name not in self.parts
            }
            for part, owner in self.parts.items()
        }

    @cached_property
    def owner(self) -> dict[str, str]:
        owner = {name: part for part, keys in self.declared.items() for name in keys}
        if len(owner) != sum(map(len, self.declared.values())):
            raise TypeError(f"a {self.noun} key is declared in two parts")
        return owner

    @cached_property
    def fields(self) -> dict[str, dataclasses.Field]:
        return {name: f for keys in self.declared.values() for name, f in keys.items()}

    @cached_property
    def hints(self) -> dict[str, Any]:
        return {
            name: hint
            for part, owner in self.parts.items()
            for name, hint in typing.get_type_hints(owner).items()
            if name in self.declared[part]
        }

    @cached_property
    def types(self) -> dict[str, type]:
        return {name: _base_type(hint) for name, hint in self.hints.items()}

    @cached_property
    def closed_sets(self) -> dict[str, type[StrEnum]]:
        return {n: e for n, hint in self.hints.items() if (e := _closed_set(hint)) is not None}

    def where(self, raw: dict, path: Path | str) -> Where:
        """The case's place, its id checked first: every later error names it."""
        case_id = raw.get("id")
        where = Where(path, self.noun, case_id if isinstance(case_id, str) else "?")
        if (
            not isinstance(case_id, str)
            or not CASE_ID.fullmatch(case_id)
            or ".." in case_id
            or len(case_id) > CASE_ID_MAX
        ):
            raise where.error(
                "id",
                "letters, digits, '.', '_' and '-', starting with a letter or digit, no '..', at "
                f"most {CASE_ID_MAX} characters",
                case_id,
            )
        return where

    def read(self, raw: dict, where: Where) -> dict[str, dict[str, Any]]:
        """Each key's value, typed, in its closed set and bounds, grouped by the part owning it;
        an unknown key, a missing model or a wrong type is one line."""
        unknown = sorted(set(raw) - set(self.fields) - set(self.extra))
        if unknown:
            known = ", ".join([*self.fields, *self.extra])
            raise where.error(unknown[0], f"a known field ({known})", raw[unknown[0]])
        if "model" in self.fields:
            check_model(where, raw.get("model"))
        values = {name: self._coerce(where, name, value) for name, value in raw.items()}
        for name in set(values) & set(self.closed_sets):
            if values[name] is not None:
                values[name] = self._member(where, name, values[name])
        for name, value in values.items():
            bounds = self.fields[name].metadata.get(BOUNDS)
            if bounds is not None and value is not None and not bounds.holds(value):
                raise where.error(name, bounds.words(self.types[name] is int), value)
        parts: dict[str, dict[str, Any]] = {part: {} for part in self.parts}
        for name, value in values.items():
            parts[self.owner[name]][name] = value
        return parts

    def keys_of(self, objects: dict[str, Any]) -> dict[str, Any]:
        """A case as its flat table: `objects` maps each part to its instance."""
        return {name: getattr(objects[self.owner[name]], name) for name in self.fields}

    def _coerce(self, where: Where, name: str, value: Any) -> Any:
        kind = self.types[name]
        if kind is float and isinstance(value, int | float) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise where.error(name, "a finite number", value)
            return float(value)
        if kind is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if kind is tuple and isinstance(value, list | tuple):
            if all(isinstance(v, str) for v in value):
                return tuple(value)
        elif kind in (str, bool, dict) and isinstance(value, kind):
            return value
        raise where.error(name, _EXPECTED[kind], value)

    def _member(self, where: Where, name: str, value: Any) -> Any:
        """A closed-set field's value as its enum member(s), or one line naming the members."""
        closed = self.closed_sets[name]
        items = value if isinstance(value, tuple) else (value,)
        for item in items:
            if item not in closed.__members__.values():
                raise where.error(name, "one of " + ", ".join(closed), item)
        if isinstance(value, tuple) and len(set(items)) != len(items):
            raise where.error(name, "each member once", list(items))
        members = tuple(closed(item) for item in items)
        return members if isinstance(value, tuple) else members[0]


def check_model(where: Where, model: Any) -> None:
    """A tiny spec's name or a folder inside the models folder, never a path out of it."""
    if model is None:
        raise where.error("model", "a tiny spec (tiny-...) or a local model name", None)
    if not (isinstance(model, str) and MODEL_NAME.fullmatch(model) and len(model) <= MODEL_MAX):
        raise where.error(
            "model",
            "a tiny spec (tiny-...) or a folder inside the models folder: names of letters, "
            f"digits, '.', '_' and '-' joined by '/', no '..', at most {MODEL_MAX} characters",
            model if not isinstance(model, str) or len(model) <= MODEL_MAX else model[:60] + "...",
        )


def check_tiny(where: Where, model: str, specs: list[str]) -> None:
    if model.startswith(TINY_PREFIX) and model not in specs:
        raise where.error(
            "model",
            "a tiny spec (" + ", ".join(specs) + ") from --fsdp-turbo-tiny-models or the plugin's",
            model,
        )


def check_known_failure(where: Where, known_failure: dict, devices: tuple) -> None:
    """device kind -> {reason, match}, for the case's own device kinds only."""
    for kind, known in known_failure.items():
        if kind not in devices or not (
            isinstance(known, dict)
            and set(known) == {"reason", "match"}
            and all(isinstance(v, str) and v.strip() for v in known.values())
        ):
            raise where.error(
                "known_failure",
                "a table per device kind of the case's devices, each with a non-empty reason "
                "(the bug, where it is tracked) and match (text in the error of each rank that "
                "fails on its own)",
                {kind: known},
            )


def check_reason(where: Where, name: str, reason: Any) -> None:
    """A reason a case gives for what it leaves out: words, never blank."""
    if not (isinstance(reason, str) and reason.strip()):
        raise where.error(name, "a reason in words", reason)


def golden_reason_of(where: Where, tier: GoldenTier, reason: str, inherited: bool = False) -> str:
    """A case without goldens (golden_tier none) says why; one with goldens gives no reason (an
    inherited one, from the case under ppo_run's overrides, is dropped)."""
    if tier == GoldenTier.NONE:
        if not reason.strip():
            raise where.error(
                "golden_reason",
                "why the case records no golden (golden_tier none), in words",
                reason,
            )
        return reason
    if reason and not inherited:
        raise where.error(
            "golden_reason", f"no reason unless golden_tier is none (it is {tier})", reason
        )
    return ""


def read_rows(
    data: dict, table: str, reader: TableReader, path: Path, read_one: Callable[[dict, list], T]
) -> list[T]:
    """A kind's `[[table]]` entries, each read by `read_one(row, the cases before it)`; ids
    unique within the table."""
    rows = data.get(table, [])
    if not isinstance(rows, list):
        raise ConfigError(f"{path}: [[{table}]] entries must be tables")
    cases: list[T] = []
    for row in rows:
        if not isinstance(row, dict):
            raise ConfigError(f"{path}: every [[{table}]] entry must be a table")
        case = read_one(row, cases)
        if case.id in {c.id for c in cases}:
            raise Where(path, reader.noun, case.id).error("id", "a unique id", "a duplicate")
        cases.append(case)
    return cases
