"""The library's published config schema per layout, for checking a turbo_config when no checkout
is at hand (`pytest-fsdp-turbo config` on a laptop): the same shape pytest_fsdp_turbo_engine/engines/turbo_inspect reads from
a checkout's dataclasses, {field: {"required": bool, "fields": nested or None}}. A checkout's own
schema always wins. Sections whose fields are not pinned here ("fields": None: model, optimizer,
data, run, checkpoint, memory, quantization, tp_plan, ep_plan) are not looked into.

Source: ../shared/FACTS-fsdp_turbo.md, "Config schema" (read from the library and its callers).
"""

from __future__ import annotations

from pytest_fsdp_turbo_contract.turbo_config import CORE_ATTENTION, FUNCTION_PATCHES, LEGACY

OPAQUE = ("model", "optimizer", "data", "run", "checkpoint", "memory", "quantization")
FSDP_PLAN = (
    "apply_modules",
    "ignored_modules",
    "hook_modules",
    "param_dtype",
    "reduce_dtype",
    "output_dtype",
    "cast_forward_inputs",
    "num_to_forward_prefetch",
    "num_to_backward_prefetch",
    "fsdp_implementation",
)
FSDP_PLAN_NEWER = ("cpu_offload", "pin_memory", "gradient_divide_factor")  # middle and newest
DISTRIBUTED = (
    "data_parallel_size",
    "fully_shard_parallel_size",
    "tensor_parallel_size",
    "ulysses_parallel_size",
    "expert_parallel_size",
    "expert_fully_shard_parallel_size",
    "expert_data_parallel_size",
)
CP_PLAN = {
    FUNCTION_PATCHES: ("ulysses_function_patches", "loss_function_patches"),
    CORE_ATTENTION: (
        "ulysses_core_attention_function",
        "ulysses_attention_type",
        "ulysses_attn_output_transposed",
        "kv_allgather_core_attention_function",
        "kv_allgather_attention_type",
    ),
}


def _leaves(names, required: tuple[str, ...] = ()) -> dict:
    return {name: {"required": name in required, "fields": None} for name in names}


def published_schema(layout: str) -> dict:
    newer = layout != LEGACY
    plan = _leaves((*FSDP_PLAN, *(FSDP_PLAN_NEWER if newer else ())))
    distributed = _leaves(
        (
            *DISTRIBUTED,
            "tp_plan",
            "ep_plan",
            *(("kv_allgather_parallel_size",) if newer else ("context_parallel_size",)),
        )
    )
    distributed["fsdp_plan"] = {"required": False, "fields": plan}
    if newer:
        distributed["cp_plan"] = {"required": False, "fields": _leaves(CP_PLAN[layout])}
    top = _leaves((*OPAQUE, *(("module_patches",) if newer else ())))
    top["distributed"] = {"required": False, "fields": distributed}
    return top
