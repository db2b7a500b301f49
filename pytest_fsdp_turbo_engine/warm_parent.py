"""The warm parent: imports torch, torch.distributed, transformers and the engine once, then forks
fresh rank processes on request, so a case costs its compute rather than its imports.

  python -m pytest_fsdp_turbo_engine.warm_parent      (started by pytest_fsdp_turbo.processes.warm)

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
import os
import socket
import sys

from pytest_fsdp_turbo_contract.lifetime import die_with_parent
from pytest_fsdp_turbo_contract.warm_protocol import Ready
from pytest_fsdp_turbo_engine.warm.server import Channel, Server
from pytest_fsdp_turbo_engine.warm.warm_up import exercise, fork_unsafe_reason, warm_up


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
    warm_up()
    exercise()
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
