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
    "scaled_lr": "ScaledLrEngine",
    "cold_logprobs": "ColdLogprobEngine",
    "never_steps": "NeverStepsEngine",
    "cold_ref": "ColdRefEngine",
    "stale_onload": "StaleOnloadEngine",
    "last_micro_batch_only": "LastMicroBatchOnlyEngine",
    "all_reduce_each": "AllReduceEachEngine",
}


def _broken_run(
    verl_trainer_run,
    request,
    case_id: str,
    bug: str,
    reference: bool = False,
    overrides: tuple[str, ...] = (),
):
    """The case with the bug's engine (`a+b`: several bugs, one engine, one run); without the
    reference unless asked (the checks that need none are proven alone there)."""
    from pytest_fsdp_turbo.kinds.registry import cases_of

    case = cases_of(request.config).get_trainer(case_id)
    broken = dataclasses.replace(
        case,
        overrides=case.overrides + overrides,
        external_modules=(MODULE,),
        env={**case.env, "PYTEST_FSDP_TURBO_TRAINER_BUG": bug},
        engine_class="_".join(ENGINE[b.partition("@")[0]] for b in bug.split("+")),
        reference=reference,
    )
    return verl_trainer_run(broken)


def _broken(verl_trainer_run, request, case_id: str, bug: str, **how):
    """The broken run, completed, and its checks' verdicts."""
    result = _broken_run(verl_trainer_run, request, case_id, bug, **how)
    checks.check_completed(result)
    return checks.evaluate(result)


def test_five_bugs_on_the_deferred_case_each_fail_their_own_check(verl_trainer_run, request):
    """The case's two optimizer steps (ppo_epochs 2), each judged on its own. On step 0 the seed's
    bug (deferral declared in verl's config, a sync context that does nothing: h); on step 1,
    deferral kept but every held gradient all-reduced by hand after the first micro-batch (h
    again, on its own step: every collective that carried gradients, where the reduce-scatter
    counts read right). The reference
    policy's pass at temperature 1 while the rollout samples at 0.8 (b: the KL's log-probs), an
    onload that restores the first mini-batch's parameters before the second (i: step 1 starts
    where step 0 began, not where it left the weights), and, on step 1 alone, the loss multiplied
    by 0 before backward: no gradient though the advantages are not 0 (a says so before it asks
    the reference; l sees a loss that sends nothing into the log-probs; c, from the reference)."""
    verdict = _broken(
        verl_trainer_run,
        request,
        "tiny-qwen3-verl-trainer-fsdp2-deferred",
        "noop_sync@0+cold_ref+stale_onload+zero_loss@1+all_reduce_each@1",
        reference=True,
        overrides=("actor_rollout_ref.rollout.temperature=0.8",),
    )
    details = {o.check: o.detail.splitlines() for o in verdict.with_status(checks.FAILED)}
    failed = {check: lines[0] for check, lines in details.items()}
    assert set(failed) == {"a", "b", "c", "h", "i", "l"}, failed
    assert "declares gradient_sync 'deferred'" in failed["h"]
    assert "expected reduce-scatters per micro-batch [0, 5], measured [5, 5]" in failed["h"]
    step_1 = [line for line in details["h"] if line.startswith("check h: step 1: ")]
    assert len(step_1) == 1, details["h"]
    assert "expected gradient collectives per micro-batch [none, 5 reduce_scatter]" in step_1[0]
    assert "measured [" in step_1[0] and " all_reduce, 5 reduce_scatter]" in step_1[0], step_1
    assert "step 0: the reference policy's log-probs verl's KL loss used differ" in failed["b"]
    assert (
        "step 1: parameter " in failed["i"] and "differs from where step 0 left it" in failed["i"]
    )
    assert "step 1: " in failed["a"], failed["a"]
    assert "= 0 on a step whose advantages are not all zero" in failed["a"]
    assert "step 1: " in failed["c"], failed["c"]
    assert "step 1: " in failed["l"], failed["l"]
    assert "the loss was scaled, masked or aggregated otherwise" in failed["l"]


def test_six_bugs_in_one_run_each_fail_their_own_check(verl_trainer_run, request):
    """One run, verl's start-up paid once, six bugs whose checks are disjoint: a stale push into
    one replica (e, no reference needed), FSDP2 dividing the gradients twice (c and a's
    reference norm: its reported norm is the true norm of what it holds, its clip right),
    the lr scaled by the data-parallel size again (i), the log-prob pass at temperature 1 while
    the rollout samples at 0.8 (b), a clip that ignores max_norm (k: the norm it reports is
    true, the gradients it steps on unclipped; the norm it holds still engages the clip), and
    gradients zeroed as each micro-batch begins (h: the micro-batch pair, no reference needed;
    every count of reduce-scatters as declared)."""
    verdict = _broken(
        verl_trainer_run,
        request,
        "tiny-qwen3-verl-trainer-fsdp2",
        "stale_push+half_grads+scaled_lr+cold_logprobs+skip_clip+last_micro_batch_only",
        reference=True,
        overrides=("actor_rollout_ref.rollout.temperature=0.8",),
    )
    failed = {o.check: o.detail.splitlines()[0] for o in verdict.with_status(checks.FAILED)}
    assert set(failed) == {"a", "b", "c", "e", "h", "i", "k"}, failed
    assert "a stale or wrong push" in failed["e"]
    assert (
        "step 0: the engine's gradients differ from the single-process reference's" in (failed["c"])
    )
    assert "the single-process reference gradients' norm is" in failed["a"]
    assert "x lr from AdamW in closed form on the engine's own clipped" in failed["i"]
    assert "the old log-probs verl trained with differ from the reference's forward" in failed["b"]
    assert "from the raw ones clipped by the global norm and max_norm" in failed["k"]
    assert "the micro-batch pair: parameter " in failed["h"], failed["h"]


def test_an_engine_that_never_steps_is_the_runs_failure_with_its_cause_first(
    verl_trainer_run, request
):
    result = _broken_run(verl_trainer_run, request, "tiny-qwen3-verl-trainer-fsdp2", "never_steps")
    head = result.failure_text().splitlines()[0]
    assert "trained on the mini-batch the actor handed it (train_batch)" in head, head
    assert "but the optimizer never stepped: nothing was updated" in head, head
