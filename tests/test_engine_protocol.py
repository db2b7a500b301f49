"""Every engine the harness drives meets pytest_fsdp_turbo_engine/engines/protocol.py, and one that does not is refused in one
line naming what it lacks (checked in each rank before the engine is built)."""

import inspect
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from pytest_fsdp_turbo_engine.engines.fsdp2 import FSDPEngineWithLMHead  # noqa: E402
from pytest_fsdp_turbo_engine.engines.protocol import (  # noqa: E402
    HarnessLoopEngine,
    OwnLoopEngine,
    contract_breaches,
)

E2E = Path(__file__).resolve().parents[1] / "e2e"


def shipped_engines() -> list[type]:
    from pytest_fsdp_turbo_engine.engines.turbo import FSDPTurboEngineWithLMHead
    from pytest_fsdp_turbo_engine.engines.verl_adapter import VerlEngineAdapter

    sys.path.insert(0, str(E2E))
    try:
        import broken_engines
    finally:
        sys.path.remove(str(E2E))
    broken = [c for _, c in inspect.getmembers(broken_engines, inspect.isclass)]
    return [FSDPEngineWithLMHead, FSDPTurboEngineWithLMHead, VerlEngineAdapter, *broken]


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
