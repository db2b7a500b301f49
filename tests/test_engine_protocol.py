"""Every engine the harness drives meets pytest_fsdp_turbo_engine/engines/protocol.py, and one that does not is refused in one
line naming what it lacks (checked in each rank before the engine is built)."""

import inspect
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from pytest_fsdp_turbo_engine.engines.fsdp2 import FSDPEngineWithLMHead  # noqa: E402
from pytest_fsdp_turbo_engine.engines.protocol import (  # noqa: E402
    HarnessLoopEngine,
    OwnLoopEngine,
    contract_breaches,
)
from pytest_fsdp_turbo_engine.step.measurements import (  # noqa: E402
    SteppedGradients,
    clip_error,
    stepped_gradients,
)

E2E = Path(__file__).resolve().parents[1] / "e2e"


def shipped_engines() -> list[type]:
    from pytest_fsdp_turbo_engine.engines.turbo import FSDPTurboEngineWithLMHead
    from pytest_fsdp_turbo_engine.engines.verl_adapter import VerlEngineAdapter

    sys.path.insert(0, str(E2E))
    try:
        import broken_engines
        import handwritten_optimizer_engine
    finally:
        sys.path.remove(str(E2E))
    broken = [
        c
        for _, c in inspect.getmembers(broken_engines, inspect.isclass)
        if c.__module__ == broken_engines.__name__  # not what the module imports (FSDPModule)
    ]
    handwritten = [
        c
        for _, c in inspect.getmembers(handwritten_optimizer_engine, inspect.isclass)
        if c.__module__ == handwritten_optimizer_engine.__name__ and hasattr(c, "build")
    ]
    assert len(handwritten) == 3
    return [
        FSDPEngineWithLMHead,
        FSDPTurboEngineWithLMHead,
        VerlEngineAdapter,
        *broken,
        *handwritten,
    ]


def test_our_engines_verls_adapter_and_every_broken_engine_meet_the_protocol():
    engines = shipped_engines()
    assert len(engines) > 10
    for engine in engines:
        assert contract_breaches(engine) == [], engine
        loop = OwnLoopEngine if engine.drives_micro_batches else HarnessLoopEngine
        missing = [n for n in ("gradient_sync_context", "forward_backward") if n in dir(loop)]
        assert all(hasattr(engine, n) for n in missing), engine


def test_an_engine_that_does_not_say_who_runs_the_loop_or_lacks_a_call_is_refused():
    class Bare:
        def build(self, model_path, *, trainable=True): ...

    assert contract_breaches(Bare) == [
        "declare drives_micro_batches = True or False (who runs the micro-batch loop)"
    ]

    class OwnLoopWithoutForwardBackward(FSDPEngineWithLMHead):
        drives_micro_batches = True

    breaches = contract_breaches(OwnLoopWithoutForwardBackward)
    assert breaches == ["no forward_backward()"]


def stepped_on(optimizer_step) -> tuple[list, str, list]:
    """What the harness reads as the gradients a step used, around `optimizer_step(params)` on a
    tiny module (no process group: plain tensors), and the raw gradients it read before."""
    torch.manual_seed(0)
    module = torch.nn.Linear(3, 2)
    module(torch.randn(4, 3)).pow(2).sum().backward()
    raw = [p.grad.clone() for p in module.parameters()]
    with stepped_gradients(module) as stepped:
        optimizer_step(list(module.parameters()))
    return stepped.read(), stepped.source, raw


def handwritten_clip_and_step(params, zero_in_place: bool = False) -> None:
    """A clip by the global norm (max_norm 0.1) in place in .grad, a plain SGD step on the clipped
    gradients, then the gradients dropped (or, breaking the protocol, zeroed in place)."""
    torch.nn.utils.clip_grad_norm_(params, 0.1)
    with torch.no_grad():
        for p in params:
            p.sub_(p.grad)
            if zero_in_place:
                p.grad.zero_()
            else:
                p.grad = None


@pytest.fixture
def torch_env_side_effects():
    """torch sets TORCHINDUCTOR_CACHE_DIR on first use in-process; keep the env guard honest."""
    from pytest_fsdp_turbo.environ import restored_environ

    with restored_environ():
        yield


def test_the_stepped_on_gradients_are_read_whatever_the_optimizers_class(torch_env_side_effects):
    """Engine.optimizer_step's promise, read by the harness: a torch optimizer's by its pre-step
    hook; any other's from the tensors the backward left in .grad, as the call left them."""

    def torch_adamw(params):
        torch.nn.utils.clip_grad_norm_(params, 0.1)
        optimizer = torch.optim.AdamW(params, lr=1e-3)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for step, source in (
        (torch_adamw, SteppedGradients.HOOK),
        (handwritten_clip_and_step, SteppedGradients.HELD),
    ):
        read, seen_by, raw = stepped_on(step)
        assert seen_by == source
        norm = float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in raw])))
        coef = min(1.0, 0.1 / (norm + 1e-6))
        assert coef < 1 and clip_error(raw, read, coef) < 1e-6, source

    # zeroed in place after the step: the harness reads zeros, which check k sees 1.0 away
    read, seen_by, raw = stepped_on(lambda ps: handwritten_clip_and_step(ps, zero_in_place=True))
    assert seen_by == SteppedGradients.HELD
    assert clip_error(raw, read, 0.5) == 1.0
