"""Where a rank is in its step: each phase announced on its log and in its phase record (which
the launcher follows live), timed, and the point where the harness's own tests inject a fault."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from pytest_fsdp_turbo_contract.records import STARTUP
from pytest_fsdp_turbo_engine.faults import Fault


@dataclass
class Phase:
    """Where the rank is, so a failure report can say so, and when it got there."""

    rank: int
    fault: Fault | None = None
    name: str = "init"
    started: dict[str, float] = field(default_factory=dict)  # phase -> wall clock
    report: Path | None = None  # rankN.phases.jsonl: the launcher follows it while the case runs

    def enter(self, name: str) -> None:
        self.name = name
        self.started[name] = time.time()
        print(f"[rank {self.rank}] phase {name}", flush=True)
        if self.report is not None:
            with open(self.report, "a") as report:
                report.write(json.dumps({"phase": name, "t": self.started[name]}) + "\n")
        if self.fault:
            self.fault.at_phase(self.rank, name)

    def timings(self, launched_at: float | None) -> dict[str, float]:
        """Seconds in every phase entered so far; `startup` is the time from launch (interpreter,
        imports, process group) to loading the model."""
        names = list(self.started)
        ends = [self.started[n] for n in names[1:]] + [time.time()]
        out = {name: end - self.started[name] for name, end in zip(names, ends) if name != "init"}
        if launched_at is not None and "load" in self.started:
            out[STARTUP] = self.started["load"] - launched_at
        return out


def phase_name(phase: str, update: int) -> str:
    """train, train2, ...: each update's phases timed apart."""
    return phase if update == 1 else f"{phase}{update}"
