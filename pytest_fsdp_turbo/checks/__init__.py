"""Verdicts over a run result, usable from any downstream test: `check_all(result)` runs every check
that applies and says which could not apply and why.

  a  gradient norm: finite, equal on every rank, equal to the norm the harness computes itself
     (and to the reference gradients' norm when there is a reference); never 0 with non-zero advantages
  b  on-policy first micro-batch: ppo_kl ~ 0, nothing clipped
  c  gradient parity: against the single-process reference, or against the replay twin
  d  replica consistency (HSDP)
  e  trainer-to-rollout weight sync
  f  memory within the case's budget
  g  goldens (pytest_fsdp_turbo.checks.goldens, needs the golden folder)
  h  the declared gradient-sync policy: reduce-scatters per micro-batch and retained gradients
  i  the optimizer step: every rank moved its parameters; each update equal to AdamW in closed form
     (the case's betas, eps, weight decay); equal to the reference's steps when there is one
  j  data-parallel ranks trained on disjoint rows
  k  the optimizer stepped on gradients clipped by the global norm and the case's max_norm
  l  the loss's gradient on each log-probability equals the PPO loss's in closed form (off-policy
     from the second update on, where the clip, the KL term and the response mask shape it)

Each failure message names the check letter, the rank, the metric or parameter, the value and the
tolerance. The checks read each rank's typed records (`RankResult.step`) for what was measured, all
of it measured by the harness inside the ranks, and the run's `RankSpec` for what was declared.

A module per concern: verdicts (passed, failed, not applicable), tolerances, readings (what a
check reads), gradients (a, c, d), rollout (b, e), sync (f, h, j), optimizer (i, k, l); this
package gathers them, and `evaluate` runs them in order.
"""

from __future__ import annotations

from collections.abc import Callable

from pytest_fsdp_turbo.checks.check_sets import (
    CHECK_SETS,
    CheckSet,
    check_set_of,
    register_check_set,
)
from pytest_fsdp_turbo.checks.gradients import (
    check_grad_norm,
    check_gradient_parity,
    check_policies_agree,
    check_replicas,
    check_twin,
    load_gradient_fingerprint,
)
from pytest_fsdp_turbo.checks.optimizer import (
    check_clip,
    check_exercised,
    check_loss_gradient,
    check_optimizer_step,
)
from pytest_fsdp_turbo.checks.readings import (
    declared,
    declares_reference,
    declares_replicas,
    declares_twin,
    missing,
)
from pytest_fsdp_turbo.checks.rollout import (
    check_on_policy,
    check_weight_sync,
)
from pytest_fsdp_turbo.checks.rounding import rounding_margins
from pytest_fsdp_turbo.checks.sync import (
    check_data_rows,
    check_memory,
    check_reduce_scatters,
    check_retained_gradients,
    check_sync_contract,
    expected_reduce_scatters,
)
from pytest_fsdp_turbo.checks.tolerances import (
    ADAMW_STEP_TOL_LR,
    CLIP_TOL,
    GRAD_NORM_REFERENCE_REL,
    GRAD_NORM_TRUE_REL,
    GRAD_PARITY_L2_TOL,
    GRAD_PARITY_TOL,
    LATER_UPDATE,
    LOSS_GRAD_TOL,
    NORM_AGREEMENT_REL,
    ON_POLICY_KL_TOL,
    ON_POLICY_LOG_RATIO_TOL,
    POLICY_AGREEMENT_TOL,
    SKETCH_CANCELLED_SHARE,
    SKETCH_FIRST_UPDATE_ONLY,
    STEP_L2_TOL,
    STEP_TOL_LR,
    TWIN_GRAD_NORM_REL,
    TWIN_LOGPROB_TOL,
    TWIN_LOSS_TOL,
    TWIN_OLD_LOGPROB_TOL,
    TWIN_SKETCH_TOL,
    WEIGHT_SYNC_TOL,
)
from pytest_fsdp_turbo.checks.trainer import TRAINER_CANNOT, TRAINER_CHECKS
from pytest_fsdp_turbo.checks.verdicts import (
    FAILED,
    NOT_APPLICABLE,
    PASSED,
    CheckFailure,
    NotApplicable,
    Outcome,
    Verdict,
    check_completed,
    judge,
    judges,
)
from pytest_fsdp_turbo_contract.results import RunResult
from pytest_fsdp_turbo_contract.vocab import CaseKindName

__all__ = [
    "CHECK_SETS",
    "TRAINER_CANNOT",
    "TRAINER_CHECKS",
    "CheckSet",
    "check_set_of",
    "register_check_set",
    "CheckFailure",
    "FAILED",
    "NOT_APPLICABLE",
    "NotApplicable",
    "Outcome",
    "PASSED",
    "Verdict",
    "check_completed",
    "judge",
    "judges",
    "ADAMW_STEP_TOL_LR",
    "CLIP_TOL",
    "GRAD_NORM_REFERENCE_REL",
    "GRAD_NORM_TRUE_REL",
    "GRAD_PARITY_L2_TOL",
    "GRAD_PARITY_TOL",
    "LATER_UPDATE",
    "LOSS_GRAD_TOL",
    "NORM_AGREEMENT_REL",
    "ON_POLICY_KL_TOL",
    "ON_POLICY_LOG_RATIO_TOL",
    "POLICY_AGREEMENT_TOL",
    "SKETCH_CANCELLED_SHARE",
    "SKETCH_FIRST_UPDATE_ONLY",
    "STEP_L2_TOL",
    "STEP_TOL_LR",
    "TWIN_GRAD_NORM_REL",
    "TWIN_LOGPROB_TOL",
    "TWIN_LOSS_TOL",
    "TWIN_OLD_LOGPROB_TOL",
    "TWIN_SKETCH_TOL",
    "WEIGHT_SYNC_TOL",
    "declared",
    "declares_reference",
    "declares_replicas",
    "declares_twin",
    "missing",
    "check_grad_norm",
    "check_gradient_parity",
    "check_policies_agree",
    "check_replicas",
    "check_twin",
    "rounding_margins",
    "load_gradient_fingerprint",
    "check_on_policy",
    "check_weight_sync",
    "check_data_rows",
    "check_memory",
    "check_reduce_scatters",
    "check_retained_gradients",
    "check_sync_contract",
    "expected_reduce_scatters",
    "check_clip",
    "check_exercised",
    "check_loss_gradient",
    "check_optimizer_step",
]


CHECKS: tuple[tuple[str, Callable[[RunResult, float | None], None]], ...] = (
    ("a", lambda r, _: check_grad_norm(r)),
    ("b", lambda r, _: check_on_policy(r)),
    ("c", lambda r, _: _parity(r)),
    ("d", lambda r, _: check_replicas(r)),
    ("e", lambda r, _: check_weight_sync(r)),
    ("f", check_memory),
    ("h", lambda r, _: check_sync_contract(r)),
    ("i", lambda r, _: check_optimizer_step(r)),
    ("j", lambda r, _: check_data_rows(r)),
    ("k", lambda r, _: check_clip(r)),
    ("l", lambda r, _: check_loss_gradient(r)),
)


def _parity(result: RunResult) -> None:
    ran = False
    for check in (check_gradient_parity, check_twin):
        try:
            check(result)
            ran = True
        except NotApplicable:
            pass
    if not ran:
        raise NotApplicable("no reference, no twin declared")


register_check_set(CheckSet(CaseKindName.PPO_STEP, CHECKS))


def evaluate(result: RunResult, budget_mb: float | None = None) -> Verdict:
    """Every check of the run's kind, without raising: what passed, what failed, what could not
    apply (and why)."""
    if budget_mb is None and (spec := result.spec()) is not None:
        budget_mb = spec.memory_budget_mb
    try:
        check_set = check_set_of(result)
    except CheckFailure as unknown:
        return Verdict((Outcome("kind", FAILED, str(unknown)),))
    return check_set.evaluate(result, budget_mb)


def check_all(result: RunResult, budget_mb: float | None = None) -> Verdict:
    """The one call for a downstream test: a-f and h-l (g, goldens, lives in goldens).

    Raises CheckFailure listing every failed check; returns the verdict, whose not_applicable()
    says which checks could not apply to this run and why.
    """
    check_completed(result)
    verdict = evaluate(result, budget_mb)
    failed = verdict.with_status(FAILED)
    if failed:
        raise CheckFailure("\n".join(o.detail for o in failed))
    return verdict
