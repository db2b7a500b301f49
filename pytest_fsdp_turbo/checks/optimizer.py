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
    GRAD_NORM,
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
    first_missing,
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
from pytest_fsdp_turbo_contract.spec import Aspect, covered, exercised_as_declared


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
    # declared: every rank's comparison must have run
    if missing := first_missing(result, (STEP_MAX_ERR_LR, STEP_REL_L2_ERR)):
        ranked, reading = missing
        raise CheckFailure(
            f"check i: the case declares the single-process reference "
            f"(reference_checks) but rank {ranked.rank} has no reading of the "
            f"reference's step ({reading.key}): the post-step comparison never ran "
            f"(phase {reading.record.PHASE!r}, log {ranked.log_path})"
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
    and the case's max_norm: the gradients the step used, read by the harness whatever the
    optimizer's class (a torch optimizer's as its step began, by a pre-step hook; any other's
    from the gradient tensors the backward left in `.grad`, as the engine's optimizer_step left
    them: the engine protocol's Engine.optimizer_step), against the raw gradients times
    min(1, max_norm / (norm + 1e-6)). Adam's first step barely sees a gradient's scale, so only
    this reading shows a clip that ignores max_norm or uses each shard's own norm. It applies
    wherever the optimizer stepped (a finite norm): a rank without the reading fails, naming it."""
    if _rank0(result).optimizer.grad_norm_finite is False:
        return  # no step to judge: a non-finite norm skips it (checks a and i judge that)
    # every rank's step was measured, whatever its optimizer
    if missing := first_missing(result, (CLIP_COEF, CLIP_MAX_REL_ERR)):
        ranked, reading = missing
        raise CheckFailure(
            f"check k: rank {ranked.rank}: no reading of the gradients the optimizer "
            f"stepped on ({reading.key}): the harness reads them whatever the "
            f"optimizer's class, so phase {reading.record.PHASE!r} never measured the "
            f"step (log {ranked.log_path})"
        )
    coef = _value(result, 0, CLIP_COEF)
    tol = CLIP_TOL[_dtype(result)]
    if over := _first_above(result, CLIP_MAX_REL_ERR, tol):
        raise CheckFailure(
            f"check k: rank {over[0]}: the optimizer stepped on gradients {over[1]:.3g} away "
            f"(relative, {CLIP_MAX_REL_ERR.key}) from the raw ones clipped by "
            f"the global norm and max_norm (coefficient {coef:.4g}, "
            f"{CLIP_COEF.key}), tolerance {tol:g}; read as a torch optimizer's step began, or, "
            "for any other optimizer, from the gradient tensors the backward left in .grad as "
            "optimizer_step left them, which the engine protocol (Engine.optimizer_step) asks an "
            "engine to clip in place and never zero in place"
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
    """The run exercised what its checks judge, each aspect (Aspect) measured or declared, or its
    case says why not (case key `not_exercised`, aspect -> reason): a second, off-policy update
    (checks l and i), whose PPO ratio clip engaged (l); gradients the optimizer stepped on clipped
    by the global norm (k); a KL reference a step from the rollout policy, so the KL term pulls
    (l, and c and i through the gradients); Adam betas other than torch's over that second update
    (i); with SP, a chunk boundary on a response token that counts. Not a check of the engine: of
    the case, whose green would otherwise pass engines one line from healthy. One line names each
    aspect missed, its reading and the setting to change."""
    check_completed(result)
    spec = declared(result)
    engine, ppo = spec.engine, spec.ppo
    norm = GRAD_NORM.of(_rank0(result))
    below = "" if norm is None else f" below the measured norm ({GRAD_NORM.key} = {norm:.3g})"
    said: dict[Aspect, str] = {  # what a run that misses the aspect did
        Aspect.SECOND_UPDATE: "one on-policy update: PPO's clip, a KL term off the rollout "
        "policy and Adam's betas never shape it",
        Aspect.RATIO_CLIP: f"its last of {ppo.updates} updates clipped no token",
        Aspect.GRAD_CLIP: "its gradients were not clipped",
        Aspect.KL_REFERENCE: "its KL reference equals the rollout policy",
        Aspect.ADAM_BETAS: f"Adam's betas are torch's defaults ({engine.adam_beta1:g}, "
        f"{engine.adam_beta2:g}), which an engine that drops the case's also steps with",
        Aspect.SP_BOUNDARY: "no SP chunk boundary fell on a response token",
    }
    change: dict[Aspect, str] = {
        Aspect.SECOND_UPDATE: f"updates = 2 (now {ppo.updates})",
        Aspect.RATIO_CLIP: f"lower clip_ratio ({ppo.clip_ratio:g})",
        Aspect.GRAD_CLIP: f"lower grad_clip ({engine.grad_clip:g}){below}",
        Aspect.KL_REFERENCE: f"a kl_reference_shift that moves it ({ppo.kl_reference_shift:g})",
        Aspect.ADAM_BETAS: "non-default betas (adam_beta2 = 0.95)",
        Aspect.SP_BOUNDARY: f"raise max_new_tokens ({ppo.max_new_tokens})",
    }
    measured: dict[Aspect, tuple[Reading[Any], Callable[[Any], bool]]] = {
        Aspect.RATIO_CLIP: (PG_CLIPFRAC_LAST_UPDATE, lambda v: v > 0),
        Aspect.GRAD_CLIP: (CLIP_COEF, lambda v: v < 1),
        Aspect.KL_REFERENCE: (KL_REFERENCE_GAP_MEAN, lambda v: v > 0),
        Aspect.SP_BOUNDARY: (SP_BOUNDARIES_IN_RESPONSES, lambda v: v > 0),
    }
    excused = ppo.unexercised()
    problems = []
    for aspect in Aspect:
        if aspect in excused or covered(aspect, engine, ppo):
            continue  # the case says why, or another aspect's miss (or reason) covers it
        if aspect in measured:
            reading, holds = measured[aspect]
            if not holds(value := _value(result, 0, reading)):
                problems.append(
                    f"{aspect}: {said[aspect]} ({reading.key} = {value:.3g}): {change[aspect]}"
                )
        elif not exercised_as_declared(aspect, engine, ppo):
            problems.append(f"{aspect}: {said[aspect]}: {change[aspect]}")
    if problems:
        raise CheckFailure(
            f"case {result.case_id} exercises less than it declares: "
            + "; ".join(problems)
            + " (or the case says why, in not_exercised: aspect = reason)"
        )
