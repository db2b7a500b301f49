"""How a run ended: `RankError` (a rank's structured failure), `RankResult` per rank and
`RunResult` for the run, read back from its folder."""

from __future__ import annotations

import functools
import os
import signal
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from pytest_fsdp_turbo_contract.artifacts import RunFolder, read_json
from pytest_fsdp_turbo_contract.records import StepMetrics
from pytest_fsdp_turbo_contract.spec import RankSpec
from pytest_fsdp_turbo_contract.vocab import CaseKindName

LOG_TAIL_LINES = 30
LOG_TAIL_BYTES = 8192  # a rank that printed megabytes without a newline still gets a short tail
FOLLOWER_CHARS = 160  # a rank that failed after the first one: its exception line, cut
LAST_LINES = 3  # a rank that ended without an error report: its log's last words, in the head
# how gloo ("Timed out waiting ... for recv operation") and NCCL's watchdog ("collective operation
# timeout") say a collective waited too long; HCCL's message names hccl and a timeout
HANG_MARKS = ("timed out waiting", "collective operation timeout")
# a rank that cannot write its error report (a full disk) exits with this plus the errno
UNWRITABLE_REPORT = 64
MESSAGE_CHARS = 2000  # an exception message shown in a failure (one of 20 MB is cut, not printed)
# what a rank's collective says when a peer it waits on died (gloo, NCCL, the store); never a
# bare "NCCL error" or "HCCL", which a rank's own bug raises too (an invalid argument, a bad
# buffer) and which would then pass as a lost peer behind another rank's known failure. HCCL
# reports a dead peer as a timeout (HANG_MARKS, after the first failure).
PEER_GONE = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Socket Timeout",
    "connection refused",
    "communicator was aborted",
    "remote process exited or there was a network error",  # NCCL's ncclRemoteError
)


@dataclass
class RankError:
    """rankN.error.json: where a rank was and what it raised."""

    rank: int
    phase: str
    type: str
    message: str
    traceback: str = ""
    time: float | None = None  # wall clock: which rank raised first

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> RankError | None:
        if not isinstance(data, dict):
            return None
        known = {f.name for f in fields(cls)}
        try:
            error = cls(**{k: v for k, v in data.items() if k in known})
        except TypeError:  # a half-written or foreign file: no error we can read
            return None
        if not isinstance(error.time, int | float):
            error.time = None
        return error


@dataclass
class RankResult:
    rank: int
    exit_code: int | None
    duration_s: float
    log_path: Path
    metrics: dict | None = None  # rankN.metrics.json as written (StepMetrics.from_json types it)
    error: RankError | None = None
    node: str = ""  # where it ran, when the launcher placed ranks on nodes (Ray)

    @property
    def name(self) -> str:
        return f"rank {self.rank}" + (f" on {self.node}" if self.node else "")

    @classmethod
    def read(
        cls, folder: RunFolder, rank: int, exit_code: int | None, duration_s: float, log: Path
    ) -> RankResult:
        metrics = read_json(folder.metrics(rank))
        error = RankError.from_json(read_json(folder.error(rank)))
        return cls(rank, exit_code, duration_s, log, metrics, error)

    @property
    def failed(self) -> bool:
        return self.exit_code != 0 or not self.metrics

    def ending(self) -> str:
        """How the process ended, in words: "killed by SIGABRT", "exited 1"."""
        code = self.exit_code
        if code is not None and code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        if code is not None and UNWRITABLE_REPORT < code <= UNWRITABLE_REPORT + 191:
            why = os.strerror(code - UNWRITABLE_REPORT)
            return f"exited {code}: it could not write its report to its folder ({why})"
        return "still running" if code is None else f"exited {code}"

    def last_lines(self, count: int = LAST_LINES) -> list[str]:
        """The log's last non-blank lines: what a rank that wrote no error said last (an abort's
        `what():`, the phase it was in when a signal ended it)."""
        return [line.rstrip() for line in self.log_tail().splitlines() if line.strip()][-count:]

    @property
    def lost_peer(self) -> bool:
        """It failed only because a peer went away: its collective says the connection is gone."""
        said = self.error.message if self.error is not None else "\n".join(self.last_lines())
        return any(mark in said for mark in PEER_GONE)

    @functools.cached_property
    def step(self) -> StepMetrics:
        """The typed view of what the rank wrote (records with nothing measured when it wrote
        nothing)."""
        return StepMetrics.from_json(self.metrics or {})

    def log_tail(self, lines: int = LOG_TAIL_LINES, without: str = "") -> str:
        """The log's last lines; `without`: a text (the traceback already shown) left out."""
        try:
            with open(self.log_path, "rb") as log:
                size = log.seek(0, os.SEEK_END)
                # enough for the traceback to be recognised and left out, then cut to the tail
                log.seek(max(0, size - LOG_TAIL_BYTES - 4 * len(without)))
                text = log.read().decode(errors="replace")
        except OSError:
            return "(no log)"
        if without.strip():
            text = text.replace(without.strip(), "(the traceback above)")
        tail = "\n".join(text.splitlines()[-lines:])
        if len(tail) > LOG_TAIL_BYTES:
            tail = f"(... {len(tail) - LOG_TAIL_BYTES} characters cut)" + tail[-LOG_TAIL_BYTES:]
        return tail


def bounded(text: str, limit: int = MESSAGE_CHARS) -> str:
    """A message as shown: its start, and how much was cut when it is longer than `limit`."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]} (... {len(text) - limit} characters cut)"


@dataclass
class RunResult:
    case_id: str
    world_size: int
    ranks: list[RankResult]
    artifacts_dir: Path
    duration_s: float
    timed_out: bool = False
    timeout_s: float = 0.0
    first_failure: int | None = None
    notes: list[str] = field(default_factory=list)
    twin: RunResult | None = None  # the replay twin's run, when the case has one
    twin_kind: str = ""  # single | every_micro_batch
    failure: str = ""  # why the group as a whole failed (its launcher died), when it did
    launched: RankSpec | None = None  # what the ranks were asked to do (read from spec.json)
    # check letter -> (status, detail), noted by each check that judged this run, for the summary
    # table's verdict; a view of the run (dataclasses.replace) shares it: judging the view judges it
    judged: dict[str, tuple[str, str]] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def launcher_failed(
        cls, case_id: str, world_size: int, artifacts_dir: Path, why: str, duration_s: float = 0.0
    ) -> RunResult:
        """A run whose ranks never reported: the launcher (warm parent, Ray driver) is gone."""
        folder = RunFolder(artifacts_dir)
        ranks = [
            RankResult(
                rank,
                None,
                duration_s,
                folder.log(rank),
                error=RankError.from_json(read_json(folder.error(rank))),
            )
            for rank in range(world_size)
        ]
        return cls(case_id, world_size, ranks, artifacts_dir, duration_s, failure=why)

    @property
    def folder(self) -> RunFolder:
        return RunFolder(self.artifacts_dir)

    @property
    def ok(self) -> bool:
        """Every rank ended well with its results, and nothing failed the group as a whole."""
        ranks_ok = all(r.exit_code == 0 and r.metrics for r in self.ranks)
        return not self.timed_out and not self.failure and ranks_ok

    @property
    def metrics(self) -> dict:
        """Rank 0's metrics (every key is reduced across ranks where it needs to be)."""
        return self.ranks[0].metrics or {}

    def spec(self) -> RankSpec | None:
        """What the ranks were launched with (a run that failed before its metrics still has it)."""
        if self.launched is None:
            try:
                self.launched = RankSpec.read(self.folder.spec)
            except (OSError, ValueError, KeyError, TypeError):
                return None
        return self.launched

    def first_failed(self) -> RankResult | None:
        """The rank that failed first (None when no single rank did: a timeout, the group)."""
        return next((r for r in self.ranks if r.rank == self.first_failure), None)

    def _followers_in_one_line(self, first: RankResult | None) -> bool:
        """Whether the ranks that failed after the first get one line each: not after a hang
        (the case's timeout, or a collective that timed out), where every rank's stacks are the
        story, nor when the group as a whole failed."""
        return not (self.timed_out or self.failure or self.hung_in_a_collective or first is None)

    @property
    def hung_in_a_collective(self) -> bool:
        """The first failure is a collective that timed out (gloo's "Timed out waiting", NCCL's
        watchdog, HCCL's timeout): a hang, ended by the collective timeout."""
        first = self.first_failed()
        if first is None or first.error is None:
            return False
        said = first.error.message.lower()
        hccl_timeout = "hccl" in said and "timeout" in said
        return hccl_timeout or any(mark in said for mark in HANG_MARKS)

    def _follower_line(self, rank: RankResult, told: dict) -> str:
        """One line for a rank that failed after the first: a peer that only lost its connection
        says so; an error every rank raised is told once."""
        error = rank.error
        if error is None:
            said = rank.ending()
        elif (key := (error.phase, error.type, error.message)) in told:
            said = f"phase {error.phase}: {error.type}: as rank {told[key]}"
        else:
            told[key] = rank.rank
            line = (error.message.strip().splitlines() or [""])[0][:FOLLOWER_CHARS]
            said = f"phase {error.phase}: {error.type}: {line}"
        if rank.lost_peer:
            return f"lost its peer rank {self.first_failure} ({said})"
        return said if error is not None else f"stopped after rank {self.first_failure} failed"

    def _no_results(self, rank: RankResult) -> str:
        """Why a rank that exited 0 has no results, in its case kind's words."""
        spec = self.spec()
        if spec is not None and spec.kind != CaseKindName.PPO_STEP:
            return f"no reading of {rank.name}: its run ended without one (the cause is above)"
        return "exited with code 0 without writing its results (did it call exit?)"

    def failure_text(self) -> str:
        if self.ok:
            return ""
        if self.failure:
            head = f"case {self.case_id}: {self.failure}"
        elif self.timed_out:
            head = (
                f"case {self.case_id}: timed out after {self.timeout_s:g}s; Python stacks of "
                "every rank are in the log tails below"
            )
        else:
            head = f"case {self.case_id}: rank {self.first_failure} failed first"
        first = self.first_failed()
        if first is not None and first.node and not self.failure:
            head = f"case {self.case_id}: {first.name} failed first"
        group_failed = self.failure or self.timed_out
        first_error = first.error if first is not None and not group_failed else None
        if first_error is not None:  # the first rank's cause, before anything else
            message = bounded(first_error.message)
            head += f" in phase {first_error.phase}: {first_error.type}: {message}"
        elif first is not None and not group_failed:  # a signal, an abort: its last words
            said = "\n".join(f"  {line}" for line in first.last_lines())
            head += f": {first.ending()} without an error report; its log ends:\n{said}"
        one_line = self._followers_in_one_line(first)
        parts = [head, f"artifacts: {self.artifacts_dir}"]
        told: dict[tuple[str, str, str], int] = {}  # an error every rank raised is shown once
        tailed: dict[Path, str] = {}  # a log several ranks share is shown once
        # the rank that failed first, then the others in rank order
        for rank in sorted(self.ranks, key=lambda r: r.rank != self.first_failure):
            if rank.exit_code == 0 and rank.metrics and not self.timed_out:
                continue
            where = f"--- {rank.name}: exit {rank.exit_code}, log {rank.log_path}"
            if one_line and rank is not first:  # what it did, not its traceback or log tail
                parts.append(f"{where}: {self._follower_line(rank, told)}")
                continue
            parts.append(where)
            if rank.exit_code == 0 and not rank.metrics:
                parts.append(self._no_results(rank))
            error = rank.error
            if error is None:
                if rank.log_path in tailed:  # ranks of one process (a trainer's log): once
                    parts.append(f"log tail: as {tailed[rank.log_path]}")
                    continue
                tailed[rank.log_path] = rank.name
                parts.append("log tail:\n" + rank.log_tail())
                continue
            key = (error.phase, error.type, error.message)
            if key in told:
                parts.append(f"phase {error.phase}: {error.type}: as rank {told[key]}")
                continue
            told[key] = rank.rank
            trace = error.traceback.rstrip().splitlines()
            if trace and error.message and trace[-1].endswith(error.message):
                trace = trace[:-1]  # the exception line: its message is in the head line
            trace = [bounded(line) for line in trace]
            cause = f"phase {error.phase}: {error.type}: {bounded(error.message)}"
            shown = [] if first_error is error else [cause]  # the head has the first one
            parts.append("\n".join([*shown, *trace]))
            parts.append("log tail:\n" + rank.log_tail(without=error.traceback))
        return "\n".join(parts)
