"""Processes that live for the whole pytest session by design: the warm parent, the Ray driver and
the Ray cluster it started. Each is registered here by the code that starts it, whichever test
happens to start it, so the leak guard never counts (or kills) them. Their descendants are the
session's only where the owner says so: the warm parent's forked ranks never are, a Ray cluster's
daemons and idle workers are, the actor processes that host a case's ranks are not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import psutil


@dataclass(frozen=True)
class SessionProcess:
    pid: int
    what: str
    # which of its descendants belong to the session too (None: none of them)
    keeps: Callable[[psutil.Process], bool] | None = None


_owned: dict[int, SessionProcess] = {}


def own(pid: int, what: str, keeps: Callable[[psutil.Process], bool] | None = None) -> None:
    _owned[pid] = SessionProcess(pid, what, keeps)


def disown(pid: int) -> None:
    _owned.pop(pid, None)


def owned() -> dict[int, SessionProcess]:
    return dict(_owned)


def belongs_to_session(proc: psutil.Process) -> bool:
    """A registered process, or a descendant its nearest registered ancestor keeps."""
    import psutil

    if proc.pid in _owned:
        return True
    try:
        ancestors = proc.parents()
    except psutil.Error:
        return False
    for ancestor in ancestors:
        entry = _owned.get(ancestor.pid)
        if entry is not None:
            try:
                return entry.keeps is not None and entry.keeps(proc)
            except psutil.Error:
                return False
    return False
