"""Process lifetime shared by both sides: a process started for a case dies with its launcher."""

from __future__ import annotations

import signal

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent() -> None:
    """Runs in the child before exec: a rank is killed when the process that launched it dies,
    so a killed pytest-xdist worker never leaves ranks behind (Linux; elsewhere a no-op).
    The kernel sends the signal when the *thread* that forked the child ends: start a process
    meant to outlive a helper thread from the main thread."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
