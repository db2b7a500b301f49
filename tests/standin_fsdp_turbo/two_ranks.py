"""Two gloo ranks for a probe, the second forked from the first after the imports (the probes run
forked from the harness's warm parent, which has no threads): no interpreter start for rank 1."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable


def run_on_two_ranks(probe: Callable[[int], dict]) -> None:
    """Rank 0 prints the probe's JSON report when both ranks finish; a rank that raises says so on
    stderr and the process exits 1. No interpreter teardown with gloo threads about."""
    child = os.fork()
    rank = 1 if child == 0 else 0
    status = 0
    try:
        found = probe(rank)
    except Exception as exc:  # reported by rank 0's exit code and stderr
        print(f"rank {rank}: {type(exc).__name__}: {exc}", file=sys.stderr)
        status = 1
    if child == 0:
        sys.stderr.flush()
        os._exit(status)
    _, child_status = os.waitpid(child, 0)
    if status == 0 and child_status == 0:
        print(json.dumps(found))
    sys.stdout.flush()
    os._exit(0 if status == 0 and child_status == 0 else 1)
