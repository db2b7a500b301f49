"""Assertions over a run result, usable from any downstream test.

Each failure message names the check, the rank, the parameter or metric, the value and the tolerance.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from pytest_fsdp_turbo.launch import RunResult

# Tolerances by compute dtype. fp32 gradient parity allows for reduction-order differences in
# long reductions (gated delta-net decay parameters); bf16 compute is compared more loosely.
GRAD_PARITY_TOL = {"fp32": 1e-4, "bf16": 5e-2}
POLICY_AGREEMENT_TOL = {"fp32": 1e-6, "bf16": 1e-2}
ON_POLICY_KL_TOL = {"fp32": 1e-5, "bf16": 1e-2}
WEIGHT_SYNC_TOL = {"fp32": 1e-4, "bf16": 1e-1}
NORM_AGREEMENT_REL = 1e-6


class CheckFailure(AssertionError):
    pass


def _dtype(result: RunResult) -> str:
    return str(result.metrics.get("case/dtype", "fp32"))


def _per_rank(result: RunResult, key: str):
    for rank in result.ranks:
        if rank.metrics is None or key not in rank.metrics:
            raise CheckFailure(f"rank {rank.rank}: metric {key!r} missing (log {rank.log_path})")
        yield rank.rank, rank.metrics[key]


def check_completed(result: RunResult) -> None:
    if not result.ok:
        raise CheckFailure(result.failure_text())


def check_grad_norm(result: RunResult) -> None:
    """a. The gradient norm is finite and the same on every rank."""
    norms = list(_per_rank(result, "actor/grad_norm"))
    for rank, value in norms:
        if value is None or not math.isfinite(value):
            raise CheckFailure(
                f"check a: rank {rank}: actor/grad_norm = {value}, expected a finite value"
            )
    base_rank, base = norms[0]
    for rank, value in norms[1:]:
        if abs(value - base) > NORM_AGREEMENT_REL * max(abs(base), 1e-12):
            raise CheckFailure(
                f"check a: rank {rank}: actor/grad_norm = {value!r} differs from rank {base_rank}'s "
                f"{base!r} beyond relative tolerance {NORM_AGREEMENT_REL:g}"
            )


def check_on_policy(result: RunResult) -> None:
    """b. On the first micro-batch the PPO ratio is 1: ppo_kl ~ 0 and nothing clipped."""
    tol = ON_POLICY_KL_TOL[_dtype(result)]
    for rank, value in _per_rank(result, "actor/ppo_kl_first_micro_batch"):
        if not abs(value) <= tol:
            raise CheckFailure(
                f"check b: rank {rank}: actor/ppo_kl on the first micro-batch = {value:.3g}, "
                f"expected |value| <= {tol:g} (old logprobs must come from the same weights)"
            )
    for rank, value in _per_rank(result, "actor/pg_clipfrac_first_micro_batch"):
        if value != 0:
            raise CheckFailure(
                f"check b: rank {rank}: actor/pg_clipfrac on the first micro-batch = {value:.3g}, expected 0"
            )


def check_gradient_parity(result: RunResult, tolerance: float | None = None) -> None:
    """c. Sharded gradients after accumulation equal a single-process reference over the batch."""
    tol = GRAD_PARITY_TOL[_dtype(result)] if tolerance is None else tolerance
    params = dict(_per_rank(result, "sync/grad_max_rel_err_param"))
    for rank, err in _per_rank(result, "sync/grad_max_rel_err"):
        if not err <= tol:
            raise CheckFailure(
                f"check c: rank {rank}: parameter {params[rank]}: gradient differs from the "
                f"single-process reference by {err:.3g} (relative to its largest entry), "
                f"tolerance {tol:g} [sync policy {result.metrics.get('case/sync_policy')}]"
            )


def load_gradient_fingerprint(result: RunResult) -> dict:
    path = Path(result.artifacts_dir) / "rank0.grads.json"
    if not path.is_file():
        raise CheckFailure(f"check c: no gradient fingerprint at {path} (reference_checks off?)")
    return json.loads(path.read_text())


def check_policies_agree(
    deferred: RunResult, every: RunResult, tolerance: float | None = None
) -> float:
    """c. Both gradient-sync policies produce the same gradients; returns the largest difference."""
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


def _each_at_most(result: RunResult, check: str, key: str, tolerance: float) -> None:
    for rank, value in _per_rank(result, key):
        if not value <= tolerance:  # written so that NaN fails too
            raise CheckFailure(
                f"check {check}: rank {rank}: {key} = {value:.3g}, tolerance {tolerance:g}"
            )


def check_replicas(result: RunResult, tolerance: float = 0.0) -> None:
    """d. Every replica holds identical parameters after the step."""
    _each_at_most(result, "d", "sync/replica_max_abs_diff", tolerance)


def check_weight_sync(result: RunResult, tolerance: float | None = None) -> None:
    """e. Weights gathered from FSDP into the rollout model reproduce the trainer's logprobs."""
    tol = WEIGHT_SYNC_TOL[_dtype(result)] if tolerance is None else tolerance
    _each_at_most(result, "e", "sync/rollout_logprob_max_abs_diff", tol)


def check_memory(result: RunResult, budget_mb: float | None) -> None:
    """f. Peak memory within budget; retained gradient bytes reported."""
    for rank, value in _per_rank(result, "sync/retained_grad_bytes"):
        if not isinstance(value, int) or value < 0:
            raise CheckFailure(
                f"check f: rank {rank}: sync/retained_grad_bytes = {value!r}, expected bytes"
            )
    if budget_mb is None:
        return
    for rank, value in _per_rank(result, "perf/peak_memory_bytes"):
        if value > budget_mb * 2**20:
            raise CheckFailure(
                f"check f: rank {rank}: perf/peak_memory_bytes = {value / 2**20:.1f} MiB, "
                f"budget {budget_mb:g} MiB"
            )


def check_params_updated(result: RunResult) -> None:
    for rank, value in _per_rank(result, "actor/param_update_max_abs"):
        if not value > 0:
            raise CheckFailure(
                f"rank {rank}: actor/param_update_max_abs = {value}, expected parameters to change"
            )


def check_all(result: RunResult, budget_mb: float | None = None) -> None:
    """a-f for one run (g, goldens, lives in pytest_fsdp_turbo.goldens)."""
    check_completed(result)
    check_grad_norm(result)
    check_on_policy(result)
    if "sync/grad_max_rel_err" in result.metrics:
        check_gradient_parity(result)
    check_replicas(result)
    check_weight_sync(result)
    check_memory(result, budget_mb)
