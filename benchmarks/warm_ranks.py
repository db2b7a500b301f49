"""Warm ranks against fresh interpreters, side by side in one run.

1. `pytest -m cpu_e2e` with --fsdp-turbo-launcher=local (ranks forked from a warm parent) and
   =spawn (fresh interpreters): wall times and their ratio (target <= 0.4).
2. The 2-rank tiny Qwen3.5 case, warm: wall time against its PPO step time (target <= 2x).
3. The collection benchmark (benchmarks/collection.py): plugin installed vs not (target <= 1.01).

Usage: python benchmarks/warm_ranks.py [--skip-suite] [--rounds N]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pytest_fsdp_turbo.devices import detect
from pytest_fsdp_turbo.launching.case_runner import standalone_runner, standalone_settings
from pytest_fsdp_turbo_contract.records import PerfRecord

REPO = Path(__file__).resolve().parent.parent


def suite_seconds(launcher: str) -> float:
    start = time.perf_counter()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-m",
            "cpu_e2e",
            "-p",
            "no:cacheprovider",
            f"--fsdp-turbo-launcher={launcher}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise SystemExit(f"cpu_e2e with launcher {launcher} failed:\n{done.stdout[-3000:]}")
    return time.perf_counter() - start


def case_wall_and_step(rounds: int) -> tuple[float, float]:
    walls, steps = [], []
    with tempfile.TemporaryDirectory() as tmp:
        settings = standalone_settings(
            {"fsdp_turbo_device": "cpu", "fsdp_turbo_artifacts": tmp}, cwd=REPO
        )
        runner = standalone_runner(settings, detect("cpu"))
        for round_ in range(rounds + 1):  # the first round starts the warm parent: not counted
            start = time.perf_counter()
            result = runner.run("tiny-qwen3_5-fsdp2-deferred", str(round_))
            wall = time.perf_counter() - start
            if not result.ok:
                raise SystemExit(result.failure_text())
            if round_:
                walls.append(wall)
                steps.append(result.metrics[PerfRecord.key("step_time_s")])
    return statistics.median(walls), statistics.median(steps)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--skip-suite", action="store_true")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if not args.skip_suite:
        warm, cold = suite_seconds("local"), suite_seconds("spawn")
        print(
            f"pytest -m cpu_e2e: warm {warm:.1f} s, spawn {cold:.1f} s, ratio {warm / cold:.2f} (target <= 0.4)"
        )
    wall, step = case_wall_and_step(args.rounds)
    print(
        f"2-rank tiny Qwen3.5 case, warm: wall {wall:.2f} s, step {step:.2f} s, ratio {wall / step:.2f} (target <= 2)"
    )
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "collection.py")], check=True)


if __name__ == "__main__":
    main()
