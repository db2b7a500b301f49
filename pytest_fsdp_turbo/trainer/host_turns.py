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

from pytest_fsdp_turbo.cases.trainer_case import TrainerCase
from pytest_fsdp_turbo.leases import LeaseBook
from pytest_fsdp_turbo_contract.errors import LeaseTimeout
from pytest_fsdp_turbo_contract.vocab import DeviceKind

PROGRESS_S = 30.0  # at least one progress line this often, and one on every change
CPU_RANK_SLOT = "cpu-trainer-rank"  # the lease book's name for a CPU trainer rank's share
HOST_TRAINER_SLOT = "verl-trainer"  # the one trainer run a host with verl's own sockets holds
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
    CPU run with vLLM's rollout (`cpu_rank_slots`), else the host's one trainer slot. Runs are
    served in the order they asked, so a large run is never starved by smaller ones."""
    if kind == DeviceKind.CPU and case.rolls_out_with_vllm:
        name, slots, what = CPU_RANK_SLOT, cpu_rank_slots(), "the cores and memory"
    else:
        name, slots, what = HOST_TRAINER_SLOT, 1, "the host"
    ranks = min(case.world_size, slots)
    with book.turn(name) as turn:
        lease = _wait(
            case,
            lambda s: book.devices(name, range(slots), ranks, timeout_s=s, turn=turn),
            f"for {what} that other verl trainer runs here hold or asked for first",
            say,
        )
    try:
        yield
    finally:
        book.release(lease)


def _wait(
    case: TrainerCase, take: Callable[[float], Any], what: str, say: Callable[[str], None] | None
) -> Any:
    """`take` retried every PROGRESS_S (a line each time) until the case's timeout has passed in
    waiting: the case's own timeout starts when its trainer does."""
    waited = time.monotonic()
    while True:
        try:
            return take(PROGRESS_S)
        except LeaseTimeout:
            if time.monotonic() - waited > case.timeout:
                raise LeaseTimeout(
                    f"trainer case {case.id}: waited more than the case's timeout "
                    f"({case.timeout:g}s) {what}"
                ) from None
            if say:
                say(f"trainer case {case.id}: waiting {what}")
