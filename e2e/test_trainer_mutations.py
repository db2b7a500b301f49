"""Broken engines through verl's own trainer: each check a trainer case claims is proven by an
engine it turns red, with the cause in the first lines of the failure."""

from __future__ import annotations

import dataclasses

import pytest

from pytest_fsdp_turbo import checks

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.cpu_e2e,
    pytest.mark.devices(2),
    pytest.mark.verl,
    pytest.mark.vllm,
    pytest.mark.verl_trainer,
]
MODULE = "e2e.broken_trainer_engines"
# the class each bug's engine is: the run is red unless verl built it (a registration that missed)
ENGINE = {
    "noop_sync": "NoopSyncEngine",
    "stale_push": "StalePushEngine",
    "skip_clip": "SkipClipEngine",
    "zero_loss": "ZeroLossEngine",
    "half_grads": "HalfGradsEngine",
}


def _broken(verl_trainer_run, request, case_id: str, bug: str, reference: bool = False):
    """The case with the bug's engine; without the reference unless asked (the checks that need
    none are proven alone there)."""
    from pytest_fsdp_turbo.kinds.registry import cases_of

    case = cases_of(request.config).get_trainer(case_id)
    broken = dataclasses.replace(
        case,
        external_modules=(MODULE,),
        env={**case.env, "PYTEST_FSDP_TURBO_TRAINER_BUG": bug},
        engine_class=ENGINE[bug],
        reference=reference,
    )
    result = verl_trainer_run(broken)
    checks.check_completed(result)
    return checks.evaluate(result)


def test_noop_sync_context_under_declared_deferral_fails_h(verl_trainer_run, request):
    """The seed's bug: deferral declared in verl's config, a sync context that does nothing."""
    verdict = _broken(
        verl_trainer_run, request, "tiny-qwen3-verl-trainer-fsdp2-deferred", "noop_sync"
    )
    failed = {o.check: o.detail for o in verdict.with_status(checks.FAILED)}
    assert set(failed) == {"h"}, failed
    first = failed["h"].splitlines()[0]
    assert "declares gradient_sync 'deferred'" in first
    assert "expected reduce-scatters per micro-batch [0, 5], measured [5, 5]" in first


def test_stale_push_into_one_replica_fails_e(verl_trainer_run, request):
    verdict = _broken(verl_trainer_run, request, "tiny-qwen3-verl-trainer-fsdp2", "stale_push")
    failed = {o.check: o.detail for o in verdict.with_status(checks.FAILED)}
    assert set(failed) == {"e"}, failed
    assert "a stale or wrong push" in failed["e"].splitlines()[0]


def test_a_clip_that_ignores_max_norm_fails_k(verl_trainer_run, request):
    verdict = _broken(verl_trainer_run, request, "tiny-qwen3-verl-trainer-fsdp2", "skip_clip")
    failed = {o.check: o.detail for o in verdict.with_status(checks.FAILED)}
    assert set(failed) == {"k"}, failed
    assert "from the raw ones clipped by the global norm and max_norm" in failed["k"]


def test_a_loss_multiplied_by_zero_fails_a_on_its_advantages(verl_trainer_run, request):
    verdict = _broken(verl_trainer_run, request, "tiny-qwen3-verl-trainer-fsdp2", "zero_loss")
    failed = {o.check: o.detail for o in verdict.with_status(checks.FAILED)}
    assert set(failed) == {"a"}, failed
    assert "= 0 on a step whose advantages are not all zero" in failed["a"].splitlines()[0]


def test_halved_gradients_fail_c_against_the_reference(verl_trainer_run, request):
    """The norm it reports is the true norm of what it holds, its clip is right, the loss
    gradient is right: only the single-process reference sees the gradients are half."""
    verdict = _broken(
        verl_trainer_run, request, "tiny-qwen3-verl-trainer-fsdp2", "half_grads", reference=True
    )
    failed = {o.check: o.detail for o in verdict.with_status(checks.FAILED)}
    assert "c" in failed and set(failed) <= {"a", "c"}, failed
    first = failed["c"].splitlines()[0]
    assert "step 0: the engine's gradients differ from the single-process reference's" in first
