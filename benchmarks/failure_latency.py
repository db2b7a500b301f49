"""How soon the launcher stops a case that cannot finish: a rank that exits with an error while
the others wait (target: the rest stopped within 10 s), and ranks that hang past the case timeout
(target: stacks dumped and the tree killed within the timeout + 12 s). The tests prove that it
stops; these are the figures, measured here rather than asserted in a test a slow box can miss.

Usage: python benchmarks/failure_latency.py
"""

from __future__ import annotations

import sys
import tempfile
import textwrap
import time
from pathlib import Path

from pytest_fsdp_turbo.processes.supervisor import launch_local

CRASH = "import os, sys, time\nif os.environ['RANK'] == '1':\n    sys.exit('rank one fell over')\ntime.sleep(300)\n"
HANG = textwrap.dedent(
    """
    import faulthandler, signal, time
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    time.sleep(300)
    """
)
TIMEOUT_S = 3


def seconds(script: str, world_size: int, timeout_s: float) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        start = time.monotonic()
        result = launch_local(
            case_id="latency",
            world_size=world_size,
            env={"PATH": "/usr/bin:/bin"},
            artifacts_dir=Path(tmp),
            timeout_s=timeout_s,
            command=[sys.executable, "-c", script],
        )
        elapsed = time.monotonic() - start
    assert not result.ok
    return elapsed


def main() -> None:
    crash = seconds(CRASH, 3, 120)
    hang = seconds(HANG, 2, TIMEOUT_S)
    print(f"first failure to all ranks stopped (3 ranks): {crash:.2f} s (target <= 10 s)")
    print(
        f"hang past a {TIMEOUT_S} s timeout to stacks dumped and tree killed: {hang:.2f} s "
        f"(target <= {TIMEOUT_S + 12} s)"
    )


if __name__ == "__main__":
    main()
