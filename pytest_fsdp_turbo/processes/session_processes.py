"""The one owner of the processes that live for the whole pytest session by design: the warm
parent (this process's, or an ancestor's it adopted), its zygotes, the Ray driver and the Ray
cluster it started. Each is registered here by the code that starts it, whichever test happens to
start it, so the leak guard never counts (or kills) them, and closed here when the process ends.
Their descendants are the session's only where the owner says so: the warm parent's forked ranks
never are, a Ray cluster's daemons and idle workers are, the actor processes that host a case's
ranks are not.
"""

from __future__ import annotations

import atexit
import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil


@dataclass(frozen=True)
class SessionProcess:
    pid: int
    what: str
    # which of its descendants belong to the session too (None: none of them)
    keeps: Callable[[psutil.Process], bool] | None = None


@dataclass
class SessionProcesses:
    """This process's long-lived helpers and every pid the leak guard leaves alone."""

    pids: dict[int, SessionProcess] = field(default_factory=dict)
    warm: Any = None  # the warm parent's conversation (processes.warm), once there is one
    warm_refusal: str | None = None  # why ranks are spawned instead, once known
    warm_log_dir: Path | None = None  # where a replacement warm parent keeps its log
    ray: Any = None  # the Ray driver (launching.ray_driver), once started
    _pid: int = field(default_factory=os.getpid)  # a forked child's copy is not the owner

    def __post_init__(self) -> None:
        atexit.register(self.close)

    def own(self, pid: int, what: str, keeps: Callable[[Any], bool] | None = None) -> None:
        self.pids[pid] = SessionProcess(pid, what, keeps)

    def disown(self, pid: int) -> None:
        self.pids.pop(pid, None)

    def stop_ray(self) -> None:
        driver, self.ray = self.ray, None
        if driver is not None:
            driver.close()

    def close(self) -> None:
        """At exit: the Ray driver first (its actors live on the cluster), then the warm parent."""
        if os.getpid() != self._pid:
            return  # a forked child inherited this object: the helpers are its parent's
        self.stop_ray()
        warm, self.warm = self.warm, None
        if warm is not None:
            with contextlib.suppress(OSError):
                warm.close()


_mine: dict[int, SessionProcesses] = {}  # by pid: a forked or xdist-spawned process has its own


def session_processes() -> SessionProcesses:
    me = os.getpid()
    if me not in _mine:
        _mine[me] = SessionProcesses()
    return _mine[me]


def own(pid: int, what: str, keeps: Callable[[psutil.Process], bool] | None = None) -> None:
    session_processes().own(pid, what, keeps)


def disown(pid: int) -> None:
    session_processes().disown(pid)


def owned() -> dict[int, SessionProcess]:
    return dict(session_processes().pids)


def belongs_to_session(proc: psutil.Process) -> bool:
    """A registered process, or a descendant its nearest registered ancestor keeps."""
    pids = session_processes().pids
    if proc.pid in pids:
        return True
    try:
        ancestors = proc.parents()
    except psutil.Error:
        return False
    for ancestor in ancestors:
        entry = pids.get(ancestor.pid)
        if entry is not None:
            try:
                return entry.keeps is not None and entry.keeps(proc)
            except psutil.Error:
                return False
    return False
