"""Every shim verl's engines need to run on CPU ranks (gloo), each with its reason. verl has no CPU
platform: with no GPU or NPU its platform manager falls back to NVIDIA.

1. A verl platform "cpu" (device "cpu", backend gloo, no-op device calls), registered through verl's
   own plug-in mechanism: VERL_USE_EXTERNAL_MODULES names this module, VERL_PLATFORM selects it.
2. VERL_ENGINE_DEVICE=cuda: verl registers its engines for cuda and npu only; the cuda entry then
   runs on this platform.
3. attn_implementation "sdpa": verl's model config asks for flash-attention 2, which needs CUDA.
4. A gated-delta-rule kernel that honours `cu_seqlens`, the role flash-linear-attention (FLA) plays
   on GPU. verl packs a micro-batch into one row and hands Qwen3.5's linear attention the sequence
   boundaries; it passes them to any kernel that takes `**kwargs`, and transformers' torch
   fallback takes them and ignores them, so each sequence's recurrent state runs on into the next
   (measured on tiny Qwen3.5, verl 0.9.1: gradients off by 10% of their largest entry, caught by
   check c). The kernel here splits the packed row at the boundaries and runs the fallback on each.

`prepare("cpu")` turns them on before anything imports verl; on cuda and npu nothing here is active.
No verl file is edited or patched. This module imports verl only inside `_register`.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

PLATFORM = "cpu"
ENV = {
    "VERL_USE_EXTERNAL_MODULES": __name__,
    "VERL_PLATFORM": PLATFORM,
    "VERL_ENGINE_DEVICE": "cuda",
}
MODEL_OVERRIDES = {"attn_implementation": "sdpa"}
_registered = False


def prepare(kind: str) -> dict:
    """Select the CPU platform for a cpu run; returns the model-config overrides the run needs."""
    if kind != PLATFORM:
        return {}
    os.environ.update(ENV)
    _register()
    _install_packed_gated_delta_rule()
    return dict(MODEL_OVERRIDES)


def _install_packed_gated_delta_rule() -> None:
    """Shim 4: transformers reads the module's `chunk_gated_delta_rule` (FLA's, when installed)
    when it builds each linear-attention layer; a model built after this runs the kernel below."""
    import torch
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen3_5

    if qwen3_5.chunk_gated_delta_rule is not None:  # FLA (or this shim) is already there
        return
    fallback = qwen3_5.torch_chunk_gated_delta_rule

    def packed_chunk_gated_delta_rule(
        query, key, value, g, beta, *, cu_seqlens=None, cu_seqlens_cpu=None, **kwargs
    ):
        if cu_seqlens is None:
            return fallback(query, key, value, g, beta, **kwargs)
        if kwargs.get("initial_state") is not None or kwargs.get("output_final_state"):
            raise NotImplementedError("packed gated delta rule: no recurrent state across calls")
        bounds = (cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens).tolist()
        pieces = [
            fallback(*(t[:, start:end] for t in (query, key, value, g, beta)), **kwargs)[0]
            for start, end in zip(bounds[:-1], bounds[1:])
            if end > start
        ]
        return torch.cat(pieces, dim=1), None

    qwen3_5.chunk_gated_delta_rule = packed_chunk_gated_delta_rule


def _register(ray_resource: str = "CPU") -> None:
    """`ray_resource`: what verl asks Ray for per rank. The engine cases' own Ray launcher places
    ranks by CPU; verl's trainer counts only "GPU" or "NPU" resources, so its CPU runs give Ray
    logical GPUs (pytest_fsdp_turbo_engine.trainer.cpu)."""
    global _registered
    if _registered:
        return
    _registered = True
    import torch
    from verl.plugin.platform.platform_base import PlatformBase
    from verl.plugin.platform.platform_manager import PlatformRegistry

    @PlatformRegistry.register(platform=PLATFORM)
    class CPUPlatform(PlatformBase):
        device_name = "cpu"
        vendor_name = "cpu"
        device_module = torch.cpu

        def is_available(self) -> bool:
            return True

        def current_device(self):
            return "cpu"  # not 0: verl moves tensors with .to(current_device()); 0 means cuda:0

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index) -> None:
            pass  # one CPU; ranks are processes

        def synchronize(self, device_index=None) -> None:
            pass  # CPU ops are synchronous

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            pass

        def empty_cache(self) -> None:
            pass  # torch.cpu has no cache to empty (verl's offload helpers call it)

        def get_device_capability(self, device_index: int = 0):
            return (None, None)

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CPU_VISIBLE_DEVICES"  # read by nothing; verl asks every platform for one

        @contextmanager
        def nvtx_range(self, msg: str):
            yield

        def profiler_start(self) -> None:
            pass

        def profiler_stop(self) -> None:
            pass

        def ray_resource_name(self) -> str:
            return ray_resource

        def ray_resource_options(self, num_gpus: float) -> dict:
            if ray_resource == "GPU":  # Ray takes its own resources by keyword only
                return {"num_gpus": num_gpus}
            return {"resources": {ray_resource: num_gpus}}

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self):
            return None


# imported by verl through VERL_USE_EXTERNAL_MODULES (the trainer's observer registers it itself)
if os.environ.get("VERL_PLATFORM") == PLATFORM and __name__ in os.environ.get(
    "VERL_USE_EXTERNAL_MODULES", ""
).split(","):
    _register()
