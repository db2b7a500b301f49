"""A broken verl engine, registered in verl's own EngineRegistry the way a downstream repository
registers a subclass: the mutation suite runs it as backend verl:fsdp2_noop_sync_context."""

from contextlib import contextmanager

from verl.workers.engine import EngineRegistry
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead


@EngineRegistry.register(
    model_type="language_model", backend="fsdp2_noop_sync_context", device=["cuda", "npu"]
)
class NoOpSyncContextVerlEngine(FSDPEngineWithLMHead):
    """The override the seed PR deleted from verl's FSDP-Turbo engine: declared deferred
    (use_no_sync_for_gradient_accumulation on), yet every micro-batch reduce-scatters."""

    @contextmanager
    def _gradient_sync_context(self, *, is_last_micro_batch: bool):
        yield
