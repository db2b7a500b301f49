"""What a Ray node needs of the driver's filesystem, sent through Ray: the folders a case names on
the driver (a tiny model the harness built, the engine folders on the case's pythonpath, the
FSDPTurbo checkout) are packed once per content, unpacked into the rank's own folder on its node,
and the rank's spec and PYTHONPATH are pointed there. Nodes need no shared filesystem; a real model
is not sent (it can be many GB): it must be at the same path on every node, and a node without it
is refused in one line before its rank starts (docs/multi-node.md)."""

from __future__ import annotations

import hashlib
import io
import os
import stat
import tarfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

SHIP_LIMIT_BYTES = 512 * 1024 * 1024  # a folder this large is not what a case means to send
SKIPPED = {".git", "__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache", ".tox", "venv"}


@dataclass(frozen=True)
class Packed:
    """One folder as a tar archive; `digest` names its content (the same folder on two runs is
    packed and sent once)."""

    path: str
    digest: str
    data: bytes


def _files(root: Path) -> Iterable[tuple[Path, int]]:
    """Every file to send and its size, folder links followed as long as they stay inside the
    folder (a link back to a folder above it is a loop, and is not followed). A link out of it
    (a home folder, /dev/zero) or anything but a regular file (a FIFO, a device) is one line:
    what a case sends is the folder it names, nothing it reaches."""
    inside = Path(os.path.realpath(root))
    for folder, dirs, files in os.walk(root, followlinks=True):
        here = Path(folder)
        above = {os.path.realpath(root / part) for part in here.relative_to(root).parents}
        if here != root and os.path.realpath(here) in above:
            dirs[:] = []
            continue
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED and not d.startswith(".venv"))
        for name in dirs:
            _stays_inside(root, inside, here / name)
        for name in sorted(files):
            if name.endswith((".pyc", ".lock")):
                continue
            file = here / name
            _stays_inside(root, inside, file)
            try:
                status = file.stat()
            except OSError as exc:
                raise ValueError(f"{root}: {file} cannot be sent: {exc.strerror}") from None
            if not stat.S_ISREG(status.st_mode):
                raise ValueError(
                    f"{root}: a Ray case sends this folder to its nodes; {file} is not a regular "
                    "file (a FIFO, a device or a socket): remove it from the folder"
                )
            yield file, status.st_size


def _stays_inside(root: Path, inside: Path, path: Path) -> None:
    target = Path(os.path.realpath(path))
    if not target.is_relative_to(inside):
        raise ValueError(
            f"{root}: a Ray case sends this folder to its nodes; {path} links out of it, to "
            f"{target}: links must stay inside the folder"
        )


def pack(path: str) -> Packed:
    """The folder as an archive of its files (links inside it followed, times and owners left
    out so the digest is the content's); one line naming the folder when it cannot be sent."""
    root = Path(path)
    if not root.is_dir():
        raise ValueError(f"{path}: a Ray case sends this folder to its nodes; it is not a folder")
    files = list(_files(root))
    if sum(size for _, size in files) > SHIP_LIMIT_BYTES:  # judged before a byte is read
        raise ValueError(
            f"{path}: a Ray case sends this folder to its nodes, up to "
            f"{SHIP_LIMIT_BYTES >> 20} MiB; it holds more (keep engine code in a folder of "
            "its own, or install it on every node)"
        )
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for file, _ in files:
            data = file.read_bytes()
            info = tarfile.TarInfo(file.relative_to(root).as_posix())
            info.size, info.mode = len(data), 0o644 | (file.stat().st_mode & 0o111)
            archive.addfile(info, io.BytesIO(data))
    data = buffer.getvalue()
    return Packed(path, hashlib.sha256(data).hexdigest(), data)


def unpack(data: bytes, into: Path) -> None:
    into.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        # our own archives; the filter where this Python has it (3.11.4 on)
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        archive.extractall(into, **safe)


def moved(path: str, places: Mapping[str, str]) -> str:
    """`path` as it is on the node: under the copy of the innermost shipped folder holding it."""
    for origin, here in sorted(places.items(), key=lambda item: -len(item[0].rstrip(os.sep))):
        origin = origin.rstrip(os.sep)
        if path.rstrip(os.sep) == origin or path.startswith(origin + os.sep):
            return here + path.rstrip(os.sep)[len(origin) :]
    return path


def moved_search_path(value: str, places: Mapping[str, str]) -> str:
    return os.pathsep.join(moved(entry, places) for entry in value.split(os.pathsep))
