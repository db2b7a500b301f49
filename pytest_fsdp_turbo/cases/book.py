"""The case file: every kind's table read into cases, looked up by id, and each case on each of
its device kinds one test parameter. Torch-free."""

from __future__ import annotations

import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from pytest_fsdp_turbo.cases.engine_case import Case, read_table
from pytest_fsdp_turbo.cases.lookup import FIXTURES_DIR, tiny_specs
from pytest_fsdp_turbo.cases.table import ReadContext
from pytest_fsdp_turbo.cases.trainer_case import TrainerCase
from pytest_fsdp_turbo_contract.engines import EngineCatalog
from pytest_fsdp_turbo_contract.errors import ConfigError
from pytest_fsdp_turbo_contract.vocab import CaseKindName

DEFAULT_CASES = Path("e2e") / "cases.toml"  # under the rootdir, unless an option or ini names one


@dataclass(frozen=True)
class CaseParam:
    """One test parameter: a case, of any kind, on one device kind."""

    case: Case | TrainerCase
    kind: str

    @property
    def id(self) -> str:
        return f"{self.case.id}-{self.kind}"

    @property
    def ranks(self) -> int:
        """Devices the test leases."""
        return self.case.world_size

    @property
    def known_failure(self) -> dict | None:
        """The crash known on this device kind ({reason, match}), if the case declares one."""
        return self.case.known_failure.get(self.kind)


def read_toml(path: Path) -> dict:
    if not path.is_file():
        what = "is a folder, not a file" if path.is_dir() else "does not exist"
        raise ConfigError(f"--fsdp-turbo-cases / fsdp_turbo_cases: case file {path} {what}")
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    except RecursionError:  # tomllib recurses once per level of nesting
        raise ConfigError(f"{path}: a value nested deeper than a case file needs") from None


def load_cases(
    path: Path,
    fixtures_dir: Path = FIXTURES_DIR,
    engines: EngineCatalog | None = None,
    tiny_models: Path | None = None,
) -> list[Case]:
    """The case file's engine cases, every one validated; backends may be any engine the catalog
    announces."""
    context = ReadContext(tiny_specs(tiny_models, fixtures_dir), engines)
    return read_table(read_toml(path), path, context)


class CaseBook:
    """The loaded case file, looked up by id: each kind's cases (kind name -> its cases)."""

    def __init__(self, path: Path, by_kind: dict[str, list]):
        self.path, self.by_kind = path, by_kind

    @property
    def cases(self) -> list[Case]:  # the harness's own PPO step's
        return self.by_kind.get(CaseKindName.PPO_STEP, [])

    @property
    def trainer_cases(self) -> list[TrainerCase]:  # verl's trainer's
        return self.by_kind.get(CaseKindName.VERL_TRAINER, [])

    @property
    def runs_fsdp_turbo(self) -> bool:
        """A case of the file runs fsdp_turbo: the FSDPTurbo checkout is needed."""
        return any(c.is_turbo for c in self.cases) or any(
            t.runs_fsdp_turbo for t in self.trainer_cases
        )

    def get(self, case_id: str) -> Case:
        return find_case(self.cases, case_id, self.path)

    def get_trainer(self, case_id: str) -> TrainerCase:
        for case in self.trainer_cases:
            if case.id == case_id:
                return case
        known = ", ".join(c.id for c in self.trainer_cases) or "none"
        raise ConfigError(f"{self.path}: no trainer case {case_id!r}; known: {known}")

    def find(self, case_id: str) -> Any:
        """The case of any kind with this id."""
        for cases in self.by_kind.values():
            for case in cases:
                if case.id == case_id:
                    return case
        raise ConfigError(
            f"{self.path}: no case {case_id!r}; known: {', '.join(self.all_ids()) or 'none'}"
        )

    def all_ids(self) -> list[str]:
        return [case.id for cases in self.by_kind.values() for case in cases]

    def params(self, kind: str = CaseKindName.PPO_STEP) -> list[CaseParam]:
        """Each case of `kind` on each of its device kinds."""
        return [CaseParam(case, dev) for case in self.by_kind.get(kind, []) for dev in case.devices]

    def trainer_params(self) -> list[CaseParam]:
        return self.params(CaseKindName.VERL_TRAINER)


class TableKind(Protocol):
    """What the book needs of a case kind: its name, its table, and its reader."""

    name: str
    table: str

    def read(self, data: dict, path: Path, context: ReadContext) -> list[Any]: ...


def read_book(path: Path, kinds: Sequence[TableKind], context: ReadContext) -> CaseBook:
    """The case file, every kind's table read by its kind; an id names one case across all."""
    data = read_toml(path)
    tables = [kind.table for kind in kinds]
    if not any(data.get(table) for table in tables):
        raise ConfigError(
            f"{path}: expected one or more " + " or ".join(f"[[{t}]]" for t in tables) + " tables"
        )
    by_kind: dict[str, list] = {}
    seen: dict[str, str] = {}
    for kind in kinds:
        by_kind[kind.name] = kind.read(data, path, context)
        for case in by_kind[kind.name]:
            if case.id in seen:
                raise ConfigError(
                    f"{path}: [[{kind.table}]] {case.id!r}: field 'id': expected an id no "
                    f"[[{seen[case.id]}]] uses; got a duplicate"
                )
            seen[case.id] = kind.table
    return CaseBook(path, by_kind)


def find_case(cases: list[Case], case_id: str, path: Path) -> Case:
    for case in cases:
        if case.id == case_id:
            return case
    raise ConfigError(f"{path}: no case {case_id!r}; known: {', '.join(c.id for c in cases)}")
