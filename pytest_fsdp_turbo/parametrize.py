"""Collection: a test that asks for a case kind's parameter (`fsdp_turbo_case`,
`fsdp_turbo_trainer_case`, or a downstream kind's) runs once per case of that kind x device kind,
each marked so a selection (`-m cpu_e2e`, `-m verl_trainer`) finds it; an invalid case file makes
each such test fail with its one line."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import pytest

from pytest_fsdp_turbo.options import KIND_BY_MARKER, MARKER_BY_KIND
from pytest_fsdp_turbo_contract.errors import ConfigError

# the built-in kinds' parameters, known without loading the case machinery at start-up
BUILT_IN_FIXTURES = ("fsdp_turbo_case", "fsdp_turbo_trainer_case")


@dataclass(frozen=True)
class BrokenCaseFile:
    """The parameter a test that takes a case gets when the case file is invalid."""

    message: str


def case_params(item: pytest.Item) -> list:
    """The case parameters (of any kind) a collected test was handed; none, without importing
    anything, in a session that never read a case file."""
    cases = sys.modules.get("pytest_fsdp_turbo.cases")
    kinds = (BrokenCaseFile, *((cases.CaseParam,) if cases is not None else ()))
    params = getattr(getattr(item, "callspec", None), "params", {}).values()
    return [p for p in params if isinstance(p, kinds)]


def case_marks(param, kind) -> list[pytest.MarkDecorator]:
    """What selects a case's test: e2e, its device kind, its devices, what its kind adds."""
    known = param.known_failure
    return [
        pytest.mark.e2e,
        getattr(pytest.mark, MARKER_BY_KIND[param.kind]),
        pytest.mark.devices(param.ranks),
        *([pytest.mark.xfail(strict=True, reason=known["reason"])] if known else []),
        *(getattr(pytest.mark, name) for name in kind.marks(param.case)),
    ]


def parametrize(metafunc: pytest.Metafunc) -> None:
    """Each case kind whose parameter the test asks for: its cases x their device kinds."""
    if not any(f in metafunc.fixturenames for f in BUILT_IN_FIXTURES) and not _kinds_loaded():
        return  # a downstream kind registers before its tests are collected
    # the case machinery, on first use
    from pytest_fsdp_turbo.kinds.registry import case_kinds, cases_of

    wanted = [kind for kind in case_kinds() if kind.fixture in metafunc.fixturenames]
    if not wanted:
        return
    try:
        book = cases_of(metafunc.config)
    except ConfigError as exc:
        # the tests that take a case each fail with the one line at setup; every other test of
        # the module and the session still runs, and any e2e selection keeps the error in view
        broken = BrokenCaseFile(str(exc))
        marks = [pytest.mark.e2e, *(getattr(pytest.mark, m) for m in KIND_BY_MARKER)]
        for kind in wanted:
            param = pytest.param(broken, id="case-file-error", marks=marks)
            metafunc.parametrize(kind.fixture, [param])
        return
    for kind in wanted:
        params = book.params(kind.name)
        metafunc.parametrize(
            kind.fixture, [pytest.param(p, id=p.id, marks=case_marks(p, kind)) for p in params]
        )


def _kinds_loaded() -> bool:
    return "pytest_fsdp_turbo.kinds.registry" in sys.modules
