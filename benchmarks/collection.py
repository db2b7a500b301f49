"""Collection cost of the plugin: a 500-test suite collected with the plugin vs `-p no:fsdp_turbo`.

Runs alternate between the two settings so machine noise hits both alike; prints medians and the
ratio (target <= 1.01).  Usage: python benchmarks/collection.py [--rounds N]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TESTS = 500


def make_suite(root: Path) -> None:
    for module in range(10):
        body = ["import pytest", ""]
        for i in range(TESTS // 10):
            body.append(f"def test_{module}_{i}():\n    assert {i} + 1 > {i}\n")
        (root / f"test_generated_{module}.py").write_text("\n".join(body))
    (root / "pytest.ini").write_text("[pytest]\n")


def collect(root: Path, extra: list[str]) -> float:
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *extra],
        cwd=root,
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
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        make_suite(root)
        collect(root, [])  # warm the file cache
        with_plugin, without = [], []
        for _ in range(args.rounds):
            with_plugin.append(collect(root, []))
            without.append(collect(root, ["-p", "no:fsdp_turbo"]))
    a, b = statistics.median(with_plugin), statistics.median(without)
    print(
        f"collect {TESTS} tests, median of {args.rounds}: with plugin {a:.3f}s, "
        f"without (-p no:fsdp_turbo) {b:.3f}s, ratio {a / b:.3f} (target <= 1.01)"
    )


if __name__ == "__main__":
    main()
