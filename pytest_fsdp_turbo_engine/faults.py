"""Fault injection for the harness's own reliability tests; inert unless the spec names one.

The spec (kinds, phases, validation) is pytest_fsdp_turbo_contract.faults, resolved in the pytest
process before launch and handed to the ranks in spec.json; this module acts on it inside the rank.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from pytest_fsdp_turbo_contract.faults import FaultSpec

WARM_PARENT_MODULE = "pytest_fsdp_turbo_engine.warm_parent"


class InjectedFault(RuntimeError):
    pass


class Fault(FaultSpec):
    @classmethod
    def of(cls, spec: FaultSpec | None) -> Fault | None:
        return None if spec is None else cls(spec.kind, spec.rank, spec.phase, spec.stall_s)

    def at_phase(self, rank: int, phase: str) -> None:
        """Called at the start of every phase; acts only for the named rank and phase."""
        if rank != self.rank or self.phase != phase:
            return
        if self.kind == "crash":
            raise InjectedFault(f"injected crash in rank {rank} at phase {phase}")
        if self.kind == "stall":  # slow, not stuck: the phase resumes after a while
            time.sleep(self.stall_s)
        if self.kind == "exit":  # gone without a word: no error file, exit code 0
            sys.stdout.flush()
            os._exit(0)
        if self.kind == "signal":
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        if self.kind == "kill_parent":
            _kill_warm_parent()
        if self.kind == "hang":
            while True:  # the other ranks block in their next collective
                time.sleep(1)


def _kill_warm_parent() -> None:
    """Only a warm parent: a spawned rank's parent is the pytest process itself."""
    parent = os.getppid()
    try:
        with open(f"/proc/{parent}/cmdline", "rb") as cmdline:
            is_warm = WARM_PARENT_MODULE.encode() in cmdline.read()
    except OSError:
        is_warm = False
    if not is_warm:
        raise InjectedFault("kill_parent needs a rank forked by the warm parent (launcher local)")
    os.kill(parent, signal.SIGKILL)
    while True:  # the parent's death signal ends this rank too
        time.sleep(1)
