"""One verl trainer test run through pytest for a benchmark: its run folder and the test's wall
time (the trainer benchmarks read the rest from the folder)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from pytest_fsdp_turbo_contract.trainer_files import TrainerFolder

REPO = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def one_trainer_run(selection: Sequence[str]) -> Iterator[tuple[TrainerFolder, float]]:
    """pytest with `selection` (options and test ids) must run exactly one trainer case, green;
    its folder lives until the block ends."""
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        command += [f"--fsdp-turbo-artifacts={tmp}", *selection]
        started = time.monotonic()
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
        wall = time.monotonic() - started
        runs = [path.parent for path in Path(tmp).glob("*/trainer_spec.json")]
        if done.returncode != 0 or len(runs) != 1:
            raise SystemExit(f"the trainer run failed ({done.returncode}):\n{done.stdout[-3000:]}")
        yield TrainerFolder(runs[0]), wall
