"""A deliberately broken FSDP-Turbo engine (e2e/test_mutations.py): the engine without its guard for
FSDP units whose forward never runs. In bf16 with fp32 reduction and deferred sync, FSDP2's final
post-backward then reads the vision tower's unsharded parameters, which were never created
(pytorch#194058): the run must fail as the engine's own error in its train phase, named first.
"""

import torch

from pytest_fsdp_turbo_engine.engines.registry import register
from pytest_fsdp_turbo_engine.engines.turbo import FSDPTurboEngineWithLMHead


@register(model_type="qwen3_5", backend="fsdp_turbo", device=["cpu", "cuda", "npu"])
class NeverForwardUnitsUnguardedEngine(FSDPTurboEngineWithLMHead):
    def _prepare_units_that_may_not_run(self, module: torch.nn.Module) -> None:
        pass
