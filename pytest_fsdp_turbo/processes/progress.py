"""Live progress of a running case: which phase each rank is in, for how long, and stalls.

Ranks append {"phase", "t"} lines to rankN.phases.jsonl as they enter each phase; the launcher's
supervision loop calls `Progress.tick` and this module follows those files. On a terminal the
status is one line rewritten in place; elsewhere (CI logs) a plain line when a phase changes, at
most every `every_s`. A case quicker than `quiet_s` prints nothing. A rank that stays in one phase
longer than `stall_share` of the collective timeout (a rank waiting in a collective fails at that
timeout, so a warning after it would come too late) gets one warning line.
After the case, `timeline` turns the files into (rank, phase, start, end) rows for the artifacts.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from pytest_fsdp_turbo_contract.artifacts import RunFolder
from pytest_fsdp_turbo_contract.faults import PHASES
from pytest_fsdp_turbo_contract.spec import RankSpec


def read_phases(path: Path) -> list[tuple[str, float]]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    entries = []
    for line in lines:
        try:
            data = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line being written right now
        entries.append((data["phase"], float(data["t"])))
    return entries


def timeline(artifacts_dir: Path, world_size: int, end: float) -> list[dict]:
    rows = []
    for rank in range(world_size):
        entries = read_phases(RunFolder(artifacts_dir).phases(rank))
        for (phase, start), nxt in zip(entries, [*entries[1:], (None, end)]):
            rows.append({"rank": rank, "phase": phase, "start": start, "end": nxt[1]})
    return rows


def write_timeline(artifacts_dir: Path, world_size: int) -> None:
    rows = timeline(artifacts_dir, world_size, time.time())
    RunFolder(artifacts_dir).timeline.write_text(json.dumps(rows, indent=1))


def group_ranks(phases: dict[int, str]) -> str:
    """{0: 'train', 1: 'train', 2: 'reference'} -> 'r0-1 train  r2 reference'."""
    parts, ranks = [], sorted(phases)
    start = 0
    for i in range(1, len(ranks) + 1):
        if i == len(ranks) or phases[ranks[i]] != phases[ranks[start]]:
            first, last = ranks[start], ranks[i - 1]
            label = f"r{first}" if first == last else f"r{first}-{last}"
            parts.append(f"{label} {phases[first]}")
            start = i
    return "  ".join(parts)


def _order(phase: str) -> int:
    """A phase's place in the step (an unknown one, "starting" included, counts as first)."""
    return PHASES.index(phase) if phase in PHASES else -1


UNCOLLECTIVE_PHASES = ("starting", "init", "load", "rollout")


@dataclass
class Progress:
    case_id: str
    world_size: int
    timeout_s: float
    artifacts_dir: Path
    live: Callable[[str], None] | None  # rewrite one status line (a terminal), or None
    line: Callable[[str], None]  # write a plain line
    stall_share: float = 0.5
    quiet_s: float = 10.0
    every_s: float = 30.0
    collective_timeout_s: float | None = None  # the stall limit's base (default: timeout_s)
    warnings: list[str] = field(default_factory=list)
    _last: tuple[str, float] = ("", 0.0)
    _warned: set = field(default_factory=set)
    _shown: bool = False

    def current(self) -> dict[int, tuple[str, float]]:
        out = {}
        for rank in range(self.world_size):
            entries = read_phases(RunFolder(self.artifacts_dir).phases(rank))
            out[rank] = entries[-1] if entries else ("starting", 0.0)
        return out

    def tick(self, elapsed: float) -> None:
        now = time.time()
        phases = self.current()
        collective = min(self.collective_timeout_s or self.timeout_s, self.timeout_s)
        # a rank already in a later phase than another is waiting for it, not stalled itself
        behind = min((_order(phase) for phase, _ in phases.values()), default=0)
        for rank, (phase, since) in phases.items():
            if _order(phase) > behind:
                continue
            # loading and generating wait on no collective: they are held to the case timeout
            base = self.timeout_s if phase in UNCOLLECTIVE_PHASES else collective
            limit = self.stall_share * base
            if since and now - since > limit and (rank, phase) not in self._warned:
                self._warned.add((rank, phase))
                if self._shown and self.live is not None:
                    self.live("")  # the status line goes before the warning takes its place
                message = (
                    f"fsdp-turbo: stall: case {self.case_id} rank {rank} has been in phase "
                    f"{phase} for {now - since:.0f}s (over {self.stall_share:g} of the "
                    f"{base:g}s {'collective ' if base < self.timeout_s else ''}timeout)"
                )
                self.warnings.append(message)
                self.line(message)
        if elapsed < self.quiet_s:
            return
        summary = group_ranks({rank: phase for rank, (phase, _) in phases.items()})
        status = f"{self.case_id} {elapsed:.0f}s  {summary}"
        if self.live is not None:
            self.live(status)
            self._shown = True
            return
        text, at = self._last
        if summary != text or now - at >= self.every_s:
            self._last = (summary, now)
            self.line(f"fsdp-turbo: {status}")

    def close(self) -> None:
        if self._shown and self.live is not None:
            self.live("")


@dataclass(frozen=True)
class Display:
    """Where runs' progress goes: one status line rewritten in place (`live`, on a terminal; None
    in a CI log) and plain lines; with the ini's stall share and quiet time."""

    live: Callable[[str], None] | None
    line: Callable[[str], None]
    stall_share: float = 0.5
    quiet_s: float = 10.0

    def follow(self, spec: RankSpec, folder: Path) -> Progress:
        """The progress of the run launched with `spec` into `folder`."""
        return Progress(
            spec.case_id,
            spec.engine.world_size,
            spec.timeout_s,
            folder,
            self.live,
            self.line,
            stall_share=self.stall_share,
            quiet_s=self.quiet_s,
            collective_timeout_s=spec.collective_timeout_s,
        )


class ArtifactWatcher:
    """Live progress under pytest-xdist: the controller cannot see its workers' terminal output,
    so it follows the artifact folders instead (every run writes rankN.phases.jsonl there while it
    runs, and timeline.json when it ends) and prints plain status and stall lines."""

    def __init__(self, root: Path, display: Display):
        self.root, self.display = root, replace(display, live=None)  # plain lines only
        self.since = time.time()  # runs of earlier sessions are not followed
        self.running: dict[Path, Progress] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="fsdp-turbo-watch")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stop.wait(0.5):
            try:
                self.scan()
            except OSError:
                continue  # a folder being created or removed right now

    def scan(self) -> None:
        if not self.root.is_dir():
            return
        for spec in self.root.glob(f"**/{RunFolder.spec}"):
            folder = spec.parent
            if RunFolder(folder).timeline.exists() or spec.stat().st_mtime < self.since:
                self.running.pop(folder, None)
                continue
            progress = self.running.get(folder) or self._follow(folder)
            entries = read_phases(RunFolder(folder).phases(0))
            if progress is not None and entries:
                progress.tick(time.time() - entries[0][1])

    def _follow(self, folder: Path) -> Progress | None:
        try:
            spec = RankSpec.read(RunFolder(folder).spec)
        except (OSError, ValueError, KeyError, TypeError):  # being written right now
            return None
        if not RunFolder(folder).phases(0).exists():
            return None
        progress = self.display.follow(spec, folder)
        self.running[folder] = progress
        return progress
