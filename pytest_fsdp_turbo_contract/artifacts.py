"""What a run leaves behind: `RunFolder` is the one owner of artifact file names."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, overload


class _File:
    """One file of a run folder: its path on a folder, its name on the class (for globs)."""

    def __init__(self, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, folder: None, owner: type) -> str: ...

    @overload
    def __get__(self, folder: RunFolder, owner: type) -> Path: ...

    def __get__(self, folder: RunFolder | None, owner: type) -> Path | str:
        return self.name if folder is None else folder.path / self.name


class _RankFile:
    """One file per rank, rank<N>.<suffix>: on a folder, the function from a rank to its path."""

    def __init__(self, suffix: str) -> None:
        self.suffix = suffix

    def __get__(self, folder: RunFolder, owner: type) -> Callable[[int], Path]:
        return lambda rank: folder.path / f"rank{rank}.{self.suffix}"


@dataclass(frozen=True)
class RunFolder:
    """One run's artifact folder: the one place its file names are spelled."""

    path: Path

    spec = _File("spec.json")  # the RankSpec every rank reads, and what a reader needs of the case
    env = _File("env.json")  # the ranks' environment, secrets masked
    timeline = _File("timeline.json")  # (rank, phase, start, end) rows
    launcher_log = _File("launcher.log")  # port retries
    batch = _File("batch.pt")  # the global training batch, for a twin to replay
    post_step = _File("post_step.pt")  # the global post-step logprobs on that batch
    nodes = _File("nodes.json")  # Ray: rank -> the node it ran on
    log = _RankFile("log")
    metrics = _RankFile("metrics.json")  # written last: the rank's success marker
    partial_metrics = _RankFile("partial-metrics.json")  # what a failed rank measured
    error = _RankFile("error.json")  # a RankError
    phases = _RankFile("phases.jsonl")  # followed live by the progress reporter
    grads = _RankFile("grads.json")  # the gradient fingerprint (rank 0, with a reference)
    RANK_FILES: ClassVar[str] = "rank*"  # everything per rank, moved aside on a retried attempt

    @property
    def twin(self) -> RunFolder:
        return RunFolder(self.path / "twin")


def read_json(path: Path) -> Any:
    """A result file, or None when it is missing or half-written (a rank killed mid-write)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
