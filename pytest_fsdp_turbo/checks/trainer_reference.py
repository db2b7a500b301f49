"""The verdicts on a verl trainer run that need the single-process reference (observe/replay.json,
written by pytest_fsdp_turbo_engine/trainer/replay.py), every step of the run:

  (a's reference norm is every case's: check_grad_norm on each step's readings, which carry the
  replayed step's norm)
  b  the old log-probs verl trained with against the reference's forward of the same tokens, on
     each update's first mini-batch (the one the old log-probs were computed for), and the
     reference policy's log-probs (the KL loss's) against its forward at the checkpoint's
     parameters, every step
  c  the engine's raw gradients (after the last backward) against the reference's, per parameter
     and as a whole
  i  the parameters after the step against AdamW in closed form on the engine's own clipped
     gradients, the update against the reference's, and the parameters before each step
     against where the previous step left them (the first: the checkpoint as the engine loads it)
  l  the gradient verl's loss sent into each row's response log-probs against the loss's in
     closed form at the engine's own log-probs

In a run that computes in bf16, b, c and i's distances from the fp32 reference are held to a
multiple of the reference's own distance when it computes in bf16 from the same parameters
(measured in that run, on that computation); in fp32, to the fp32 tolerances.
"""

from __future__ import annotations

from pytest_fsdp_turbo.checks.readings import declared, declares_reference
from pytest_fsdp_turbo.checks.rounding import beyond_rounding
from pytest_fsdp_turbo.checks.tolerances import (
    ADAMW_STEP_TOL_LR,
    GRAD_PARITY_L2_TOL,
    GRAD_PARITY_TOL,
    LOSS_GRAD_TOL,
    REFERENCE_NOISE_FACTOR,
    STEP_L2_TOL,
    TWIN_OLD_LOGPROB_TOL,
)
from pytest_fsdp_turbo.checks.verdicts import CheckFailure, NotApplicable, judges
from pytest_fsdp_turbo_contract.records import NAMES_DIFFER
from pytest_fsdp_turbo_contract.results import RunResult
from pytest_fsdp_turbo_contract.trainer_files import TrainerFolder
from pytest_fsdp_turbo_contract.trainer_records import (
    Replay,
    ReplayedStep,
    read_ranks,
    read_replay,
)

FP32 = "fp32"
# bf16's machine epsilon: one rounding, relative to the entry. l on a trainer run computing in bf16
# is held to it; measured on the three tiny trainer cases, all then in bf16 (verl's FSDP2 engine and
# its FSDP-Turbo engine with Ulysses SP 2, every step, fresh clone of f98d17b, 2026-12-07): 1.3e-3
# to 3.3e-3, so 2.4 times the worst healthy reading; a loss scaled, masked or aggregated otherwise
# is O(1)
BF16_ROUNDING = 2.0**-7


def replayed(result: RunResult, letter: str) -> Replay:
    """The reference's replay, when the case declares it: a replay that is missing, failed or
    skipped a step fails the check; what the reference refuses to model cannot apply."""
    folder = TrainerFolder(result.artifacts_dir)
    replay = read_replay(folder.replay)
    if replay is not None and replay.refused:  # spec.json then declares no reference
        raise NotApplicable(f"the reference refuses: {replay.refused}")
    if not declares_reference(result):
        raise NotApplicable("no reference declared (the trainer case's `reference`)")
    if replay is None:
        raise CheckFailure(
            f"check {letter}: the case declares the single-process reference, but the replay "
            f"wrote no readable record ({folder.replay}): did the trainer finish?"
        )
    if replay.error:
        raise CheckFailure(f"check {letter}: {replay.error} (its traceback: {folder.log})")
    if not replay.steps:
        raise CheckFailure(
            f"check {letter}: the observer captured no optimizer step to replay "
            f"({folder.observe / 'capture'})"
        )
    ranks = read_ranks(folder.ranks())
    stepped = max((len(rank.steps) for rank in ranks.values()), default=0)
    indices = [step.step for step in replay.steps]
    if not replay.complete or indices != list(range(stepped)):
        raise CheckFailure(
            f"check {letter}: the replay covers steps {indices or 'none'} of the {stepped} the "
            f"observer saw the optimizer take"
            + ("" if replay.complete else ", and stopped short")
            + f" ({folder.replay}; the trainer's log: {folder.log})"
        )
    for step in replay.steps:
        if step.problem:
            raise CheckFailure(f"check {letter}: step {step.step}: {step.problem}")
    return replay


def _compute_dtype(result: RunResult) -> str:
    return str(declared(result).golden_dtype or FP32)


def _tolerance(noise: float | None, fp32: float) -> tuple[float, str]:
    """fp32's tolerance, or in bf16 the reference's own bf16 distance times the factor."""
    if noise is None:
        return fp32, f"tolerance {fp32:g}"
    tol = max(REFERENCE_NOISE_FACTOR * noise, fp32)
    return tol, (
        f"tolerance {tol:.3g} = {REFERENCE_NOISE_FACTOR:g} x the reference's own distance in "
        f"bf16 ({noise:.3g})"
    )


def _missing(letter: str, step: ReplayedStep, value: float | None, what: str) -> float:
    if value is None:
        raise CheckFailure(f"check {letter}: step {step.step}: the replay has no {what}")
    return value


@judges("b")
def check_old_logprobs(result: RunResult) -> None:
    """b: the log-probs verl trained with against the reference's forward of the same tokens:
    the old policy's at the step's parameters (each update's first mini-batch), and the reference
    policy's (the KL loss's) at the checkpoint's, every step that holds them."""
    replay = replayed(result, "b")
    steps = replay.steps
    judged = [s for s in steps if s.old_logprob_max_abs_diff is not None]
    if not judged:
        raise CheckFailure("check b: no replayed step is an update's first mini-batch")
    for step in judged:
        _held_to_noise(
            step,
            step.old_logprob_max_abs_diff or 0.0,
            step.old_logprob_noise,
            "the old log-probs verl trained with differ from the reference's forward of the same "
            "tokens at the step's parameters",
            "the old policy's forward is not the policy's",
        )
    if replay.kl_loss and all(s.ref_logprob_max_abs_diff is None for s in steps):
        raise CheckFailure(
            "check b: verl's resolved config declares a KL loss, but no replayed step holds the "
            "reference policy's log-probs (ref_log_prob in the mini-batch train_batch got)"
        )
    for step in steps:
        if step.ref_logprob_max_abs_diff is not None:
            _held_to_noise(
                step,
                step.ref_logprob_max_abs_diff,
                step.ref_logprob_noise,
                "the reference policy's log-probs verl's KL loss used differ from the reference's "
                "forward of the same tokens at the checkpoint's parameters",
                "the KL is taken against another policy",
            )


def _held_to_noise(
    step: ReplayedStep, diff: float, noise: float | None, what: str, meaning: str
) -> None:
    """b's log-probs: fp32's tolerance, or the reference's own distance in bf16 times the factor."""
    tol, said = _tolerance(noise, TWIN_OLD_LOGPROB_TOL[FP32])
    if not diff <= tol:
        raise CheckFailure(f"check b: step {step.step}: {what} by {diff:.3g} ({said}): {meaning}")


@judges("c")
def check_trainer_gradients(result: RunResult) -> None:
    """c: the engine's raw gradients against the reference's, every step."""
    policy = declared(result).engine.gradient_sync
    for step in replayed(result, "c").steps:
        if step.grad_max_rel_err_param.startswith(NAMES_DIFFER):
            raise CheckFailure(
                f"check c: step {step.step}: the engine's {step.grad_max_rel_err_param}"
            )
        l2 = _missing("c", step, step.grad_rel_l2_err, "gradient reading")
        tol, said = _tolerance(step.grad_rel_l2_noise, GRAD_PARITY_L2_TOL[FP32])
        if not l2 <= tol:
            raise CheckFailure(
                f"check c: step {step.step}: the engine's gradients differ from the "
                f"single-process reference's by relative L2 error {l2:.3g} ({said}) [sync "
                f"policy {policy}, {step.rows} rows, {step.tokens} response tokens]"
            )
        if step.grad_param_rel_l2 is not None:  # bf16: each parameter against its rounding
            entries = ((n, mine, noise) for n, (mine, noise) in step.grad_param_rel_l2.items())
            if over := beyond_rounding(entries):
                said = over.said(
                    "its gradient differs from the single-process reference's in bf16 by "
                    "relative L2 error"
                )
                raise CheckFailure(
                    f"check c: step {step.step}: parameter {over.name}: {said} [sync policy "
                    f"{policy}]"
                )
        elif step.grad_rel_l2_noise is not None:
            raise CheckFailure(
                f"check c: step {step.step}: the run computes in bf16, but the replay has no "
                "per-parameter reading (grad_param_rel_l2)"
            )
        per_param = GRAD_PARITY_TOL[FP32]
        if step.grad_rel_l2_noise is None and not (step.grad_max_rel_err or 0.0) <= per_param:
            raise CheckFailure(
                f"check c: step {step.step}: parameter {step.grad_max_rel_err_param}: its "
                f"gradient differs from the reference's by {step.grad_max_rel_err:.3g} (relative "
                f"to its largest entry), tolerance {per_param:g} [sync policy {policy}]"
            )


@judges("i")
def check_trainer_update(result: RunResult) -> None:
    """i: the optimizer step in closed form on the engine's gradients, then against the
    reference's update."""
    tol_lr = ADAMW_STEP_TOL_LR[FP32]
    for step in replayed(result, "i").steps:
        moved = step.continuity_max_abs
        if moved is not None and moved != 0.0:
            where = f"where step {step.step - 1} left it" if step.step else "the checkpoint"
            raise CheckFailure(
                f"check i: step {step.step}: parameter {step.continuity_param} before the step "
                f"differs from {where} by {moved:.3g}: something changed the weights "
                + ("between optimizer steps" if step.step else "before the first step")
            )
        err = _missing("i", step, step.update_max_err_lr, "update reading")
        if not err <= tol_lr:
            raise CheckFailure(
                f"check i: step {step.step}: parameter {step.update_max_err_param} after the "
                f"step is {err:.3g} x lr from AdamW in closed form on the engine's own clipped "
                f"gradients, beyond one rounding of the parameter (tolerance {tol_lr:g} x lr): "
                "the optimizer did not take the declared step"
            )
        l2 = _missing("i", step, step.update_rel_l2_err, "update reading")
        tol, said = _tolerance(step.update_rel_l2_noise, STEP_L2_TOL[FP32])
        if not l2 <= tol:
            raise CheckFailure(
                f"check i: step {step.step}: the update differs from the reference's by relative "
                f"L2 error {l2:.3g} ({said})"
            )


@judges("l")
def check_trainer_loss_gradient(result: RunResult) -> None:
    """l: the gradient reaching each row's log-probs against the loss in closed form."""
    # the log-probs verl's loss differentiates are in the compute dtype: one rounding of theirs
    tol = LOSS_GRAD_TOL[FP32] if _compute_dtype(result) == FP32 else BF16_ROUNDING
    for step in replayed(result, "l").steps:
        err = _missing("l", step, step.loss_grad_max_rel_err, "loss gradient reading")
        if step.loss_grad_rows != step.rows:
            raise CheckFailure(
                f"check l: step {step.step}: the observer caught the loss gradient of "
                f"{step.loss_grad_rows} of {step.rows} rows"
            )
        if not err <= tol:
            raise CheckFailure(
                f"check l: step {step.step}: the gradient verl's loss sent into the response "
                f"log-probs differs from the loss's in closed form at the engine's own log-probs "
                f"by {err:.3g} of its largest entry, tolerance {tol:.3g}: the loss was scaled, "
                "masked or aggregated otherwise"
            )
