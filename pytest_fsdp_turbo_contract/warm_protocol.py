"""The warm parent's protocol, shared by the launcher (pytest_fsdp_turbo.launching.warm) and the
parent itself (pytest_fsdp_turbo_engine.warm_parent): JSON lines, one message each, encoded and
decoded here only; and what both sides must agree on before a fork is safe (the interpreter, the
environment read once at import)."""

from __future__ import annotations

import json
import os
import sys

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


def encode(message: dict) -> bytes:
    """One message as one JSON line: the only encoding either side writes."""
    return (json.dumps(message) + "\n").encode()


def decode(pending: bytes) -> tuple[list[dict], bytes]:
    """The complete JSON lines in a receive buffer, and what is left of it."""
    *lines, rest = pending.split(b"\n")
    return [decode_line(line) for line in lines], rest


def decode_line(line: bytes | str) -> dict:
    """One JSON line back into its message: the only decoding either side does."""
    return json.loads(line)
