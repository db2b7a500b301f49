"""An engine whose optimizer is not a `torch.optim.Optimizer` (e2e/handwritten_optimizer_engine.py:
AdamW and the clip in plain tensor math) is judged as one with torch's: the healthy one passes
every check, and check k still reads the gradients its step used (a clip 0.2% short is red on k
alone; an engine that zeroes them in place, against Engine.optimizer_step's promise, is red on k
naming that promise). Two-rank tiny runs, a few seconds each."""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_fsdp_turbo import checks
from pytest_fsdp_turbo_contract.records import OptimizerRecord

E2E = Path(__file__).resolve().parents[1] / "e2e"
CASE = "tiny-llama-fsdp2-deferred"
MODULE = "handwritten_optimizer_engine"
CLIP_ENGAGED = {"grad_clip": 0.5}  # below the case's norm (about 0.9): the clip scales every step

pytestmark = pytest.mark.devices(2)


def run(ppo_run, backend: str, **options):
    result = ppo_run(
        CASE,
        backend=backend,
        engine_modules=[MODULE],
        pythonpath=[str(E2E)],
        reference_checks=True,
        twin="none",
        **CLIP_ENGAGED,
        **options,
    )
    checks.check_completed(result)
    return result


def failed(result) -> dict[str, str]:
    verdict = checks.evaluate(result)
    return {o.check: o.detail for o in verdict.with_status(checks.FAILED)}


def test_a_healthy_engine_with_a_handwritten_adamw_passes_every_check(ppo_run):
    """Two updates (the betas count on the second), weight decay, and a clip that engages on
    both: every check that applies passes, c, i and k against the single-process reference and
    the harness's own closed forms."""
    result = run(ppo_run, "handwritten_adamw", updates=2, weight_decay=0.01)
    verdict = checks.check_all(result)
    assert verdict.not_applicable() == ["d: no replicas"]
    for rank in result.ranks:
        assert rank.metrics[OptimizerRecord.key("clip_coef")] < 1  # the clip was at work
        assert rank.metrics[OptimizerRecord.key("clip_max_rel_err")] < 1e-6


def test_k_reads_a_handwritten_clip_that_is_short(ppo_run):
    result = run(ppo_run, "handwritten_adamw_clip_loose_eps")
    assert set(failed(result)) == {"k"}, failed(result)
    assert "from the raw ones clipped by the global norm and max_norm" in failed(result)["k"]


def test_an_engine_that_zeroes_its_gradients_in_place_breaks_the_protocol_and_k_says_so(ppo_run):
    result = run(ppo_run, "handwritten_adamw_zeroes_gradients_in_place")
    why = failed(result)
    assert set(why) == {"k"}, why
    assert "stepped on gradients 1 away" in why["k"]
    assert "never zero in place" in why["k"] and "Engine.optimizer_step" in why["k"]
