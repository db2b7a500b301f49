"""A forked process's first steps: its own session, log, environment and threads, then the worker
(or a helper module run as `python -m` would), ending with an exit code whatever fails."""

from __future__ import annotations

import contextlib
import os
import sys

from pytest_fsdp_turbo_contract.lifetime import die_with_parent
from pytest_fsdp_turbo_contract.warm_protocol import Fork

# Stacks a rank would import itself, which depend on the device kind at import time (verl resolves
# and caches its platform while importing). A zygote per (stack, kind) imports one, then forks the
# ranks that need it. CPU only: importing verl elsewhere probes CUDA/NPU, and a process that did
# must not fork.
PRELOADS = {"verl": "pytest_fsdp_turbo_engine.engines.verl_adapter:preload"}
PRELOAD_KINDS = ("cpu",)


def run_child(request: Fork, inherited: list[int]) -> None:
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
