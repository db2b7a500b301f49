"""A deliberately broken stand-in loss patch for an SP mutant (e2e/test_mutations.py): each SP
rank shifts the labels of its own chunk of the sequence, not the whole sequence's before taking its
chunk, so the last position of every chunk loses its label (the next chunk's first token). Where
the chunk boundary falls inside the prompt (labels -100 there) nothing changes; where it falls on
a response token, that token drops out of the causal-LM loss. The engine is healthy; it swaps the
stand-in fsdp_turbo's causal_lm_loss wrapper before the library applies its patches.
"""

import functools

import torch.distributed as dist
import torch.nn.functional as F

from pytest_fsdp_turbo_engine.engines.registry import register
from pytest_fsdp_turbo_engine.engines.turbo import FSDPTurboEngineWithLMHead


def labels_shifted_per_chunk(fn, group):
    """The stand-in's own loss patch, handed this rank's chunk of the labels shifted inside the
    chunk (its `shift_labels`) instead of the whole sequence's shifted and then cut."""
    import fsdp_turbo_standin_ulysses

    healthy = fsdp_turbo_standin_ulysses.causal_lm_loss(fn, group)

    @functools.wraps(fn)
    def loss(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, **kwargs):
        rank, local = dist.get_rank(group), logits.shape[1]
        mine = labels[..., rank * local : (rank + 1) * local]
        shifted = F.pad(mine, (0, 1), value=ignore_index)[..., 1:]
        kwargs["shift_labels"] = shifted
        return healthy(logits, None, vocab_size, num_items_in_batch, ignore_index, **kwargs)

    return loss


@register(model_type="qwen3_5", backend="fsdp_turbo", device=["cpu", "cuda", "npu"])
class SPLabelsShiftedPerChunkEngine(FSDPTurboEngineWithLMHead):
    def _wrap(self, model):
        import fsdp_turbo_standin_ulysses  # the stand-in: this mutant exists only in tests

        fsdp_turbo_standin_ulysses.WRAPPERS["causal_lm_loss"] = labels_shifted_per_chunk
        return super()._wrap(model)
