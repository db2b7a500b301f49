"""Nothing a case started outlives it: every process tree killed through psutil, then what escaped
the trees (a helper in a rank's session or process group, or one that left both and re-parented,
found by the case token in its environment)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Mapping, Sequence

import psutil

from pytest_fsdp_turbo_contract.vocab import Env

CASE_TOKEN_VAR = Env.CASE_TOKEN


def _process_tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def kill_pid_tree(pid: int) -> None:
    """Kill a process we did not start (a forked rank) and everything it started."""
    for proc in reversed(_process_tree(pid)):
        with contextlib.suppress(psutil.Error):
            proc.kill()


def case_processes(token: str, sessions: Mapping[int, float]) -> list[psutil.Process]:
    """This user's processes a case started, wherever they went: in a rank's session or process
    group (`sessions`: each rank's pid, which names both, and when it started), or carrying the
    case's token in their environment (a helper that started a session of its own and re-parented).
    A session whose leader is alive but started at another time is another process's, which got
    a dead rank's pid: never touched; nor is anything that started before the ranks."""
    me, uid = os.getpid(), os.getuid()
    earliest = min(sessions.values(), default=0.0)
    found = []
    for proc in psutil.process_iter(["uids", "create_time"]):
        with contextlib.suppress(psutil.Error, OSError):
            if proc.pid == me or proc.info["uids"] is None or proc.info["uids"].real != uid:
                continue
            if proc.info["create_time"] < earliest - 1.0:
                continue
            pid = proc.pid
            leaders = {os.getsid(pid), os.getpgid(pid)} & set(sessions)
            in_a_rank = any(_still_the_rank(leader, sessions[leader]) for leader in leaders)
            if in_a_rank or proc.environ().get(CASE_TOKEN_VAR) == token:
                found.append(proc)
    return found


def _still_the_rank(pid: int, started: float) -> bool:
    """The session (group) leader `pid` is the rank itself, or gone: not a process that took
    the pid since."""
    try:
        return abs(psutil.Process(pid).create_time() - started) < 0.5
    except psutil.NoSuchProcess:
        return True


def process_create_time(pid: int) -> float:
    try:
        return psutil.Process(pid).create_time()
    except psutil.NoSuchProcess:
        return time.time()  # gone already: nothing of it to match later


def reap_case(token: str, sessions: Mapping[int, float], grace_s: float = 0.0) -> list[int]:
    """Kill what a case left behind; the pids killed (nothing, for a case that cleaned up). With
    `grace_s`, each is asked to end first (a trainer's Ray daemons and vLLM servers clean up their
    files on SIGTERM) and killed when it has not after that long."""
    found = left = case_processes(token, sessions)
    for signal_name in ("terminate", "kill") if grace_s > 0 else ("kill",):
        for proc in left:
            with contextlib.suppress(psutil.Error):
                getattr(proc, signal_name)()
        _, left = psutil.wait_procs(left, timeout=grace_s if signal_name == "terminate" else 5)
        if not left:
            break
    return [proc.pid for proc in found]


def kill_trees(children: Sequence[subprocess.Popen], grace_s: float = 0.0) -> None:
    """Kill each rank and everything it started; reap ranks through Popen to keep exit codes.
    With `grace_s`, the whole tree is asked to end first (SIGTERM) and given that long."""
    if grace_s > 0:
        tree = [p for child in children for p in _process_tree(child.pid)]
        for proc in tree:
            with contextlib.suppress(psutil.Error):
                proc.terminate()
        psutil.wait_procs(tree, timeout=grace_s)
    descendants = [p for child in children for p in _process_tree(child.pid)[1:]]
    for proc in descendants:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    for child in children:
        if child.poll() is None:
            child.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=5)
    psutil.wait_procs(descendants, timeout=5)
