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
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from pytest_fsdp_turbo_contract.records import NAMES_DIFFER, Reading, StepMetrics
from pytest_fsdp_turbo_contract.results import RunResult
from pytest_fsdp_turbo_contract.spec import RankSpec
from pytest_fsdp_turbo_contract.vocab import SyncPolicy, TwinKind

# Tolerances by compute dtype; measured margins: benchmarks/check_margins.py (README). fp32 gradient
# parity per parameter allows for reduction-order differences in long reductions (gated delta-net
# decay parameters: 5.6e-5). Under bf16 compute, parameters whose reference gradient is tiny flip
# sign against an fp32 reference, so bf16 is held to whole-gradient relative L2 errors instead.
# Per parameter, relative to its largest reference entry, or to 1e-3 of the largest of any
# parameter where its own is smaller (pytest_fsdp_turbo_engine/step/reference.py, CANCELLED_SHARE).
GRAD_PARITY_TOL = {"fp32": 1e-4}
GRAD_PARITY_L2_TOL = {"fp32": 1e-5, "bf16": 5e-2}  # all gradients: ||g - ref|| / ||ref||
# Deferred vs every-micro-batch sum the same gradients in a different order. Measured on Qwen3.5's
# gated delta-net A_log: 2.2e-7 with transformers 5.24, 1.2e-6 with 5.10 (verl's pin); a sync bug
# is O(1).
POLICY_AGREEMENT_TOL = {"fp32": 1e-5, "bf16": 1e-2}
ON_POLICY_KL_TOL = {"fp32": 1e-5, "bf16": 1e-2}
# The same per token, fp32 only: a micro-batch's forward against the whole batch's, float rounding
# (measured: benchmarks/check_margins.py); bf16 autocast rounds each token's logprob too coarsely.
ON_POLICY_LOG_RATIO_TOL = {"fp32": 1e-4}
WEIGHT_SYNC_TOL = {"fp32": 1e-4, "bf16": 1e-1}
NORM_AGREEMENT_REL = 1e-6  # the same number on every rank
# The engine's norm against the harness's own sum over the same sharded gradients (fp32 either way).
GRAD_NORM_TRUE_REL = {"fp32": 1e-5, "bf16": 1e-3}
# The engine's norm against the reference gradients' norm (verl's bf16 anchor: rtol 3e-2).
GRAD_NORM_REFERENCE_REL = {"fp32": 1e-4, "bf16": 3e-2}
# Post-step parameters against the reference step, in units of the learning rate (Adam's first
# step moves every entry by about lr, so 1.0 would be "one entry went the other way"), and the
# whole update's relative L2 error (a doubled step is 1.0, a rank that did not step about 0.7).
STEP_TOL_LR = {"fp32": 5e-2}
# AdamW in closed form against the engine's step: float rounding only, in units of lr
ADAMW_STEP_TOL_LR = {"fp32": 1e-3, "bf16": 1e-3}
STEP_L2_TOL = {"fp32": 1e-3, "bf16": 0.5}
# Replay twin (same batch, reference layout): loss (atol, rtol), grad norm rtol, post-step logprobs.
TWIN_LOSS_TOL = {"fp32": (1e-6, 1e-5), "bf16": (1e-2, 1e-2)}
TWIN_GRAD_NORM_REL = {"fp32": 1e-5, "bf16": 3e-2}
TWIN_LOGPROB_TOL = {"fp32": 1e-5, "bf16": 5e-2}
# Each rank's old log-probs against the twin's forward of the same rows, before either trained.
# Healthy fp32: 0 to 9.5e-7, one ulp of a log-prob near -8 (ours, verl's FSDP2, SP on the
# stand-in); one rank's rotary embedding in bf16: 6.7e-6. bf16: ours 1.9e-3, verl's FSDP-Turbo
# engine (bf16 log-probs) 3.1e-2, so a per-rank precision bug of that size is invisible in bf16.
TWIN_OLD_LOGPROB_TOL = {"fp32": 2.5e-6, "bf16": 5e-2}
# per parameter, |difference| of the gradient's norm and projection relative to the twin's norm;
# measured on healthy runs: fp32 1.5e-6, bf16 3.1e-2 (a 4-element dt_bias); the bf16 mutant that
# sends gradients to the wrong SP rank: 10.4
TWIN_SKETCH_TOL = {"fp32": 1e-4, "bf16": 1e-1}
# ... relative to at least this share of the largest gradient norm of any parameter: a gradient
# smaller than that is what is left of cancelling terms, all rounding (measured: a gated
# delta-net A_log at 1e-5 of the largest norm, 0.24 to 0.81 of itself apart under bf16)
SKETCH_CANCELLED_SHARE = 1e-3
# bf16: from the second update on, tokens at PPO's clip boundary land on either side of it in the
# run and in its twin by rounding alone, and a flipped token's gradient is all or nothing: healthy
# runs of ours measured up to 0.61 of a parameter's norm apart (22% of tokens clipped). The
# sketches are compared on the first, on-policy update only; l judges every update's loss.
SKETCH_FIRST_UPDATE_ONLY = ("bf16",)
LATER_UPDATE = " (update "  # how a later update's entries are named (records.EACH)

# The readings the checks judge: each an attribute path of a rank's records (mypy checks it),
# which also knows its metric key and the phase that writes it.
ADAMW_STEP_MAX_ERR_LR = Reading(lambda m: m.optimizer.adamw_step_max_err_lr)
ADVANTAGES_ABS_MAX = Reading(lambda m: m.rollout.advantages_abs_max)
CLIP_COEF = Reading(lambda m: m.optimizer.clip_coef)
CLIP_MAX_REL_ERR = Reading(lambda m: m.optimizer.clip_max_rel_err)
DATA_ROWS = Reading(lambda m: m.train.data_rows)
FSDP_UNITS = Reading(lambda m: m.train.fsdp_units)
GRAD_MAX_REL_ERR = Reading(lambda m: m.reference.grad_max_rel_err)
GRAD_NORM = Reading(lambda m: m.optimizer.grad_norm)
GRAD_NORM_MEASURED = Reading(lambda m: m.optimizer.grad_norm_measured)
GRAD_REL_L2_ERR = Reading(lambda m: m.reference.grad_rel_l2_err)
GRAD_SKETCH = Reading(lambda m: m.train.grad_sketch)
HANDOFF_WEIGHT_MAX_ABS_DIFF = Reading(lambda m: m.post_step.handoff_weight_max_abs_diff)
KL_REFERENCE_GAP_MEAN = Reading(lambda m: m.rollout.kl_reference_gap_mean)
LAYER_TOKENS = Reading(lambda m: m.train.layer_tokens)
LOCAL_PARAM_NUMEL = Reading(lambda m: m.optimizer.local_param_numel)
LOSS = Reading(lambda m: m.loss.loss)
LOSS_GRAD_MAX_REL_ERR = Reading(lambda m: m.train.loss_grad_max_rel_err)
MICRO_BATCH_ROWS = Reading(lambda m: m.train.micro_batch_rows)
OLD_LOGPROB_MAX_ABS_DIFF = Reading(lambda m: m.replay.old_logprob_max_abs_diff)
OLD_LOGPROB_WORST_ROW = Reading(lambda m: m.replay.old_logprob_worst_row)
PARAM_UPDATE_MAX_ABS = Reading(lambda m: m.optimizer.param_update_max_abs)
PEAK_MEMORY_BYTES = Reading(lambda m: m.perf.peak_memory_bytes)
PG_CLIPFRAC = Reading(lambda m: m.loss.pg_clipfrac)
PG_CLIPFRAC_FIRST_MICRO_BATCH = Reading(lambda m: m.loss.pg_clipfrac_first_micro_batch)
PG_CLIPFRAC_LAST_UPDATE = Reading(lambda m: m.loss.pg_clipfrac_last_update)
POST_STEP_LOGPROB_MAX_ABS_DIFF = Reading(lambda m: m.post_step.post_step_logprob_max_abs_diff)
PPO_KL = Reading(lambda m: m.loss.ppo_kl)
PPO_KL_FIRST_MICRO_BATCH = Reading(lambda m: m.loss.ppo_kl_first_micro_batch)
PPO_LOG_RATIO_ABS_MAX_FIRST_MICRO_BATCH = Reading(
    lambda m: m.loss.ppo_log_ratio_abs_max_first_micro_batch
)
REDUCE_SCATTER_CALLS_BY_MICRO_BATCH = Reading(lambda m: m.train.reduce_scatter_calls_by_micro_batch)
REPLICA_MAX_ABS_DIFF = Reading(lambda m: m.post_step.replica_max_abs_diff)
RETAINED_GRAD_BYTES = Reading(lambda m: m.train.retained_grad_bytes)
ROLLOUT_LOGPROB_MAX_ABS_DIFF = Reading(lambda m: m.post_step.rollout_logprob_max_abs_diff)
ROLLOUT_WEIGHT_MAX_ABS_DIFF = Reading(lambda m: m.post_step.rollout_weight_max_abs_diff)
SEQ_LEN = Reading(lambda m: m.train.seq_len)
SHARD_GROUP_SIZE = Reading(lambda m: m.train.shard_group_size)
SP_BOUNDARIES_IN_RESPONSES = Reading(lambda m: m.rollout.sp_boundaries_in_responses)
STEP_MAX_ERR_LR = Reading(lambda m: m.post_step.step_max_err_lr)
STEP_REL_L2_ERR = Reading(lambda m: m.post_step.step_rel_l2_err)

T = TypeVar("T")

PASSED, FAILED, NOT_APPLICABLE = "passed", "failed", "not applicable"


class CheckFailure(AssertionError):
    pass


class NotApplicable(Exception):
    """Raised by a check that cannot apply to this run; the message says why."""


@dataclass(frozen=True)
class Outcome:
    check: str
    status: str
    detail: str = ""

    def describe(self) -> str:
        return f"{self.check}: {self.detail}" if self.detail else self.check


@dataclass(frozen=True)
class Verdict:
    outcomes: tuple[Outcome, ...]

    def with_status(self, status: str) -> list[Outcome]:
        return [o for o in self.outcomes if o.status == status]

    @property
    def ok(self) -> bool:
        return not self.with_status(FAILED)

    def not_applicable(self) -> list[str]:
        """e.g. ["c: no reference, no twin", "d: no replicas"], for the summary table."""
        return [o.describe() for o in self.with_status(NOT_APPLICABLE)]


# a check's outcome on a result, once judged: failed outranks passed, passed outranks "not
# applicable" (check c has two ways to apply)
_PRECEDENCE = {NOT_APPLICABLE: 0, PASSED: 1, FAILED: 2}


def judge(result: RunResult, letter: str, status: str, detail: str = "") -> None:
    """Note on the result what a check found, for the summary table: a run no check judged is
    "ran, unchecked" there, and a failed check shows its letter and numbers."""
    judged = getattr(result, "judged", None)  # a downstream stand-in for a RunResult: no notes
    if judged is None:
        return
    known = judged.get(letter)
    if known is None or _PRECEDENCE[status] >= _PRECEDENCE[known[0]]:
        judged[letter] = (status, detail)


def judges(letter: str) -> Callable:
    """A check function that notes its outcome on the result it judged (judge)."""

    def decorate(check: Callable) -> Callable:
        @functools.wraps(check)
        def judged(result: RunResult, *args: Any, **kwargs: Any) -> Any:
            try:
                value = check(result, *args, **kwargs)
            except NotApplicable as why:
                judge(result, letter, NOT_APPLICABLE, str(why))
                raise
            except CheckFailure as failure:
                judge(result, letter, FAILED, _lettered(letter, failure))
                raise
            judge(result, letter, PASSED)
            return value

        return judged

    return decorate


def declared(result: RunResult) -> RankSpec:
    """What the ranks were asked to do: the declared values every check reads."""
    spec = result.spec()
    if spec is None:
        raise CheckFailure(
            f"case {result.case_id}: no readable spec.json in {result.artifacts_dir}, which "
            "says what the ranks were asked to do"
        )
    return spec


def declares_reference(result: RunResult) -> bool:
    """The case asked for the in-rank single-process reference (reference_checks)."""
    return bool(declared(result).ppo.reference_checks)  # a rank's spec holds the answer


def declares_twin(result: RunResult) -> bool:
    """The case asked for a replay twin (single or every_micro_batch)."""
    return result.twin_kind in (TwinKind.SINGLE, TwinKind.EVERY_MICRO_BATCH)


def declares_replicas(result: RunResult) -> bool:
    """HSDP: a parameter is sharded over fewer ranks than the world (fsdp_size x sp_size)."""
    engine = declared(result).engine
    return engine.fsdp_size * engine.sp_size < engine.world_size


def _dtype(result: RunResult) -> str:
    return str(declared(result).engine.dtype)


def _rank0(result: RunResult) -> StepMetrics:
    return result.ranks[0].step


def _read(result: RunResult, rank: int, reading: Reading[T], required: bool) -> T | None:
    """One rank's `reading`. A rank whose record holds nothing (or, `required`, whose reading
    holds nothing) fails, naming the metric and the rank's log."""
    step = result.ranks[rank].step
    value = reading.of(step)
    if not step.record(reading.record).measured() or (required and value is None):
        raise CheckFailure(missing(result, rank, reading))
    return value


def missing(result: RunResult, rank: int, reading: Reading) -> str:
    """A check that applies found no reading: it fails, naming the reading and the phase."""
    return (
        f"rank {rank}: metric {reading.key!r} missing: the case declares what this check "
        f"judges, and phase {reading.record.PHASE!r} should have written it "
        f"(log {result.ranks[rank].log_path})"
    )


def _per_rank(
    result: RunResult, reading: Reading[T], required: bool = False
) -> Iterator[tuple[int, T | None]]:
    """(rank, its reading) for every rank, read as _read reads it."""
    for ranked in result.ranks:
        yield ranked.rank, _read(result, ranked.rank, reading, required)


def _measured(result: RunResult, reading: Reading[T]) -> Iterator[tuple[int, T]]:
    """(rank, its reading) for every rank, each of which must hold a value."""
    for ranked in result.ranks:
        yield ranked.rank, _value(result, ranked.rank, reading)


def _value(result: RunResult, rank: int, reading: Reading[T]) -> T:
    """One rank's reading, which must hold a value."""
    return cast(T, _read(result, rank, reading, required=True))


def _first_above(
    result: RunResult, reading: Reading[float], tolerance: float
) -> tuple[int, float] | None:
    """The first rank whose reading is above `tolerance` (NaN counts as above), or None; a rank
    without the reading fails."""
    for rank, value in _measured(result, reading):
        if not value <= tolerance:
            return rank, value
    return None


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def check_completed(result: RunResult) -> None:
    if not result.ok:
        raise CheckFailure(result.failure_text())


@judges("a")
def check_grad_norm(result: RunResult) -> None:
    """a. Finite, the same on every rank, and true: the global L2 norm of the sharded gradients."""
    dtype = _dtype(result)
    key = GRAD_NORM.key
    norms: list[tuple[int, float]] = []
    for rank, value in _per_rank(result, GRAD_NORM):
        if value is None or not math.isfinite(value):
            raise CheckFailure(f"check a: rank {rank}: {key} = {value}, expected a finite value")
        norms.append((rank, value))
    base_rank, base = norms[0]
    for rank, value in norms[1:]:
        if abs(value - base) > NORM_AGREEMENT_REL * max(abs(base), 1e-12):
            raise CheckFailure(
                f"check a: rank {rank}: {key} = {value!r} differs from rank {base_rank}'s "
                f"{base!r} beyond relative tolerance {NORM_AGREEMENT_REL:g}"
            )
    tol = GRAD_NORM_TRUE_REL[dtype]
    for (rank, reported), (_, measured) in zip(norms, _measured(result, GRAD_NORM_MEASURED)):
        if not _rel(reported, measured) <= tol:
            raise CheckFailure(
                f"check a: rank {rank}: {key} = {reported:.6g} but the global L2 norm of "
                f"the sharded gradients is {measured:.6g} (relative difference "
                f"{_rel(reported, measured):.3g}, tolerance {tol:g})"
            )
    advantages = _rank0(result).rollout.advantages_abs_max or 0.0
    if base == 0 and advantages > 0:
        raise CheckFailure(
            f"check a: rank {base_rank}: {key} = 0 on a step whose advantages are not all zero "
            f"({ADVANTAGES_ABS_MAX.key} = {advantages:.3g}): no gradient reached "
            "the shards"
        )
    reference = _rank0(result).reference.reference_grad_norm
    if reference is not None:
        tol = GRAD_NORM_REFERENCE_REL[dtype]
        if not _rel(base, reference) <= tol:
            raise CheckFailure(
                f"check a: rank {base_rank}: {key} = {base:.6g}, the single-process "
                f"reference gradients' norm is {reference:.6g} (relative difference "
                f"{_rel(base, reference):.3g}, tolerance {tol:g})"
            )


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


@judges("c")
def check_gradient_parity(result: RunResult, tolerance: float | None = None) -> None:
    """c. Sharded gradients after accumulation equal a single-process reference over the batch."""
    if not declares_reference(result):
        raise NotApplicable("no reference declared")
    _value(result, 0, GRAD_REL_L2_ERR)  # declared: it must have run
    dtype = _dtype(result)
    tol = GRAD_PARITY_TOL.get(dtype) if tolerance is None else tolerance
    policy = declared(result).engine.gradient_sync
    # fp32: per parameter first, so the message names the parameter
    for ranked in result.ranks:  # name sets first, whatever the dtype: nothing else compares
        names = ranked.step.reference.grad_max_rel_err_param or ""
        if names.startswith(NAMES_DIFFER):
            raise CheckFailure(f"check c: rank {ranked.rank}: the engine's {names}")
    if tol is not None and (over := _first_above(result, GRAD_MAX_REL_ERR, tol)):
        rank, err = over
        param = result.ranks[rank].step.reference.grad_max_rel_err_param
        raise CheckFailure(
            f"check c: rank {rank}: parameter {param}: gradient differs from the single-process "
            f"reference by {err:.3g} (relative to its largest entry), tolerance {tol:g} "
            f"[sync policy {policy}]"
        )
    tol = GRAD_PARITY_L2_TOL[dtype]
    if over := _first_above(result, GRAD_REL_L2_ERR, tol):
        raise CheckFailure(
            f"check c: rank {over[0]}: gradients differ from the single-process reference by "
            f"relative L2 error {over[1]:.3g} ({GRAD_REL_L2_ERR.key}), "
            f"tolerance {tol:g} "
            f"[sync policy {policy}]"
        )


@judges("c")
def check_twin(result: RunResult) -> None:
    """c. The replay twin (same batch, reference layout) gives the same loss, norm and step."""
    twin = result.twin
    if not declares_twin(result):
        raise NotApplicable("no twin declared")
    label = f"check c: twin ({result.twin_kind})"
    if twin is None:
        raise CheckFailure(f"{label}: the case declares a twin; no twin run is attached")
    if not twin.ok:
        raise CheckFailure(f"{label}: the twin run failed\n{twin.failure_text()}")
    dtype = _dtype(result)
    mine, theirs = _rank0(result), _rank0(twin)
    atol, rtol = TWIN_LOSS_TOL[dtype]
    a, b = _value(result, 0, LOSS), _value(twin, 0, LOSS)
    diff = abs(a - b)
    if not diff <= atol + rtol * abs(b):
        raise CheckFailure(
            f"{label}: {LOSS.key} = {a:.6g}, twin {b:.6g} "
            f"(difference {diff:.3g}, tolerance atol {atol:g} + rtol {rtol:g})"
        )
    tol = TWIN_GRAD_NORM_REL[dtype]
    a = _value(result, 0, GRAD_NORM)
    b = _value(twin, 0, GRAD_NORM)
    if not (math.isfinite(a) and _rel(a, b) <= tol):
        raise CheckFailure(
            f"{label}: {GRAD_NORM.key} = {a:.6g}, twin {b:.6g} (relative "
            f"difference {_rel(a, b):.3g}, tolerance {tol:g})"
        )
    _twin_sketches_agree(label, mine.train.grad_sketch, theirs.train.grad_sketch, dtype)
    _ranks_agree_with_twin(label, result, twin, dtype)
    tol = TWIN_LOGPROB_TOL[dtype]
    lp = _value(twin, 0, POST_STEP_LOGPROB_MAX_ABS_DIFF)
    if not lp <= tol:
        raise CheckFailure(
            f"{label}: post-step logprobs on the batch differ from the twin's by up to {lp:.3g} "
            f"({POST_STEP_LOGPROB_MAX_ABS_DIFF.key}), tolerance {tol:g}"
        )


def _ranks_agree_with_twin(label: str, result: RunResult, twin: RunResult, dtype: str) -> None:
    """Each rank's own numerics: the old log-probs every rank recorded for its rows, against the
    twin's forward of the same rows before it trained. A rank that computes differently (one
    rank's rotary embedding in bf16) is off on its rows alone; its own ratio cancels it and the
    totals average it away."""
    tol = TWIN_OLD_LOGPROB_TOL[dtype]
    diff = _value(twin, 0, OLD_LOGPROB_MAX_ABS_DIFF)
    if not diff <= tol:
        row = _value(twin, 0, OLD_LOGPROB_WORST_ROW)
        spec = declared(result)
        dp = spec.engine.world_size // spec.engine.sp_size
        block = spec.ppo.num_prompts * spec.ppo.n // dp
        raise CheckFailure(
            f"{label}: the old log-probs of row {row}, which data-parallel rank {row // block} "
            f"computed, differ from the twin's forward of them by {diff:.3g} "
            f"({OLD_LOGPROB_MAX_ABS_DIFF.key}), tolerance {tol:g}: that rank "
            "computes differently"
        )


def _twin_sketches_agree(label: str, mine: dict | None, twin: dict | None, dtype: str) -> None:
    """Per parameter, the run's gradient sketch against the twin's: a per-tensor measure that a
    total (the global norm) hides, e.g. head gradients sent to the wrong rank."""
    if mine is None or twin is None:
        return  # a run with a reference sketches nothing: the reference compares per parameter
    if missing := sorted(set(mine) ^ set(twin)):
        raise CheckFailure(
            f"{label}: parameters with a gradient in one run only: {', '.join(missing[:5])}"
        )
    tol = TWIN_SKETCH_TOL[dtype]
    worst, worst_name = 0.0, ""
    largest = max((norm for norm, _ in twin.values()), default=0.0)
    for name, (norm, projection) in twin.items():
        if dtype in SKETCH_FIRST_UPDATE_ONLY and LATER_UPDATE in name:
            continue
        got_norm, got_projection = mine[name]
        scale = max(norm, SKETCH_CANCELLED_SHARE * largest, 1e-12)
        err = max(abs(got_norm - norm), abs(got_projection - projection)) / scale
        if not math.isfinite(err) or err > worst:
            worst, worst_name = (math.inf if not math.isfinite(err) else err), name
    if not worst <= tol:
        raise CheckFailure(
            f"{label}: parameter {worst_name}: gradient sketch differs from the twin's by "
            f"{worst:.3g} of its norm ({GRAD_SKETCH.key}), tolerance {tol:g}"
        )


def load_gradient_fingerprint(result: RunResult) -> dict:
    path = result.folder.grads(0)
    if not path.is_file():
        raise CheckFailure(f"check c: no gradient fingerprint at {path} (reference_checks off?)")
    return json.loads(path.read_text())


def check_policies_agree(
    deferred: RunResult, every: RunResult, tolerance: float | None = None
) -> float:
    """c. Both gradient-sync policies produce the same gradients; returns the largest difference.
    A run that failed raises its own failure first (a crash is never "no fingerprint")."""
    check_completed(deferred)
    check_completed(every)
    try:
        worst = _policy_difference(deferred, every, tolerance)
    except CheckFailure as failure:
        for run in (deferred, every):
            judge(run, "c", FAILED, str(failure))
        raise
    for run in (deferred, every):
        judge(run, "c", PASSED)
    return worst


def _policy_difference(deferred: RunResult, every: RunResult, tolerance: float | None) -> float:
    tol = POLICY_AGREEMENT_TOL[_dtype(deferred)] if tolerance is None else tolerance
    a, b = load_gradient_fingerprint(deferred), load_gradient_fingerprint(every)
    if set(a) != set(b):
        raise CheckFailure(
            f"check c: parameters differ between policies: {sorted(set(a) ^ set(b))[:5]}"
        )
    worst = 0.0
    for name in a:
        scale = max(max(abs(v) for v in a[name]["head"]), abs(a[name]["norm"]), 1e-12)
        diffs = [abs(x - y) for x, y in zip(a[name]["head"], b[name]["head"])]
        err = max([*diffs, abs(a[name]["norm"] - b[name]["norm"])]) / scale
        if not err <= tol:
            raise CheckFailure(
                f"check c: parameter {name}: deferred and every_micro_batch gradients differ by "
                f"{err:.3g} relative, tolerance {tol:g}"
            )
        worst = max(worst, err)
    return worst


@judges("d")
def check_replicas(result: RunResult, tolerance: float = 0.0) -> None:
    """d. Every replica holds identical parameters after the step."""
    if not declares_replicas(result):
        raise NotApplicable("no replicas")
    if over := _first_above(result, REPLICA_MAX_ABS_DIFF, tolerance):
        raise CheckFailure(
            f"check d: rank {over[0]}: {REPLICA_MAX_ABS_DIFF.key} = "
            f"{over[1]:.3g}, tolerance {tolerance:g}"
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


@judges("f")
def check_memory(result: RunResult, budget_mb: float | None) -> None:
    """f. Peak memory within budget."""
    if budget_mb is None:
        raise NotApplicable("no memory budget")
    for rank, value in _measured(result, PEAK_MEMORY_BYTES):
        if value > budget_mb * 2**20:
            raise CheckFailure(
                f"check f: rank {rank}: {PEAK_MEMORY_BYTES.key} = {value / 2**20:.1f} MiB, "
                f"budget {budget_mb:g} MiB"
            )


def expected_reduce_scatters(
    policy: str, micro_batches: int, units: int, shard_group_size: int
) -> list[int]:
    """One reduce-scatter per FSDP unit that ran forward, per synced backward (none when a unit is
    sharded over one rank: FSDP2 skips the collective); deferred syncs only the last micro-batch."""
    per_sync = units if shard_group_size > 1 else 0
    if policy == SyncPolicy.DEFERRED:
        return [0] * (micro_batches - 1) + [per_sync]
    return [per_sync] * micro_batches


@judges("h")
def check_sync_contract(result: RunResult) -> None:
    """h. What the declared gradient-sync policy promises is what the ranks measured; with
    sequence parallelism, each rank's decoder layers saw only its chunk of the sequence."""
    spec = declared(result)
    policy, micro_batches = str(spec.engine.gradient_sync), spec.ppo.micro_batches
    head = (
        f"check h: case {result.case_id}: declared gradient_sync {policy!r} with "
        f"{micro_batches} micro-batches"
    )
    check_reduce_scatters(result, policy, micro_batches, head)
    sp = spec.engine.sp_size
    if sp > 1:  # sequence parallelism: each rank's decoder layers see only its chunk
        rows = _value(result, 0, MICRO_BATCH_ROWS)
        seq = _value(result, 0, SEQ_LEN)
        tokens = rows * seq
        # 1/sp of the micro-batch's tokens, each row (or the one packed row) padded to split evenly
        low, high = -(-tokens // sp), (tokens + rows * (sp - 1)) // sp
        for rank, seen in _measured(result, LAYER_TOKENS):
            if not low <= seen <= high:
                raise CheckFailure(
                    f"{head}: declared sp_size {sp} over micro-batches of {rows} x {seq} tokens: "
                    f"expected each rank's decoder layers to be handed {low}..{high} tokens at "
                    f"once, measured {seen} on rank {rank} ({LAYER_TOKENS.key})"
                )
    check_retained_gradients(result, policy, micro_batches, head)


def check_reduce_scatters(result: RunResult, policy: str, micro_batches: int, head: str) -> None:
    """h's counts: one reduce-scatter per FSDP unit that ran, on each synced backward."""
    for rank, calls in _measured(result, REDUCE_SCATTER_CALLS_BY_MICRO_BATCH):
        units = _value(result, rank, FSDP_UNITS)
        shards = _value(result, rank, SHARD_GROUP_SIZE)
        want = expected_reduce_scatters(policy, micro_batches, units, shards)
        if calls != want:
            raise CheckFailure(
                f"{head} over {units} FSDP units that ran, sharded {shards} ways: expected "
                f"reduce-scatters per micro-batch {want}, measured {calls} on rank {rank} "
                f"({REDUCE_SCATTER_CALLS_BY_MICRO_BATCH.key})"
            )


def check_retained_gradients(result: RunResult, policy: str, micro_batches: int, head: str) -> None:
    """h's memory: deferral holds unsharded gradients between micro-batches, syncing never does."""
    retained_key = RETAINED_GRAD_BYTES.key
    for rank, retained in _measured(result, RETAINED_GRAD_BYTES):
        holds = policy == SyncPolicy.DEFERRED and micro_batches > 1
        if holds and not retained > 0:
            raise CheckFailure(
                f"{head}: expected unsharded gradients held between micro-batches, measured "
                f"{retained_key} = {retained} on rank {rank}"
            )
        if not holds and retained != 0:
            raise CheckFailure(
                f"{head}: expected no unsharded gradients held between micro-batches, measured "
                f"{retained_key} = {retained} on rank {rank}"
            )


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
    if _rank0(result).post_step.step_max_err_lr is None:
        return  # no reference step
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


CLIP_TOL = {"fp32": 1e-5, "bf16": 1e-4}  # relative to the largest clipped gradient entry


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


@judges("j")
def check_data_rows(result: RunResult) -> None:
    """j. Data-parallel ranks train on disjoint rows: the ranks that share rows are exactly one
    sequence-parallel group (sp_size ranks), and no row is trained by two groups. Read from the
    rows the harness handed each rank, so an engine whose data rank is wrong (an HSDP engine that
    takes it from the shard dimension) cannot hide behind a reference or twin that replays the
    same duplicated batch."""
    if declared(result).engine.world_size < 2:
        raise NotApplicable("one rank")
    rows: dict[int, list[int]] = dict(_measured(result, DATA_ROWS))
    sp = declared(result).engine.sp_size
    key = DATA_ROWS.key
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank, listed in sorted(rows.items()):
        groups.setdefault(tuple(sorted(listed)), []).append(rank)
    for shared, ranks in groups.items():
        if len(ranks) != sp:
            raise CheckFailure(
                f"check j: ranks {ranks} trained on the same rows {list(shared)[:8]}"
                f"{'...' if len(shared) > 8 else ''} ({key}); with sp_size {sp} "
                f"each row belongs to one data-parallel rank of {sp} rank(s)"
            )
    seen: dict[int, list[int]] = {}
    for shared, ranks in groups.items():
        for row in shared:
            if row in seen:
                raise CheckFailure(
                    f"check j: row {row} was trained by ranks {seen[row]} and by ranks {ranks} "
                    f"({key}): data-parallel ranks must hold disjoint rows"
                )
            seen[row] = ranks


# The engine's loss gradient on each log-probability against autograd over the harness's loss on
# the same values. fp32: the same formula, measured 0.0 on ours and verl's engines. bf16: an
# engine whose log-probabilities are bf16 (verl's FSDP-Turbo engine) gets its gradient in bf16
# arithmetic, measured 4.5e-3; ours keep fp32 log-probabilities (0.0).
LOSS_GRAD_TOL = {"fp32": 1e-6, "bf16": 2e-2}


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


def evaluate(result: RunResult, budget_mb: float | None = None) -> Verdict:
    """Every check that applies, without raising: what passed, what failed, what could not apply."""
    from pytest_fsdp_turbo.checks import trainer

    if trainer.is_trainer_run(result):  # verl's own trainer: its checks, and what it cannot have
        return trainer.evaluate(result)
    if budget_mb is None and (spec := result.spec()) is not None:
        budget_mb = spec.memory_budget_mb
    outcomes = []
    for letter, check in CHECKS:
        try:
            check(result, budget_mb)
            outcomes.append(Outcome(letter, PASSED))
        except NotApplicable as why:
            outcomes.append(Outcome(letter, NOT_APPLICABLE, str(why)))
        except CheckFailure as failure:
            outcomes.append(Outcome(letter, FAILED, _lettered(letter, failure)))
    return Verdict(tuple(outcomes))


def _lettered(letter: str, failure: CheckFailure) -> str:
    """Every failure line starts with its check's letter (a missing reading's too)."""
    text = str(failure)
    return text if text.startswith("check ") else f"check {letter}: {text}"


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
