"""GPU check for a box with a single CUDA GPU: the gpu_e2e cases that fit on one device.

Each tiny case runs with world_size 1 over nccl in bf16 with the HF rollout (and once more with the
vLLM rollout when vllm is importable), through the run path and checks pytest uses (gates, leases,
launcher, twin). Prints a short table of metrics and times; exits 1 if any case fails.
Usage: python benchmarks/gpu_check.py
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
import tempfile
import time
from pathlib import Path

from pytest_fsdp_turbo import checks
from pytest_fsdp_turbo.cases import load_cases
from pytest_fsdp_turbo.devices import detect
from pytest_fsdp_turbo.launching.case_runner import (
    Unavailable,
    standalone_runner,
    standalone_settings,
)
from pytest_fsdp_turbo_contract.records import (
    LossRecord,
    OptimizerRecord,
    PerfRecord,
    PostStepRecord,
)
from pytest_fsdp_turbo_contract.vocab import Rollout

REPO = Path(__file__).resolve().parent.parent


def single_device_cases() -> list:
    seen, cases = set(), []
    for case in load_cases(REPO / "e2e" / "cases.toml"):
        key = (case.model, case.engine.gradient_sync)
        if case.is_tiny and "cuda" in case.devices and key not in seen:
            seen.add(key)
            one = dataclasses.replace(case.engine, world_size=1, fsdp_size=1)
            cases.append(dataclasses.replace(case, id=f"{case.id}-1gpu", engine=one))
    if importlib.util.find_spec("vllm") is not None and cases:
        vllm = dataclasses.replace(cases[0].ppo, rollout=Rollout.VLLM)
        cases.append(dataclasses.replace(cases[0], id=cases[0].id + "-vllm", ppo=vllm))
    return cases


def main() -> int:
    accel = detect()
    if accel.kind != "cuda" or accel.count < 1:
        print(f"gpu_check: needs a CUDA GPU; detected {accel.describe()}", file=sys.stderr)
        return 2
    print(f"device: {accel.describe()}")
    rows, failed = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        settings = standalone_settings(
            {"fsdp_turbo_device": "cuda", "fsdp_turbo_artifacts": tmp}, cwd=REPO
        )
        runner = standalone_runner(settings, accel)  # the run path ppo_run uses
        for case in single_device_cases():
            start = time.perf_counter()
            try:
                result = runner.run(case, case.id)
            except Unavailable as exc:
                rows.append((case.id, "-", "-", "-", "-", "-", "-", "-", f"skipped: {exc}"))
                continue
            wall = time.perf_counter() - start
            try:
                checks.check_all(result, case.memory_budget_mb)
                verdict = "passed"
            except checks.CheckFailure as exc:
                verdict, failed = f"FAILED: {str(exc).splitlines()[0][:80]}", failed + 1
            m = result.metrics
            rows.append(
                (
                    case.id,
                    str(result.spec().engine.dtype) if result.spec() else "?",
                    f"{m.get(OptimizerRecord.key('grad_norm'), float('nan')):.4g}",
                    f"{m.get(LossRecord.key('pg_loss'), float('nan')):.4g}",
                    f"{m.get(PostStepRecord.key('rollout_logprob_max_abs_diff'), float('nan')):.3g}",
                    f"{m.get(PerfRecord.key('peak_memory_bytes'), 0) / 2**20:.0f}",
                    f"{m.get(PerfRecord.key('step_time_s'), float('nan')):.2f}",
                    f"{wall:.1f}",
                    verdict,
                )
            )
    header = (
        "case",
        "dtype",
        "grad norm",
        "pg loss",
        "rollout lp diff",
        "peak MiB",
        "step s",
        "wall s",
        "verdict",
    )
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
