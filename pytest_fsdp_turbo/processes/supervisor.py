"""Start one group of rank processes, watch them, and hand back a structured result.

One log file per rank; one timeout for the group, counted from when every rank has started (its
imports done). A rank that fails stops the others at once; a group that times out dumps every
rank's Python stacks (faulthandler, SIGUSR1) into its log first. Nothing the group started outlives
it, passed or failed (reaping.py).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple, Protocol

from pytest_fsdp_turbo.processes import progress
from pytest_fsdp_turbo.processes.reaping import (
    CASE_TOKEN_VAR,
    kill_pid_tree,
    kill_trees,
    process_create_time,
    reap_case,
)
from pytest_fsdp_turbo_contract.artifacts import RunFolder
from pytest_fsdp_turbo_contract.lifetime import die_with_parent
from pytest_fsdp_turbo_contract.results import RankResult, RunResult
from pytest_fsdp_turbo_contract.vocab import Env

WORKER_MODULE = "pytest_fsdp_turbo_engine.worker"
STACK_DUMP_SIGNAL = signal.SIGUSR1
STACK_DUMP_WAIT_S = 1.0
WATCH_EVERY_S = 0.5
# a fresh rank's interpreter and imports (torch, transformers, the harness's step), before its
# first phase: a guard against an import that hangs, never part of the case timeout (a busy box
# takes minutes); an engine's own modules are imported in its load phase, inside the timeout
START_UP_TIMEOUT_S = 600.0
LAUNCHED_AT_VAR = Env.LAUNCHED_AT  # wall clock at launch: start-up time per rank


# what a torchrun agent sets for its own workers: inherited by a pytest started inside a torchrun
# job, TORCHELASTIC_USE_AGENT_STORE has every rank wait on an agent store nobody serves
AGENT_VARIABLES = ("GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME")
AGENT_PREFIXES = ("TORCHELASTIC_", "TORCH_ELASTIC_")


def rank_env(base: Mapping[str, str], rank: int, world_size: int) -> dict[str, str]:
    """A rank's environment: `base` without a torchrun agent's variables, plus its own."""
    env = {
        name: value
        for name, value in base.items()
        if name not in AGENT_VARIABLES and not name.startswith(AGENT_PREFIXES)
    }
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        PYTHONUNBUFFERED="1",
        PYTHONFAULTHANDLER="1",
    )
    return env


class RankHandle(Protocol):
    """One running rank, wherever it runs (a local process, a Ray actor)."""

    rank: int
    log_path: Path

    def poll(self) -> int | None: ...

    def dump_stacks(self) -> None: ...

    def kill(self) -> None: ...


class LocalRank:
    def __init__(
        self,
        rank: int,
        command: Sequence[str],
        env: Mapping[str, str],
        log_path: Path,
        grace_s: float = 0.0,  # SIGTERM first, this long, for a tree that cleans up after itself
    ):
        self.rank, self.log_path, self.grace_s = rank, log_path, grace_s
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                list(command),
                env=dict(env),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=die_with_parent if sys.platform == "linux" else None,
            )
        self.pid = self.proc.pid
        self.started = process_create_time(self.pid)

    def poll(self) -> int | None:
        return self.proc.poll()

    def dump_stacks(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                os.kill(self.proc.pid, STACK_DUMP_SIGNAL)

    def kill(self) -> None:
        kill_trees([self.proc], self.grace_s if self.proc.poll() is None else 0.0)


class ForkedRank:
    """A rank forked by this process's warm parent; the parent reaps it and reports its exit."""

    def __init__(
        self,
        parent,
        rank: int,
        env: Mapping[str, str],
        spec: Path,
        log_path: Path,
        preload: str | None = None,
    ):
        self.parent, self.rank, self.log_path = parent, rank, log_path
        self.pid = parent.fork(rank, env, spec, log_path, preload)
        self.started = process_create_time(self.pid)

    def poll(self) -> int | None:
        code = self.parent.exits.get(self.pid)
        if code is None and not self.parent.alive:
            return -signal.SIGKILL  # it died with the parent
        return code

    def dump_stacks(self) -> None:
        if self.poll() is None:
            with contextlib.suppress(OSError):
                os.kill(self.pid, STACK_DUMP_SIGNAL)

    def kill(self) -> None:
        if self.poll() is None:
            kill_pid_tree(self.pid)
            self.parent.wait_exit(self.pid, 5.0)  # its exit, reported by the parent


class Supervised(NamedTuple):
    timed_out: bool
    first_failure: int | None
    ends: dict[int, float]  # rank -> when it ended (monotonic)
    start_up_s: float | None  # until every rank had started (None: one never did)


def supervise(
    handles: Sequence[RankHandle],
    timeout_s: float,
    poll_s: float = 0.05,
    watch: Callable[[float], None] | None = None,
    completed: Callable[[RankHandle], bool] | None = None,
    started: Callable[[RankHandle], bool] | None = None,
) -> Supervised:
    """Wait for every rank; on the first failure or at the timeout, dump the stacks of the ranks
    still alive (which rank waited where) and stop them. `watch(elapsed)` is called about every
    WATCH_EVERY_S while the ranks run (live progress). A rank that exits 0 without `completed`
    (its results) is a failure too, so its peers do not wait for it until a timeout. With
    `started` (a rank is past its interpreter's start and its imports), the timeout counts from
    when every rank had started, and the start-up itself is held to START_UP_TIMEOUT_S."""
    start = time.monotonic()
    clock = start if started is None else None  # when the timeout began to count
    ends: dict[int, float] = {}
    timed_out, first_failure = False, None
    watched = start
    try:
        while len(ends) < len(handles):
            if watch is not None and time.monotonic() - watched >= WATCH_EVERY_S:
                watched = time.monotonic()
                watch(watched - start)
            for handle in handles:
                if handle.rank not in ends and (code := handle.poll()) is not None:
                    ends[handle.rank] = time.monotonic()
                    failed = code != 0 or (completed is not None and not completed(handle))
                    if failed and first_failure is None:
                        first_failure = handle.rank
            now = time.monotonic()
            if started is not None and clock is None:  # waiting for the ranks' start-up
                clock = now if all(h.rank in ends or started(h) for h in handles) else None
            stop = first_failure is not None and len(ends) < len(handles)
            if clock is None:
                timed_out = not stop and now - start >= START_UP_TIMEOUT_S
            else:
                timed_out = not stop and now - clock >= timeout_s
            if stop or timed_out:
                for handle in handles:
                    if handle.rank not in ends:
                        handle.dump_stacks()
                time.sleep(STACK_DUMP_WAIT_S)
                break
            time.sleep(poll_s)
    finally:
        for handle in handles:
            handle.kill()
    return Supervised(timed_out, first_failure, ends, None if clock is None else clock - start)


def began_phases(artifacts_dir: Path) -> Callable[[RankHandle], bool]:
    """The engine worker's start-up is over: it recorded its first phase (after its imports)."""

    def began(handle: RankHandle) -> bool:
        report = RunFolder(artifacts_dir).phases(handle.rank)
        return report.is_file() and report.stat().st_size > 0

    return began


def collect_result(
    case_id: str,
    handles: Sequence[RankHandle],
    artifacts_dir: Path,
    timeout_s: float,
    start: float,
    outcome: Supervised,
) -> RunResult:
    timed_out, first_failure, ends, start_up_s = outcome
    notes = []
    failure = ""
    if timed_out and start_up_s is None:
        failure = (
            f"its ranks did not finish starting (interpreter and imports, before their first "
            f"phase) within {START_UP_TIMEOUT_S:g}s; Python stacks of every rank are in its log"
        )
    elif timed_out and start_up_s:
        notes.append(
            f"fsdp-turbo: the case timeout counted from when every rank had started: their "
            f"start-up (interpreter and imports) took {start_up_s:.1f}s before it"
        )
    try:
        # what every rank did when, kept with the logs
        progress.write_timeline(artifacts_dir, len(handles))
    except OSError as exc:  # a full disk must not hide what the ranks did
        notes.append(f"fsdp-turbo: timeline not written to {artifacts_dir}: {exc.strerror}")
    now = time.monotonic()
    folder = RunFolder(artifacts_dir)
    ranks = [
        RankResult.read(folder, h.rank, h.poll(), ends.get(h.rank, now) - start, h.log_path)
        for h in handles
    ]
    if not timed_out and (first := first_to_fail(ranks, ends, now)) is not None:
        first_failure = first
    return RunResult(
        case_id=case_id,
        world_size=len(handles),
        ranks=ranks,
        artifacts_dir=artifacts_dir,
        duration_s=now - start,
        timed_out=timed_out,
        timeout_s=timeout_s,
        first_failure=first_failure,
        failure=failure,
        notes=notes,
    )


def first_to_fail(ranks: Sequence[RankResult], ends: dict[int, float], now: float) -> int | None:
    """The rank whose own failure came first: its error, an abort in a collective or a signal,
    by wall clock (its error's time, else when it ended, else now: the supervisor stopped it). A
    rank whose collective only lost its connection follows any rank that failed on its own, even
    one the supervisor stopped mid-abort, after its peer's error had already ended the wait."""
    wall = time.time() - now

    def when(rank: RankResult) -> float:
        if rank.error is not None and rank.error.time is not None:
            return rank.error.time
        return wall + ends.get(rank.rank, now)

    failed = [r for r in ranks if r.failed]
    own = [r for r in failed if not r.lost_peer]
    return min(own or failed, key=when).rank if failed else None


def wrote_results(artifacts_dir: Path) -> Callable[[RankHandle], bool]:
    """The engine worker's success marker: a rank's metrics file (written before it exits 0)."""
    return lambda handle: RunFolder(artifacts_dir).metrics(handle.rank).is_file()


def worker_command(artifacts_dir: Path, python: str = sys.executable) -> list[str]:
    return [python, "-m", WORKER_MODULE, str(RunFolder(artifacts_dir).spec)]


def launch_local(
    *,
    case_id: str,
    world_size: int,
    env: Mapping[str, str],
    artifacts_dir: Path,
    timeout_s: float,
    command: Sequence[str] | None = None,
    poll_s: float = 0.05,
    warm_parent=None,
    preload: str | None = None,
    watch: Callable[[float], None] | None = None,
) -> RunResult:
    """Run `command` (default: the engine worker on artifacts_dir/spec.json) as world_size ranks:
    forked from `warm_parent` when one is given, otherwise fresh interpreters."""
    artifacts_dir.mkdir(parents=True, exist_ok=True)
    completed = None if command else wrote_results(artifacts_dir)
    command = list(command or worker_command(artifacts_dir))
    handles: list[LocalRank | ForkedRank] = []
    token = f"{os.getpid()}-{uuid.uuid4().hex}"
    start = time.monotonic()
    try:
        try:
            for rank in range(world_size):
                log_path = RunFolder(artifacts_dir).log(rank)
                rank_vars = {
                    **rank_env(env, rank, world_size),
                    LAUNCHED_AT_VAR: f"{time.time():.6f}",
                    CASE_TOKEN_VAR: token,
                }
                if warm_parent is not None:
                    spec = RunFolder(artifacts_dir).spec
                    handles.append(
                        ForkedRank(warm_parent, rank, rank_vars, spec, log_path, preload)
                    )
                else:
                    handles.append(LocalRank(rank, command, rank_vars, log_path))
        except BaseException as exc:
            for handle in handles:
                handle.kill()
            if warm_parent is None or warm_parent.alive or getattr(warm_parent, "silent", False):
                raise  # a silent parent: the caller spawns the ranks instead
            return RunResult.launcher_failed(
                case_id, world_size, artifacts_dir, _warm_parent_died(warm_parent, exc)
            )
        # the engine worker records its phases, the first after its imports (a helper: none)
        began = began_phases(artifacts_dir) if completed is not None else None
        outcome = supervise(handles, timeout_s, poll_s, watch, completed, began)
        result = collect_result(case_id, handles, artifacts_dir, timeout_s, start, outcome)
        if warm_parent is not None and not warm_parent.alive:
            result.failure = _warm_parent_died(warm_parent)
        return result
    finally:  # each rank leads its own session: its pid names its session and process group
        reap_case(token, {handle.pid: handle.started for handle in handles})


def _warm_parent_died(parent, exc: BaseException | None = None) -> str:
    how = f" ({type(exc).__name__}: {exc})" if exc else ""
    return (
        f"the warm parent (pid {parent.pid}) died while the case ran, exit code "
        f"{parent.exit_code}{how}; its ranks died with it, and the next case starts a new one; "
        f"its log: {parent.log_path}"
    )
