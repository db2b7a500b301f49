"""How far inside its tolerances each numeric check lands, measured on the tiny cases per dtype.

Runs a case with its in-rank reference and again with no reference and a single-rank twin, in fp32
and in bf16 (CPU bf16 compute, fp32 gradient reduction), and prints each measured value beside the
tolerance it is checked against. The fp32 tolerances are set with at least 10x headroom over these
figures; bf16 figures here come from CPU kernels, not CUDA or NPU ones.

Usage: python benchmarks/check_margins.py [--case ID] [--dtypes fp32,bf16]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from pytest_fsdp_turbo import checks
from pytest_fsdp_turbo.devices import detect
from pytest_fsdp_turbo.launching.case_runner import standalone_runner, standalone_settings
from pytest_fsdp_turbo_contract.records import (
    LossRecord,
    OptimizerRecord,
    PostStepRecord,
    ReferenceRecord,
)

REPO = Path(__file__).resolve().parent.parent


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def margins(result, twin_result, dtype: str) -> list[tuple[str, float, float]]:
    ref, main, twin = result.metrics, twin_result.metrics, twin_result.twin.metrics
    worst_step = max(r.metrics[PostStepRecord.key("step_max_err_lr")] for r in result.ranks)
    worst_l2 = max(r.metrics[PostStepRecord.key("step_rel_l2_err")] for r in result.ranks)
    atol, rtol = checks.TWIN_LOSS_TOL[dtype]
    worst_adamw = max(r.metrics[OptimizerRecord.key("adamw_step_max_err_lr")] for r in result.ranks)
    return [
        (
            "b first micro-batch ppo_kl (abs)",
            ref[LossRecord.key("ppo_kl_first_micro_batch")],
            checks.ON_POLICY_KL_TOL[dtype],
        ),
        (
            "b first micro-batch log-ratio (abs, per token)",
            ref[LossRecord.key("ppo_log_ratio_abs_max_first_micro_batch")],
            checks.ON_POLICY_LOG_RATIO_TOL.get(dtype),
        ),
        (
            "a norm vs harness norm (rel)",
            rel(
                ref[OptimizerRecord.key("grad_norm")],
                ref[OptimizerRecord.key("grad_norm_measured")],
            ),
            checks.GRAD_NORM_TRUE_REL[dtype],
        ),
        (
            "a norm vs reference norm (rel)",
            rel(
                ref[OptimizerRecord.key("grad_norm")],
                ref[ReferenceRecord.key("reference_grad_norm")],
            ),
            checks.GRAD_NORM_REFERENCE_REL[dtype],
        ),
        (
            "c gradients vs reference (relative L2)",
            ref[ReferenceRecord.key("grad_rel_l2_err")],
            checks.GRAD_PARITY_L2_TOL[dtype],
        ),
        (
            "c gradients vs reference (per parameter, rel to its max entry)",
            ref[ReferenceRecord.key("grad_max_rel_err")],
            checks.GRAD_PARITY_TOL.get(dtype),
        ),
        (
            "c twin loss (abs)",
            abs(main[LossRecord.key("loss")] - twin[LossRecord.key("loss")]),
            atol + rtol * abs(twin[LossRecord.key("loss")]),
        ),
        (
            "c twin grad norm (rel)",
            rel(main[OptimizerRecord.key("grad_norm")], twin[OptimizerRecord.key("grad_norm")]),
            checks.TWIN_GRAD_NORM_REL[dtype],
        ),
        (
            "c twin post-step logprobs (abs)",
            twin[PostStepRecord.key("post_step_logprob_max_abs_diff")],
            checks.TWIN_LOGPROB_TOL[dtype],
        ),
        ("i step vs AdamW's first step (x lr)", worst_adamw, checks.ADAMW_STEP_TOL_LR[dtype]),
        ("i update vs reference update (relative L2)", worst_l2, checks.STEP_L2_TOL[dtype]),
        ("i step vs reference step (x lr, per entry)", worst_step, checks.STEP_TOL_LR.get(dtype)),
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", default="tiny-qwen3_5-fsdp2-deferred")
    parser.add_argument("--dtypes", default="fp32,bf16")
    args = parser.parse_args()
    accel = detect("cpu")
    with tempfile.TemporaryDirectory() as tmp:
        settings = standalone_settings(
            {"fsdp_turbo_device": "cpu", "fsdp_turbo_artifacts": tmp}, cwd=REPO
        )
        runner = standalone_runner(settings, accel)
        case = runner.cases().get(args.case)
        print(f"case {case.id}, {case.engine.world_size} ranks on {accel.describe()}")
        for dtype in args.dtypes.split(","):
            runs = []
            for mode, fields in (
                ("reference", {"reference_checks": True, "twin": "none"}),
                ("twin", {"reference_checks": False, "twin": "single"}),
            ):
                result = runner.run(case, f"{dtype}-{mode}", dtype=dtype, **fields)
                if not result.ok:
                    raise SystemExit(result.failure_text())
                runs.append(result)
            print(f"\n{dtype}: {'measured':>10}  {'tolerance':>10}  {'headroom':>8}  what")
            print(
                f"      worst parameter: {runs[0].metrics[ReferenceRecord.key('grad_max_rel_err_param')]}"
            )
            for what, value, tol in margins(*runs, dtype):
                if tol is None:
                    print(f"      {value:10.3g}  {'-':>10}  {'-':>8}  {what} (not checked)")
                else:
                    room = f"{tol / value:7.0f}x" if value else "  exact"
                    print(f"      {value:10.3g}  {tol:10.3g}  {room:>8}  {what}")


if __name__ == "__main__":
    main()
