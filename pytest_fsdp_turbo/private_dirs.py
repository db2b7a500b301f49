"""Folders the harness keeps in shared places (lease state, warm-parent and Ray-driver logs, model
and checkout caches) belong to the user running it alone, as pytest's own tmp_path root does: created
0o700, refused in one line when another user owns them or others may write into them, and state
files written without following a symlink someone planted.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

from pytest_fsdp_turbo_contract.errors import ConfigError

SHARED_BITS = stat.S_IWGRP | stat.S_IWOTH


def private_dir(path: Path, what: str, set_by: str) -> Path:
    """`path`, created 0o700 when missing; `what` names the folder, `set_by` what moves it."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
        info = os.lstat(path)
    except OSError as exc:  # a read-only or full disk: one line, never a traceback
        raise ConfigError(
            f"{what} {path}: cannot create it ({exc.strerror}); point {set_by} at a folder you "
            "can write"
        ) from None
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        problem = "is a symbolic link" if stat.S_ISLNK(info.st_mode) else "is not a folder"
    elif info.st_uid != os.getuid():
        problem = f"is owned by uid {info.st_uid}, not by this user (uid {os.getuid()})"
    elif info.st_mode & SHARED_BITS:
        problem = f"is writable by other users (mode {stat.S_IMODE(info.st_mode):o})"
    else:
        return path
    raise ConfigError(
        f"{what} {path} {problem}: refusing to use it; remove it, or point {set_by} at a folder "
        "of your own"
    )


def write_private(path: Path, text: str) -> None:
    """Replace `path` atomically through a fresh temporary file that is never a symlink."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(text)
        os.replace(tmp, path)
    except OSError as exc:  # a full or read-only disk: one line naming the file
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise ConfigError(f"{path}: cannot write it ({exc.strerror})") from None
