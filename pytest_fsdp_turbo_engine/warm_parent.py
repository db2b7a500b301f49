"""The warm parent: imports torch, torch.distributed, transformers and the engine once, then forks
fresh rank processes on request, so a case costs its compute rather than its imports.

  python -m pytest_fsdp_turbo_engine.warm_parent      (started by pytest_fsdp_turbo.launching.warm)

It never runs a case itself, creates no device context and starts no threads, so every forked rank
begins from the same clean state: no process group, no model, no RNG draws, no module a previous
case imported. At start it runs one CPU step of each tiny model family (no process group, RNG
state put back) so first-call set-up is paid once, here.

Protocol (pytest_fsdp_turbo_contract/warm_protocol.py): typed messages, one JSON line each. The
launcher writes Fork on stdin and reads Forked back; the parent reports Exited when a process it
started ends (as subprocess does: negative for a signal). Its first line is Ready. It dies with
the process that started it, and its ranks die with it. A zygote (a fork that imported one more
stack) serves the parent with the same server loop and the same messages.

With --listen PATH it also serves the same conversation on a unix socket, so the launcher's
descendants (an inner pytest session, a `pytest-fsdp-turbo run`) fork from it instead of paying the
imports again. Each socket client is greeted with the ready line (plus the interpreter and import
environment, so it can tell whether the imports fit it), hears only of its own ranks' exits, and
takes them down with it when it disconnects.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import select
import signal
import socket
import sys
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from pytest_fsdp_turbo_contract.lifetime import die_with_parent
from pytest_fsdp_turbo_contract.warm_protocol import (
    IMPORT_TIME_ENV,
    Exited,
    Fork,
    Forked,
    Message,
    MessageBuffer,
    Ready,
    ZygoteStarted,
    encode,
    interpreter,
)


def _warm_up() -> None:
    """Everything a rank imports before its first phase, except device runtimes: torch, FSDP2,
    transformers, the engine, and the modeling modules of the tiny model families."""
    import importlib

    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import transformers  # noqa: F401
    from pytest_fsdp_turbo_fixtures import DATA_DIR
    from transformers import (  # noqa: F401
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoTokenizer,  # noqa: F401
    )

    from pytest_fsdp_turbo_engine import worker  # noqa: F401
    from pytest_fsdp_turbo_engine.step import run  # noqa: F401

    for spec in sorted((DATA_DIR / "models").glob("*.json")):
        family = json.loads(spec.read_text())["model_type"].removesuffix("_text")
        with contextlib.suppress(ImportError):  # an older transformers lacks it: ranks import it
            importlib.import_module(f"transformers.models.{family}.modeling_{family}")


def _exercise() -> None:
    """One forward, backward and AdamW step of each tiny model family, built from its spec on the
    CPU, with no process group and no device: the lazy imports and first-call set-up of
    transformers, autograd and the optimizer are then paid here once, not in every rank (about
    0.2 s a rank). Nothing of it survives but warm code paths: the models are dropped and the RNG
    state is put back, so a rank's seeded draws are what they would have been."""
    import torch
    from pytest_fsdp_turbo_fixtures import DATA_DIR

    from pytest_fsdp_turbo_engine.engines.hf_model import from_config
    from pytest_fsdp_turbo_engine.tiny_models import tiny_config

    rng = torch.random.get_rng_state()
    try:
        for spec_path in sorted((DATA_DIR / "models").glob("*.json")):
            spec = json.loads(spec_path.read_text())
            model = from_config(tiny_config(spec, vocab_size=64), dtype=torch.float32)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            model(input_ids=torch.randint(0, 64, (2, 8))).logits.float().sum().backward()
            torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0, foreach=False)
            optimizer.step()
            del model, optimizer
    except Exception as exc:  # noqa: BLE001 - a warm-up is an optimisation, never a failure
        sys.stderr.write(f"warm parent: warm-up step skipped: {type(exc).__name__}: {exc}\n")
    finally:
        torch.random.set_rng_state(rng)


def fork_unsafe_reason() -> str | None:
    """Why forking ranks from this process would be unsafe, or None."""
    import torch

    if "torch_npu" in sys.modules:
        return "torch_npu is imported (its runtime does not survive fork)"
    if torch.cuda.is_initialized():
        return "a CUDA context exists"
    if threading.active_count() > 1:
        return f"{threading.active_count()} threads are running"
    return None


def _child(request: Fork, inherited: list[int]) -> None:
    """In the forked rank, which never returns into the parent's server code: whatever fails,
    even before the worker's own error handling is set up, ends this process with exit 1 and the
    cause on its stderr (its log, once opened)."""
    code = 1
    try:
        code = _rank(request, inherited)
    except BaseException as exc:  # noqa: BLE001 - reported, then this process ends
        with contextlib.suppress(Exception):
            os.write(
                2, f"warm fork: setting up the rank failed: {type(exc).__name__}: {exc}\n".encode()
            )
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _rank(request: Fork, inherited: list[int]) -> int:
    """Its own session, log, environment, folder and thread count, then the worker. The parent's
    sockets are closed first, so a client sees EOF when the parent dies."""
    for fd in inherited:
        with contextlib.suppress(OSError):
            os.close(fd)
    os.setsid()
    die_with_parent()
    log = os.open(request.log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    out = request.stdout
    os.dup2(os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600) if out else log, 1)
    os.dup2(log, 2)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    env = request.env
    os.environ.clear()
    os.environ.update(env)
    if request.cwd:
        os.chdir(request.cwd)
    for entry in reversed([p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    import torch

    threads = env.get("OMP_NUM_THREADS", "1").split(",")[0]  # "4,2": nested levels, 4 here
    if not (threads.isdigit() and int(threads) > 0):
        raise ValueError(f"OMP_NUM_THREADS: expected a positive integer; got {threads!r}")
    torch.set_num_threads(int(threads))
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    if request.module is not None:
        return _run_module(request.module, request.argv)
    from pytest_fsdp_turbo_engine import worker

    preloaded = sorted({name.partition(".")[0] for name in sys.modules} & set(PRELOADS))
    print(f"[warm fork] stacks already imported: {', '.join(preloaded) or 'none'}")
    return worker.main([str(request.spec)])


def _run_module(module: str, argv: list[str]) -> int:
    """`python -m module argv...` in the forked child: a helper (tiny-model builder, inspection)
    that needs torch and transformers, which this process has already imported."""
    import runpy
    import traceback

    sys.argv = [module, *argv]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    except BaseException:  # noqa: BLE001 - reported as a subprocess would: traceback, exit 1
        traceback.print_exc()
        return 1
    return 0


# Stacks a rank would import itself, which depend on the device kind at import time (verl resolves
# and caches its platform while importing). A zygote per (stack, kind) imports one, then forks the
# ranks that need it. CPU only: importing verl elsewhere probes CUDA/NPU, and a process that did
# must not fork.
PRELOADS = {"verl": "pytest_fsdp_turbo_engine.engines.verl_adapter:preload"}
PRELOAD_KINDS = ("cpu",)


def _zygote_main(conn: socket.socket, preload: str) -> None:
    """In the zygote: import the stack, say whether forking stays safe, then serve the parent as
    the parent serves its launcher (the same loop: fork on request, report exits)."""
    die_with_parent()
    os.dup2(2, 1)  # stdout is the launcher's conversation: what an import prints goes to the log
    name, kind = preload.split(":")
    reason = None
    try:
        module, function = PRELOADS[name].split(":")
        getattr(importlib.import_module(module), function)(kind)
        reason = fork_unsafe_reason()
    except BaseException as exc:  # noqa: BLE001 - any failure means: fork from the parent instead
        reason = f"{type(exc).__name__}: {exc}"
    ready = Ready(fork_safe=reason is None, reason=reason)
    conn.sendall(encode(ready))
    if reason is not None:
        os._exit(1)
    Server(ready, Channel(conn.fileno(), conn.sendall, socket=True), makes_zygotes=False).serve()
    os._exit(0)  # the parent went away (its ranks go with it: parent-death signal)


def _reaped() -> list[tuple[int, int]]:
    ended = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return ended
        if pid == 0:
            return ended
        ended.append((pid, os.waitstatus_to_exitcode(status)))


class Channel:
    """The conversation a server answers first: the launcher's stdin and stdout for the parent,
    the socket pair to the parent for a zygote. EOF on it ends the server."""

    def __init__(self, read_fd: int, write: Callable[[bytes], Any], socket: bool = False):
        self.read_fd, self.write, self.socket = read_fd, write, socket


class Zygote:
    """The parent's side of one zygote: its socket and what it said."""

    def __init__(self, preload: str, inherited: list[int]):
        ours, theirs = socket.socketpair()
        self.pid = os.fork()
        if self.pid == 0:
            for fd in [*inherited, ours.fileno()]:
                with contextlib.suppress(OSError):
                    os.close(fd)
            _zygote_main(theirs, preload)
        theirs.close()
        self.conn, self.buffer = ours, MessageBuffer()
        self.heard: list[Message] = []
        ready = self.next_message()
        self.reason = (
            None
            if isinstance(ready, Ready) and ready.fork_safe
            else getattr(ready, "reason", None) or "died"
        )
        self.exits: list[Exited] = []  # read while waiting for a reply; the server routes them

    def next_message(self) -> Message | None:
        while not self.heard:
            chunk = self.conn.recv(1 << 16)
            if not chunk:
                return None
            self.heard += self.buffer.feed(chunk)
        return self.heard.pop(0)

    def fork(self, request: Fork) -> int | None:
        self.conn.sendall(encode(request))
        while (message := self.next_message()) is not None:
            if isinstance(message, Exited):
                self.exits.append(message)
            elif isinstance(message, Forked):
                return message.pid
        return None


class Server:
    """Forks what its conversations ask for and tells each the exits of its own processes: the
    home channel (key None) and socket clients (their fd); the parent also runs a zygote per
    preloaded stack and forwards those ranks' requests and exits."""

    def __init__(
        self,
        ready: Ready,
        home: Channel,
        listener: socket.socket | None = None,
        makes_zygotes: bool = True,
    ):
        self.ready, self.home, self.listener = ready, home, listener
        self.makes_zygotes = makes_zygotes
        self.clients: dict[int, socket.socket] = {}
        self.buffers: dict[int | None, MessageBuffer] = {None: MessageBuffer()}
        self.owner: dict[int, int | None] = {}  # pid -> who asked for it
        self.zygotes: dict[str, Zygote | None] = {}  # None: that preload failed, fork here
        self.via: dict[int, Zygote] = {}  # rank pid -> the zygote that forked it

    def send(self, to: int | None, message: Message) -> None:
        if to is None:
            self.home.write(encode(message))
        elif to in self.clients:
            try:
                self.clients[to].sendall(encode(message))
            except OSError:
                self.drop(to)

    def serve(self) -> None:
        """Until the home channel ends. Exits are reaped at least every 50 ms."""
        while True:
            zygotes = {z.conn.fileno(): z for z in self.zygotes.values() if z is not None}
            watched: list[Any] = [self.home.read_fd, *self.clients, *zygotes]
            watched += [self.listener] if self.listener else []
            ready, _, _ = select.select(watched, [], [], 0.05)
            self.reap()
            for item in ready:
                if item is self.listener:
                    self.accept()
                elif item in zygotes:
                    self.hear_zygote(zygotes[item])
                elif item == self.home.read_fd:
                    chunk = _read(item)
                    if not chunk:
                        return
                    self.receive(None, chunk)
                elif chunk := _read(item):
                    self.receive(item, chunk)
                else:
                    self.drop(item)

    def accept(self) -> None:
        conn, _ = self.listener.accept()
        conn.setblocking(True)
        self.clients[conn.fileno()] = conn
        self.buffers[conn.fileno()] = MessageBuffer()
        import_env = {k: os.environ.get(k) for k in IMPORT_TIME_ENV}
        hello = replace(
            self.ready, pid=os.getpid(), interpreter=interpreter(), import_env=import_env
        )
        self.send(conn.fileno(), hello)

    def drop(self, fd: int) -> None:
        """A client went away: its ranks go with it, as they would with their own parent."""
        conn = self.clients.pop(fd, None)
        self.buffers.pop(fd, None)
        if conn is not None:
            conn.close()
        for pid, owner in list(self.owner.items()):
            if owner == fd:
                del self.owner[pid]
                with contextlib.suppress(OSError):
                    os.killpg(pid, signal.SIGKILL)

    def reap(self) -> None:
        for pid, code in _reaped():  # a zygote's own exit is no one's: not in owner
            if pid in self.owner:
                self.send(self.owner.pop(pid), Exited(pid, code))

    def receive(self, source: int | None, chunk: bytes) -> None:
        for request in self.buffers[source].feed(chunk):
            if source is not None and source not in self.clients:
                return  # dropped while answering an earlier request: nothing more for it
            if not isinstance(request, Fork):
                continue  # only forks are asked of a server
            pid = self.fork_in_zygote(request)
            if pid is None:
                pid = os.fork()
                if pid == 0:
                    _child(request, self.inherited())
            self.owner[pid] = source
            self.send(source, Forked(pid, request.rank))

    def inherited(self) -> list[int]:
        """Descriptors a forked process must close: every conversation's but its own."""
        fds = [c.fileno() for c in self.clients.values()]
        fds += [z.conn.fileno() for z in self.zygotes.values() if z is not None]
        fds += [self.home.read_fd] if self.home.socket else []
        return fds + ([self.listener.fileno()] if self.listener is not None else [])

    def fork_in_zygote(self, request: Fork) -> int | None:
        preload = request.preload
        if not self.makes_zygotes or not preload or preload.split(":")[-1] not in PRELOAD_KINDS:
            return None
        if preload not in self.zygotes:
            zygote = Zygote(preload, self.inherited())
            if zygote.reason is not None:
                sys.stderr.write(f"warm parent: no zygote for {preload}: {zygote.reason}\n")
                zygote.conn.close()
                zygote = None
            self.zygotes[preload] = zygote
            if zygote is not None:  # a process of the session: the launcher registers it
                self.send(None, ZygoteStarted(zygote.pid, preload))
        zygote = self.zygotes[preload]
        pid = zygote.fork(request) if zygote is not None else None
        if zygote is not None:
            self.route_exits(zygote)
            if pid is None:  # it died: later requests fork here
                self.zygotes[preload] = None
            else:
                self.via[pid] = zygote
        return pid

    def route_exits(self, zygote: Zygote) -> None:
        for message in zygote.exits:
            self.via.pop(message.pid, None)
            if message.pid in self.owner:
                self.send(self.owner.pop(message.pid), message)
        zygote.exits.clear()

    def hear_zygote(self, zygote: Zygote) -> None:
        chunk = _read(zygote.conn.fileno())
        if not chunk:  # it died; its ranks died with it and their clients see them gone
            for key, known in list(self.zygotes.items()):
                if known is zygote:
                    self.zygotes[key] = None
            zygote.conn.close()
            for pid in [pid for pid, via in self.via.items() if via is zygote]:
                del self.via[pid]
                with contextlib.suppress(OSError):
                    os.killpg(pid, signal.SIGKILL)  # their parent-death signal, made sure of
                if pid in self.owner:
                    self.send(self.owner.pop(pid), Exited(pid, -signal.SIGKILL))
            return
        # only exits come unasked
        zygote.exits += [m for m in zygote.buffer.feed(chunk) if isinstance(m, Exited)]
        self.route_exits(zygote)


def _read(fd: int) -> bytes:
    """What arrived on a conversation; b"" when it ended (or broke)."""
    try:
        return os.read(fd, 1 << 16)
    except OSError:
        return b""


def _listen(path: str) -> socket.socket | None:
    """A socket only this user can reach (it lives in the launcher's private state folder); None
    when it cannot be made (a path too long for AF_UNIX): descendants then start their own."""
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        os.chmod(path, 0o600)
        listener.listen(16)
        return listener
    except OSError:
        return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    die_with_parent()
    # listening before the imports: a descendant that connects meanwhile waits for the greeting
    # instead of finding no socket and paying the imports in a parent of its own
    listener = _listen(argv[1]) if argv[:1] == ["--listen"] else None
    _warm_up()
    _exercise()
    reason = fork_unsafe_reason()
    if reason is not None and listener is not None:  # clients waiting see the socket close
        listener.close()
        with contextlib.suppress(OSError):
            os.unlink(argv[1])
        listener = None
    ready = Ready(
        fork_safe=reason is None,
        reason=reason,
        socket=argv[1] if listener else None,
    )
    launcher = Channel(sys.stdin.fileno(), lambda data: os.write(sys.stdout.fileno(), data))
    server = Server(ready, launcher, listener)
    server.send(None, ready)
    try:
        server.serve()  # until the launcher goes away
        return 0
    finally:
        if listener is not None:
            with contextlib.suppress(OSError):
                os.unlink(argv[1])


if __name__ == "__main__":
    raise SystemExit(main())
