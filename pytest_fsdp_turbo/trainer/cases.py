"""Trainer cases: verl's own trainer (`main_ppo`) as a verl e2e script runs it, one step, judged by
the harness. A `[[trainer_case]]` table of the case file holds the script's Hydra overrides as the
script writes them, the model, the device kinds and the world size; everything else is the harness's
(leases, collective environment, timeout, logs, the observer, the checks). Torch-free.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from pytest_fsdp_turbo.cases import CASE_ID, CASE_ID_MAX, TINY_PREFIX
from pytest_fsdp_turbo.devices import KINDS
from pytest_fsdp_turbo_contract.errors import ConfigError
from pytest_fsdp_turbo_contract.trainer_spec import PLACEHOLDERS
from pytest_fsdp_turbo_contract.vocab import DeviceKind, GoldenTier

TABLE = "trainer_case"
ENTRY = "verl.trainer.main_ppo"
_PLACEHOLDER = re.compile(r"\{[a-z_]+\}")
# key=value, +key=value, ++key=value or ~key: Hydra's override grammar, as far as a case needs it
_OVERRIDE = re.compile(r"^(\+\+|\+|~)?[A-Za-z_][\w.\-]*(=.*)?$", re.S)


@dataclass(frozen=True)
class TrainerCase:
    id: str
    model: str
    overrides: tuple[
        str, ...
    ]  # the script's, as its `python -m verl.trainer.main_ppo` line has them
    world_size: int = 2  # trainer.n_gpus_per_node x trainer.nnodes: the devices the harness leases
    devices: tuple[DeviceKind, ...] = (DeviceKind.CPU,)
    # modules verl imports in every process (VERL_USE_EXTERNAL_MODULES): a downstream engine
    # registered in verl's EngineRegistry, for instance
    external_modules: tuple[str, ...] = ()
    # the script's own exports (HCCL_CONNECT_TIMEOUT, ...); the lease's collective environment
    # (device visibility, HCCL port ranges) wins over them
    env: dict[str, str] = field(default_factory=dict)
    timeout: float = 900.0  # the whole trainer: Ray, every actor, the rollout servers, one step
    golden_tier: GoldenTier = GoldenTier.RELATIVE
    description: str = ""

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


@dataclass(frozen=True)
class TrainerParam:
    """One test parameter: a trainer case on one device kind."""

    case: TrainerCase
    kind: str

    @property
    def id(self) -> str:
        return f"{self.case.id}-{self.kind}"

    @property
    def ranks(self) -> int:
        """Devices the test leases."""
        return self.case.world_size


_FIELDS = {f.name: f for f in fields(TrainerCase)}


def _error(path: Path | str, case_id: str, name: str, expected: str, got: Any) -> ConfigError:
    return ConfigError(
        f"{path}: trainer case {case_id!r}: field {name!r}: expected {expected}; got {got!r}"
    )


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
    case_id = raw.get("id")
    shown = case_id if isinstance(case_id, str) else "?"

    def error(name: str, expected: str, got: Any) -> ConfigError:
        return _error(path, shown, name, expected, got)

    if (
        not isinstance(case_id, str)
        or not CASE_ID.fullmatch(case_id)
        or ".." in case_id
        or len(case_id) > CASE_ID_MAX
    ):
        raise error("id", "letters, digits, '.', '_' and '-', no '..'", case_id)
    unknown = sorted(set(raw) - set(_FIELDS) - {"script", "extends"})
    if unknown:
        known = ", ".join([*_FIELDS, "script", "extends"])
        raise error(unknown[0], f"a known field ({known})", raw[unknown[0]])
    values = dict(raw)
    if "extends" in values:  # another trainer case's overrides first, then this one's
        base = (earlier or {}).get(values.pop("extends"))
        if base is None:
            raise error("extends", "the id of a trainer case above this one", raw["extends"])
        values["overrides"] = [*base.overrides, *values.get("overrides", [])]
        values.setdefault("model", base.model)
    if "script" in values:  # a verl e2e script's own overrides, then the case's
        script = Path(path).parent / str(values.pop("script"))
        if not script.is_file():
            raise error("script", "a shell script next to the case file", str(script))
        values["overrides"] = [*overrides_of_script(script), *values.get("overrides", [])]
    if not isinstance(values.get("model"), str) or not values["model"]:
        raise error("model", "a tiny spec (tiny-...) or a local model name", values.get("model"))
    overrides = values.get("overrides")
    if not isinstance(overrides, list | tuple) or not all(isinstance(o, str) for o in overrides):
        raise error("overrides", "a list of Hydra overrides (key=value strings)", overrides)
    for item in overrides:
        if not _OVERRIDE.match(item):
            raise error("overrides", "key=value, +key=value, ++key=value or ~key", item)
        for placeholder in _PLACEHOLDER.findall(item):
            if placeholder not in PLACEHOLDERS:
                raise error("overrides", "placeholders among " + ", ".join(PLACEHOLDERS), item)
    values["overrides"] = tuple(overrides)
    for name in ("devices", "external_modules"):
        if name in values:
            items = values[name]
            if not isinstance(items, list | tuple) or not all(isinstance(i, str) for i in items):
                raise error(name, "a list of strings", items)
            values[name] = tuple(items)
    for kind in values.get("devices", ()):
        if kind not in KINDS:
            raise error("devices", "each one of " + ", ".join(KINDS), kind)
    values["devices"] = tuple(DeviceKind(k) for k in values.get("devices", ("cpu",)))
    if not values["devices"]:
        raise error("devices", "at least one of " + ", ".join(KINDS), [])
    world = values.get("world_size", 2)
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise error("world_size", "a positive integer", world)
    timeout = values.get("timeout", 900.0)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout < 1e6:
        raise error("timeout", "a number of seconds > 0", timeout)
    values["timeout"] = float(timeout)
    tier = values.get("golden_tier", GoldenTier.RELATIVE)
    if tier not in GoldenTier.__members__.values():
        raise error("golden_tier", "one of " + ", ".join(GoldenTier), tier)
    values["golden_tier"] = GoldenTier(tier)
    env = values.get("env", {})
    if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
        raise error("env", "a table of variable = string", env)
    if not isinstance(values.get("description", ""), str):
        raise error("description", "a string", values["description"])
    case = TrainerCase(**values)
    if case.is_tiny and case.model not in specs:
        raise error("model", "a tiny spec (" + ", ".join(specs) + ")", case.model)
    per_node, nodes = case.override("trainer.n_gpus_per_node"), case.override("trainer.nnodes")
    if per_node is not None:
        declared = _int(per_node) * _int(nodes or "1")
        if declared != case.world_size:
            raise error(
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
    rows = data.get(TABLE, [])
    if not isinstance(rows, list):
        raise ConfigError(f"{path}: [[{TABLE}]] entries must be tables")
    cases: list[TrainerCase] = []
    seen: set[str] = set()
    for row in rows:
        if not isinstance(row, dict):
            raise ConfigError(f"{path}: every [[{TABLE}]] entry must be a table")
        case = validate_trainer_case(row, path, specs, {c.id: c for c in cases})
        if case.id in seen:
            raise _error(path, case.id, "id", "a unique id", "a duplicate")
        seen.add(case.id)
        cases.append(case)
    return cases
