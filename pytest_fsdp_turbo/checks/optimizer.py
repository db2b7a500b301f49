"""The optimizer step and the loss: i (every rank stepped, as AdamW in closed form and as the
reference), k (on gradients clipped by the global norm), l (the loss's gradient on each
log-probability), and whether the case exercised what those checks judge."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from pytest_fsdp_turbo.checks.readings import (
    ADAMW_STEP_MAX_ERR_LR,
    CLIP_COEF,
    CLIP_MAX_REL_ERR,
    KL_REFERENCE_GAP_MEAN,
    LOCAL_PARAM_NUMEL,
    LOSS_GRAD_MAX_REL_ERR,
    PARAM_UPDATE_MAX_ABS,
    PG_CLIPFRAC_LAST_UPDATE,
    SP_BOUNDARIES_IN_RESPONSES,
    STEP_MAX_ERR_LR,
    STEP_REL_L2_ERR,
    _dtype,
    _first_above,
    _measured,
    _rank0,
    _value,
    declared,
    declares_reference,
)
from pytest_fsdp_turbo.checks.tolerances import (
    ADAMW_STEP_TOL_LR,
    CLIP_TOL,
    LOSS_GRAD_TOL,
    STEP_L2_TOL,
    STEP_TOL_LR,
)
from pytest_fsdp_turbo.checks.verdicts import (
    CheckFailure,
    check_completed,
    judges,
)
from pytest_fsdp_turbo_contract.records import Reading
from pytest_fsdp_turbo_contract.results import RunResult


@judges("i")
def check_optimizer_step(result: RunResult) -> None:
    """i. Every rank holding parameters changed them (all bit-identical when the norm was not
    finite); in every mode, each parameter element moved as AdamW moves it, computed by the
    harness from the (clipped) gradients and parameters it read, its own moments and the case's
    lr, betas, eps and weight decay (the betas cancel out of the first step: a case with
    `updates = 2` proves them); with a reference, the post-step parameters also equal the
    reference's steps."""
    finite = _rank0(result).optimizer.grad_norm_finite is not False
    moved_key = PARAM_UPDATE_MAX_ABS.key
    numel = dict(_measured(result, LOCAL_PARAM_NUMEL))
    for rank, moved in _measured(result, PARAM_UPDATE_MAX_ABS):
        if finite and numel[rank] and not moved > 0:
            raise CheckFailure(
                f"check i: rank {rank}: {moved_key} = {moved}, expected this rank's "
                f"{numel[rank]} parameters to change in the optimizer step"
            )
        if not finite and moved != 0:
            raise CheckFailure(
                f"check i: rank {rank}: {moved_key} = {moved} after a non-finite "
                "gradient norm, expected the step to be skipped (parameters bit-identical)"
            )
    tol = ADAMW_STEP_TOL_LR[_dtype(result)]
    over = _first_above(result, ADAMW_STEP_MAX_ERR_LR, tol) if finite else None
    if over:
        raise CheckFailure(
            f"check i: rank {over[0]}: post-step parameters differ from AdamW in closed form "
            f"(from the gradients and parameters the harness read, its own moments over "
            f"{declared(result).ppo.updates} update(s), and the case's lr, betas, eps and weight "
            f"decay) by {over[1]:.3g} x lr ({ADAMW_STEP_MAX_ERR_LR.key}), "
            f"tolerance {tol:g}"
        )
    if not declares_reference(result) or not finite:
        return  # no reference step declared, or no step to compare (a non-finite norm skips it)
    if _rank0(result).post_step.step_max_err_lr is None:
        raise CheckFailure(
            f"check i: the case declares the single-process reference (reference_checks) but "
            f"rank 0 has no reading of the reference's step ({STEP_MAX_ERR_LR.key}): the "
            "post-step comparison never ran"
        )
    dtype = _dtype(result)
    tol = STEP_L2_TOL[dtype]
    if over := _first_above(result, STEP_REL_L2_ERR, tol):
        raise CheckFailure(
            f"check i: rank {over[0]}: the update differs from the single-process reference "
            f"step's by relative L2 error {over[1]:.3g} ({STEP_REL_L2_ERR.key}), "
            f"tolerance {tol:g}"
        )
    tol_lr = STEP_TOL_LR.get(dtype)
    if tol_lr is not None and (over := _first_above(result, STEP_MAX_ERR_LR, tol_lr)):
        raise CheckFailure(
            f"check i: rank {over[0]}: post-step parameters differ from the single-process "
            f"reference step by {over[1]:.3g} x lr ({STEP_MAX_ERR_LR.key}), "
            f"tolerance {tol_lr:g}"
        )


@judges("k")
def check_clip(result: RunResult) -> None:
    """k. The optimizer stepped on the gradients clipped by the global norm the harness measured
    and the case's max_norm: read as the step began (a pre-step hook of the harness's), against
    the raw gradients times min(1, max_norm / (norm + 1e-6)). Adam's first step barely sees a
    gradient's scale, so only this reading shows a clip that ignores max_norm or uses each
    shard's own norm."""
    coef = _value(result, 0, CLIP_COEF)
    tol = CLIP_TOL[_dtype(result)]
    if over := _first_above(result, CLIP_MAX_REL_ERR, tol):
        raise CheckFailure(
            f"check k: rank {over[0]}: the optimizer stepped on gradients {over[1]:.3g} away "
            f"(relative, {CLIP_MAX_REL_ERR.key}) from the raw ones clipped by "
            f"the global norm and max_norm (coefficient {coef:.4g}, "
            f"{CLIP_COEF.key}), tolerance {tol:g}"
        )


@judges("l")
def check_loss_gradient(result: RunResult) -> None:
    """l. The gradient the engine's backward delivered to the log-probabilities it reported, per
    micro-batch and update, against the PPO loss's gradient in closed form (clip range, dual
    clip, KL term, entropy and causal-LM coefficients, response mask, global token mean),
    caught by a hook of the harness's on that tensor. On one on-policy update the ratio is 1 and
    the KL gradient 0, so only a case with `updates = 2` shows a loss that drops the clip range,
    counts the KL twice or ignores the response mask."""
    tol = LOSS_GRAD_TOL[_dtype(result)]
    if over := _first_above(result, LOSS_GRAD_MAX_REL_ERR, tol):
        updates = declared(result).ppo.updates
        what = (
            "never reached the log-probabilities the engine reported"
            if over[1] == math.inf
            else f"differs by {over[1]:.3g} (relative to its largest entry)"
        )
        raise CheckFailure(
            f"check l: rank {over[0]}: the loss's gradient on the log-probabilities {what} from "
            f"the PPO loss's in closed form over {updates} update(s) "
            f"({LOSS_GRAD_MAX_REL_ERR.key}), tolerance {tol:g}"
        )


def check_exercised(result: RunResult) -> None:
    """What the case declares in order to exercise the checks, happened (not a check of the
    engine: of the case): a second update clipped tokens (PPO's clip) and the optimizer stepped
    on clipped gradients, so checks k, l and i see both clips at work; a KL reference a step away
    reached the batch, so the KL term pulls; with SP, a chunk boundary fell on a response token
    that counts, so a label shifted per chunk changes the loss. A case whose settings exercise
    none of it passes engines with those bugs."""
    check_completed(result)
    spec = declared(result)
    again, ppo = spec.ppo.updates > 1, spec.ppo
    wanted: tuple[tuple[bool, Reading[Any], Callable[[Any], bool], str, str], ...] = (
        # (declared, reading, must hold, what it says when not, what to change)
        (again and not ppo.clip_not_exercised, PG_CLIPFRAC_LAST_UPDATE,
         lambda v: v > 0, f"its last of {ppo.updates} updates clipped no token",
         f"lower clip_ratio ({ppo.clip_ratio:g})"),
        (again, CLIP_COEF, lambda v: v < 1, "its gradients were not clipped",
         f"lower grad_clip ({spec.engine.grad_clip:g})"),
        (ppo.kl_reference_shift > 0, KL_REFERENCE_GAP_MEAN, lambda v: v > 0,
         "its KL reference equals the rollout policy", "a kl_reference_shift that moves it"),
        (spec.engine.sp_size > 1, SP_BOUNDARIES_IN_RESPONSES, lambda v: v > 0,
         "no SP chunk boundary fell on a response token",
         f"raise max_new_tokens ({ppo.max_new_tokens})"),
    )  # fmt: skip
    problems = [
        f"{said} ({reading.key} = {value:.3g}): {change}"
        for applies, reading, holds, said, change in wanted
        if applies and not holds(value := _value(result, 0, reading))
    ]
    if problems:
        raise CheckFailure(
            f"case {result.case_id} exercises less than it declares: " + "; ".join(problems)
        )
