"""When a trainer run may start on a host where others run. verl's colocated weight sync names its
IPC sockets /tmp/rl-colocate-zmq-<Ray job id>-..., and every fresh Ray cluster's first job has the
same id: two trainer runs on one host (xdist workers) push into each other's sockets and hang (seen
here), so they take turns; but on CPU, where the harness's shim gives each run's sockets its own
name (pytest_fsdp_turbo_engine/trainer/cpu.py, shim 10, vLLM's rollout only), runs overlap as far
as the host's cores and memory hold their ranks."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import psutil
from filelock import FileLock, Timeout

from pytest_fsdp_turbo.cases.trainer_case import TrainerCase
from pytest_fsdp_turbo.leases import LeaseBook
from pytest_fsdp_turbo_contract.errors import LeaseTimeout
from pytest_fsdp_turbo_contract.vocab import DeviceKind

PROGRESS_S = 30.0  # at least one progress line this often, and one on every change
CPU_RANK_SLOT = "cpu-trainer-rank"  # the lease book's name for a CPU trainer rank's share
# What one rank of a CPU trainer run holds, its actor and its vLLM replica together: measured
# 3.6 GB (three 2-rank runs at once, when Ray's OOM killer fired at 22.4 of 23.5 GB) to 3.9 GB
# (the 4-rank FSDP-Turbo case alone, 16.3 GB), tiny models, 2026-12-06
CPU_RANK_BYTES = 4 * 2**30


def cpu_rank_slots() -> int:
    """How many CPU trainer ranks this host holds at once: one core each (a rank's actor and its
    vLLM replica each run threads over every core they see: on 2 cores, two 2-rank runs at once
    took 220-320 s each in CI against 104-117 s alone, 2026-12-07) and 4 GiB each. At least 1: a
    run larger than the host runs alone, never refused."""
    memory = psutil.virtual_memory().total // CPU_RANK_BYTES
    return max(1, min(memory, os.cpu_count() or 1))


@contextlib.contextmanager
def one_trainer_per_host(
    book: LeaseBook, kind: str, case: TrainerCase, say: Callable[[str], None] | None = None
) -> Iterator[None]:
    """Held while the case's trainer runs: CPU rank slots of the host's cores and memory for a
    CPU run with vLLM's rollout (`cpu_rank_slots`), else the host's one trainer lock."""
    if kind == DeviceKind.CPU and case.rolls_out_with_vllm:
        slots = cpu_rank_slots()
        lease = _wait(
            case,
            lambda s: book.devices(
                CPU_RANK_SLOT, range(slots), min(case.world_size, slots), timeout_s=s
            ),
            LeaseTimeout,
            "for the cores and memory other verl trainer runs here hold",
            say,
        )
        try:
            yield
        finally:
            book.release(lease)
        return
    lock = FileLock(str(book.state_dir / "verl-trainer.lock"))
    _wait(case, lambda s: lock.acquire(timeout=s), Timeout, "for another verl trainer run", say)
    try:
        yield
    finally:
        lock.release()


def _wait(
    case: TrainerCase,
    take: Callable[[float], Any],
    busy: type[Exception],
    what: str,
    say: Callable[[str], None] | None,
) -> Any:
    """`take` retried every PROGRESS_S (a line each time) until the case's timeout has passed in
    waiting: the case's own timeout starts when its trainer does."""
    waited = time.monotonic()
    while True:
        try:
            return take(PROGRESS_S)
        except busy:
            if time.monotonic() - waited > case.timeout:
                raise LeaseTimeout(
                    f"trainer case {case.id}: waited more than the case's timeout "
                    f"({case.timeout:g}s) {what}"
                ) from None
            if say:
                say(f"trainer case {case.id}: waiting {what}")
