"""The gradients: a (the norm), c (parity with the single-process reference, or with the replay
twin), d (HSDP replicas), and the agreement of two sync policies on the same step."""

from __future__ import annotations

import json
import math

from pytest_fsdp_turbo.checks.readings import (
    ADVANTAGES_ABS_MAX,
    ENGINE_REPLICA_GROUP,
    GRAD_MAX_REL_ERR,
    GRAD_NORM,
    GRAD_NORM_MEASURED,
    GRAD_PARAM_REL_L2,
    GRAD_REL_L2_ERR,
    GRAD_SKETCH,
    GRAD_SKETCH_LOW,
    LOSS,
    OLD_LOGPROB_MAX_ABS_DIFF,
    OLD_LOGPROB_WORST_ROW,
    POST_STEP_LOGPROB_MAX_ABS_DIFF,
    REFERENCE_GRAD_NORM,
    REPLICA_MAX_ABS_DIFF,
    _dtype,
    _first_above,
    _measured,
    _per_rank,
    _rank0,
    _rel,
    _value,
    declared,
    declares_reference,
    declares_replicas,
    declares_twin,
)
from pytest_fsdp_turbo.checks.rounding import (
    beyond_rounding,
    norm_distances,
    pairs,
)
from pytest_fsdp_turbo.checks.tolerances import (
    GRAD_NORM_REFERENCE_REL,
    GRAD_NORM_TRUE_REL,
    GRAD_PARITY_L2_TOL,
    GRAD_PARITY_TOL,
    LATER_UPDATE,
    NORM_AGREEMENT_REL,
    POLICY_AGREEMENT_TOL,
    SKETCH_CANCELLED_SHARE,
    SKETCH_FIRST_UPDATE_ONLY,
    TWIN_GRAD_NORM_REL,
    TWIN_LOGPROB_TOL,
    TWIN_LOSS_TOL,
    TWIN_OLD_LOGPROB_TOL,
    TWIN_SKETCH_TOL,
)
from pytest_fsdp_turbo.checks.verdicts import (
    FAILED,
    PASSED,
    CheckFailure,
    NotApplicable,
    check_completed,
    judge,
    judges,
)
from pytest_fsdp_turbo_contract.layout import replica_ranks
from pytest_fsdp_turbo_contract.records import NAMES_DIFFER
from pytest_fsdp_turbo_contract.results import RunResult
from pytest_fsdp_turbo_contract.vocab import TwinKind

FP32 = "fp32"


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
    if declares_reference(result) and reference is None:
        raise CheckFailure(
            f"check a: the case declares the single-process reference (reference_checks) but "
            f"rank 0 has no reading of the reference gradients' norm ({REFERENCE_GRAD_NORM.key})"
        )
    if reference is not None:
        tol = GRAD_NORM_REFERENCE_REL[dtype]
        if not _rel(base, reference) <= tol:
            raise CheckFailure(
                f"check a: rank {base_rank}: {key} = {base:.6g}, the single-process "
                f"reference gradients' norm is {reference:.6g} (relative difference "
                f"{_rel(base, reference):.3g}, tolerance {tol:g})"
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
    if dtype != FP32:
        _parameters_within_rounding(result, policy)
    tol = GRAD_PARITY_L2_TOL[dtype]
    if over := _first_above(result, GRAD_REL_L2_ERR, tol):
        raise CheckFailure(
            f"check c: rank {over[0]}: gradients differ from the single-process reference by "
            f"relative L2 error {over[1]:.3g} ({GRAD_REL_L2_ERR.key}), "
            f"tolerance {tol:g} "
            f"[sync policy {policy}]"
        )


def _parameters_within_rounding(result: RunResult, policy: str) -> None:
    """Low precision, each parameter on its own: the engine's gradient's distance from the
    reference's computed in the engine's dtype (both round the parameters alike), against that
    reference's own distance from fp32 on the same batch from the same parameters (rank 0
    measured both). Scale-free, so a wrong gradient of a parameter 1e-5 the size of the largest
    is as red as a wrong large one."""
    readings = _value(result, 0, GRAD_PARAM_REL_L2)
    if over := beyond_rounding(pairs(readings)):
        said = over.said(
            f"its gradient differs from the single-process reference's in {_dtype(result)} "
            f"({GRAD_PARAM_REL_L2.key}) by relative L2 error"
        )
        raise CheckFailure(f"check c: parameter {over.name}: {said} [sync policy {policy}]")


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
    _ranks_agree_with_twin(label, result, twin, dtype)  # names the rank: the cause, first
    if dtype != FP32 and result.twin_kind == TwinKind.SINGLE:
        _sketches_within_rounding(label, result, twin)
    else:
        mine_sketch, twin_sketch = _value(result, 0, GRAD_SKETCH), _value(twin, 0, GRAD_SKETCH)
        _twin_sketches_agree(label, mine_sketch, twin_sketch, dtype)
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


def _twin_sketches_agree(label: str, mine: dict, twin: dict, dtype: str) -> None:
    """fp32, or a twin of the run's own engine and layout (every_micro_batch): per parameter, the
    run's gradient sketch against the twin's: a per-tensor measure that a total (the global norm)
    hides, e.g. head gradients sent to the wrong rank."""
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


def _sketches_within_rounding(label: str, result: RunResult, twin: RunResult) -> None:
    """Low precision, against the reference's gradient the twin computed in the run's dtype on
    the same batch at the same parameters: per parameter, the run's gradient norm held to a
    multiple of that gradient's own distance from fp32 (the twin measured both; |a norm's change|
    is at most the gradient's, so the rule is the reference's, `_parameters_within_rounding`),
    then the whole sketch as any twin's (a projection catches gradients that trade places, which
    keep the norm)."""
    mine = _value(result, 0, GRAD_SKETCH)
    low = _value(twin, 0, GRAD_SKETCH_LOW)
    first = {name: value for name, value in mine.items() if LATER_UPDATE not in name}
    if missing := sorted(set(first) ^ set(low)):
        raise CheckFailure(
            f"{label}: parameters with a gradient in one of the run and the twin's reference "
            f"only: {', '.join(missing[:5])}"
        )

    if over := beyond_rounding(norm_distances(first, low)):
        said = over.said(
            f"its gradient's norm differs from the norm of the reference's gradient in "
            f"{_dtype(result)} on the same batch ({GRAD_SKETCH.key} against the twin's "
            f"{GRAD_SKETCH_LOW.key}) by, relative to the latter,"
        )
        raise CheckFailure(f"{label}: parameter {over.name}: {said}")
    sketches = {name: [norm, projection] for name, (norm, projection, _) in low.items()}
    _twin_sketches_agree(label, first, sketches, _dtype(result))


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
    """d. Every replica holds identical parameters after the step. The replicas are the declared
    layout's (world_size, fsdp_size: shard groups of fsdp_size consecutive ranks, the replicas of
    a rank the ranks at its place in each), whose local shards the harness compares over process
    groups of its own (sync/replica_max_abs_diff), never over a group the engine reports. The
    engine's own replica group (rank/engine_replica_group) must name the same ranks: one that
    names fewer (this rank alone) would have a harness that asked it compare a rank with itself."""
    if not declares_replicas(result):
        raise NotApplicable("no replicas")
    engine = declared(result).engine
    world, shard = engine.world_size, engine.shard_size
    layout = f"the declared layout (world_size {world}, fsdp_size {shard})"
    wrong = {
        rank: sorted(group or [])
        for rank, group in _per_rank(result, ENGINE_REPLICA_GROUP, required=True)
        if sorted(group or []) != replica_ranks(rank, world, shard)
    }
    if over := _first_above(result, REPLICA_MAX_ABS_DIFF, tolerance):
        rank, spread = over
        hidden = (
            f"; the engine reports replica group {wrong[rank]} ({ENGINE_REPLICA_GROUP.key})"
            if rank in wrong
            else ""
        )
        raise CheckFailure(
            f"check d: rank {rank}: {REPLICA_MAX_ABS_DIFF.key} = {spread:.3g} across the replicas "
            f"{layout} names, {replica_ranks(rank, world, shard)}; tolerance {tolerance:g}"
            f"{hidden}"
        )
    if wrong:
        rank, group = min(wrong.items())
        raise CheckFailure(
            f"check d: rank {rank}: the engine reports replica group {group} "
            f"({ENGINE_REPLICA_GROUP.key}); {layout} makes its replicas "
            f"{replica_ranks(rank, world, shard)}, the ranks holding the same shard"
        )
