"""What `pytest-fsdp-turbo config` and `doctor` say of trainer cases: verl's own config resolved
with the case's overrides (the sync policy first), and the overrides main_ppo is handed."""

from __future__ import annotations

from pytest_fsdp_turbo.cases.trainer_case import TrainerCase
from pytest_fsdp_turbo.trainer.verl_config import resolve_case
from pytest_fsdp_turbo_contract.errors import ConfigError, Unavailable


def trainer_config_lines(case: TrainerCase) -> list[str]:
    """The case as verl resolves it; ConfigError or Unavailable where verl cannot here."""
    resolved = resolve_case(case)
    return [
        f"trainer case {case.id} (verl's main_ppo, {case.world_size} ranks):",
        *(f"  {line}" for line in resolved.lines()),
        "overrides (the case's; the harness adds one step, its logs and its observer):",
        *(f"  {override}" for override in case.overrides),
    ]


def trainer_case_lines(cases: list[TrainerCase]) -> list[str]:
    """Each trainer case's sync policy as verl's own config resolves it, for doctor."""
    lines = []
    for case in cases:
        try:
            line = resolve_case(case).lines()[0]
        except (ConfigError, Unavailable) as exc:
            line = f"verl's config cannot be resolved here ({exc})"
        lines.append(f"trainer:   {case.id}: {line}")
    return lines
