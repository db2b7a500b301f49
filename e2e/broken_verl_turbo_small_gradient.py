"""verl's FSDP-Turbo engine with one small parameter's gradient wrong after its micro-batch loop
(e2e/broken_small_gradient.py says which and how), registered in verl's registry as a downstream
subclass: backend verl:turbo_small_gradient_wrong."""

from broken_small_gradient import spoil_small_gradient
from verl.workers.engine import EngineRegistry
from verl.workers.engine.fsdp.fsdp_turbo_impl import FSDPTurboEngineWithLMHead


@EngineRegistry.register(
    model_type="language_model", backend="turbo_small_gradient_wrong", device=["cuda", "npu"]
)
class SmallGradientWrongVerlEngine(FSDPTurboEngineWithLMHead):
    def forward_backward_batch(self, data, loss_function, forward_only=False):
        outputs = super().forward_backward_batch(data, loss_function, forward_only)
        if not forward_only:
            spoil_small_gradient(self.module)
        return outputs
