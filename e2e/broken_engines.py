"""Deliberately broken engines, imported by ranks only in the test that proves check c catches them."""

from contextlib import contextmanager

from pytest_fsdp_turbo_engine.fsdp_engine import FSDPEngineWithLMHead
from pytest_fsdp_turbo_engine.registry import register


@register(backend="fsdp_off_by_one_sync", device=["cpu", "cuda", "npu"])
class OffByOneSyncEngine(FSDPEngineWithLMHead):
    """Reduce-scatters on the first micro-batch instead of the last: the last one's gradients are
    left in the unsharded accumulators and never reach the optimizer."""

    @contextmanager
    def _gradient_sync_context(self, is_last_micro_batch: bool):
        self._set_gradient_sync(not is_last_micro_batch)
        try:
            yield
        finally:
            self._set_gradient_sync(True)
