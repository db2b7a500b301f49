"""Fault injection for the harness's own reliability tests; inert unless the variable is set.

PYTEST_FSDP_TURBO_FAULT=KIND:RANK[:PHASE], KIND one of crash | hang | nan | stall, e.g.
"crash:1:rollout"; stall sleeps PYTEST_FSDP_TURBO_FAULT_STALL_S seconds, then carries on.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from pytest_fsdp_turbo.vocab import Env

FAULT_VAR = Env.FAULT
KINDS = ("crash", "hang", "nan", "stall")
STALL_SECONDS_VAR = "PYTEST_FSDP_TURBO_FAULT_STALL_S"  # how long "stall" sleeps (default 5)


class InjectedFault(RuntimeError):
    pass


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    phase: str | None = None

    @classmethod
    def from_env(cls) -> Fault | None:
        value = os.environ.get(FAULT_VAR, "").strip()
        if not value:
            return None
        parts = value.split(":")
        if len(parts) not in (2, 3) or parts[0] not in KINDS or not parts[1].isdigit():
            raise ValueError(
                f"{FAULT_VAR}: expected KIND:RANK[:PHASE] with KIND in {KINDS}; got {value!r}"
            )
        return cls(parts[0], int(parts[1]), parts[2] if len(parts) == 3 else None)

    def at_phase(self, rank: int, phase: str) -> None:
        """Called at the start of every phase; acts only for the named rank and phase."""
        if rank != self.rank or self.phase != phase:
            return
        if self.kind == "crash":
            raise InjectedFault(f"injected crash in rank {rank} at phase {phase}")
        if self.kind == "stall":  # slow, not stuck: the phase resumes after a while
            time.sleep(float(os.environ.get(STALL_SECONDS_VAR, "5")))
        if self.kind == "hang":
            while True:  # the other ranks block in their next collective
                time.sleep(1)
