"""A deliberately broken stand-in Ulysses exchange for an SP mutant (e2e/test_mutations.py): its
forward is right, its backward sends each rank's share of the gradient to the other SP rank (the
pieces in reverse order). The engine is healthy; it swaps the stand-in's backward before the
library wraps anything. In bf16 the global norm moves by well under the twin's tolerance: only a
per-parameter comparison sees it.
"""

import torch
import torch.distributed as dist

from pytest_fsdp_turbo_engine.engines.registry import register
from pytest_fsdp_turbo_engine.engines.turbo import FSDPTurboEngineWithLMHead


def backward_to_the_wrong_rank(ctx, grad):
    scatter_dim, gather_dim = ctx.dims
    size = dist.get_world_size(ctx.group)
    sent = torch.stack(list(grad.chunk(size, dim=gather_dim))[::-1]).contiguous()
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent, group=ctx.group)
    return torch.cat(received.unbind(0), dim=scatter_dim), None, None, None


@register(model_type="qwen3_5", backend="fsdp_turbo", device=["cpu", "cuda", "npu"])
class HeadGradientsToTheWrongRankEngine(FSDPTurboEngineWithLMHead):
    def _wrap(self, model):
        import fsdp_turbo_standin_ulysses  # the stand-in: this mutant exists only in tests

        fsdp_turbo_standin_ulysses._AllToAll.backward = staticmethod(backward_to_the_wrong_rank)
        return super()._wrap(model)
