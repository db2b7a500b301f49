"""verl's own trainer as a case kind: a `[[trainer_case]]` table (pytest_fsdp_turbo/cases/
trainer_case.py) runs verl's `main_ppo` as its e2e scripts do (pytest_fsdp_turbo/trainer/),
observed from outside verl and judged by its check set (pytest_fsdp_turbo/checks/trainer.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pytest_fsdp_turbo.cases.table import ReadContext
from pytest_fsdp_turbo.cases.trainer_case import TABLE, TrainerCase, trainer_cases
from pytest_fsdp_turbo.models import missing_model
from pytest_fsdp_turbo.settings import Settings
from pytest_fsdp_turbo.trainer.run import missing_needs
from pytest_fsdp_turbo_contract.results import RunResult
from pytest_fsdp_turbo_contract.vocab import CaseKindName


class VerlTrainer:
    name = CaseKindName.VERL_TRAINER
    table = TABLE
    fixture = "fsdp_turbo_trainer_case"

    def read(self, data: dict, path: Path, context: ReadContext) -> list[TrainerCase]:
        return trainer_cases(data, path, context.specs)

    def owns(self, case: object) -> bool:
        return isinstance(case, TrainerCase)

    def marks(self, case: TrainerCase) -> list[str]:
        return ["verl", "verl_trainer", *(["vllm"] if case.rolls_out_with_vllm else [])]

    def missing(self, case: TrainerCase, device_kind: str, settings: Settings) -> list[str]:
        lines = [f"verl's trainer needs {need}" for need in missing_needs()]
        return lines + ([] if case.is_tiny else missing_model(case.model, settings.models))

    def run(self, request: pytest.FixtureRequest, case: TrainerCase, **options: Any) -> RunResult:
        """Through the `verl_trainer_run` fixture; a trainer case takes no options (its overrides
        are its script's)."""
        if options:
            from pytest_fsdp_turbo.outcomes import fail_line

            fail_line(f"trainer case {case.id}: takes no run options; got {', '.join(options)}")
        return request.getfixturevalue("verl_trainer_run")(case)
