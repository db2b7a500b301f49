"""The harness's own PPO step as a case kind: a `[[case]]` table is a `Case`, its keys read from the
case's own fields and from the rank spec's `EngineSpec` and `PPOSpec` (pytest_fsdp_turbo_contract/
spec.py), each key's default and bounds on its field. Torch-free."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pytest_fsdp_turbo.cases.lookup import PROMPT_SET, prompt_count, tiny_specs
from pytest_fsdp_turbo.cases.table import (
    DERIVED,
    TINY_PREFIX,
    ReadContext,
    TableReader,
    Where,
    check_known_failure,
    check_reason,
    check_tiny,
    golden_reason_of,
    read_rows,
)
from pytest_fsdp_turbo.settings import default_engines
from pytest_fsdp_turbo_contract.engines import (
    ANNOUNCED_WHERE,
    GIVEN,
    Capabilities,
    EngineCatalog,
)
from pytest_fsdp_turbo_contract.errors import ConfigError
from pytest_fsdp_turbo_contract.spec import (
    ASPECTS,
    Aspect,
    EngineSpec,
    PPOSpec,
    RankSpec,
    reason_refused,
)
from pytest_fsdp_turbo_contract.turbo_config import build_turbo_config
from pytest_fsdp_turbo_contract.vocab import (
    VERL_PREFIX,
    Capability,
    DeviceKind,
    GoldenTier,
    SyncPolicy,
    TwinKind,
)

TABLE = "case"
REASONS = ("not_exercised", "clip_not_exercised", "golden_reason")  # keys that say why not
KINDS = tuple(DeviceKind)
VERL_NAME = re.compile(r"^verl:[A-Za-z0-9_]+$")


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
    golden_reason: str = ""  # why the case records no golden: required with golden_tier none
    twin: TwinKind | None = None  # default: single when there is no in-rank reference, else none
    description: str = ""
    # device kind -> {reason, match}: a crash known on that kind, run as a strict expected failure
    # (red if it starts passing, or if it fails without `match` in its failure), never a skip
    known_failure: dict = field(default_factory=dict)
    # what the backend's engine declares on its catalog entry: set by validation, never by a case
    capabilities: Capabilities = field(default=Capabilities(), metadata={DERIVED: True})

    @property
    def is_tiny(self) -> bool:
        return self.model.startswith(TINY_PREFIX)

    @property
    def world_size(self) -> int:
        return self.engine.world_size

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
READER = TableReader("case", {"case": Case, "engine": EngineSpec, "ppo": PPOSpec})
PARTS = tuple(READER.parts)
OWNER = READER.owner
_FIELDS = READER.fields


def case_keys(case: Case) -> dict[str, Any]:
    """The case as its flat table: every key, whichever part owns it."""
    return READER.keys_of({"case": case, "engine": case.engine, "ppo": case.ppo})


def validate_case(
    raw: dict,
    path: Path | str,
    specs: list[str],
    engines: EngineCatalog | None = None,
    announced: str = ANNOUNCED_WHERE,
    inherited: frozenset[str] = frozenset(),
) -> Case:
    """Every rule for a case, wherever it is made (case file or ppo_run overrides). The backend
    must be one the engine catalog knows; a catalog with bare modules accepts any plain name, and
    the ranks' registry names it if no module registers it. `inherited`: the reason keys
    (not_exercised, clip_not_exercised, golden_reason) ppo_run took from the case, not from its
    overrides; a reason its overrides make moot (they run a second update, say) is dropped."""
    where = READER.where(raw, path)
    parts = READER.read(raw, where)
    case = Case(**parts["case"], engine=EngineSpec(**parts["engine"]), ppo=PPOSpec(**parts["ppo"]))
    engine, ppo = case.engine, case.ppo
    check_tiny(where, case.model, specs)
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
    check_known_failure(where, case.known_failure, case.devices)
    case = _with_reasons(case, where, inherited)
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


def _with_reasons(case: Case, where: Where, inherited: frozenset[str]) -> Case:
    """What the case leaves unexercised, and its goldens, each with its reason (one line per bad
    value: an unknown aspect, a blank reason, a reason for what the case's settings exercise or
    another aspect's reason covers). An inherited reason the overrides made moot is dropped."""
    ppo = case.ppo
    given = dict(ppo.not_exercised)
    for name, reason in given.items():
        if name not in ASPECTS:
            raise where.error("not_exercised", "aspects among " + ", ".join(ASPECTS), name)
        check_reason(where, f"not_exercised.{name}", reason)
    clip = ppo.clip_not_exercised
    if clip:
        check_reason(where, "clip_not_exercised", clip)
        if Aspect.RATIO_CLIP in given:
            raise where.error(
                "clip_not_exercised",
                "no key beside not_exercised.ratio_clip (its older spelling)",
                clip,
            )
    for name in list(given):
        if refused := reason_refused(Aspect(name), case.engine, ppo):
            if "not_exercised" not in inherited:
                raise where.error(f"not_exercised.{name}", refused, given[name])
            del given[name]
    if clip and (refused := reason_refused(Aspect.RATIO_CLIP, case.engine, ppo)):
        if "clip_not_exercised" not in inherited:
            raise where.error("clip_not_exercised", refused, clip)
        clip = ""
    golden_reason = golden_reason_of(
        where, case.golden_tier, case.golden_reason, "golden_reason" in inherited
    )
    return dataclasses.replace(
        case,
        ppo=dataclasses.replace(ppo, not_exercised=given, clip_not_exercised=clip),
        golden_reason=golden_reason,
    )


def _engine_can(case: Case, where: Where) -> None:
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
    inherited = frozenset(REASONS) - set(overrides)
    return validate_case(
        raw, "ppo_run overrides", specs, engines, announced=announced, inherited=inherited
    )


def read_table(data: dict, path: Path, context: ReadContext) -> list[Case]:
    """The case file's `[[case]]` tables, each over `[defaults]`, every one validated; ids unique."""
    defaults = data.get("defaults", {})
    if not isinstance(defaults, dict):
        raise ConfigError(f"{path}: [defaults] must be a table")

    def read_one(row: dict, earlier: list) -> Case:
        return validate_case({**defaults, **row}, path, context.specs, context.engines)

    return read_rows(data, TABLE, READER, path, read_one)
