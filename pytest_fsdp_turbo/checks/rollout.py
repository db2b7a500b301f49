"""Trainer and rollout agree: b (the first micro-batch is on-policy) and e (the weights the rollout
serves after the step are the trainer's)."""

from __future__ import annotations

from pytest_fsdp_turbo.checks.readings import (
    HANDOFF_WEIGHT_MAX_ABS_DIFF,
    PG_CLIPFRAC,
    PG_CLIPFRAC_FIRST_MICRO_BATCH,
    PPO_KL,
    PPO_KL_FIRST_MICRO_BATCH,
    PPO_LOG_RATIO_ABS_MAX_FIRST_MICRO_BATCH,
    ROLLOUT_LOGPROB_MAX_ABS_DIFF,
    ROLLOUT_WEIGHT_MAX_ABS_DIFF,
    _dtype,
    _first_above,
    _measured,
    declared,
)
from pytest_fsdp_turbo.checks.tolerances import (
    ON_POLICY_KL_TOL,
    ON_POLICY_LOG_RATIO_TOL,
    WEIGHT_SYNC_TOL,
)
from pytest_fsdp_turbo.checks.verdicts import (
    CheckFailure,
    NotApplicable,
    judges,
)
from pytest_fsdp_turbo_contract.results import RunResult


@judges("b")
def check_on_policy(result: RunResult) -> None:
    """b. On the first micro-batch the PPO ratio is 1: ppo_kl ~ 0, nothing clipped, and (fp32) every
    token's log-ratio ~ 0, which a mean can hide when errors of both signs cancel."""
    dtype = _dtype(result)
    tol = ON_POLICY_LOG_RATIO_TOL.get(dtype)
    key = PPO_LOG_RATIO_ABS_MAX_FIRST_MICRO_BATCH.key
    if tol is not None and (
        over := _first_above(result, PPO_LOG_RATIO_ABS_MAX_FIRST_MICRO_BATCH, tol)
    ):
        raise CheckFailure(
            f"check b: rank {over[0]}: a token's |logprob - old logprob| on the first micro-batch "
            f"is {over[1]:.3g} ({key}), expected <= {tol:g} (old logprobs must come from the "
            "same weights)"
        )
    tol = ON_POLICY_KL_TOL[dtype]
    for rank, value in _measured(result, PPO_KL_FIRST_MICRO_BATCH):
        if not abs(value) <= tol:
            raise CheckFailure(
                f"check b: rank {rank}: {PPO_KL.key} on the first micro-batch = {value:.3g}, "
                f"expected |value| <= {tol:g} (old logprobs must come from the same weights)"
            )
    for rank, value in _measured(result, PG_CLIPFRAC_FIRST_MICRO_BATCH):
        if value != 0:
            raise CheckFailure(
                f"check b: rank {rank}: {PG_CLIPFRAC.key} on the first micro-batch = {value:.3g}, expected 0"
            )


@judges("e")
def check_weight_sync(result: RunResult, tolerance: float | None = None) -> None:
    """e. Weights gathered from FSDP into the rollout model reproduce the trainer's logprobs, and
    every tensor the rollout serves readably equals the trainer's own parameter exactly (in the
    served dtype; the harness gathers the parameters from the engine's module, not from the state
    dict the engine handed over)."""
    if declared(result).ppo.replay:
        raise NotApplicable("no rollout (a replay twin)")
    tol = WEIGHT_SYNC_TOL[_dtype(result)] if tolerance is None else tolerance
    problems = []
    if over := _first_above(result, ROLLOUT_LOGPROB_MAX_ABS_DIFF, tol):
        problems.append(
            f"rank {over[0]}: {ROLLOUT_LOGPROB_MAX_ABS_DIFF.key} = {over[1]:.3g}, tolerance {tol:g}"
        )
    for rank, diff in _measured(result, HANDOFF_WEIGHT_MAX_ABS_DIFF):
        if diff != 0:
            worst = result.ranks[rank].step.post_step.handoff_weight_worst
            problems.append(
                f"rank {rank}: the engine hands the rollout {worst!r} {diff:.3g} away from its "
                f"own parameter ({HANDOFF_WEIGHT_MAX_ABS_DIFF.key})"
            )
            break
    for rank, diff in _measured(result, ROLLOUT_WEIGHT_MAX_ABS_DIFF):
        after = result.ranks[rank].step.post_step
        compared = after.rollout_weights_compared
        if diff != 0 or compared == 0:
            problems.append(
                f"rank {rank}: the rollout serves {after.rollout_weight_worst!r} "
                f"{diff:.3g} away from the trainer's parameter after the push ({compared} "
                f"tensors compared exactly; {ROLLOUT_WEIGHT_MAX_ABS_DIFF.key})"
            )
            break
    if problems:
        raise CheckFailure("check e: " + "; ".join(problems))
