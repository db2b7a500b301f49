"""A 2-rank verl case against the same case on our own FSDP2 engine, side by side.

Alternates the two so noise hits both alike and prints median wall times (launch to results, as a
user meets them) and the ratio (target <= 2.0). Needs the verl extra.
Usage: python benchmarks/verl_case.py [--rounds N] [--case ID]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from pytest_fsdp_turbo.cases import with_overrides
from pytest_fsdp_turbo.devices import detect
from pytest_fsdp_turbo.launching.case_runner import standalone_runner, standalone_settings
from pytest_fsdp_turbo_contract.records import PerfRecord

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--case", default="tiny-qwen3-verl-fsdp2-deferred")
    args = parser.parse_args()
    times: dict[str, list[float]] = {"native": [], "verl": []}
    steps: dict[str, list[float]] = {"native": [], "verl": []}
    with tempfile.TemporaryDirectory() as tmp:
        settings = standalone_settings(
            {"fsdp_turbo_device": "cpu", "fsdp_turbo_artifacts": tmp}, cwd=REPO
        )
        runner = standalone_runner(settings, detect("cpu"))
        verl = runner.cases().get(args.case)
        native = with_overrides(verl, {"backend": "fsdp"})  # our engine, same case
        for round_ in range(args.rounds):
            for name, case in (("native", native), ("verl", verl)):
                start = time.perf_counter()
                result = runner.run(case, f"{name}{round_}")
                if not result.ok:
                    raise SystemExit(result.failure_text())
                times[name].append(time.perf_counter() - start)
                steps[name].append(result.metrics[PerfRecord.key("step_time_s")])
    med = {name: statistics.median(values) for name, values in times.items()}
    step = {name: statistics.median(values) for name, values in steps.items()}
    print(f"case {verl.id} ({verl.engine.world_size} ranks, {args.rounds} rounds, medians)")
    print(f"  ours  (backend fsdp):       {med['native']:.2f} s wall, step {step['native']:.2f} s")
    print(
        f"  verl  (backend {verl.engine.backend}): {med['verl']:.2f} s wall, step {step['verl']:.2f} s"
    )
    print(f"  ratio verl / ours: {med['verl'] / med['native']:.2f} (target <= 2.0)")


if __name__ == "__main__":
    main()
