"""The case kinds a session knows: the built-in two, then any a downstream registers; the case
file read by all of them, once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_fsdp_turbo.cases.book import CaseBook, read_book
from pytest_fsdp_turbo.cases.lookup import FIXTURES_DIR, tiny_specs
from pytest_fsdp_turbo.cases.table import ReadContext
from pytest_fsdp_turbo.kinds.base import CaseKind
from pytest_fsdp_turbo.kinds.ppo_step import PPOStep
from pytest_fsdp_turbo.kinds.verl_trainer import VerlTrainer
from pytest_fsdp_turbo.launching.case_runner import case_file
from pytest_fsdp_turbo.session import cases_path, settings_of
from pytest_fsdp_turbo.settings import Settings
from pytest_fsdp_turbo_contract.engines import EngineCatalog
from pytest_fsdp_turbo_contract.errors import ConfigError

_KINDS: dict[str, CaseKind] = {kind.name: kind for kind in (PPOStep(), VerlTrainer())}
CASES_KEY = pytest.StashKey["CaseBook"]()


def register_kind(kind: CaseKind) -> None:
    """A downstream case kind, before the case file is read (a conftest, a plugin's import). Its
    name, table and test parameter must be its own."""
    for other in _KINDS.values():
        if type(other) is type(kind):
            continue
        for what in ("name", "table", "fixture"):
            if getattr(kind, what) == getattr(other, what):
                raise ConfigError(
                    f"case kind {str(kind.name)!r}: its {what} {str(getattr(kind, what))!r} is "
                    f"case kind {str(other.name)!r}'s already"
                )
    _KINDS[kind.name] = kind


def case_kinds() -> list[CaseKind]:
    return list(_KINDS.values())


def kind_of(case: object) -> CaseKind:
    for kind in _KINDS.values():
        if kind.owns(case):
            return kind
    known = ", ".join(_KINDS)
    raise ConfigError(f"{type(case).__name__} is a case of no known kind ({known})")


def load_book(
    path: Path,
    fixtures_dir: Path = FIXTURES_DIR,
    engines: EngineCatalog | None = None,
    tiny_models: Path | None = None,
) -> CaseBook:
    """The case file, every kind's table validated; an id names one case across all kinds."""
    return read_book(
        path, case_kinds(), ReadContext(tiny_specs(tiny_models, fixtures_dir), engines)
    )


def book_for(path: Path, settings: Settings) -> CaseBook:
    return load_book(path, engines=settings.engines(), tiny_models=settings.tiny_models)


def cases_of(config: pytest.Config) -> CaseBook:
    """The case file, loaded and validated once per session (ConfigError on bad input)."""
    if CASES_KEY not in config.stash:
        config.stash[CASES_KEY] = book_for(cases_path(config), settings_of(config))
    return config.stash[CASES_KEY]


def standalone_book(settings: Settings) -> CaseBook:
    """The case book `pytest-fsdp-turbo` verbs read, found as pytest would find it."""
    return book_for(case_file(settings), settings)
