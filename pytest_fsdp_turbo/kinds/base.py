"""The case-kind seam: what every kind of case does, the way pytest-xdist makes each scheduler one
implementation of one protocol. A kind reads its own table of the case file into cases; runs a
case (the spec its run gets, what is launched and supervised, the run folder read back into a
`RunResult` whose spec.json names the kind); says what selects its tests and what this machine
lacks for them; and names the check set that judges its runs (pytest_fsdp_turbo.checks).

Built-in kinds: the harness's own PPO step (ppo_step.py) and verl's trainer (verl_trainer.py). A
downstream kind is one module: an object with these members, handed to `register_kind`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import pytest

    from pytest_fsdp_turbo.cases.table import ReadContext
    from pytest_fsdp_turbo.settings import Settings
    from pytest_fsdp_turbo_contract.results import RunResult


class KindCase(Protocol):
    """What every kind's case has: a test parameter needs its id, device kinds, world size (the
    devices it leases) and its known failures (device kind -> {reason, match})."""

    @property
    def id(self) -> str: ...
    @property
    def devices(self) -> tuple[str, ...]: ...
    @property
    def world_size(self) -> int: ...
    @property
    def known_failure(self) -> dict: ...


class CaseKind(Protocol):
    name: str  # spec.json's `kind`, and the key of the check set that judges its runs
    table: str  # its `[[table]]` in the case file
    fixture: str  # the test parameter its cases are handed as, once per case x device kind

    def read(self, data: dict, path: Path, context: ReadContext) -> list[Any]:
        """Its table's rows (`data` is the whole file) as validated cases, one line per error."""
        ...

    def owns(self, case: object) -> bool:
        """Whether `case` is one of this kind's cases."""
        ...

    def marks(self, case: Any) -> list[str]:
        """The markers that select its tests beyond e2e, the device kind and devices(n)."""
        ...

    def missing(self, case: Any, device_kind: str, settings: Settings) -> list[str]:
        """What this machine lacks to run the case (packages, model folders), one line each,
        found at collection for --fsdp-turbo-strict's pre-flight; nothing is imported."""
        ...

    def run(self, request: pytest.FixtureRequest, case: Any, **options: Any) -> RunResult:
        """The case run once, its files in an artifact folder of the test's: the spec the run gets,
        what is launched and supervised, and the run folder read back. Skips (or fails under
        strict) where it cannot run here, naming what was looked for."""
        ...
