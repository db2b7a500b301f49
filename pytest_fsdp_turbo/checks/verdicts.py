"""What a check says: it passed, it failed (CheckFailure) or it cannot apply (NotApplicable); the
verdict over a run, and the note each check leaves on the result for the summary table."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pytest_fsdp_turbo_contract.results import RunResult

PASSED, FAILED, NOT_APPLICABLE = "passed", "failed", "not applicable"


class CheckFailure(AssertionError):
    pass


class NotApplicable(Exception):
    """Raised by a check that cannot apply to this run; the message says why."""


@dataclass(frozen=True)
class Outcome:
    check: str
    status: str
    detail: str = ""

    def describe(self) -> str:
        return f"{self.check}: {self.detail}" if self.detail else self.check


@dataclass(frozen=True)
class Verdict:
    outcomes: tuple[Outcome, ...]

    def with_status(self, status: str) -> list[Outcome]:
        return [o for o in self.outcomes if o.status == status]

    @property
    def ok(self) -> bool:
        return not self.with_status(FAILED)

    def not_applicable(self) -> list[str]:
        """e.g. ["c: no reference, no twin", "d: no replicas"], for the summary table."""
        return [o.describe() for o in self.with_status(NOT_APPLICABLE)]


# a check's outcome on a result, once judged: failed outranks passed, passed outranks "not
# applicable" (check c has two ways to apply)
_PRECEDENCE = {NOT_APPLICABLE: 0, PASSED: 1, FAILED: 2}


def judge(result: RunResult, letter: str, status: str, detail: str = "") -> None:
    """Note on the result what a check found, for the summary table: a run no check judged is
    "ran, unchecked" there, and a failed check shows its letter and numbers."""
    judged = getattr(result, "judged", None)  # a downstream stand-in for a RunResult: no notes
    if judged is None:
        return
    known = judged.get(letter)
    if known is None or _PRECEDENCE[status] >= _PRECEDENCE[known[0]]:
        judged[letter] = (status, detail)


def judges(letter: str) -> Callable:
    """A check function that notes its outcome on the result it judged (judge)."""

    def decorate(check: Callable) -> Callable:
        @functools.wraps(check)
        def judged(result: RunResult, *args: Any, **kwargs: Any) -> Any:
            try:
                value = check(result, *args, **kwargs)
            except NotApplicable as why:
                judge(result, letter, NOT_APPLICABLE, str(why))
                raise
            except CheckFailure as failure:
                judge(result, letter, FAILED, _lettered(letter, failure))
                raise
            judge(result, letter, PASSED)
            return value

        return judged

    return decorate


def _lettered(letter: str, failure: CheckFailure) -> str:
    """Every failure line starts with its check's letter (a missing reading's too)."""
    text = str(failure)
    return text if text.startswith("check ") else f"check {letter}: {text}"


def check_completed(result: RunResult) -> None:
    if not result.ok:
        raise CheckFailure(result.failure_text())
