"""The stand-in's FSDPTurbo against each fsdp_plan / memory setting verl's turbo_config passes, over
two gloo ranks: `python settings_probe.py STORE` (rank 1 forked). Rank 0 prints a JSON report of what
it observed on the sharded model (for the test to compare with the library's published behaviour),
and each refusal as "ExceptionType: message".
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE / "function_patches")]
from fsdp_turbo.fsdp_turbo import FSDPTurbo  # noqa: E402
from fsdp_turbo.fsdp_turbo_config import FSDPTurboConfig, _dict_to_dataclass  # noqa: E402
from fsdp_turbo.training.clip_grads import clip_grad_norm  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from two_ranks import run_on_two_ranks  # noqa: E402

WORLD = 2


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.calls = 0  # counted in forward itself: torch's checkpoint recomputes without hooks

    def forward(self, x):
        self.calls += 1
        return self.proj(x)


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList([Block(), Block()])
        self.head = torch.nn.Linear(4, 4)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def sharded(plan: dict | None = None, memory: dict | None = None, **distributed) -> Tiny:
    fsdp_plan = {"apply_modules": {"layers.{*}": {}, "head": {}}, **(plan or {})}
    config = _dict_to_dataclass(
        FSDPTurboConfig,
        {
            "distributed": {
                "fully_shard_parallel_size": WORLD,
                "fsdp_plan": fsdp_plan,
                **distributed,
            },
            "memory": memory or {},
        },
    )
    return FSDPTurbo(config, Tiny()).model


def outcome(call):
    try:
        return call()
    except Exception as exc:  # noqa: BLE001 - the refusal is what is reported
        return f"{type(exc).__name__}: {str(exc).splitlines()[0]}"


def forward_counts(model: Tiny) -> list[int]:
    """How often each block ran in one forward and backward: 2 where recomputed."""
    model(torch.randn(2, 4)).sum().backward()
    return [layer.calls for layer in model.layers]


def dtypes(plan: dict) -> dict:
    model = sharded(plan)
    seen = {}
    model.layers[0].proj.register_forward_pre_hook(
        lambda _, args: seen.__setitem__("input", str(args[0].dtype))
    )
    out = model.layers[0](torch.randn(2, 4))
    return {"unit_input": seen["input"], "unit_output": str(out.dtype)}


def prefetch(plan: dict) -> dict:
    model = sharded(plan)
    names = {id(m): n for n, m in model.named_modules()}

    def targets(module, attribute):
        state = module._get_fsdp_state()
        return [names[id(s._modules[0])] for s in getattr(state, attribute)]

    return {
        name: {
            "forward": targets(module, "_states_to_forward_prefetch"),
            "backward": targets(module, "_states_to_backward_prefetch"),
        }
        for name, module in (
            ("layers.0", model.layers[0]),
            ("layers.1", model.layers[1]),
            ("head", model.head),
        )
    }


def offload(plan: dict) -> str:
    model = sharded(plan)
    policy = model.layers[0]._get_fsdp_state()._fsdp_param_group.offload_policy
    return f"{type(policy).__name__}(pin_memory={getattr(policy, 'pin_memory', None)})"


def resharded_after_forward(plan: dict) -> bool:
    model = sharded(plan)
    model(torch.randn(2, 4))
    return isinstance(model.layers[0].proj.weight, DTensor)


def clip(rank: int) -> dict:
    """Plain (unsharded) gradients that differ by rank: 3 on rank 0, 4 on rank 1."""
    model = torch.nn.Linear(1, 1, bias=False)
    model.weight.grad = torch.full((1, 1), 3.0 + rank)
    alone = clip_grad_norm(model, max_norm=100.0)
    model.weight.grad = torch.full((1, 1), 3.0 + rank)
    grouped = clip_grad_norm(model, max_norm=100.0, group=dist.group.WORLD)
    return {"without_group": alone, "over_the_group": grouped}


def probe(rank: int) -> dict:
    os.environ.update(WORLD_SIZE=str(WORLD), RANK=str(rank))
    dist.init_process_group(
        "gloo", store=dist.FileStore(sys.argv[1], WORLD), rank=rank, world_size=WORLD
    )
    layers = {"layers.{*}": {}}
    return {
        "recompute": forward_counts(
            sharded(memory={"recompute": True, "recompute_plan": ["layers.{*}"]})
        ),
        "no_recompute": forward_counts(sharded()),
        "recompute_nothing_matches": outcome(
            lambda: sharded(memory={"recompute": True, "recompute_plan": ["blocks.{*}"]})
        ),
        "recompute_without_plan": outcome(lambda: sharded(memory={"recompute": True})),
        "bf16_params": dtypes({"param_dtype": "bf16"}),
        "bf16_params_fp32_output": dtypes({"param_dtype": "bf16", "output_dtype": "fp32"}),
        "inputs_not_cast": outcome(
            lambda: dtypes({"param_dtype": "bf16", "cast_forward_inputs": False})
        ),
        "offload": offload({"cpu_offload": True, "pin_memory": False}),
        "no_offload": offload({}),
        "pinned_offload_on_cpu": outcome(lambda: offload({"cpu_offload": True})),
        "ignored_head_is_dtensor": isinstance(
            sharded({"ignored_modules": ["head"]}).head.weight, DTensor
        ),
        "kept_layer_is_dtensor": isinstance(
            sharded({"ignored_modules": ["head"]}).layers[0].proj.weight, DTensor
        ),
        "ignored_nothing_matches": isinstance(sharded({"ignored_modules": ["nowhere"]}), Tiny),
        "prefetch": prefetch({"num_to_forward_prefetch": 1, "num_to_backward_prefetch": 1}),
        "no_prefetch": prefetch({}),
        "per_module_keeps_unsharded": not resharded_after_forward(
            {"apply_modules": {"layers.{*}": {"reshard_after_forward": False}, "head": {}}}
        ),
        "default_reshards": resharded_after_forward({}),
        "per_module_unknown_key": outcome(
            lambda: sharded({"apply_modules": {"layers.{*}": {"param_dtype": "bf16"}}})
        ),
        "dtype_bfloat16": outcome(lambda: sharded({"param_dtype": "bfloat16"})),
        "apply_modules_list": outcome(lambda: sharded({"apply_modules": ["layers.{*}"]})),
        "reversed_range": outcome(lambda: sharded({"apply_modules": {"layers.{1-0}": {}}})),
        "non_integer_range": outcome(lambda: sharded({"apply_modules": {"layers.{a-b}": {}}})),
        "bare_number": outcome(lambda: sharded({"apply_modules": {"layers.{3}": {}}})),
        "double_dot_only": outcome(lambda: sharded({"apply_modules": {"layers..0": {}}})),
        "custom_fsdp": outcome(lambda: sharded({"fsdp_implementation": "custom"})),
        "unknown_fsdp": outcome(lambda: sharded({"fsdp_implementation": "fast"})),
        "tensor_parallel": outcome(lambda: sharded(tensor_parallel_size=2)),
        "expert_parallel": outcome(lambda: sharded(expert_parallel_size=2)),
        "chunk_batch": outcome(lambda: sharded(memory={"chunk_batch": True})),
        "clip": clip(rank),
        "meshes": meshes(),
        "only_layers": outcome(lambda: isinstance(sharded({"apply_modules": layers}), Tiny)),
    }


def meshes() -> dict:
    from fsdp_turbo.distributed.parallel_state import get_parallel_state

    state = get_parallel_state()
    return {
        name: state.device_mesh_map[name].mesh.shape[0]
        if state.device_mesh_map[name].ndim == 1
        else list(state.device_mesh_map[name].mesh.shape)
        for name in ("cp", "ep", "dp_fsdp", "edp_efsdp")
    }


def main() -> None:
    run_on_two_ranks(probe)


if __name__ == "__main__":
    main()
