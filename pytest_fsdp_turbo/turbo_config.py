"""The turbo_config a fsdp_turbo case hands the library, derived from the case (torch-free).

The case's own `turbo_config` table is the base; the parallel layout always follows the case fields
(fully_shard_parallel_size = fsdp_size, ulysses_parallel_size = sp_size) and a contradiction between
the two is an error rather than a silent override. With sp_size > 1 on a Qwen3.5 model the Ulysses
patch lists are added: attention, gated delta net and causal-LM loss, plus the module patch for the
Qwen3.5 model forward. Keys the library would drop are refused in the rank, against its dataclasses.
"""

from __future__ import annotations

import copy

from pytest_fsdp_turbo.errors import ConfigError

ULYSSES_PATCHES = {
    "qwen3_5": ["qwen3_5.attention", "qwen3_5.gated_delta_net", "causal_lm_loss"],
}
MODULE_PATCHES = {
    "qwen3_5": ["qwen3_5.model_forward"],
}
DTYPE_NAMES = {"bf16": "bf16", "fp32": "fp32"}


def model_family(model: str) -> str | None:
    """`Qwen3.5-2B`, `tiny-qwen3_5` -> `qwen3_5`; None when no patch set is known."""
    name = model.lower().replace(".", "_").replace("-", "_")
    return "qwen3_5" if "qwen3_5" in name else None


def _set(table: dict, key: str, value, where: str) -> None:
    if key in table and table[key] != value:
        raise ConfigError(
            f"turbo_config.{where}{key}: the case says {value!r} but turbo_config says {table[key]!r}"
        )
    table[key] = value


def build_turbo_config(case, kind: str) -> dict:
    config = copy.deepcopy(case.turbo_config)
    dist = config.setdefault("distributed", {})
    _set(dist, "fully_shard_parallel_size", case.shard_size, "distributed.")
    _set(dist, "ulysses_parallel_size", case.sp_size, "distributed.")
    plan = dist.setdefault("fsdp_plan", {})
    _set(plan, "param_dtype", DTYPE_NAMES[case.dtype_on(kind)], "distributed.fsdp_plan.")
    plan.setdefault("reduce_dtype", "fp32")
    if case.sp_size > 1:
        family = model_family(case.model)
        if family is None:
            raise ConfigError(
                f"case {case.id!r}: sp_size {case.sp_size} needs Ulysses patches, and none are known "
                f"for model {case.model!r} (known: {', '.join(ULYSSES_PATCHES)})"
            )
        ulysses = dist.setdefault("ulysses_plan", {})
        _set(ulysses, "patches", ULYSSES_PATCHES[family], "distributed.ulysses_plan.")
        _set(ulysses, "module_patches", MODULE_PATCHES[family], "distributed.ulysses_plan.")
    return config
