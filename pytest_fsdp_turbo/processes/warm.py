"""The launcher's side of warm ranks: one warm parent per pytest process (so one per xdist worker),
started on first use, that forks each case's rank processes (pytest_fsdp_turbo_engine/warm_parent.py). Every case still
gets fresh processes and a fresh process group; only the imports are shared. A process started
inside a pytest session (an inner pytest, `pytest-fsdp-turbo run`) forks from its ancestor's warm
parent through the socket advertised in PYTEST_FSDP_TURBO_WARM_SOCKET, when the imports fit it.

Where forking is unsafe (torch_npu installed, which torch imports with itself; a CUDA context; a
thread in the parent) or turned off (PYTEST_FSDP_TURBO_NO_FORK=1), ranks are spawned as fresh
interpreters instead, and the run's notes and the session header say why.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import queue
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from pytest_fsdp_turbo.processes.reaping import kill_pid_tree
from pytest_fsdp_turbo.processes.session_processes import disown, own, session_processes
from pytest_fsdp_turbo.settings import HarnessEnv
from pytest_fsdp_turbo_contract.lifetime import die_with_parent
from pytest_fsdp_turbo_contract.vocab import Env
from pytest_fsdp_turbo_contract.warm_protocol import (
    Exited,
    Fork,
    Forked,
    Message,
    Ready,
    ZygoteStarted,
    ZygoteStarting,
    decode_line,
    encode,
    interpreter,
)

WARM_MODULE = "pytest_fsdp_turbo_engine.warm_parent"
NO_FORK_VAR = Env.NO_FORK
SOCKET_VAR = Env.WARM_SOCKET
READY_TIMEOUT_S = 300.0  # the parent's start-up (its imports), or a zygote's: a hang guard
# a fork is answered in milliseconds: silence this long means stopped or stuck. While a zygote
# imports its stack (verl), the parent says so (ZygoteStarting) and answers nothing: that wait
# is start-up, held to READY_TIMEOUT_S from then
FORK_TIMEOUT_S = 60.0
SILENT_SOCKETS: set[str] = set()  # shared parents that once left a fork unanswered: not adopted
CONNECT_TIMEOUT_S = 5.0


def import_env() -> dict[str, str]:
    """The values the parent imports under: the user's where set, the harness's defaults else."""
    return HarnessEnv.read().import_env


def fork_unavailable_reason() -> str | None:
    """Known before starting anything (the header uses it); the parent checks again itself."""
    if HarnessEnv.read().no_fork:
        return f"{NO_FORK_VAR} is set"
    if sys.platform != "linux":
        return "not Linux"
    if importlib.util.find_spec("torch_npu") is not None:
        return "torch_npu is installed, and torch imports it (its runtime does not survive fork)"
    return None


class WarmParentSilent(RuntimeError):
    """The warm parent did not answer a fork (stopped, or stuck): ranks are spawned instead."""


class _Conversation:
    """Typed messages with a warm parent (pytest_fsdp_turbo_contract/warm_protocol.py): Fork out;
    Ready and Forked replies, Exited and ZygoteStarted news in, read by one thread."""

    pid: int
    log_path: Path
    silent = False  # it once left a fork unanswered: never asked again

    def _start_reading(self, lines) -> None:
        self.exits: dict[int, int] = {}
        self.zygotes: list[int] = []
        self._replies: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._waited_s = 0.0  # how long the last reply was waited for, at most
        self._exited = threading.Condition()
        self._ended = threading.Event()
        self._ready: Ready | None = None
        self._greeted = threading.Event()  # its Ready arrived, or it ended first
        threading.Thread(
            target=self._read, args=(lines,), daemon=True, name="fsdp-turbo-warm-parent"
        ).start()

    def _await_ready(self, what: str) -> Ready:
        self._greeted.wait(READY_TIMEOUT_S)
        if self._ready is None:
            raise RuntimeError(f"warm parent did not answer ({what}); see {self.log_path}")
        return self._ready

    def _read(self, lines) -> None:
        with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
            for line in lines:
                message = decode_line(line)
                if isinstance(message, Ready):
                    self._ready = message
                    self._greeted.set()
                elif isinstance(message, Exited):
                    with self._exited:
                        self.exits[message.pid] = message.code
                        self._exited.notify_all()
                elif isinstance(message, ZygoteStarted):  # lives as long as the parent
                    self.zygotes.append(message.pid)
                    own(message.pid, f"warm parent's zygote for {message.preload}")
                else:
                    self._replies.put(message)
        self._ended.set()
        self._greeted.set()
        with self._exited:
            self._exited.notify_all()
        self._replies.put(None)  # the parent ended, or the connection to it did

    def _reply(self, timeout_s: float, what: str) -> Message:
        """The next reply; a zygote starting on the way gives the wait READY_TIMEOUT_S from then."""
        started = time.monotonic()
        deadline = started + timeout_s
        while True:
            try:
                message = self._replies.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                message = None
            if not isinstance(message, ZygoteStarting):
                break
            deadline = time.monotonic() + READY_TIMEOUT_S
        self._waited_s = round(deadline - started, 1)
        if message is None:
            raise RuntimeError(f"warm parent did not answer ({what}); see {self.log_path}")
        return message

    def wait_exit(self, pid: int, timeout_s: float) -> int | None:
        """The exit code of `pid`, once the parent reports it; None at the timeout or when the
        parent is gone first."""
        with self._exited:
            self._exited.wait_for(
                lambda: pid in self.exits or self._ended.is_set(), timeout=timeout_s
            )
            return self.exits.get(pid)

    def _write(self, data: bytes) -> None:
        raise NotImplementedError

    def fork(
        self, rank: int, env: Mapping[str, str], spec: Path, log: Path, preload: str | None = None
    ) -> int:
        """A rank's pid; `preload` ("verl:cpu") forks it from a zygote that imported that stack."""
        request = Fork(dict(env), str(log), os.getcwd(), rank=rank, spec=str(spec), preload=preload)
        return self._request(request, f"fork rank {rank}")

    def _request(self, request: Fork, what: str) -> int:
        with self._lock:
            if self.silent:
                raise WarmParentSilent(f"the warm parent (pid {self.pid}) was given up earlier")
            self._write(encode(request))
            try:
                reply = self._reply(FORK_TIMEOUT_S, what)
            except RuntimeError:
                if not self.alive:
                    raise
                self.silent = True  # from now on not alive: the session starts or spawns anew
                if getattr(self, "path", None):
                    SILENT_SOCKETS.add(self.path)
                self.close()
                raise WarmParentSilent(
                    f"the warm parent (pid {self.pid}) did not answer within "
                    f"{self._waited_s:g}s ({what}; stopped?); its log: {self.log_path}"
                ) from None
        if not isinstance(reply, Forked):
            raise RuntimeError(f"warm parent answered {reply} to {what}; see {self.log_path}")
        return reply.pid

    def run_module(
        self, module: str, argv: Sequence[str], env: Mapping[str, str], timeout_s: float
    ) -> subprocess.CompletedProcess:
        """`python -m module argv...` forked from this parent: its imports are already paid."""
        with tempfile.TemporaryDirectory(prefix="fsdp-turbo-run-") as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            request = Fork(
                dict(env), str(err), os.getcwd(), module=module, argv=list(argv), stdout=str(out)
            )
            pid = self._request(request, f"run {module}")
            code = self.wait_exit(pid, timeout_s)
            if code is None and not self.alive:
                raise RuntimeError(f"warm parent died while running {module}")
            if code is None:
                kill_pid_tree(pid)
                raise subprocess.TimeoutExpired([module, *argv], timeout_s)
            return subprocess.CompletedProcess(
                [module, *argv],
                code,
                out.read_text(errors="replace"),
                err.read_text(errors="replace"),
            )

    @property
    def alive(self) -> bool:
        return not self.silent and not self._ended.is_set()

    @property
    def exit_code(self) -> int | None:
        return None


class WarmParent(_Conversation):
    """A warm parent this process started; it also listens on `socket_path` for descendants.
    `wait=False` returns at once: the parent imports in the background (it listens already), and
    what its Ready line says is awaited when first asked for."""

    def __init__(self, log_path: Path, socket_path: Path | None = None, wait: bool = True):
        env = {**os.environ, **import_env()}
        self.log_path = log_path
        self._log = open(log_path, "ab")  # noqa: SIM115 - lives as long as the parent
        listen = ["--listen", str(socket_path)] if socket_path else []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", WARM_MODULE, *listen],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=env,
            preexec_fn=die_with_parent,
        )
        self.pid = self.proc.pid
        self._socket_path = str(socket_path) if socket_path else None
        self._start_reading(self.proc.stdout)
        if wait:
            self._await_ready("start")

    @property
    def fork_safe(self) -> bool:
        return self._await_ready("start").fork_safe

    @property
    def reason(self) -> str | None:
        return self._await_ready("start").reason

    @property
    def socket(self) -> str | None:
        """Where descendants connect: the path asked for until its Ready line says otherwise
        (none, when forking turned out unsafe)."""
        return self._ready.socket if self._ready is not None else self._socket_path

    def _write(self, data: bytes) -> None:
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    @property
    def alive(self) -> bool:
        return not self.silent and self.proc.poll() is None

    @property
    def exit_code(self) -> int | None:
        return self.proc.poll()

    def close(self) -> None:
        for pid in [self.proc.pid, *self.zygotes]:
            disown(pid)  # a pid the system may hand to another process from now on
        with contextlib.suppress(OSError):
            self.proc.kill()
        self.proc.wait()
        self._log.close()


class SharedWarmParent(_Conversation):
    """The warm parent of an ancestor process (an outer pytest session), reached through the
    socket it names in PYTEST_FSDP_TURBO_WARM_SOCKET. Its imports are already paid; the ranks it
    forks for this process are killed when this process disconnects or dies."""

    def __init__(self, socket_path: str):
        self.path = socket_path
        self.log_path = Path(socket_path).with_suffix(".log")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(CONNECT_TIMEOUT_S)
        try:
            self._sock.connect(socket_path)
        except OSError:
            self._sock.close()
            raise
        self._sock.settimeout(None)
        self._start_reading(self._sock.makefile("rb"))
        hello = self._await_ready("connect")
        self.pid, self.fork_safe, self.reason = hello.pid or 0, hello.fork_safe, hello.reason
        self.socket = socket_path
        self.fits = hello.interpreter == interpreter() and hello.import_env == import_env()

    def _write(self, data: bytes) -> None:
        self._sock.sendall(data)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()


def _shared_parent() -> SharedWarmParent | None:
    """An ancestor's warm parent this process may fork from, if one is advertised and fits."""
    path = HarnessEnv.read().warm_socket
    if not path or path in SILENT_SOCKETS:
        return None
    try:
        parent = SharedWarmParent(path)
    except (OSError, RuntimeError, KeyError, ValueError):
        return None  # gone (a stale path) or not answering: this process starts its own
    if parent.fits and parent.fork_safe:
        return parent
    parent.close()
    return None


def _adopt_shared_parent() -> SharedWarmParent | None:
    """The ancestor's warm parent, kept as this process's own from now on, if there is one."""
    shared = _shared_parent() if fork_unavailable_reason() is None else None
    if shared is not None:
        session_processes().warm = shared
    return shared


def run_module(
    module: str, argv: Sequence[str], *, timeout_s: float, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess:
    """`python -m module argv...` (stdout and stderr captured, never raising on its exit code):
    forked from the warm parent this process already has, its own or an ancestor's, so torch and
    transformers are not imported again; in a fresh interpreter when there is none."""
    env = {**os.environ, **(env or {})}
    processes = session_processes()
    parent = processes.warm
    if parent is not None and not parent.alive and processes.warm_log_dir is not None:
        parent, _ = warm_parent(processes.warm_log_dir)  # it died (a fault test): a new one
    if parent is None:
        parent = _adopt_shared_parent()
    if parent is not None and parent.alive:
        with contextlib.suppress(WarmParentSilent):  # given up: a fresh interpreter below
            return parent.run_module(module, argv, env, timeout_s)
    return subprocess.run(
        [sys.executable, "-m", module, *argv],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
        check=False,
    )


def warm_parent(log_dir: Path) -> tuple[_Conversation | None, str | None]:
    """This process's warm parent (an ancestor's, or one started on first use), or (None, why ranks
    must be spawned). One this process starts is advertised to its descendants."""
    me, processes = os.getpid(), session_processes()
    processes.warm_log_dir = log_dir
    if processes.warm_refusal is not None:
        return None, processes.warm_refusal
    parent = processes.warm
    if parent is not None:
        if parent.alive:
            return parent, None
        parent.close()  # died (a case reported it); a new one takes its place
        processes.warm = None
    shared = _adopt_shared_parent()
    if shared is not None:
        return shared, None
    reason = fork_unavailable_reason()
    if reason is None:
        log_dir.mkdir(parents=True, exist_ok=True)
        try:
            parent = WarmParent(
                log_dir / f"warm-parent-{me}.log", log_dir / f"warm-parent-{me}.sock"
            )
        except (OSError, RuntimeError) as exc:
            reason = f"warm parent failed to start: {exc}"
        else:
            if parent.fork_safe:
                processes.warm = parent
                own(parent.proc.pid, "warm parent")  # its forked ranks stay the test's
                if parent.socket:
                    os.environ[SOCKET_VAR] = parent.socket
                return parent, None
            reason = f"fork is unsafe in the warm parent: {parent.reason}"
            parent.close()
    processes.warm_refusal = reason
    return None, reason
