"""The warm parent: imports torch, torch.distributed, transformers and the engine once, then forks
fresh rank processes on request, so a case costs its compute rather than its imports.

  python -m pytest_fsdp_turbo_engine.warm_parent      (started by pytest_fsdp_turbo.launching.warm)

It never runs a case itself, creates no device context and starts no threads, so every forked rank
begins from the same clean state: no process group, no model, no RNG draws, no module a previous
case imported. At start it runs one CPU step of each tiny model family (no process group, RNG
state put back) so first-call set-up is paid once, here.

Protocol, one JSON object per line: the launcher writes {"rank", "env", "spec", "log", "cwd"} on
stdin and reads {"pid"} back; the parent reports {"exit": pid, "code": c} when a rank ends (as
subprocess does: negative for a signal). The first line it writes is {"ready", "fork_safe",
"reason", "import_s", "socket"}. It dies with the process that started it, and its ranks die with it.

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
import time

from pytest_fsdp_turbo_contract.lifetime import die_with_parent
from pytest_fsdp_turbo_contract.warm_protocol import (
    IMPORT_TIME_ENV,
    decode,
    decode_line,
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

    from pytest_fsdp_turbo_engine import step, worker  # noqa: F401

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

    from pytest_fsdp_turbo_engine.hf_model import from_config
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


def _child(request: dict, inherited: list[int]) -> None:
    """In the forked rank: its own session, log, environment, folder and thread count, then the
    worker. The parent's sockets are closed first, so a client sees EOF when the parent dies."""
    for fd in inherited:
        with contextlib.suppress(OSError):
            os.close(fd)
    os.setsid()
    die_with_parent()
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    out = request.get("stdout")
    os.dup2(os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600) if out else log, 1)
    os.dup2(log, 2)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    env = request["env"]
    os.environ.clear()
    os.environ.update(env)
    if request.get("cwd"):
        os.chdir(request["cwd"])
    for entry in reversed([p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    import torch

    torch.set_num_threads(max(1, int(env.get("OMP_NUM_THREADS", "1"))))
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    code = 1
    try:
        if "module" in request:
            code = _run_module(request["module"], request["argv"])
        else:
            from pytest_fsdp_turbo_engine import worker

            preloaded = sorted({name.partition(".")[0] for name in sys.modules} & set(PRELOADS))
            print(f"[warm fork] stacks already imported: {', '.join(preloaded) or 'none'}")
            code = worker.main([request["spec"]])
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


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
PRELOADS = {"verl": "pytest_fsdp_turbo_engine.verl_adapter:preload"}
PRELOAD_KINDS = ("cpu",)


def _zygote_main(conn: socket.socket, preload: str) -> None:
    """In the zygote: import the stack, say whether forking stays safe, then fork ranks on request
    and report their exits, exactly like the parent does."""
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
    conn.sendall(encode({"ready": reason is None, "reason": reason}))
    if reason is not None:
        os._exit(1)
    pending = b""
    while True:
        ready, _, _ = select.select([conn], [], [], 0.05)
        for pid, code in _reaped():
            conn.sendall(encode({"exit": pid, "code": code}))
        if not ready:
            continue
        chunk = conn.recv(1 << 16)
        if not chunk:  # the parent went away (its ranks go with it: parent-death signal)
            os._exit(0)
        requests, pending = decode(pending + chunk)
        for request in requests:
            pid = os.fork()
            if pid == 0:
                _child(request, [conn.fileno()])
            conn.sendall(encode({"pid": pid}))


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


class Zygote:
    """The parent's side of one zygote: a socket pair and a line buffer."""

    def __init__(self, preload: str, inherited: list[int]):
        ours, theirs = socket.socketpair()
        self.pid = os.fork()
        if self.pid == 0:
            for fd in [*inherited, ours.fileno()]:
                with contextlib.suppress(OSError):
                    os.close(fd)
            _zygote_main(theirs, preload)
        theirs.close()
        self.conn, self.pending = ours, b""
        ready = self.next_message()
        self.reason = None if ready and ready.get("ready") else (ready or {}).get("reason", "died")
        self.exits: list[dict] = []  # read while waiting for a reply; the server routes them

    def next_message(self) -> dict | None:
        while b"\n" not in self.pending:
            chunk = self.conn.recv(1 << 16)
            if not chunk:
                return None
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return decode_line(line)

    def fork(self, request: dict) -> int | None:
        self.conn.sendall(encode(request))
        while (message := self.next_message()) is not None:
            if "exit" in message:
                self.exits.append(message)
            else:
                return message["pid"]
        return None


class Server:
    """The conversations: the launcher on stdin/stdout (key None) and socket clients (their fd)."""

    def __init__(self, ready: dict, listener: socket.socket | None):
        self.ready, self.listener = ready, listener
        self.clients: dict[int, socket.socket] = {}
        self.pending: dict[int | None, bytes] = {None: b""}
        self.owner: dict[int, int | None] = {}  # rank pid -> who asked for it
        self.zygotes: dict[str, Zygote | None] = {}  # None: that preload failed, fork here
        self.via: dict[int, Zygote] = {}  # rank pid -> the zygote that forked it

    def send(self, to: int | None, message: dict) -> None:
        if to is None:
            os.write(sys.stdout.fileno(), encode(message))
        elif to in self.clients:
            try:
                self.clients[to].sendall(encode(message))
            except OSError:
                self.drop(to)

    def accept(self) -> None:
        conn, _ = self.listener.accept()
        conn.setblocking(True)
        self.clients[conn.fileno()] = conn
        self.pending[conn.fileno()] = b""
        hello = {
            **self.ready,
            "pid": os.getpid(),
            "interpreter": interpreter(),
            "import_env": {k: os.environ.get(k) for k in IMPORT_TIME_ENV},
        }
        self.send(conn.fileno(), hello)

    def drop(self, fd: int) -> None:
        """A client went away: its ranks go with it, as they would with their own parent."""
        conn = self.clients.pop(fd, None)
        self.pending.pop(fd, None)
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
                self.send(self.owner.pop(pid), {"exit": pid, "code": code})

    def receive(self, source: int | None, chunk: bytes) -> None:
        requests, self.pending[source] = decode(self.pending[source] + chunk)
        for request in requests:
            if source is not None and source not in self.clients:
                return  # dropped while answering an earlier request: nothing more for it
            pid = self.fork_in_zygote(request)
            if pid is None:
                pid = os.fork()
                if pid == 0:
                    _child(request, self.inherited())
            self.owner[pid] = source
            self.send(source, {"pid": pid, "rank": request.get("rank")})

    def inherited(self) -> list[int]:
        """Descriptors a forked process must close: every conversation's but its own."""
        fds = [c.fileno() for c in self.clients.values()]
        fds += [z.conn.fileno() for z in self.zygotes.values() if z is not None]
        return fds + ([self.listener.fileno()] if self.listener is not None else [])

    def fork_in_zygote(self, request: dict) -> int | None:
        preload = request.get("preload")
        if not preload or preload.split(":")[-1] not in PRELOAD_KINDS:
            return None
        if preload not in self.zygotes:
            zygote = Zygote(preload, self.inherited())
            if zygote.reason is not None:
                sys.stderr.write(f"warm parent: no zygote for {preload}: {zygote.reason}\n")
                zygote.conn.close()
                zygote = None
            self.zygotes[preload] = zygote
            if zygote is not None:  # a process of the session: the launcher registers it
                self.send(None, {"zygote": zygote.pid, "preload": preload})
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
            self.via.pop(message["exit"], None)
            if message["exit"] in self.owner:
                self.send(self.owner.pop(message["exit"]), message)
        zygote.exits.clear()

    def serve(self) -> int:
        stdin = sys.stdin.fileno()
        while True:
            zygotes = {z.conn.fileno(): z for z in self.zygotes.values() if z is not None}
            watched = [stdin, *self.clients, *zygotes]
            watched += [self.listener] if self.listener else []
            ready, _, _ = select.select(watched, [], [], 0.05)
            self.reap()
            for item in ready:
                if item is self.listener:
                    self.accept()
                    continue
                if item in zygotes:
                    self.hear_zygote(zygotes[item])
                    continue
                fd = item
                chunk = os.read(fd, 1 << 16) if fd == stdin else self._recv(fd)
                if not chunk:
                    if fd == stdin:  # the launcher went away
                        return 0
                    self.drop(fd)
                    continue
                self.receive(None if fd == stdin else fd, chunk)

    def hear_zygote(self, zygote: Zygote) -> None:
        chunk = b""
        with contextlib.suppress(OSError):
            chunk = zygote.conn.recv(1 << 16)
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
                    self.send(self.owner.pop(pid), {"exit": pid, "code": -signal.SIGKILL})
            return
        messages, zygote.pending = decode(zygote.pending + chunk)
        zygote.exits += messages  # only exits come unasked
        self.route_exits(zygote)

    def _recv(self, fd: int) -> bytes:
        try:
            return self.clients[fd].recv(1 << 16)
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
    start = time.monotonic()
    _warm_up()
    _exercise()
    reason = fork_unsafe_reason()
    listener = _listen(argv[1]) if argv[:1] == ["--listen"] and reason is None else None
    ready = {
        "ready": True,
        "fork_safe": reason is None,
        "reason": reason,
        "import_s": time.monotonic() - start,
    }
    server = Server(ready, listener)
    server.send(None, {**ready, "socket": argv[1] if listener else None})
    try:
        return server.serve()
    finally:
        if listener is not None:
            with contextlib.suppress(OSError):
                os.unlink(argv[1])


if __name__ == "__main__":
    raise SystemExit(main())
