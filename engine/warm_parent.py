"""The warm parent: imports torch, torch.distributed, transformers and the engine once, then forks
fresh rank processes on request, so a case costs its compute rather than its imports.

  python -m pytest_fsdp_turbo_engine.warm_parent      (started by pytest_fsdp_turbo.warm)

It never runs a case itself, creates no device context and starts no threads, so every forked rank
begins from the same clean state: no process group, no model, no RNG draws, no module a previous
case imported. Protocol, one JSON object per line: the launcher writes {"rank", "env", "spec",
"log"} on stdin and reads {"pid"} back; the parent reports {"exit": pid, "code": c} when a rank ends
(as subprocess does: negative for a signal). The first line it writes is {"ready", "fork_safe",
"reason", "import_s"}. It dies with the process that started it, and its ranks die with it.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def _die_with_parent() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def _warm_up() -> None:
    """Everything a rank imports before its first phase, except device runtimes: torch, FSDP2,
    transformers, the engine, and the modeling modules of the tiny model families."""
    import importlib

    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import transformers  # noqa: F401
    from pytest_fsdp_turbo_engine import step, worker  # noqa: F401
    from pytest_fsdp_turbo_fixtures import DATA_DIR
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    for spec in sorted((DATA_DIR / "models").glob("*.json")):
        family = json.loads(spec.read_text())["model_type"].removesuffix("_text")
        with contextlib.suppress(ImportError):  # an older transformers lacks it: ranks import it
            importlib.import_module(f"transformers.models.{family}.modeling_{family}")


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


def _child(request: dict) -> None:
    """In the forked rank: its own session, log, environment and thread count, then the worker."""
    os.setsid()
    _die_with_parent()
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    env = request["env"]
    os.environ.clear()
    os.environ.update(env)
    for entry in reversed([p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    import torch

    torch.set_num_threads(max(1, int(env.get("OMP_NUM_THREADS", "1"))))
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    from pytest_fsdp_turbo_engine import worker

    code = 1
    try:
        code = worker.main([request["spec"]])
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _send(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _reap() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send({"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def main() -> int:
    _die_with_parent()
    start = time.monotonic()
    _warm_up()
    reason = fork_unsafe_reason()
    _send(
        {
            "ready": True,
            "fork_safe": reason is None,
            "reason": reason,
            "import_s": time.monotonic() - start,
        }
    )
    fd, pending = sys.stdin.fileno(), b""
    while True:
        ready, _, _ = select.select([fd], [], [], 0.05)
        _reap()
        if not ready:
            continue
        chunk = os.read(fd, 1 << 16)
        if not chunk:  # the launcher went away
            return 0
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                _child(request)
            _send({"pid": pid, "rank": request["rank"]})


if __name__ == "__main__":
    raise SystemExit(main())
