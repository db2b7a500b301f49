"""What the harness calls on an engine, and what an engine may declare about itself.

An engine is any class registered for a backend (ours, a downstream's, verl's through its adapter);
it need not inherit from anything here. The step (pytest_fsdp_turbo_engine/step/) calls only what `Engine` lists,
plus, depending on `drives_micro_batches`, either `gradient_sync_context` (the harness runs the
micro-batch loop) or `forward_backward` (the engine runs its own, as verl's does). Every
measurement a check depends on is taken by the harness around these calls, never inside them.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

if TYPE_CHECKING:
    from torch import Tensor, device
    from torch.distributed import ProcessGroup
    from torch.nn import Module

    from pytest_fsdp_turbo_contract.spec import EngineSpec, PPOSpec


@runtime_checkable
class Engine(Protocol):
    """The calls every engine answers."""

    # True: the engine runs its own micro-batch loop (forward_backward); False: the harness runs it
    # and asks the engine for its gradient-sync policy per micro-batch (gradient_sync_context)
    drives_micro_batches: ClassVar[bool]
    module: Module | None  # the trainable, sharded policy, once built

    def __init__(self, config: EngineSpec, device: device) -> None: ...

    def build(self, model_path: str, *, trainable: bool = True) -> Module: ...

    def forward_logprobs(
        self, input_ids: Tensor, prompt_len: int, *, module: Module | None, with_entropy: bool
    ) -> tuple[Tensor, Tensor | None]:
        """Response-token log-probabilities (and entropy) under `module` (None: the policy);
        both keywords have defaults in an engine (None, False)."""
        ...

    def data_parallel_rank(self) -> int: ...

    def data_parallel_size(self) -> int: ...

    def data_parallel_group(self) -> ProcessGroup: ...

    def replicate_group(self) -> ProcessGroup | None: ...

    def optimizer_step(self) -> float:
        """Clip the gradients by their global L2 norm (the case's max_norm, torch's
        `min(1, max_norm / (norm + 1e-6))`), step AdamW on them, and return the norm before the
        clip; a non-finite norm skips the update on every rank alike.

        Any optimizer will do, a `torch.optim.Optimizer` or hand-written tensor math. The
        harness reads the gradients the step used itself (step/measurements.SteppedGradients):
        with a torch optimizer, by a pre-step hook as its step begins; with any other optimizer,
        from the gradient tensors the backward left in each parameter's `.grad`, which the
        harness holds across this call and reads once it returns. So an engine whose optimizer
        is not a torch one promises: it clips in those tensors, in place (as
        `torch.nn.utils.clip_grad_norm_` does), steps on them, and then drops them
        (`p.grad = None`, as `zero_grad(set_to_none=True)` does); it never zeroes or overwrites
        them in place, nor steps on a clipped copy. An engine that breaks this reads as
        a step on the wrong gradients: check k is red (1.0 away when they were zeroed)."""
        ...

    def full_state_dict(self) -> dict[str, Tensor]: ...


@runtime_checkable
class HarnessLoopEngine(Engine, Protocol):
    """drives_micro_batches = False: the harness runs forward and backward per micro-batch."""

    def gradient_sync_context(self, is_last_micro_batch: bool) -> AbstractContextManager[None]:
        """Whether this micro-batch's backward reduce-scatters its gradients (the sync policy)."""
        ...


@runtime_checkable
class OwnLoopEngine(Engine, Protocol):
    """drives_micro_batches = True: the engine runs the loop and calls `probe.loss_computed` with
    each micro-batch's log-probabilities, as the harness's loop does."""

    def forward_backward(self, batch: Any, tokens: float, cfg: PPOSpec, probe: Any) -> None: ...


def require_protocol(engine_class: type, backend: str) -> type:
    """The engine class a case's backend names, refused in one line if it breaks the protocol."""
    from pytest_fsdp_turbo_engine.engines.registry import RegistryError

    breaches = contract_breaches(engine_class)
    if breaches:
        raise RegistryError(
            f"engine {engine_class.__qualname__} (backend {backend!r}) does not meet the engine "
            f"protocol (pytest_fsdp_turbo_engine.engines.protocol): {'; '.join(breaches)}"
        )
    return engine_class


def contract_breaches(engine_class: type) -> list[str]:
    """What an engine class lacks of the protocol it declares, in words (empty: none)."""
    own_loop = getattr(engine_class, "drives_micro_batches", None)
    if not isinstance(own_loop, bool):
        return ["declare drives_micro_batches = True or False (who runs the micro-batch loop)"]
    needed = [name for name in dir(OwnLoopEngine if own_loop else HarnessLoopEngine)]
    wanted = {
        name
        for name in needed
        if not name.startswith("_") and name not in ("module", "drives_micro_batches")
    }
    breaches = [f"no {name}()" for name in sorted(wanted) if not hasattr(engine_class, name)]
    return breaches


if TYPE_CHECKING:  # the type checker proves that the engines shipped here meet their protocol
    from pytest_fsdp_turbo_engine.engines.fsdp2 import FSDPEngineWithLMHead
    from pytest_fsdp_turbo_engine.engines.turbo import FSDPTurboEngineWithLMHead
    from pytest_fsdp_turbo_engine.engines.verl_adapter import VerlEngineAdapter

    _ours: type[HarnessLoopEngine] = FSDPEngineWithLMHead
    _turbo: type[HarnessLoopEngine] = FSDPTurboEngineWithLMHead
    _verl: type[OwnLoopEngine] = VerlEngineAdapter
