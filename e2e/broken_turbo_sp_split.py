"""A deliberately broken FSDP-Turbo engine for an SP mutant (see broken_turbo_sp_loss.py for why it
registers under backend "fsdp_turbo")."""

from pytest_fsdp_turbo_engine.engines.registry import register
from pytest_fsdp_turbo_engine.engines.turbo import FSDPTurboEngineWithLMHead


@register(model_type="qwen3_5", backend="fsdp_turbo", device=["cpu", "cuda", "npu"])
class SPSequenceNotSplitEngine(FSDPTurboEngineWithLMHead):
    """Drops the library's module patch after wrapping (as a later step that rebinds forward would):
    the inner model's forward is the class's again, so every rank runs the whole sequence. The
    gathered logits and the summed gradients still come out right; only the work is not split."""

    def _wrap(self, model):
        wrapped = super()._wrap(model)
        for module in wrapped.modules():
            vars(module).pop("forward", None)  # the instance-level patch FSDPTurbo bound
        return wrapped
