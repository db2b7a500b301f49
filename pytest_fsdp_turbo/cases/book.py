"""The case file: every kind's table read into cases, looked up by id, and each case on each of
its device kinds one test parameter. Torch-free."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

from pytest_fsdp_turbo.cases.engine_case import TABLE as CASE_TABLE
from pytest_fsdp_turbo.cases.engine_case import Case, validate_case
from pytest_fsdp_turbo.cases.lookup import FIXTURES_DIR, tiny_specs
from pytest_fsdp_turbo.cases.trainer_case import TABLE as TRAINER_TABLE
from pytest_fsdp_turbo.cases.trainer_case import TrainerCase, trainer_cases
from pytest_fsdp_turbo_contract.engines import EngineCatalog
from pytest_fsdp_turbo_contract.errors import ConfigError

DEFAULT_CASES = Path("e2e") / "cases.toml"  # under the rootdir, unless an option or ini names one
TABLES = (CASE_TABLE, TRAINER_TABLE)


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


def _read_toml(path: Path) -> dict:
    if not path.is_file():
        what = "is a folder, not a file" if path.is_dir() else "does not exist"
        raise ConfigError(f"--fsdp-turbo-cases / fsdp_turbo_cases: case file {path} {what}")
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    except RecursionError:  # tomllib recurses once per level of nesting
        raise ConfigError(f"{path}: a value nested deeper than a case file needs") from None


def _engine_cases(
    data: dict, path: Path, specs: list[str], engines: EngineCatalog | None
) -> list[Case]:
    rows = data.get(CASE_TABLE, [])
    if not isinstance(rows, list) or not (rows or data.get(TRAINER_TABLE)):
        raise ConfigError(f"{path}: expected one or more [[case]] or [[trainer_case]] tables")
    defaults = data.get("defaults", {})
    if not isinstance(defaults, dict):
        raise ConfigError(f"{path}: [defaults] must be a table")
    cases: list[Case] = []
    for row in rows:
        if not isinstance(row, dict):
            raise ConfigError(f"{path}: every [[case]] entry must be a table")
        case = validate_case({**defaults, **row}, path, specs, engines)
        if case.id in {c.id for c in cases}:
            raise ConfigError(
                f"{path}: case {case.id!r}: field 'id': expected a unique id; got a duplicate"
            )
        cases.append(case)
    return cases


def load_cases(
    path: Path,
    fixtures_dir: Path = FIXTURES_DIR,
    engines: EngineCatalog | None = None,
    tiny_models: Path | None = None,
) -> list[Case]:
    """The case file's engine cases, every one validated; backends may be any engine the catalog
    announces."""
    return _engine_cases(_read_toml(path), path, tiny_specs(tiny_models, fixtures_dir), engines)


class CaseBook:
    """The loaded case file, looked up by id: engine cases and verl trainer cases."""

    def __init__(
        self, path: Path, cases: list[Case], trainer_cases: list[TrainerCase] | None = None
    ):
        self.path, self.cases = path, cases
        self.trainer_cases = trainer_cases or []

    def get(self, case_id: str) -> Case:
        return find_case(self.cases, case_id, self.path)

    def get_trainer(self, case_id: str) -> TrainerCase:
        for case in self.trainer_cases:
            if case.id == case_id:
                return case
        known = ", ".join(c.id for c in self.trainer_cases) or "none"
        raise ConfigError(f"{self.path}: no trainer case {case_id!r}; known: {known}")

    def all_ids(self) -> list[str]:
        return [c.id for c in self.cases] + [c.id for c in self.trainer_cases]

    def params(self) -> list[CaseParam]:
        return [CaseParam(case, kind) for case in self.cases for kind in case.devices]

    def trainer_params(self) -> list[CaseParam]:
        return [CaseParam(case, kind) for case in self.trainer_cases for kind in case.devices]


def load_book(
    path: Path,
    fixtures_dir: Path = FIXTURES_DIR,
    engines: EngineCatalog | None = None,
    tiny_models: Path | None = None,
) -> CaseBook:
    """The case file's engine cases and trainer cases; an id names one case across both."""
    data = _read_toml(path)
    specs = tiny_specs(tiny_models, fixtures_dir)
    cases = _engine_cases(data, path, specs, engines)
    trainers = trainer_cases(data, path, specs)
    clash = {c.id for c in cases} & {c.id for c in trainers}
    if clash:
        raise ConfigError(
            f"{path}: trainer case {sorted(clash)[0]!r}: field 'id': expected an id no [[case]] "
            "uses; got a duplicate"
        )
    return CaseBook(path, cases, trainers)


def find_case(cases: list[Case], case_id: str, path: Path) -> Case:
    for case in cases:
        if case.id == case_id:
            return case
    raise ConfigError(f"{path}: no case {case_id!r}; known: {', '.join(c.id for c in cases)}")
