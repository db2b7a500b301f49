"""The warm parent's protocol, shared by the launcher (pytest_fsdp_turbo.processes.warm) and the
parent itself (pytest_fsdp_turbo_engine.warm_parent): typed messages, one JSON line each, encoded
and decoded here only; and what both sides must agree on before a fork is safe (the interpreter,
the environment read once at import).

  launcher -> parent   Fork            start a rank (spec) or a helper module, answered by Forked
  parent -> launcher   Ready           the first line: whether forking is safe, and why not
                       Forked          the pid of what a Fork started
                       Exited          a process it started ended (a negative code: a signal)
                       ZygoteStarted   a zygote that lives as long as the parent
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass, field

THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
# Read once at import by transformers / huggingface_hub, so they must be set before the parent
# imports them (a rank would set them too late, after the fork); the launcher supplies defaults.
IMPORT_TIME_ENV = {
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "TOKENIZERS_PARALLELISM": "false",
}


def interpreter() -> list[str]:
    """Which Python this is, however it was called (venv `python` and `python3` are one)."""
    return [os.path.realpath(sys.executable), sys.prefix]


@dataclass(frozen=True)
class Ready:
    """A parent's (or zygote's) first line; a socket client's greeting adds who and how it is."""

    fork_safe: bool
    reason: str | None = None  # why forking is unsafe here
    socket: str | None = None  # where descendants may connect
    pid: int | None = None
    interpreter: list[str] | None = None
    import_env: dict[str, str | None] | None = None


@dataclass(frozen=True)
class Fork:
    """Start a rank (`spec`) or a helper (`module` with `argv`), logging to `log`."""

    env: dict[str, str]
    log: str
    cwd: str | None = None
    rank: int | None = None
    spec: str | None = None
    module: str | None = None
    argv: list[str] = field(default_factory=list)
    stdout: str | None = None  # a helper's stdout, apart from its log
    preload: str | None = None  # "verl:cpu": from a zygote that imported that stack


@dataclass(frozen=True)
class Forked:
    pid: int
    rank: int | None = None


@dataclass(frozen=True)
class Exited:
    pid: int
    code: int


@dataclass(frozen=True)
class ZygoteStarted:
    pid: int
    preload: str


@dataclass(frozen=True)
class ZygoteStarting:
    """Told to every conversation as a zygote begins importing its stack: the parent answers no
    request until it is done, and that wait is start-up, not silence."""

    preload: str


Message = Ready | Fork | Forked | Exited | ZygoteStarted | ZygoteStarting
_KINDS: dict[str, type] = {
    kind.__name__: kind for kind in (Ready, Fork, Forked, Exited, ZygoteStarted, ZygoteStarting)
}


def encode(message: Message) -> bytes:
    """One message as one JSON line: the only encoding either side writes."""
    return (json.dumps({"type": type(message).__name__, **asdict(message)}) + "\n").encode()


def decode_line(line: bytes | str) -> Message:
    """One JSON line back into its message: the only decoding either side does."""
    data = json.loads(line)
    return _KINDS[data.pop("type")](**data)


class MessageBuffer:
    """Bytes as they arrive, messages as they complete: the one reader either side uses."""

    def __init__(self) -> None:
        self.pending = b""

    def feed(self, chunk: bytes) -> list[Message]:
        *lines, self.pending = (self.pending + chunk).split(b"\n")
        return [decode_line(line) for line in lines]
