"""verl's own trainer as a case kind: `main_ppo` as a verl e2e script runs it, judged by the harness.
A `[[trainer_case]]` table holds the script's Hydra overrides as the script writes them, the model,
the device kinds and the world size; everything else is the harness's (leases, collective
environment, timeout, logs, the observer, the checks). Its keys are read by the same reader as an
engine case's, from `TrainerCase`'s fields. Torch-free.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from pytest_fsdp_turbo.cases.table import (
    TINY_PREFIX,
    TableReader,
    check_known_failure,
    check_tiny,
    read_rows,
)
from pytest_fsdp_turbo_contract.errors import ConfigError
from pytest_fsdp_turbo_contract.spec import BOUNDS, Bounds
from pytest_fsdp_turbo_contract.trainer_spec import PLACEHOLDERS
from pytest_fsdp_turbo_contract.vocab import DeviceKind, GoldenTier

TABLE = "trainer_case"
ENTRY = "verl.trainer.main_ppo"
_PLACEHOLDER = re.compile(r"\{[a-z_]+\}")
# key=value, +key=value, ++key=value or ~key: Hydra's override grammar, as far as a case needs it
_OVERRIDE = re.compile(r"^(\+\+|\+|~)?[A-Za-z_][\w.\-]*(=.*)?$", re.S)
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class TrainerCase:
    id: str
    model: str
    # the script's, as its `python -m verl.trainer.main_ppo` line has them
    overrides: tuple[str, ...] = ()
    # trainer.n_gpus_per_node x trainer.nnodes: the devices the harness leases
    world_size: int = field(default=2, metadata={BOUNDS: Bounds(1)})
    devices: tuple[DeviceKind, ...] = (DeviceKind.CPU,)
    # modules verl imports in every process (VERL_USE_EXTERNAL_MODULES): a downstream engine
    # registered in verl's EngineRegistry, for instance
    external_modules: tuple[str, ...] = ()
    # the script's own exports (HCCL_CONNECT_TIMEOUT, ...); the lease's collective environment
    # (device visibility, HCCL port ranges) wins over them
    env: dict[str, str] = field(default_factory=dict)
    # the whole trainer: Ray, every actor, the rollout servers, one step
    timeout: float = field(
        default=900.0,
        metadata={BOUNDS: Bounds(0, 1e6, low_open=True, expected="a number of seconds > 0")},
    )
    golden_tier: GoldenTier = GoldenTier.RELATIVE
    description: str = ""
    # device kind -> {reason, match}, as an engine case's
    known_failure: dict = field(default_factory=dict)

    @property
    def is_tiny(self) -> bool:
        return self.model.startswith(TINY_PREFIX)

    @property
    def rolls_out_with_vllm(self) -> bool:
        return self.override("actor_rollout_ref.rollout.name") in (None, "vllm")

    def override(self, key: str) -> str | None:
        """The value the case's overrides give `key` (the last one wins, as in Hydra)."""
        found = None
        for item in self.overrides:
            name, _, value = item.lstrip("+").partition("=")
            if name == key:
                found = value
        return found


READER = TableReader("trainer case", {"case": TrainerCase}, extra=("script", "extends"))


def overrides_of_script(script: Path) -> tuple[str, ...]:
    """The Hydra overrides of the `python -m verl.trainer.main_ppo ...` line of a shell script (a
    verl e2e script), continuation lines joined; `$VAR` and `${VAR}` are kept as written."""
    text = script.read_text(encoding="utf-8").replace("\\\n", " ")
    for line in text.splitlines():
        words = shlex.split(line, comments=True)
        if ENTRY in words:
            return tuple(w for w in words[words.index(ENTRY) + 1 :] if "=" in w or w[:1] == "~")
    raise ConfigError(f"{script}: no `python -m {ENTRY}` line")


def validate_trainer_case(
    raw: dict, path: Path | str, specs: list[str], earlier: dict[str, TrainerCase] | None = None
) -> TrainerCase:
    where = READER.where(raw, path)
    values = dict(raw)
    if "extends" in values:  # another trainer case's overrides first, then this one's
        base = (earlier or {}).get(values.pop("extends"))
        if base is None:
            raise where.error("extends", "the id of a trainer case above this one", raw["extends"])
        values["overrides"] = [*base.overrides, *values.get("overrides", [])]
        values.setdefault("model", base.model)
    if "script" in values:  # a verl e2e script's own overrides, then the case's
        script = Path(path).parent / str(values.pop("script"))
        if not script.is_file():
            raise where.error("script", "a shell script next to the case file", str(script))
        values["overrides"] = [*overrides_of_script(script), *values.get("overrides", [])]
    if not isinstance(values.get("overrides"), list | tuple):
        raise where.error(
            "overrides", "a list of Hydra overrides (key=value strings)", values.get("overrides")
        )
    case = TrainerCase(**READER.read(values, where)["case"])
    for item in case.overrides:
        if not _OVERRIDE.match(item):
            raise where.error("overrides", "key=value, +key=value, ++key=value or ~key", item)
        for placeholder in _PLACEHOLDER.findall(item):
            if placeholder not in PLACEHOLDERS:
                raise where.error(
                    "overrides", "placeholders among " + ", ".join(PLACEHOLDERS), item
                )
    if not case.devices:
        raise where.error("devices", "at least one of " + ", ".join(DeviceKind), [])
    bad_env = [
        (k, v) for k, v in case.env.items() if not _ENV_NAME.fullmatch(k) or not isinstance(v, str)
    ]
    if bad_env:
        raise where.error("env", "a table of variable = string", dict(bad_env))
    check_tiny(where, case.model, specs)
    check_known_failure(where, case.known_failure, case.devices)
    per_node, nodes = case.override("trainer.n_gpus_per_node"), case.override("trainer.nnodes")
    if per_node is not None:
        declared = _int(per_node) * _int(nodes or "1")
        if declared != case.world_size:
            raise where.error(
                "world_size",
                f"trainer.n_gpus_per_node x trainer.nnodes from the overrides ({declared})",
                case.world_size,
            )
    return case


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        return -1


def trainer_cases(data: dict, path: Path, specs: list[str]) -> list[TrainerCase]:
    """The case file's `[[trainer_case]]` tables, each validated; ids unique among them."""

    def read_one(row: dict, earlier: list[TrainerCase]) -> TrainerCase:
        return validate_trainer_case(row, path, specs, {c.id: c for c in earlier})

    return read_rows(data, TABLE, READER, path, read_one)
