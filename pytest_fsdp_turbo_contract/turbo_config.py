"""The turbo_config a fsdp_turbo case hands the library, derived from the case (torch-free).

The library's config schema has changed shape across versions; the layout is detected from the
installed library's config dataclasses (`detect_layout`), never from a version string:

  function_patches  (newest) cp_plan.ulysses_function_patches / loss_function_patches, entries
                    {target_functions: [...], type}; top-level module_patches; data-parallel getters
  core_attention    (middle) cp_plan.ulysses_core_attention_function; module_patches; no loss patch
  legacy            (oldest) no Ulysses fields in cp_plan, no module_patches

The case's own `turbo_config` table is the base; the parallel layout, dtypes and the FSDP module plan
follow the case and the loaded model's module tree, and a contradiction between the two is an error
rather than a silent override. `schema_problems` lists what the library's loader would silently drop
and what it requires but is missing.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field

from pytest_fsdp_turbo_contract.errors import ConfigError
from pytest_fsdp_turbo_contract.spec import EngineSpec

FUNCTION_PATCHES, CORE_ATTENTION, LEGACY = "function_patches", "core_attention", "legacy"
LAYOUTS = (FUNCTION_PATCHES, CORE_ATTENTION, LEGACY)
NEWEST = FUNCTION_PATCHES
DTYPE_NAMES = {"bf16": "bf16", "fp32": "fp32"}
# What the library's FSDPTurbo refuses to run without (None raises there, not in the loader).
REQUIRED = ("distributed.fsdp_plan.apply_modules",)

# The types each layout's Ulysses patch entries accept (FACTS-fsdp_turbo.md, "Config schema").
PATCH_TYPES = {
    "ulysses_function_patches": (
        "full_attention",
        "gated_delta_net",
        "compressor_full_attention_transposed",
    ),
    "loss_function_patches": ("causal_lm_loss",),
}
CORE_ATTENTION_TYPES = ("full_attention",)  # what ulysses_attention_type "default" shards
ATTENTION_TYPE_VALUES = ("default", "with_compressor")

QWEN3_5 = "transformers.models.qwen3_5.modeling_qwen3_5"
ULYSSES_FUNCTIONS = {  # per model family: (target, type)
    "qwen3_5": [
        (f"{QWEN3_5}.eager_attention_forward", "full_attention"),
        (f"{QWEN3_5}.Qwen3_5GatedDeltaNet.forward", "gated_delta_net"),
    ],
}
LOSS_FUNCTIONS = {"qwen3_5": [("transformers.loss.loss_utils.ForCausalLMLoss", "causal_lm_loss")]}
MODULE_PATCHES = {
    "qwen3_5": [
        {
            "target": f"{QWEN3_5}.Qwen3_5Model.forward",
            "replacement": "fsdp_turbo.models.qwen.qwen3_5.qwen3_5_model_forward",
        }
    ],
}


@dataclass(frozen=True)
class ModulePlan:
    """Module-name patterns of the model class actually loaded ({*} stands for a layer index)."""

    model_class: str
    layers: tuple[str, ...]  # e.g. "model.layers.{*}" or "model.language_model.layers.{*}"
    others: tuple[str, ...] = field(default=())  # embeddings, lm_head, vision blocks
    classes: tuple[str, ...] = field(default=())  # "module.Class" of every module instance
    # (target, exists) for the module-level functions the known patch sets name
    functions: tuple[tuple[str, bool], ...] = field(default=())
    names: tuple[str, ...] = field(default=())  # every module name, "" for the root

    @classmethod
    def from_json(cls, data: dict) -> ModulePlan:
        return cls(
            data["model_class"],
            tuple(data["layers"]),
            tuple(data["others"]),
            tuple(data.get("classes", ())),
            tuple((t, bool(e)) for t, e in data.get("functions", ())),
            tuple(data.get("names", ())),
        )


def model_family(model: str) -> str | None:
    """`Qwen3.5-2B`, `tiny-qwen3_5` -> `qwen3_5`; None when no patch set is known."""
    name = model.lower().replace(".", "_").replace("-", "_")
    return "qwen3_5" if "qwen3_5" in name else None


def detect_layout(schema: dict) -> str:
    """schema: nested {field: subschema or None} of FSDPTurboConfig (see pytest_fsdp_turbo_engine/engines/turbo_inspect)."""
    cp_plan = (schema.get("distributed") or {}).get("fields", {}).get("cp_plan") or {}
    cp_fields = cp_plan.get("fields") or {}
    if "ulysses_function_patches" in cp_fields:
        return FUNCTION_PATCHES
    if "ulysses_core_attention_function" in cp_fields:
        return CORE_ATTENTION
    return LEGACY


def _set(table: dict, key: str, value, where: str) -> None:
    if key in table and table[key] != value:
        raise ConfigError(
            f"turbo_config.{where}{key}: the case says {value!r} but turbo_config says {table[key]!r}"
        )
    table[key] = value


def _table(parent: dict, key: str, where: str) -> dict:
    """A nested table the harness fills in, created when absent; anything else there is one line."""
    table = parent.setdefault(key, {})
    if not isinstance(table, dict):
        raise ConfigError(f"turbo_config.{where}{key}: expected a table; got {table!r}")
    return table


def _ulysses(config: dict, cp_plan: dict, family: str, layout: str) -> None:
    if layout == FUNCTION_PATCHES:
        entries = [{"target_functions": [t], "type": k} for t, k in ULYSSES_FUNCTIONS[family]]
        losses = [{"target_functions": [t], "type": k} for t, k in LOSS_FUNCTIONS[family]]
        _set(cp_plan, "ulysses_function_patches", entries, "distributed.cp_plan.")
        _set(cp_plan, "loss_function_patches", losses, "distributed.cp_plan.")
    elif layout == CORE_ATTENTION:
        unsupported = sorted({k for _, k in ULYSSES_FUNCTIONS[family]} - set(CORE_ATTENTION_TYPES))
        if unsupported:  # those layers would silently run on each rank's chunk of the sequence
            raise ConfigError(
                f"turbo_config: the installed fsdp_turbo has the {CORE_ATTENTION} config layout, "
                f"which cannot shard {family} layers of type {', '.join(unsupported)} over the "
                "sequence (ulysses_attention_type takes only "
                f"{', '.join(CORE_ATTENTION_TYPES)}); sp_size > 1 needs the {FUNCTION_PATCHES} layout"
            )
        attention = [t for t, kind in ULYSSES_FUNCTIONS[family] if kind == "full_attention"]
        _set(cp_plan, "ulysses_core_attention_function", attention, "distributed.cp_plan.")
    else:
        raise ConfigError(
            f"turbo_config: the installed fsdp_turbo has the {LEGACY} config layout, which has no "
            "Ulysses patch fields; sp_size > 1 needs a newer FSDPTurbo"
        )
    _set(config, "module_patches", copy.deepcopy(MODULE_PATCHES[family]), "")


def build_turbo_config(
    engine: EngineSpec,
    kind: str,
    model: str,
    layout: str = NEWEST,
    modules: ModulePlan | None = None,
) -> dict:
    """The exact turbo_config for a case's `engine` part on device `kind` with `model` (its name
    picks the Ulysses patches), for library `layout` and model `modules` (without `modules` the
    FSDP module plan is left out: it needs the model's module tree)."""
    config = copy.deepcopy(engine.turbo_config)
    dist = _table(config, "distributed", "")
    _set(dist, "fully_shard_parallel_size", engine.shard_size, "distributed.")
    _set(dist, "ulysses_parallel_size", engine.sp_size, "distributed.")
    plan = _table(dist, "fsdp_plan", "distributed.")
    _set(plan, "param_dtype", DTYPE_NAMES[engine.dtype_on(kind)], "distributed.fsdp_plan.")
    plan.setdefault("reduce_dtype", "fp32")
    if modules is not None:
        wanted: dict[str, dict] = {pattern: {} for pattern in (*modules.layers, *modules.others)}
        _set(plan, "apply_modules", wanted, "distributed.fsdp_plan.")
        _set(plan, "hook_modules", list(modules.layers), "distributed.fsdp_plan.")
    if engine.sp_size > 1:
        family = model_family(model)
        if family is None:
            raise ConfigError(
                f"sp_size {engine.sp_size} needs Ulysses patches, and none are known for model "
                f"{model!r} (known: {', '.join(ULYSSES_FUNCTIONS)})"
            )
        _ulysses(config, _table(dist, "cp_plan", "distributed."), family, layout)
    return config


def schema_problems(schema: dict, config: dict) -> list[str]:
    """One line per key the library's loader would drop with only a warning, and per required
    field that is missing."""
    problems: list[str] = []

    def walk(node: dict, given: dict, prefix: str) -> None:
        for key, value in given.items():
            if key not in node:
                problems.append(
                    f"turbo_config.{prefix}{key}: not in the library's schema "
                    f"(known: {', '.join(sorted(node))}); its loader would drop it"
                )
                continue
            child = node[key].get("fields")
            if child is not None and isinstance(value, dict):
                walk(child, value, f"{prefix}{key}.")
        for key, spec in node.items():
            if spec.get("required") and key not in given:
                problems.append(f"turbo_config.{prefix}{key}: required by the library, missing")

    walk(schema, config, "")
    for dotted in REQUIRED:
        node: object = config
        for part in dotted.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is None:
            problems.append(
                f"turbo_config.{dotted}: required by the library (None raises), missing"
            )
    return problems


def _dotted(value: object) -> bool:
    return isinstance(value, str) and "." in value and ":" not in value and " " not in value


def entry_problems(config: dict) -> list[str]:
    """One line per list entry or value the library refuses when it builds or applies its config:
    patch entries' shape, keys and types, an apply_modules that can match nothing."""
    problems: list[str] = []
    dist = config.get("distributed") or {}
    plan = dist.get("fsdp_plan") or {}
    if "apply_modules" in plan and not plan["apply_modules"]:
        problems.append(
            "turbo_config.distributed.fsdp_plan.apply_modules: empty; the library needs at least "
            "one module-name pattern that matches the model"
        )
    patches = config.get("module_patches")
    if patches is not None and not isinstance(patches, list):
        problems.append("turbo_config.module_patches: expected a list of {target, replacement}")
        patches = []
    for i, entry in enumerate(patches or []):
        where = f"turbo_config.module_patches[{i}]"
        if not isinstance(entry, dict) or set(entry) != {"target", "replacement"}:
            problems.append(f"{where}: expected exactly the keys target and replacement")
            continue
        for key in ("target", "replacement"):
            if not _dotted(entry[key]):
                problems.append(f"{where}.{key}: expected a dotted path; got {entry[key]!r}")
    cp_plan = dist.get("cp_plan") or {}
    for name, types in PATCH_TYPES.items():
        entries = cp_plan.get(name)
        if entries is None:
            continue
        if not isinstance(entries, list):
            problems.append(f"turbo_config.distributed.cp_plan.{name}: expected a list")
            continue
        for i, entry in enumerate(entries):
            where = f"turbo_config.distributed.cp_plan.{name}[{i}]"
            if not isinstance(entry, dict) or set(entry) != {"target_functions", "type"}:
                problems.append(f"{where}: expected exactly the keys target_functions and type")
                continue
            targets = entry["target_functions"]
            if not isinstance(targets, list) or not targets or not all(map(_dotted, targets)):
                problems.append(f"{where}.target_functions: expected a list of dotted paths")
            if entry["type"] not in types:
                problems.append(
                    f"{where}.type: {entry['type']!r} is not one the library knows "
                    f"({', '.join(types)})"
                )
    kind = cp_plan.get("ulysses_attention_type")
    if isinstance(kind, str) and kind not in ATTENTION_TYPE_VALUES:
        problems.append(
            f"turbo_config.distributed.cp_plan.ulysses_attention_type: {kind!r}; the library "
            f"takes {', '.join(ATTENTION_TYPE_VALUES)} or a callable"
        )
    return problems


CP_PLAN_WHERE = "turbo_config.distributed.cp_plan."


def patch_targets(config: dict) -> list[tuple[str, str]]:
    """(where, dotted target) of every patch in the config: module patches and Ulysses/loss
    function patches."""
    found = []
    for i, entry in enumerate(config.get("module_patches") or []):
        if isinstance(entry, dict) and isinstance(entry.get("target"), str):
            found.append((f"turbo_config.module_patches[{i}].target", entry["target"]))
    cp_plan = (config.get("distributed") or {}).get("cp_plan") or {}
    for name in PATCH_TYPES:
        for i, entry in enumerate(cp_plan.get(name) or []):
            targets = entry.get("target_functions") if isinstance(entry, dict) else None
            for j, target in enumerate(targets if isinstance(targets, list) else []):
                found.append((f"{CP_PLAN_WHERE}{name}[{i}][{j}]", target))
    return found


def class_of_target(target: str) -> str | None:
    """`pkg.module.Class.member` -> `pkg.module.Class`; None for a module-level callable (the
    class is told by its capital letter, as Python's naming conventions and every target seen)."""
    parts = target.split(".")
    return ".".join(parts[:-1]) if len(parts) > 2 and parts[-2][:1].isupper() else None


def _resolves(target: str, modules: ModulePlan) -> bool | None:
    """Whether a patch target exists in the loaded model (a class member) or in the installed
    transformers (a module-level function); None when the inspection did not look."""
    owner = class_of_target(target)
    if owner is not None:
        return owner in modules.classes
    return dict(modules.functions).get(target)


def pattern_regex(pattern: str) -> re.Pattern:
    """FSDPTurbo's module-name pattern as a regex over whole names: `{*}` any layer index, `{a-b}`
    an index from a to b (checked by `pattern_matches`), `*` any text, `?` one character."""
    parts = re.split(r"(\{\*\}|\{\d+-\d+\}|\*|\?)", pattern)
    wild = {"{*}": r"(\d+)", "*": ".*", "?": "."}
    return re.compile(
        "".join(
            wild.get(p) or (r"(\d+)" if re.fullmatch(r"\{\d+-\d+\}", p) else re.escape(p))
            for p in parts
        )
    )


def pattern_matches(pattern: str, name: str) -> bool:
    found = pattern_regex(pattern).fullmatch(name)
    if found is None:
        return False
    bounds = [tuple(map(int, b.split("-"))) for b in re.findall(r"\{(\d+-\d+)\}", pattern)]
    indexed = [g for g, p in zip(found.groups(), re.findall(r"\{[^}]*\}", pattern)) if p != "{*}"]
    return all(low <= int(i) <= high for i, (low, high) in zip(indexed, bounds))


def pattern_problems(config: dict, modules: ModulePlan) -> list[str]:
    """An apply_modules or hook_modules pattern that matches no module of the loaded model wraps or
    hooks nothing (the library raises only when every pattern misses, so a single typo among good
    patterns would pass there silently)."""
    if not modules.names:
        return []
    plan = ((config.get("distributed") or {}).get("fsdp_plan")) or {}
    problems = []
    for key in ("apply_modules", "hook_modules"):
        given = plan.get(key)
        for pattern in given if isinstance(given, (dict, list)) else ():
            if isinstance(pattern, str) and not any(
                pattern_matches(pattern, n) for n in modules.names
            ):
                problems.append(
                    f"turbo_config.distributed.fsdp_plan.{key}: pattern {pattern!r} matches no "
                    f"module of the model the engine loads ({modules.model_class})"
                )
    return problems


def target_problems(config: dict, modules: ModulePlan) -> list[str]:
    """A patch on a class member takes effect only on instances of that class in the model: the
    library refuses a module patch that matches none ("Configured module patch did not match the
    model"), and a function patch on a class the model never instantiates is never called. Module
    patterns that match nothing are refused too (pattern_problems)."""
    problems = pattern_problems(config, modules)
    if not modules.classes:
        return problems
    for where, target in patch_targets(config):
        if _resolves(target, modules) is not False:
            continue
        owner = class_of_target(target)
        if owner is not None:
            problems.append(
                f"{where}: {target} matches nothing in the model the engine loads "
                f"({modules.model_class} has no {owner.rsplit('.', 1)[-1]} module)"
            )
        else:
            problems.append(
                f"{where}: {target} does not exist in the installed transformers; the patch "
                "would have nothing to replace"
            )
    return problems


def resolved_targets(config: dict, modules: ModulePlan) -> list[str]:
    """The patch targets that do resolve in the loaded model (the config verb lists them)."""
    return [t for _, t in patch_targets(config) if _resolves(t, modules)]


def ulysses_size(config: dict) -> int:
    return int((config.get("distributed") or {}).get("ulysses_parallel_size") or 1)


def ulysses_function_targets(config: dict) -> list[str]:
    """The functions the library wraps in place when Ulysses is on: the cp_plan patch entries
    (newest layout) and the core attention function(s) (middle layout)."""
    cp_plan = (config.get("distributed") or {}).get("cp_plan") or {}
    found = [t for where, t in patch_targets(config) if where.startswith(CP_PLAN_WHERE)]
    core = cp_plan.get("ulysses_core_attention_function") or []
    return found + ([core] if isinstance(core, str) else list(core))


EAGER_ATTENTION = "eager_attention_forward"


def attention_implementation(config: dict) -> str | None:
    """The attention the model must be loaded with so the Ulysses patch is the code that runs:
    eager when a patch targets transformers' eager attention function (with sdpa it is never
    called and attention would stay sequence-local, silently); None leaves the model's default."""
    targets = {t for _, t in patch_targets(config)} | set(ulysses_function_targets(config))
    if ulysses_size(config) > 1 and any(
        isinstance(t, str) and t.endswith(f".{EAGER_ATTENTION}") for t in targets
    ):
        return "eager"
    return None


def _setting(config: object, dotted: str) -> object:
    node = config
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else getattr(node, part, None)
    return node


def _holds(value: object, condition: object) -> bool:
    if condition == "above_one":
        return isinstance(value, int | float) and not isinstance(value, bool) and value > 1
    if condition == "truthy":
        return bool(value)
    return value == condition


def not_modelled(rules: list | tuple, config: object, device: str) -> list[str]:
    """One line per rule a checkout declares it cannot apply (a stand-in's NOT_MODELLED: each
    {"when": {dotted key: "above_one" | "truthy" | a value}, "why": ..., "devices": [...]}) that
    the config (a dict, or the library's built dataclasses) trips on `device`."""
    found = []
    for rule in rules:
        if device not in rule.get("devices", [device]):
            continue
        when = rule["when"]
        if all(_holds(_setting(config, key), condition) for key, condition in when.items()):
            keys = ", ".join(f"turbo_config.{key} = {_setting(config, key)!r}" for key in when)
            found.append(f"{keys}: {rule['why']}, not modelled by the stand-in")
    return found
