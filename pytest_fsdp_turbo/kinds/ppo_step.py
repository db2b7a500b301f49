"""The harness's own PPO step as a case kind: a `[[case]]` table (pytest_fsdp_turbo/cases/
engine_case.py) runs through an engine on leased ranks (pytest_fsdp_turbo/launching/), judged by
checks a to l."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pytest_fsdp_turbo.cases.engine_case import TABLE, Case, read_table
from pytest_fsdp_turbo.cases.table import ReadContext
from pytest_fsdp_turbo.models import missing_model
from pytest_fsdp_turbo.needs import case_needs, missing_packages
from pytest_fsdp_turbo.settings import Settings
from pytest_fsdp_turbo_contract.results import RunResult
from pytest_fsdp_turbo_contract.vocab import CaseKindName, Rollout


class PPOStep:
    name = CaseKindName.PPO_STEP
    table = TABLE
    fixture = "fsdp_turbo_case"

    def read(self, data: dict, path: Path, context: ReadContext) -> list[Case]:
        return read_table(data, path, context)

    def owns(self, case: object) -> bool:
        return isinstance(case, Case)

    def marks(self, case: Case) -> list[str]:
        return [
            *(["vllm"] if case.ppo.rollout == Rollout.VLLM else []),
            *(["fsdp_turbo"] if case.is_turbo else []),
            *(["verl"] if case.is_verl else []),
        ]

    def missing(self, case: Case, device_kind: str, settings: Settings) -> list[str]:
        needs = case_needs(case, device_kind)
        lines = [f"{n.reason} needs {n.name}: {n.hint}" for n in missing_packages(needs)]
        for need in (n for n in needs if n.kind == "model"):
            lines += missing_model(need.name, settings.models)
        return lines

    def run(self, request: pytest.FixtureRequest, case: Case, **options: Any) -> RunResult:
        """Through the `ppo_run` fixture, which takes the case's field overrides and launch
        options (engine_modules, pythonpath, extra_env, launcher, checkout)."""
        return request.getfixturevalue("ppo_run")(case, **options)
