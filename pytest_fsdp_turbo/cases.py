"""The e2e case file: schema, loading, validation and parametrization (torch-free).

Every problem is a ConfigError naming the file, the case id, the field and what was expected.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from pytest_fsdp_turbo_fixtures import DATA_DIR

from pytest_fsdp_turbo.devices import KINDS
from pytest_fsdp_turbo.settings import default_engines
from pytest_fsdp_turbo_contract.engines import (
    ANNOUNCED_WHERE,
    GIVEN,
    Capabilities,
    EngineCatalog,
)
from pytest_fsdp_turbo_contract.errors import ConfigError
from pytest_fsdp_turbo_contract.spec import BOUNDS, RUN, EngineSpec, PPOSpec, RankSpec
from pytest_fsdp_turbo_contract.vocab import (
    VERL_PREFIX,
    Capability,
    DeviceKind,
    GoldenTier,
    SyncPolicy,
    TwinKind,
)

FIXTURES_DIR = DATA_DIR
PROMPT_SET = DATA_DIR / "prompts" / "nearest_char.jsonl"  # the prompts every case samples from
TINY_PREFIX = "tiny-"
VERL_NAME = re.compile(r"^verl:[A-Za-z0-9_]+$")
# Ids become test ids and folder names (goldens, artifacts): no separators, no "..", no spaces.
CASE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")  # whole id (fullmatch: no trailing newline)
CASE_ID_MAX = 100  # a folder name under the artifacts and goldens, with room for suffixes
# a model is a folder inside the models folder (an organisation's subfolder allowed), never a path
# out of it; each part starts with a letter or digit, so ".." and hidden folders cannot appear
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)*")
MODEL_MAX = 200
DEFAULT_CASES = Path("e2e") / "cases.toml"  # under the rootdir, unless an option or ini names one


@dataclass(frozen=True)
class Case:
    """One `[[case]]`. The harness's own fields are here; what the ranks are asked to do is in
    `engine` and `ppo`, the rank spec's own dataclasses (pytest_fsdp_turbo_contract/spec.py),
    read from the same flat table: each key goes to the dataclass whose field it names."""

    id: str
    model: str
    engine: EngineSpec = field(default_factory=EngineSpec)
    ppo: PPOSpec = field(default_factory=PPOSpec)
    devices: tuple[DeviceKind, ...] = (DeviceKind.CPU,)
    timeout: float = 300.0
    collective_timeout: float = 120.0
    memory_budget_mb: float | None = None
    golden_tier: GoldenTier = GoldenTier.RELATIVE
    twin: TwinKind | None = None  # default: single when there is no in-rank reference, else none
    description: str = ""
    # device kind -> {reason, match}: a crash known on that kind, run as a strict expected failure
    # (red if it starts passing, or if it fails without `match` in its failure), never a skip
    known_failure: dict = field(default_factory=dict)
    # what the backend's engine declares on its catalog entry: set by validation, never by a case
    capabilities: Capabilities = field(default=Capabilities(), metadata={"derived": True})

    @property
    def is_tiny(self) -> bool:
        return self.model.startswith(TINY_PREFIX)

    @property
    def is_verl(self) -> bool:
        return self.engine.backend.startswith(VERL_PREFIX)

    @property
    def is_turbo(self) -> bool:
        """Built on the fsdp_turbo library (its catalog entry declares turbo_config): ours,
        verl's FSDP-Turbo engine, or a downstream engine that says so."""
        return Capability.TURBO_CONFIG in self.capabilities

    def with_reference_checks(self) -> bool:
        checks = self.ppo.reference_checks
        return self.is_tiny if checks is None else checks

    def twin_kind(self) -> TwinKind:
        if self.twin is not None:
            return self.twin
        return TwinKind.NONE if self.with_reference_checks() else TwinKind.SINGLE

    def rank_spec(
        self,
        kind: str,
        *,
        model_path: str,
        model_type: str,
    ) -> RankSpec:
        """What every rank of this case is asked to do on `kind` (spec.json): the case's own
        engine and PPO parts, with what depends on the device kind settled; a run adds its own
        part (launching.request.rank_spec)."""
        engine = dataclasses.replace(
            self.engine,
            fsdp_size=self.engine.shard_size,
            dtype=self.engine.dtype_on(kind),
            capabilities=self.capabilities.capabilities,
        )
        ppo = dataclasses.replace(self.ppo, reference_checks=self.with_reference_checks())
        return RankSpec(
            case_id=self.id,
            model_path=model_path,
            model_type=model_type,
            device_kind=DeviceKind(kind),
            engine=engine,
            ppo=ppo,
            memory_budget_mb=self.memory_budget_mb,
            collective_timeout_s=self.collective_timeout,
            timeout_s=self.timeout,
            golden_tier=self.golden_tier,
        )


# Each flat key of a [[case]] and the part that owns it: the case itself, or the spec's engine or
# PPO dataclass (their fields a run fills in are no keys)
PARTS = ("case", "engine", "ppo")
_OWN = {"case": Case, "engine": EngineSpec, "ppo": PPOSpec}
_DECLARED = {
    part: {
        f.name: f
        for f in dataclasses.fields(_OWN[part])
        if not f.metadata.get("derived") and not f.metadata.get(RUN) and f.name not in PARTS
    }
    for part in PARTS
}
OWNER = {name: part for part in PARTS for name in _DECLARED[part]}
assert len(OWNER) == sum(map(len, _DECLARED.values())), "a case key is declared in two parts"
_FIELDS = {name: f for part in PARTS for name, f in _DECLARED[part].items()}
_EXPECTED = {
    int: "an integer",
    float: "a number",
    str: "a string",
    bool: "true or false",
    dict: "a table",
    tuple: "a list of strings",
}


def case_keys(case: Case) -> dict[str, Any]:
    """The case as its flat table: every key, whichever part owns it."""
    parts = {"case": case, "engine": case.engine, "ppo": case.ppo}
    return {name: getattr(parts[OWNER[name]], name) for name in _FIELDS}


def _base_type(annotation) -> type:
    """`int`, `float | None`, `tuple[str, ...]`, `SyncPolicy` -> int, float, tuple, str: the
    field's TOML type."""
    for arg in (annotation, *typing.get_args(annotation)):
        origin = typing.get_origin(arg) or arg
        if origin in _EXPECTED:
            return origin
        if isinstance(origin, type) and issubclass(origin, StrEnum):
            return str
    raise TypeError(f"Case field type {annotation!r} has no TOML reading")


def _closed_set(annotation) -> type[StrEnum] | None:
    """The vocabulary enum a field (or each item of a tuple field) takes its values from."""
    for arg in (annotation, *typing.get_args(annotation)):
        if isinstance(arg, type) and issubclass(arg, StrEnum):
            return arg
        if typing.get_origin(arg) is tuple:
            return _closed_set(typing.get_args(arg)[0])
    return None


_HINTS = {
    name: hint
    for part in PARTS
    for name, hint in typing.get_type_hints(_OWN[part]).items()
    if name in _DECLARED[part]
}
_TYPES = {name: _base_type(hint) for name, hint in _HINTS.items()}
_CLOSED_SETS = {name: e for name, hint in _HINTS.items() if (e := _closed_set(hint)) is not None}


@functools.cache
def prompt_count() -> int:
    return sum(1 for line in PROMPT_SET.read_text().splitlines() if line.strip())


def engine_module_source(module: str, pythonpath: Iterable[str] = ()) -> Path | None:
    """Where a named engine module's source is, as the ranks will look (ppo_run's `pythonpath`
    first, then this process's path), found by walking folders: nothing is imported, not even a
    parent package's `__init__.py` (the engines run only in the ranks); None: nowhere."""
    import importlib.util
    import sys

    top, *rest = module.split(".")
    roots = [Path(root or ".") for root in (*pythonpath, *sys.path)]
    try:  # a top-level name is found without importing anything (editable installs' finders too)
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        roots += [Path(p).parent for p in spec.submodule_search_locations]
    elif spec is not None and spec.origin and not rest:
        roots.append(Path(spec.origin).parent)
    for root in roots:
        folder = root.joinpath(top, *rest[:-1]) if rest else root
        name = rest[-1] if rest else top
        for candidate in (folder / f"{name}.py", folder / name / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


def tiny_spec_dirs(extra: Path | None = None, fixtures_dir: Path = FIXTURES_DIR) -> list[Path]:
    """Where tiny model specs are looked up: a downstream's own folder first
    (--fsdp-turbo-tiny-models), then the ones that ship with the plugin."""
    return [*([extra] if extra else []), fixtures_dir / "models"]


def tiny_spec_path(name: str, dirs: list[Path]) -> Path | None:
    return next((d / f"{name}.json" for d in dirs if (d / f"{name}.json").is_file()), None)


def tiny_specs(extra: Path | None = None, fixtures_dir: Path = FIXTURES_DIR) -> list[str]:
    dirs = tiny_spec_dirs(extra, fixtures_dir)
    return sorted({p.stem for d in dirs for p in d.glob("*.json")})


class _Where:
    def __init__(self, path: Path | str, case_id: str):
        self.path, self.case_id = path, case_id

    def error(self, name: str, expected: str, got: Any) -> ConfigError:
        return ConfigError(
            f"{self.path}: case {self.case_id!r}: field {name!r}: expected {expected}; got {got!r}"
        )


def _coerce(where: _Where, name: str, value: Any) -> Any:
    kind = _TYPES[name]
    if kind is float and isinstance(value, int | float) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise where.error(name, "a finite number", value)
        return float(value)
    if kind is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if kind is tuple and isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
        return tuple(value)
    if kind in (str, bool, dict) and isinstance(value, kind):
        return value
    raise where.error(name, _EXPECTED[kind], value)


def _member(where: _Where, name: str, value: Any) -> Any:
    """A closed-set field's value as its enum member(s), or one line naming the members."""
    closed = _CLOSED_SETS[name]
    items = value if isinstance(value, tuple) else (value,)
    for item in items:
        if item not in closed.__members__.values():
            raise where.error(name, "one of " + ", ".join(closed), item)
    members = tuple(closed(item) for item in items)
    return members if isinstance(value, tuple) else members[0]


def validate_case(
    raw: dict,
    path: Path | str,
    specs: list[str],
    engines: EngineCatalog | None = None,
    announced: str = ANNOUNCED_WHERE,
) -> Case:
    """Every rule for a case, wherever it is made (case file or ppo_run overrides). The backend
    must be one the engine catalog knows; a catalog with bare modules accepts any plain name, and
    the ranks' registry names it if no module registers it."""
    case_id = raw.get("id")
    where = _Where(path, case_id if isinstance(case_id, str) else "?")
    if (
        not isinstance(case_id, str)
        or not CASE_ID.fullmatch(case_id)
        or ".." in case_id
        or len(case_id) > CASE_ID_MAX
    ):
        raise where.error(
            "id",
            "letters, digits, '.', '_' and '-', starting with a letter or digit, no '..', at "
            f"most {CASE_ID_MAX} characters",
            case_id,
        )
    unknown = sorted(set(raw) - set(_FIELDS))
    if unknown:
        raise where.error(unknown[0], "a known field (" + ", ".join(_FIELDS) + ")", raw[unknown[0]])
    if "model" not in raw:
        raise where.error("model", "a tiny spec (tiny-...) or a local model name", None)
    model = raw["model"]
    if not (isinstance(model, str) and MODEL_NAME.fullmatch(model) and len(model) <= MODEL_MAX):
        raise where.error(
            "model",
            "a tiny spec (tiny-...) or a folder inside the models folder: names of letters, "
            f"digits, '.', '_' and '-' joined by '/', no '..', at most {MODEL_MAX} characters",
            model if not isinstance(model, str) or len(model) <= MODEL_MAX else model[:60] + "...",
        )
    values = {name: _coerce(where, name, value) for name, value in raw.items()}
    for name in set(values) & set(_CLOSED_SETS):
        if values[name] is not None:
            values[name] = _member(where, name, values[name])
    for name, value in values.items():
        bounds = _FIELDS[name].metadata.get(BOUNDS)
        if bounds is not None and value is not None and not bounds.holds(value):
            raise where.error(name, bounds.words(_TYPES[name] is int), value)
    parts: dict[str, dict[str, Any]] = {part: {} for part in PARTS}
    for name, value in values.items():
        parts[OWNER[name]][name] = value
    case = Case(**parts["case"], engine=EngineSpec(**parts["engine"]), ppo=PPOSpec(**parts["ppo"]))
    engine, ppo = case.engine, case.ppo
    if case.is_tiny and case.model not in specs:
        raise where.error(
            "model",
            "a tiny spec (" + ", ".join(specs) + ") from --fsdp-turbo-tiny-models or the plugin's",
            case.model,
        )
    engines = engines or default_engines()
    if case.is_verl:
        if not VERL_NAME.match(engine.backend):
            raise where.error(
                "backend", "verl:<name> with a name from verl's EngineRegistry", engine.backend
            )
    elif not engines.accepts(engine.backend):
        plain = [b for b in engines.backends if not b.startswith(VERL_PREFIX)]
        allowed = ", ".join((*plain, "verl:<name>"))
        raise where.error("backend", f"one of {allowed} ({announced})", engine.backend)
    case = dataclasses.replace(case, capabilities=engines.capabilities(engine.backend))
    _engine_can(case, where)
    if (
        case.twin_kind() == TwinKind.EVERY_MICRO_BATCH
        and engine.gradient_sync != SyncPolicy.DEFERRED
    ):
        raise where.error(
            "twin", "single or none when gradient_sync is already every_micro_batch", case.twin
        )
    if not case.devices:
        raise where.error("devices", "at least one of " + ", ".join(KINDS), list(case.devices))
    if engine.world_size % (engine.shard_size * engine.sp_size):
        raise where.error(
            "world_size",
            f"divisible by fsdp_size x sp_size = {engine.shard_size * engine.sp_size}",
            engine.world_size,
        )
    for kind, known in case.known_failure.items():
        if kind not in case.devices or not (
            isinstance(known, dict)
            and set(known) == {"reason", "match"}
            and all(isinstance(v, str) and v.strip() for v in known.values())
        ):
            raise where.error(
                "known_failure",
                "a table per device kind of the case's devices, each with a non-empty reason "
                "(the bug, where it is tracked) and match (text its failure must contain)",
                {kind: known},
            )
    if ppo.clip_not_exercised and ppo.updates < 2:
        raise where.error(
            "clip_not_exercised",
            "no reason unless updates > 1 (one on-policy update never clips)",
            ppo.clip_not_exercised,
        )
    if not 0 < case.collective_timeout < case.timeout:
        raise where.error(
            "collective_timeout",
            f"positive and shorter than timeout ({case.timeout:g}s) so a hang names its rank",
            case.collective_timeout,
        )
    if ppo.num_prompts % engine.data_parallel_size:
        raise where.error(
            "num_prompts",
            f"divisible by the data-parallel size {engine.data_parallel_size}",
            ppo.num_prompts,
        )
    available = prompt_count()
    if ppo.num_prompts > available:
        raise where.error(
            "num_prompts", f"at most the {available} prompts of {PROMPT_SET.name}", ppo.num_prompts
        )
    rows = ppo.num_prompts // engine.data_parallel_size * ppo.n
    if ppo.micro_batches > rows:
        raise where.error(
            "micro_batches", f"at most the {rows} rows each rank trains on", ppo.micro_batches
        )
    if case.is_turbo:
        from pytest_fsdp_turbo_contract.turbo_config import build_turbo_config

        for kind in case.devices:
            try:
                build_turbo_config(engine, kind, case.model)
            except ConfigError as exc:
                raise ConfigError(
                    f"{path}: case {case.id!r}: field 'turbo_config': {exc}"
                ) from None
    if case.memory_budget_mb is not None and case.memory_budget_mb <= 0:
        raise where.error("memory_budget_mb", "a positive number of MiB", case.memory_budget_mb)
    return case


def _engine_can(case: Case, where: _Where) -> None:
    """What the case asks of its engine against what the engine's catalog entry declares."""
    engine, spec = case.capabilities, case.engine

    def lacks(capability: str) -> str:
        return (
            f"the backend's engine to declare {capability} (backend {spec.backend}: "
            f"{engine.announced_by or 'nothing declared'}; an entry declares it as "
            f"BACKEND = MODULE [{capability}, ...])"
        )

    if spec.sp_size > 1 and Capability.SP not in engine:
        raise where.error("sp_size", f"1, or {lacks(Capability.SP)}", spec.sp_size)
    if spec.packed and Capability.PACKING not in engine:
        raise where.error("packed", f"false, or {lacks(Capability.PACKING)}", spec.packed)
    if spec.packed and spec.sp_size < 2:
        raise where.error(
            "packed", "false unless sp_size > 1 (packing is what Ulysses shards)", spec.packed
        )
    if spec.turbo_config and Capability.TURBO_CONFIG not in engine:
        raise where.error(
            "turbo_config", f"no table, or {lacks(Capability.TURBO_CONFIG)}", "a table"
        )
    if outside := [kind for kind in case.devices if kind not in engine.devices]:
        raise where.error(
            "devices",
            f"device kinds the engine declares ({', '.join(sorted(engine.devices))}; "
            f"{engine.announced_by})",
            outside[0],
        )


def with_overrides(
    case: Case,
    overrides: dict,
    engines: EngineCatalog | None = None,
    tiny_models: Path | None = None,
) -> Case:
    """`ppo_run(case, **overrides)`: the same rules as the case file, the same one-line errors,
    against the catalog of engines this run announces (ppo_run's engine_modules included)."""
    raw = {k: v for k, v in case_keys(case).items() if v is not None}
    raw.update(overrides)
    raw = {k: v for k, v in raw.items() if v is not None}  # None: back to the field's default
    engines = engines or default_engines()
    announced = ANNOUNCED_WHERE
    given = [e.text for e in engines.entries if e.where == GIVEN]
    if given:
        announced += f"; ppo_run engine_modules: {', '.join(given)}"
    specs = tiny_specs(tiny_models)
    return validate_case(raw, "ppo_run overrides", specs, engines, announced=announced)


def load_cases(
    path: Path,
    fixtures_dir: Path = FIXTURES_DIR,
    engines: EngineCatalog | None = None,
    tiny_models: Path | None = None,
) -> list[Case]:
    """The case file, every case validated; backends may be any engine the catalog announces."""
    import tomllib

    if not path.is_file():
        what = "is a folder, not a file" if path.is_dir() else "does not exist"
        raise ConfigError(f"--fsdp-turbo-cases / fsdp_turbo_cases: case file {path} {what}")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    except RecursionError:  # tomllib recurses once per level of nesting
        raise ConfigError(f"{path}: a value nested deeper than a case file needs") from None
    rows = data.get("case", [])
    if not isinstance(rows, list) or not (rows or data.get("trainer_case")):
        raise ConfigError(f"{path}: expected one or more [[case]] or [[trainer_case]] tables")
    defaults = data.get("defaults", {})
    if not isinstance(defaults, dict):
        raise ConfigError(f"{path}: [defaults] must be a table")
    specs = tiny_specs(tiny_models, fixtures_dir)
    engines = engines or default_engines()
    cases, seen = [], set()
    for row in rows:
        if not isinstance(row, dict):
            raise ConfigError(f"{path}: every [[case]] entry must be a table")
        case = validate_case({**defaults, **row}, path, specs, engines)
        if case.id in seen:
            raise ConfigError(
                f"{path}: case {case.id!r}: field 'id': expected a unique id; got a duplicate"
            )
        seen.add(case.id)
        cases.append(case)
    return cases


@dataclass(frozen=True)
class CaseParam:
    """One test parameter: a case on one device kind."""

    case: Case
    kind: str

    @property
    def id(self) -> str:
        return f"{self.case.id}-{self.kind}"

    @property
    def ranks(self) -> int:
        """Devices the test leases."""
        return self.case.engine.world_size

    @property
    def known_failure(self) -> dict | None:
        """The crash known on this device kind ({reason, match}), if the case declares one."""
        return self.case.known_failure.get(self.kind)


class CaseBook:
    """The loaded case file, looked up by id: engine cases and verl trainer cases."""

    def __init__(self, path: Path, cases: list[Case], trainer_cases: list | None = None):
        self.path, self.cases = path, cases
        self.trainer_cases = trainer_cases or []

    def get(self, case_id: str) -> Case:
        return find_case(self.cases, case_id, self.path)

    def get_trainer(self, case_id: str):
        for case in self.trainer_cases:
            if case.id == case_id:
                return case
        known = ", ".join(c.id for c in self.trainer_cases) or "none"
        raise ConfigError(f"{self.path}: no trainer case {case_id!r}; known: {known}")

    def params(self) -> list[CaseParam]:
        return [CaseParam(case, kind) for case in self.cases for kind in case.devices]

    def trainer_params(self) -> list:
        from pytest_fsdp_turbo.trainer.cases import TrainerParam

        return [TrainerParam(case, kind) for case in self.trainer_cases for kind in case.devices]


def load_book(
    path: Path,
    fixtures_dir: Path = FIXTURES_DIR,
    engines: EngineCatalog | None = None,
    tiny_models: Path | None = None,
) -> CaseBook:
    """The case file's engine cases and trainer cases; an id names one case across both."""
    import tomllib

    from pytest_fsdp_turbo.trainer.cases import trainer_cases

    cases = load_cases(path, fixtures_dir, engines, tiny_models)
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    trainers = trainer_cases(data, path, tiny_specs(tiny_models, fixtures_dir))
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
