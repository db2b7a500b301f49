"""A deliberately broken FSDP-Turbo engine for an SP mutant (e2e/test_mutations.py). The run path
builds a turbo_config and resolves a checkout only for backend "fsdp_turbo", so it registers under
that backend for the tiny Qwen3.5's model type (one broken engine per module: the key is taken); a
rank imports this module only in its test, and there it takes precedence over the engine
registered for every model type.
"""

import torch.distributed as dist

from pytest_fsdp_turbo_engine.engines.registry import register
from pytest_fsdp_turbo_engine.engines.turbo import FSDPTurboEngineWithLMHead, GatherSequence


class _GatherWithoutReduce(GatherSequence):
    @staticmethod
    def backward(ctx, grad):
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(size, dim=1)[rank].contiguous(), None


@register(model_type="qwen3_5", backend="fsdp_turbo", device=["cpu", "cuda", "npu"])
class SPLossNotReducedEngine(FSDPTurboEngineWithLMHead):
    """Gathers the sequence chunks but never sums the loss gradient over the SP group: each rank
    backpropagates only its own copy of the loss, so every gradient is 1/sp of what it should be."""

    sequence_gather = _GatherWithoutReduce
