"""Collection cost of the plugin: a 500-test suite collected with the plugin vs `-p no:fsdp_turbo`.

Each round runs the arms back to back in an order that rotates from round to round, so drift and
cache warmth hit them alike; the ratio is the median of the per-round ratios (target <= 1.01). A
third arm loads an empty plugin instead of this one: the floor any pytest plugin pays.
Usage: python benchmarks/collection.py [--rounds N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TESTS = 500
ARMS = {
    "plugin": [],
    "without": ["-p", "no:fsdp_turbo"],
    "empty plugin": ["-p", "no:fsdp_turbo", "-p", "empty_plugin"],
}


def make_suite(root: Path) -> None:
    for module in range(10):
        body = ["import pytest", ""]
        for i in range(TESTS // 10):
            body.append(f"def test_{module}_{i}():\n    assert {i} + 1 > {i}\n")
        (root / f"test_generated_{module}.py").write_text("\n".join(body))
    (root / "pytest.ini").write_text("[pytest]\n")
    plugins = root / "plugins"
    plugins.mkdir()
    (plugins / "empty_plugin.py").write_text("def pytest_configure(config):\n    pass\n")


def collect(root: Path, extra: list[str]) -> float:
    env = {**os.environ, "PYTHONPATH": str(root / "plugins")}
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *extra],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    elapsed = time.perf_counter() - start
    if f"{TESTS} tests collected" not in done.stdout:
        raise SystemExit(f"collection failed: {done.stdout[-500:]}{done.stderr[-500:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=31)
    args = parser.parse_args()
    if os.environ.get("PYTHONDONTWRITEBYTECODE"):
        print("note: PYTHONDONTWRITEBYTECODE is set, so every start recompiles every module")
    names = list(ARMS)
    times: dict[str, list[float]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        make_suite(root)
        for name in names:
            collect(root, ARMS[name])  # warm the file cache and write the bytecode
        for round_ in range(args.rounds):
            shift = round_ % len(names)
            for name in names[shift:] + names[:shift]:
                times[name].append(collect(root, ARMS[name]))
    base = times["without"]

    def ratio(name: str) -> float:
        return statistics.median(a / b for a, b in zip(times[name], base))

    medians = ", ".join(f"{name} {statistics.median(times[name]):.3f}s" for name in names)
    print(f"collect {TESTS} tests, medians of {args.rounds} rounds: {medians}")
    print(
        f"ratio plugin / without {ratio('plugin'):.3f} (target <= 1.01); "
        f"empty plugin / without {ratio('empty plugin'):.3f}"
    )


if __name__ == "__main__":
    main()
