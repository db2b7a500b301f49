"""The server loop the warm parent and each zygote run: fork on request, tell each conversation the
exits of its own processes, and (the parent) keep a zygote per preloaded stack."""

from __future__ import annotations

import contextlib
import importlib
import os
import select
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from pytest_fsdp_turbo_contract.lifetime import die_with_parent
from pytest_fsdp_turbo_contract.warm_protocol import (
    Exited,
    Fork,
    Forked,
    Message,
    MessageBuffer,
    Ready,
    ZygoteStarted,
    ZygoteStarting,
    encode,
    interpreter,
)
from pytest_fsdp_turbo_engine.rank_env import import_time_env
from pytest_fsdp_turbo_engine.warm.fork import PRELOAD_KINDS, PRELOADS, run_child
from pytest_fsdp_turbo_engine.warm.warm_up import fork_unsafe_reason


def zygote_main(conn: socket.socket, preload: str) -> None:
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
            zygote_main(theirs, preload)
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
        import_env = import_time_env()
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
                    run_child(request, self.inherited())
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
            for to in [None, *self.clients]:  # each waits on this loop while the zygote imports
                self.send(to, ZygoteStarting(preload))
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
