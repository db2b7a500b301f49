"""What `pytest-fsdp-turbo config` and `doctor` say of trainer cases: verl's own config resolved
with the case's overrides (the sync policy first), and the overrides main_ppo is handed."""

from __future__ import annotations

from pytest_fsdp_turbo.cases.trainer_case import TrainerCase, variable_names, variable_value
from pytest_fsdp_turbo.environ import mask_secrets
from pytest_fsdp_turbo.trainer.verl_config import resolve_case
from pytest_fsdp_turbo_contract.errors import ConfigError, Unavailable


def trainer_config_lines(case: TrainerCase) -> list[str]:
    """The case as verl resolves it; ConfigError or Unavailable where verl cannot here."""
    resolved = resolve_case(case)
    return [
        f"trainer case {case.id} (verl's main_ppo, {case.world_size} ranks):",
        *(f"  {line}" for line in resolved.lines()),
        "  engine class: "
        + (
            f"{case.engine_class} (a run where verl built another is red)"
            if case.engine_class
            else "not declared: whatever verl's EngineRegistry holds (the run records the class)"
        )
        + (
            f"; external modules: {', '.join(case.external_modules)}"
            if case.external_modules
            else ""
        ),
        "overrides (a script's, then the case's; the last of a key wins, as in Hydra; the harness "
        "adds one step, its logs and its observer):",
        *(f"  {line}" for line in _annotated(case)),
        "env (the case's; a script's export lines are not run: they belong here):",
        *(f"  {name}={value}" for name, value in sorted(mask_secrets(case.env).items())),
    ]


def _annotated(case: TrainerCase) -> list[str]:
    """Each override, with the variables it reads as they expand (the case's env, then this
    environment) and a mark where a later override of the same key replaces it."""
    keys = [item.lstrip("+~").partition("=")[0] for item in case.overrides]
    lines = []
    for index, (item, key) in enumerate(zip(case.overrides, keys)):
        notes = []
        for name in variable_names(item):
            value = variable_value(name, case.env)
            shown = mask_secrets({name: value})[name] if value is not None else None
            notes.append(f"${name} = {shown}" if shown is not None else f"${name} unset")
        if key in keys[index + 1 :]:
            notes.append(f"replaced by a later override of {key}")
        lines.append(item + (f"   ({'; '.join(notes)})" if notes else ""))
    return lines


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
