"""Ports, devices and HCCL port ranges leased across pytest-xdist workers and concurrent sessions.

One JSON state file guarded by a filelock records each holder's PID and process start time; an entry
whose holder is gone (or whose PID was reused) is free again, so a killed worker never strands a GPU.
Waiters that must not starve take a turn in a queue first and are served in the order they came.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import stat
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil
from filelock import FileLock

from pytest_fsdp_turbo.private_dirs import private_dir, write_private
from pytest_fsdp_turbo.settings import HarnessEnv
from pytest_fsdp_turbo_contract.errors import ConfigError, LeaseTimeout
from pytest_fsdp_turbo_contract.vocab import Env

STATE_DIR_VAR = Env.STATE_DIR
HCCL_RANGE_BASE = 61000  # above Linux's default ephemeral range (32768-60999)
HCCL_RANGE_SPAN = 64
HCCL_RANGE_SLOTS = (65535 - HCCL_RANGE_BASE + 1) // (2 * HCCL_RANGE_SPAN)
LEASE_TABLES = ("ports", "devices", "ranges", "turns")
TURN_DIGITS = 12  # a turn's number, zero-padded so that the keys sort in the order they were taken


def default_state_dir() -> Path:
    return HarnessEnv.read().state_dir


def hccl_port_ranges(slot: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The (host, npu) HCCL socket port ranges of one slot; slots never overlap."""
    host = HCCL_RANGE_BASE + 2 * slot * HCCL_RANGE_SPAN
    npu = host + HCCL_RANGE_SPAN
    return (host, host + HCCL_RANGE_SPAN - 1), (npu, npu + HCCL_RANGE_SPAN - 1)


@dataclass(frozen=True)
class DeviceLease:
    kind: str
    ids: tuple[int, ...]
    owner_pid: int


def _owner(pid: int) -> dict:
    return {"pid": pid, "started": psutil.Process(pid).create_time()}


def _alive(owner: dict) -> bool:
    try:
        return abs(psutil.Process(owner["pid"]).create_time() - owner["started"]) < 0.01
    except (psutil.Error, KeyError, TypeError):
        return False


def _port_bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _turn_number(key: str) -> int:
    number = key.rpartition(":")[2].partition("-")[0]
    return int(number) if number.isdigit() else 0


def _queue(turns: dict[str, dict], kind: str) -> list[str]:
    """The live turns of kind's queue (their keys sort in the order they were taken)."""
    return [key for key in turns if key.startswith(f"{kind}:")]


class LeaseBook:
    """All leases of one machine (or one state dir); every method is safe across processes."""

    def __init__(self, state_dir: Path | str | None = None, owner_pid: int | None = None):
        self.state_dir = private_dir(
            Path(state_dir) if state_dir else default_state_dir(),
            "lease state folder",
            STATE_DIR_VAR,
        )
        lock = self.state_dir / "leases.lock"
        if lock.is_symlink() or (lock.exists() and not lock.is_file()):
            raise ConfigError(
                f"lease lock {lock}: expected a regular file (or none), found a "
                f"{'symlink' if lock.is_symlink() else 'special file'}; remove it, or move the "
                f"state with {STATE_DIR_VAR}"
            )
        self._lock = FileLock(str(lock))
        self._state_file = self.state_dir / "leases.json"
        self.owner_pid = owner_pid or os.getpid()

    def _read(self) -> dict[str, dict[str, dict]]:
        return {
            table: {key: owner for key, owner in rows.items() if _alive(owner)}
            for table, rows in self._stored().items()
        }

    def _stored(self) -> dict[str, dict[str, dict]]:
        """The state file's tables. Opened without following a symlink and without blocking (a
        FIFO there would hang every session); anything but the harness's own JSON is refused in
        one line naming the file (an unreadable half-write, cut JSON, counts as empty)."""
        path = self._state_file
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            return {table: {} for table in LEASE_TABLES}
        except OSError as exc:
            raise self._bad(f"cannot be opened ({exc.strerror})") from None
        with os.fdopen(fd, "rb") as handle:
            if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
                raise self._bad("is not a regular file")
            raw = handle.read()
        try:
            state = json.loads(raw.decode("utf-8")) if raw.strip() else {}
        except UnicodeDecodeError:
            raise self._bad("is not UTF-8 text") from None
        except json.JSONDecodeError:
            state = {}
        if not isinstance(state, dict) or not all(
            isinstance(state.get(table, {}), dict)
            and all(isinstance(owner, dict) for owner in state.get(table, {}).values())
            for table in LEASE_TABLES
        ):
            raise self._bad(
                f"expected a JSON object of tables {', '.join(LEASE_TABLES)}, each mapping a key "
                f"to its owner; got {type(state).__name__}"
            )
        return {table: dict(state.get(table, {})) for table in LEASE_TABLES}

    def _bad(self, what: str) -> ConfigError:
        return ConfigError(
            f"lease state file {self._state_file} {what}; remove it (the harness rebuilds it), "
            f"or move the state with {STATE_DIR_VAR}"
        )

    def _write(self, state: dict) -> None:
        write_private(self._state_file, json.dumps(state, sort_keys=True))

    def holders(self) -> dict[str, dict[str, int]]:
        with self._lock:
            state = self._read()
        return {table: {k: v["pid"] for k, v in rows.items()} for table, rows in state.items()}

    def port(self, attempts: int = 64) -> int:
        """A port that is bindable now and held by no other live lease."""
        with self._lock:
            state = self._read()
            for _ in range(attempts):
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                    sock.bind(("127.0.0.1", 0))
                    port = sock.getsockname()[1]
                if str(port) not in state["ports"] and _port_bindable(port):
                    state["ports"][str(port)] = _owner(self.owner_pid)
                    self._write(state)
                    return port
        raise LeaseTimeout(f"no free port after {attempts} tries")

    def release_port(self, port: int) -> None:
        self._release("ports", [str(port)])

    @contextlib.contextmanager
    def turn(self, kind: str) -> Iterator[str]:
        """A place in kind's queue, kept while the caller waits for `devices(..., turn=...)`.
        Polling alone lets a holder that releases and asks again win every time: in CI a 4-rank
        run waited 900 s while another worker's 2-rank runs took the same slots back to back."""
        with self._lock:
            state = self._read()
            last = max((_turn_number(key) for key in _queue(state["turns"], kind)), default=0)
            # numbered after every live turn; the token keeps a number taken again after this
            # turn was granted (the queue emptied) from being given back by this one's exit
            turn = f"{kind}:{last + 1:0{TURN_DIGITS}d}-{uuid.uuid4().hex[:8]}"
            state["turns"][turn] = _owner(self.owner_pid)
            self._write(state)
        try:
            yield turn
        finally:
            self._release("turns", [turn])  # a granted turn is gone already

    def devices(
        self,
        kind: str,
        pool: Sequence[int],
        n: int,
        *,
        timeout_s: float = 300.0,
        poll_s: float = 0.1,
        turn: str | None = None,
    ) -> DeviceLease:
        """n ids from pool that no live holder has; waits while others hold them and, with a
        `turn`, while a live waiter that came earlier to kind's queue is still waiting."""
        if n > len(pool):
            raise LeaseTimeout(
                f"asked for {n} {kind} devices; only {len(pool)} exist: {list(pool)}"
            )
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                state = self._read()
                free = [i for i in pool if f"{kind}:{i}" not in state["devices"]]
                queue = [] if turn is None else _queue(state["turns"], kind)
                ahead = [key for key in queue if key < turn]
                if len(free) >= n and not ahead:
                    chosen = tuple(free[:n])
                    for i in chosen:
                        state["devices"][f"{kind}:{i}"] = _owner(self.owner_pid)
                    if turn is not None:
                        state["turns"].pop(turn, None)
                    self._write(state)
                    return DeviceLease(kind, chosen, self.owner_pid)
            if time.monotonic() >= deadline:
                held = {k: v["pid"] for k, v in state["devices"].items() if k.startswith(kind)}
                queued = f"; {len(ahead)} waiter(s) ahead in the queue" if ahead else ""
                raise LeaseTimeout(
                    f"waited {timeout_s:g}s for {n} {kind} devices from {list(pool)}; "
                    f"held by live owners: {held}{queued}"
                )
            time.sleep(poll_s)

    def release(self, lease: DeviceLease) -> None:
        self._release("devices", [f"{lease.kind}:{i}" for i in lease.ids])

    def port_ranges(self) -> tuple[int, tuple[tuple[int, int], tuple[int, int]]]:
        """A slot of two disjoint HCCL socket port ranges (host, npu) no concurrent group uses."""
        with self._lock:
            state = self._read()
            for slot in range(HCCL_RANGE_SLOTS):
                if str(slot) not in state["ranges"]:
                    state["ranges"][str(slot)] = _owner(self.owner_pid)
                    self._write(state)
                    return slot, hccl_port_ranges(slot)
        raise LeaseTimeout(f"all {HCCL_RANGE_SLOTS} HCCL port-range slots are held")

    def release_port_ranges(self, slot: int) -> None:
        self._release("ranges", [str(slot)])

    def _release(self, table: str, keys: list[str]) -> None:
        with self._lock:
            state = self._read()
            for key in keys:
                owner = state[table].get(key)
                if owner and owner["pid"] == self.owner_pid:
                    del state[table][key]
            self._write(state)
