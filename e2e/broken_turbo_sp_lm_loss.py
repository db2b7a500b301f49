"""A deliberately broken stand-in loss patch for an SP mutant (e2e/test_mutations.py): the
causal-LM loss normalised per SP rank (each rank's chunk a mean of its own, the group averaging
those means) instead of over the whole sequence's labelled tokens. The engine is healthy; it swaps
the stand-in fsdp_turbo's causal_lm_loss wrapper before the library applies its patches, so the
loss path the case exercises (labels through the model's loss function) carries the bug.
"""

import functools

import torch.distributed as dist
import torch.distributed.nn as dist_nn
import torch.nn.functional as F

from pytest_fsdp_turbo_engine.engines.registry import register
from pytest_fsdp_turbo_engine.engines.turbo import FSDPTurboEngineWithLMHead


def per_rank_mean_loss(fn, group):
    @functools.wraps(fn)
    def loss(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, **kwargs):
        size, rank, local = dist.get_world_size(group), dist.get_rank(group), logits.shape[1]
        shifted = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        mine = shifted[..., rank * local : (rank + 1) * local].reshape(-1)
        per_rank = F.cross_entropy(
            logits.float().reshape(-1, vocab_size), mine, ignore_index=ignore_index
        )
        return dist_nn.all_reduce(per_rank, group=group) / size

    return loss


@register(model_type="qwen3_5", backend="fsdp_turbo", device=["cpu", "cuda", "npu"])
class SPLossNormalisedPerRankEngine(FSDPTurboEngineWithLMHead):
    def _wrap(self, model):
        import fsdp_turbo_standin_ulysses  # the stand-in: this mutant exists only in tests

        fsdp_turbo_standin_ulysses.WRAPPERS["causal_lm_loss"] = per_rank_mean_loss
        return super()._wrap(model)
