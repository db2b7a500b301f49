"""The launcher's side of warm ranks: one warm parent per pytest process (so one per xdist worker),
started on first use, that forks each case's rank processes (engine/warm_parent.py). Every case still
gets fresh processes and a fresh process group; only the imports are shared.

Where forking is unsafe (torch_npu installed, which torch imports with itself; a CUDA context; a
thread in the parent) or turned off (PYTEST_FSDP_TURBO_NO_FORK=1), ranks are spawned as fresh
interpreters instead, and the run's notes and the session header say why.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import json
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path

from pytest_fsdp_turbo.launch import die_with_parent
from pytest_fsdp_turbo.session_processes import disown, own
from pytest_fsdp_turbo.vocab import Env

WARM_MODULE = "pytest_fsdp_turbo_engine.warm_parent"
NO_FORK_VAR = Env.NO_FORK
READY_TIMEOUT_S = 300.0
FORK_TIMEOUT_S = 60.0
# Read once at import by transformers / huggingface_hub, so they must be set before the parent
# imports them (the rank would set them too late, after the fork).
IMPORT_TIME_ENV = {
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "TOKENIZERS_PARALLELISM": "false",
}


def fork_unavailable_reason() -> str | None:
    """Known before starting anything (the header uses it); the parent checks again itself."""
    if os.environ.get(NO_FORK_VAR, "") not in ("", "0"):
        return f"{NO_FORK_VAR} is set"
    if sys.platform != "linux":
        return "not Linux"
    if importlib.util.find_spec("torch_npu") is not None:
        return "torch_npu is installed, and torch imports it (its runtime does not survive fork)"
    return None


class WarmParent:
    def __init__(self, log_path: Path):
        env = {**os.environ, **{k: os.environ.get(k, v) for k, v in IMPORT_TIME_ENV.items()}}
        self.log_path = log_path
        self._log = open(log_path, "ab")  # noqa: SIM115 - lives as long as the parent
        self.proc = subprocess.Popen(
            [sys.executable, "-m", WARM_MODULE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=env,
            preexec_fn=die_with_parent,
        )
        self.exits: dict[int, int] = {}
        self._replies: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True, name="fsdp-turbo-warm-parent").start()
        ready = self._reply(READY_TIMEOUT_S, "start")
        self.fork_safe, self.reason = ready["fork_safe"], ready["reason"]
        self.import_s = ready["import_s"]

    def _read(self) -> None:
        for line in self.proc.stdout:
            message = json.loads(line)
            if "exit" in message:
                self.exits[message["exit"]] = message["code"]
            else:
                self._replies.put(message)
        self._replies.put(None)  # the parent ended

    def _reply(self, timeout_s: float, what: str) -> dict:
        try:
            message = self._replies.get(timeout=timeout_s)
        except queue.Empty:
            message = None
        if message is None:
            raise RuntimeError(f"warm parent did not answer ({what}); see {self._log.name}")
        return message

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def fork(self, rank: int, env: Mapping[str, str], spec: Path, log: Path) -> int:
        request = {"rank": rank, "env": dict(env), "spec": str(spec), "log": str(log)}
        with self._lock:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
            return self._reply(FORK_TIMEOUT_S, f"fork rank {rank}")["pid"]

    def close(self) -> None:
        disown(self.proc.pid)  # a pid the system may hand to another process from now on
        with contextlib.suppress(OSError):
            self.proc.kill()
        self.proc.wait()
        self._log.close()


_parents: dict[int, WarmParent] = {}  # by pid: a forked or xdist-spawned process starts its own
_refusals: dict[int, str] = {}


def warm_parent(log_dir: Path) -> tuple[WarmParent | None, str | None]:
    """This process's warm parent (started on first use), or (None, why ranks must be spawned)."""
    me = os.getpid()
    if me in _refusals:
        return None, _refusals[me]
    parent = _parents.get(me)
    if parent is not None:
        if parent.alive:
            return parent, None
        parent.close()  # died (a case reported it); a new one takes its place
    reason = fork_unavailable_reason()
    if reason is None:
        log_dir.mkdir(parents=True, exist_ok=True)
        try:
            parent = WarmParent(log_dir / f"warm-parent-{me}.log")
        except (OSError, RuntimeError) as exc:
            reason = f"warm parent failed to start: {exc}"
        else:
            if parent.fork_safe:
                _parents[me] = parent
                own(parent.proc.pid, "warm parent")  # its forked ranks stay the test's
                atexit.register(parent.close)
                return parent, None
            reason = f"fork is unsafe in the warm parent: {parent.reason}"
            parent.close()
    _refusals[me] = reason
    return None, reason
