"""The pytest side of the Ray launcher: one Ray driver process per pytest process, started on first
use, that joins the cluster (or starts a local one) and launches each case's rank actors.

The driver is a subprocess because Ray ends a driver process whose cluster dies (raylet or GCS
gone): there it takes the driver, and the case that was running, or the next one, fails with the
reason; the pytest session goes on to its summary. Connecting is bounded by
--fsdp-turbo-ray-connect-timeout, so an address where nothing answers is one line, not a hang.
The driver and the cluster it started are registered as the session's processes, so the leak guard
leaves them alone and still fails a test whose actors or ranks outlive it.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

from pytest_fsdp_turbo.processes.reaping import kill_pid_tree
from pytest_fsdp_turbo.processes.session_processes import disown, own, session_processes
from pytest_fsdp_turbo.processes.supervisor import (
    START_UP_TIMEOUT_S,
    WATCH_EVERY_S,
    Supervised,
    collect_result,
)
from pytest_fsdp_turbo_contract.artifacts import RunFolder
from pytest_fsdp_turbo_contract.errors import ConfigError
from pytest_fsdp_turbo_contract.lifetime import die_with_parent
from pytest_fsdp_turbo_contract.results import RunResult

DRIVER_MODULE = "pytest_fsdp_turbo.launching.ray_ranks"
LOCAL_START_TIMEOUT_S = 120.0  # starting a local instance on a busy 2-core box
# beyond the case's own timeout and its ranks' start-up bound: placement (120 s,
# ray_ranks.PLACEMENT_TIMEOUT_S), the actors' start (300 s, START_TIMEOUT_S), calls and kills
LAUNCH_GRACE_S = 480.0
# Ray processes titled ray::<name> that are the cluster's own: its agents and its pooled workers
# that host nothing (yet); an actor's worker is titled after its class (ray::RankActor)
CLUSTER_TITLES = ("ray::IDLE", "ray::DashboardAgent", "ray::RuntimeEnvAgent")
LOG_TAIL_LINES = 3
ERROR_LINE = re.compile(
    r"^\[\S+ \S+ [EF] \d+|Error|terminate"
)  # Ray's glog E/F lines, Python errors


@dataclass
class EndedRank:
    """A rank the driver has supervised to its end: what collect_result needs of it."""

    rank: int
    log_path: Path
    code: int | None

    def poll(self) -> int | None:
        return self.code

    def dump_stacks(self) -> None:
        pass

    def kill(self) -> None:
        pass


def _cmdline(proc) -> str:
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:
        return ""


class RayDriver:
    """One driver subprocess and its protocol (a JSON request per line, a JSON reply per line).

    Raises ConfigError, in one line, when the cluster does not answer within the bound."""

    def __init__(self, address: str | None, connect_timeout_s: float, log_path: Path):
        self.address = address or None
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - lives as long as the driver
        self.proc = subprocess.Popen(
            [sys.executable, "-m", DRIVER_MODULE, *([address] if address else [])],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            preexec_fn=die_with_parent,
        )
        self._replies: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True, name="fsdp-turbo-ray-driver").start()
        bound = connect_timeout_s if address else max(connect_timeout_s, LOCAL_START_TIMEOUT_S)
        ready = self._wait(bound)
        if ready is None or "error" in ready:
            refusal = self._refusal(ready, bound)
            self.close(grace_s=0)
            raise ConfigError(refusal)
        self.started = bool(ready["started"])
        self.cluster_address = ready.get("address") or address
        self._core = self._core_processes()
        own(self.proc.pid, "Ray driver", keeps=self._keeps)

    def _read(self) -> None:
        for line in self.proc.stdout:
            with contextlib.suppress(json.JSONDecodeError):
                self._replies.put(json.loads(line))
        self._replies.put({"gone": True})  # the driver ended

    def _wait(self, timeout_s: float) -> dict | None:
        try:
            message = self._replies.get(timeout=timeout_s)
        except queue.Empty:
            return None
        return None if message.get("gone") else message

    def _refusal(self, reply: dict | None, bound: float) -> str:
        where = (
            f"Ray cluster at {self.address}" if self.address else "a local Ray instance"
        ) + " (--fsdp-turbo-ray-address / RAY_ADDRESS)"
        if reply is not None:
            return f"{where}: {reply['error']}; driver log {self.log_path}"
        if self.proc.poll() is None:
            return (
                f"{where} did not answer within {bound:g}s (raise the bound with "
                f"--fsdp-turbo-ray-connect-timeout); driver log {self.log_path}"
            )
        return f"{where}: the driver ended with exit code {self.proc.poll()}: {self._log_tail()}"

    def _core_processes(self) -> dict:
        """The daemons of a cluster this driver started (gcs_server, raylet, monitors, agents)."""
        try:
            tree = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            return {}
        return {p.pid: p for p in tree if not _cmdline(p).startswith("ray::IDLE")}

    def _keeps(self, proc) -> bool:
        """The cluster's daemons and its idle pooled workers are the session's; an actor's worker
        process (ray::RankActor...) and everything it started (ranks) belong to a test."""
        return proc.pid in self._core or _cmdline(proc).startswith(CLUSTER_TITLES)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def _log_tail(self) -> str:
        self._log.flush()
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        errors = [line.strip() for line in lines if ERROR_LINE.search(line)]
        tail = " | ".join((errors or lines)[-LOG_TAIL_LINES:])
        return f"driver log: {tail or '(empty)'}; whole log {self.log_path}"

    def gone(self) -> str:
        return (
            f"the Ray driver (pid {self.proc.pid}) ended with exit code {self.proc.poll()}: "
            f"the Ray cluster it used is gone (stopped, or its raylet or GCS died); Ray cases "
            f"after this one fail too. {self._log_tail()}"
        )

    def _request(self, op: str, args: Mapping | None = None) -> None:
        line = json.dumps({"op": op, "args": dict(args or {})}) + "\n"
        self.proc.stdin.write(line.encode())
        self.proc.stdin.flush()

    def resources(self, timeout_s: float = 30.0) -> dict:
        """{"available": ..., "total": ...} of the cluster, as Ray reports them."""
        self._request("resources")
        reply = self._wait(timeout_s)
        if reply is None:
            raise ConfigError(self.gone() if not self.alive else "Ray driver did not answer")
        return reply

    def launch(
        self,
        *,
        case_id: str,
        world_size: int,
        kind: str,
        env_overrides: Mapping[str, str],
        artifacts_dir: Path,
        timeout_s: float,
        ship: Sequence[str] = (),
        watch: Callable[[float], None] | None = None,
    ) -> RunResult:
        """The case's ranks on the cluster; `ship`: folders of this machine the ranks read (sent
        to their nodes, see launching.shipping)."""
        start = time.monotonic()

        def failed(why: str) -> RunResult:
            return RunResult.launcher_failed(
                case_id, world_size, artifacts_dir, why, time.monotonic() - start
            )

        if not self.alive:
            return failed(self.gone())
        args = {
            "case_id": case_id,
            "world_size": world_size,
            "kind": kind,
            "env_overrides": dict(env_overrides),
            "artifacts_dir": str(artifacts_dir),
            "timeout_s": timeout_s,
            "ship": list(ship),
        }
        try:
            self._request("launch", args)
        except OSError:
            return failed(self.gone())
        bound = timeout_s + START_UP_TIMEOUT_S + LAUNCH_GRACE_S  # the ranks' start-up: not timed
        deadline = start + bound
        while True:
            try:
                reply = self._replies.get(timeout=WATCH_EVERY_S)
                break
            except queue.Empty:
                if watch is not None:
                    watch(time.monotonic() - start)
                if time.monotonic() > deadline:
                    self.close(grace_s=0)
                    return failed(
                        f"the Ray driver gave no outcome within {bound:g}s (case timeout + the "
                        f"ranks' start-up bound + {LAUNCH_GRACE_S:g}s) and was stopped; "
                        f"{self._log_tail()}"
                    )
        if reply.get("gone"):
            self.proc.wait()
            return failed(self.gone())
        if "error" in reply:
            raise ConfigError(f"case {case_id}: Ray launcher: {reply['error']}")
        codes = {int(rank): code for rank, code in reply["codes"].items()}
        handles = [
            EndedRank(rank, RunFolder(artifacts_dir).log(rank), codes.get(rank))
            for rank in range(world_size)
        ]
        ends = {int(rank): t for rank, t in reply["ends"].items()}
        outcome = Supervised(reply["timed_out"], reply["first_failure"], ends, reply["start_up_s"])
        result = collect_result(case_id, handles, artifacts_dir, timeout_s, reply["start"], outcome)
        result.notes.extend(reply["notes"])
        nodes = {int(rank): node for rank, node in reply.get("nodes", {}).items()}
        for ranked in result.ranks:
            ranked.node = nodes.get(ranked.rank, "")
        if lost := reply.get("lost_nodes"):
            result.failure = "; ".join(
                f"{node} left the Ray cluster while rank(s) {', '.join(map(str, ranks))} ran on it"
                for node, ranks in lost.items()
            )
        return result

    def close(self, grace_s: float = 20.0) -> None:
        """Stops the driver (which stops a cluster it started) and whatever it left."""
        disown(self.proc.pid)
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            kill_pid_tree(self.proc.pid)
            self.proc.wait()
        for proc in getattr(self, "_core", {}).values():  # daemons that outlived ray.shutdown()
            with contextlib.suppress(psutil.Error):  # psutil checks the pid was not reused
                proc.kill()
        self._log.close()


def ray_driver(address: str | None, connect_timeout_s: float, log_dir: Path) -> RayDriver:
    """This process's Ray driver (started on first use; a dead one is reported by its launches,
    not replaced, so every affected case says what happened)."""
    processes = session_processes()
    if processes.ray is None:
        log_dir.mkdir(parents=True, exist_ok=True)
        log = log_dir / f"ray-driver-{os.getpid()}.log"
        processes.ray = RayDriver(address, connect_timeout_s, log)
    return processes.ray


def stop_ray_driver() -> None:
    session_processes().stop_ray()
