"""Collection: a test that asks for a case fixture runs once per case x device kind of the case
file, each marked so a selection (`-m cpu_e2e`, `-m verl_trainer`) finds it; an invalid case file
makes each such test fail with its one line."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from pytest_fsdp_turbo.options import KIND_BY_MARKER, MARKER_BY_KIND
from pytest_fsdp_turbo.session import cases_of
from pytest_fsdp_turbo_contract.errors import ConfigError

CASE_FIXTURE = "fsdp_turbo_case"
TRAINER_CASE_FIXTURE = "fsdp_turbo_trainer_case"


@dataclass(frozen=True)
class BrokenCaseFile:
    """The parameter a test that takes a case gets when the case file is invalid."""

    message: str


def case_param(item: pytest.Item):
    return getattr(getattr(item, "callspec", None), "params", {}).get(CASE_FIXTURE)


def trainer_param(item: pytest.Item):
    return getattr(getattr(item, "callspec", None), "params", {}).get(TRAINER_CASE_FIXTURE)


def case_marks(param) -> list[pytest.MarkDecorator]:
    """What selects a case's test: e2e, its device kind, its devices, what it needs."""
    from pytest_fsdp_turbo.cases import Case  # loaded with the case file, not at start-up

    case, known = param.case, param.known_failure
    common = [
        pytest.mark.e2e,
        getattr(pytest.mark, MARKER_BY_KIND[param.kind]),
        pytest.mark.devices(param.ranks),
        *([pytest.mark.xfail(strict=True, reason=known["reason"])] if known else []),
    ]
    if isinstance(case, Case):
        return [
            *common,
            *([pytest.mark.vllm] if case.ppo.rollout == "vllm" else []),
            *([pytest.mark.fsdp_turbo] if case.is_turbo else []),
            *([pytest.mark.verl] if case.is_verl else []),
        ]
    return [  # verl's own trainer
        *common,
        pytest.mark.verl,
        pytest.mark.verl_trainer,
        *([pytest.mark.vllm] if case.rolls_out_with_vllm else []),
    ]


def parametrize(metafunc: pytest.Metafunc, fixture: str) -> None:
    try:
        book = cases_of(metafunc.config)
    except ConfigError as exc:
        # the tests that take a case each fail with the one line at setup; every other test of
        # the module and the session still runs, and any e2e selection keeps the error in view
        broken = BrokenCaseFile(str(exc))
        marks = [pytest.mark.e2e, *(getattr(pytest.mark, m) for m in KIND_BY_MARKER)]
        metafunc.parametrize(fixture, [pytest.param(broken, id="case-file-error", marks=marks)])
        return
    params = book.params() if fixture == CASE_FIXTURE else book.trainer_params()
    metafunc.parametrize(fixture, [pytest.param(p, id=p.id, marks=case_marks(p)) for p in params])
