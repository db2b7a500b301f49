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
from dataclasses import dataclass, field

from pytest_fsdp_turbo.errors import ConfigError

FUNCTION_PATCHES, CORE_ATTENTION, LEGACY = "function_patches", "core_attention", "legacy"
LAYOUTS = (FUNCTION_PATCHES, CORE_ATTENTION, LEGACY)
NEWEST = FUNCTION_PATCHES
DTYPE_NAMES = {"bf16": "bf16", "fp32": "fp32"}
# What the library's FSDPTurbo refuses to run without (None raises there, not in the loader).
REQUIRED = ("distributed.fsdp_plan.apply_modules",)

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

    @classmethod
    def from_json(cls, data: dict) -> ModulePlan:
        return cls(data["model_class"], tuple(data["layers"]), tuple(data["others"]))


def model_family(model: str) -> str | None:
    """`Qwen3.5-2B`, `tiny-qwen3_5` -> `qwen3_5`; None when no patch set is known."""
    name = model.lower().replace(".", "_").replace("-", "_")
    return "qwen3_5" if "qwen3_5" in name else None


def detect_layout(schema: dict) -> str:
    """schema: nested {field: subschema or None} of FSDPTurboConfig (see engine/turbo_inspect)."""
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


def _ulysses(config: dict, cp_plan: dict, family: str, layout: str) -> None:
    if layout == FUNCTION_PATCHES:
        entries = [{"target_functions": [t], "type": k} for t, k in ULYSSES_FUNCTIONS[family]]
        losses = [{"target_functions": [t], "type": k} for t, k in LOSS_FUNCTIONS[family]]
        _set(cp_plan, "ulysses_function_patches", entries, "distributed.cp_plan.")
        _set(cp_plan, "loss_function_patches", losses, "distributed.cp_plan.")
    elif layout == CORE_ATTENTION:
        attention = [t for t, kind in ULYSSES_FUNCTIONS[family] if kind == "full_attention"]
        _set(cp_plan, "ulysses_core_attention_function", attention, "distributed.cp_plan.")
    else:
        raise ConfigError(
            f"turbo_config: the installed fsdp_turbo has the {LEGACY} config layout, which has no "
            "Ulysses patch fields; sp_size > 1 needs a newer FSDPTurbo"
        )
    _set(config, "module_patches", copy.deepcopy(MODULE_PATCHES[family]), "")


def build_turbo_config(
    case, kind: str, layout: str = NEWEST, modules: ModulePlan | None = None
) -> dict:
    """The exact turbo_config for `case` on device `kind`, for library `layout` and model `modules`
    (without `modules` the FSDP module plan is left out: it needs the model's module tree)."""
    config = copy.deepcopy(case.turbo_config)
    dist = config.setdefault("distributed", {})
    _set(dist, "fully_shard_parallel_size", case.shard_size, "distributed.")
    _set(dist, "ulysses_parallel_size", case.sp_size, "distributed.")
    plan = dist.setdefault("fsdp_plan", {})
    _set(plan, "param_dtype", DTYPE_NAMES[case.dtype_on(kind)], "distributed.fsdp_plan.")
    plan.setdefault("reduce_dtype", "fp32")
    if modules is not None:
        wanted = {pattern: {} for pattern in (*modules.layers, *modules.others)}
        _set(plan, "apply_modules", wanted, "distributed.fsdp_plan.")
        _set(plan, "hook_modules", list(modules.layers), "distributed.fsdp_plan.")
    if case.sp_size > 1:
        family = model_family(case.model)
        if family is None:
            raise ConfigError(
                f"case {case.id!r}: sp_size {case.sp_size} needs Ulysses patches, and none are known "
                f"for model {case.model!r} (known: {', '.join(ULYSSES_FUNCTIONS)})"
            )
        _ulysses(config, dist.setdefault("cp_plan", {}), family, layout)
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
