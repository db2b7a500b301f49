"""A deliberately broken FSDP-Turbo engine (e2e/test_mutations.py): it packs each micro-batch into
one row with restarting position_ids but drops cu_seqlens, so the gated delta net's recurrent state
runs from one sequence into the next (what a kernel that ignores the bounds does).
"""

import torch

from pytest_fsdp_turbo_engine.engines.registry import register
from pytest_fsdp_turbo_engine.engines.turbo import FSDPTurboEngineWithLMHead


class _WithoutBounds(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model
        self.config = model.config

    def forward(self, *args, cu_seqlens=None, **kwargs):
        return self.model(*args, **kwargs)


@register(model_type="qwen3_5", backend="fsdp_turbo", device=["cpu", "cuda", "npu"])
class PackedWithoutBoundsEngine(FSDPTurboEngineWithLMHead):
    def _packed_logits(self, model, input_ids, group, labels=None):
        return super()._packed_logits(_WithoutBounds(model), input_ids, group, labels)
