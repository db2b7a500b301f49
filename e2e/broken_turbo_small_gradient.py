"""Our FSDP-Turbo engine with one small parameter's gradient wrong after the last micro-batch
(e2e/broken_small_gradient.py says which and how). Registered under backend fsdp_turbo for the
tiny Qwen3.5's model type, which a rank that imports this module prefers (as
e2e/broken_turbo_sp_loss.py does)."""

from contextlib import contextmanager

from broken_small_gradient import spoil_small_gradient

from pytest_fsdp_turbo_engine.engines.registry import register
from pytest_fsdp_turbo_engine.engines.turbo import FSDPTurboEngineWithLMHead


@register(model_type="qwen3_5", backend="fsdp_turbo", device=["cpu", "cuda", "npu"])
class SmallGradientWrongEngine(FSDPTurboEngineWithLMHead):
    @contextmanager
    def gradient_sync_context(self, is_last_micro_batch: bool):
        with super().gradient_sync_context(is_last_micro_batch):
            yield
        if is_last_micro_batch:
            spoil_small_gradient(self.module)
