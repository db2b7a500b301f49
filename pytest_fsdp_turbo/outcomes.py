"""A test's outcome said in one line: failed, or skipped (failed under --fsdp-turbo-strict); a
known failure held to itself, rank by rank; a strict session in which every test skipped."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NoReturn

import pytest

if TYPE_CHECKING:
    from pytest_fsdp_turbo_contract.results import RankResult, RunResult

# the terminal reporter's categories of a test that ran (a setup or teardown that passed has none)
RAN = ("passed", "failed", "error", "xfailed", "xpassed")
LINE_CHARS = 200  # a rank's error, cut, in the line that names it


def fail_line(message: str) -> NoReturn:
    """Fail the test with exactly one line: never chained to the exception being handled, which
    pytest would otherwise print again under "During handling of the above exception"."""
    raise pytest.fail.Exception(message, pytrace=False) from None


def skip_or_fail(strict: bool, message: str) -> NoReturn:
    """Skip a test that cannot run here, or fail it under --fsdp-turbo-strict; one line."""
    if strict:
        raise pytest.fail.Exception(f"--fsdp-turbo-strict: {message}", pytrace=False) from None
    raise pytest.skip.Exception(message) from None


def skip_reason(report) -> str:
    """A skipped test report's reason, as -rs shows it."""
    longrepr = getattr(report, "longrepr", None)
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return reason.removeprefix("Skipped: ")


def every_test_skipped(stats: dict[str, list]) -> str | None:
    """A strict session whose selected tests all skipped proves nothing, whatever skipped them:
    its one line with the first reason (None when a test ran). `stats`: the terminal reporter's."""
    skipped = stats.get("skipped", [])
    if not skipped or any(stats.get(outcome) for outcome in RAN):
        return None
    return (
        f"--fsdp-turbo-strict: every selected test skipped ({len(skipped)}), the first because: "
        f"{skip_reason(skipped[0])}"
    )


def off_the_known_failure(
    known: dict, error: BaseException, runs: Sequence[RunResult]
) -> str | None:
    """How a test expected to fail as `known` ({reason, match}) failed otherwise, cause first,
    then what it said (None: as known). Its error must say `match`, and in each run whose ranks
    failed every failed rank must say it in its own error or have only lost its peer, so a new
    crash on one rank cannot hide behind another rank's known one. `runs`: the test's runs."""
    said = str(error)
    why = _otherwise(known["match"], said, runs)
    if why is None:
        return None
    expected = f"known failure expected ({known['match']!r}: {known['reason']})"
    return f"{expected}, but {why}:\n{said or type(error).__name__}"


def _otherwise(match: str, said: str, runs: Sequence[RunResult]) -> str | None:
    if match not in said:
        return "it failed otherwise"
    for run in (one for made in runs for one in (made, made.twin) if one is not None):
        if run.ok or run.timed_out or run.failure:  # a group failure has no rank of its own
            continue
        failed = [rank for rank in run.ranks if rank.failed]
        for rank in failed:
            if match not in _own_words(rank) and not _lost_its_peer(run, rank):
                return f"{rank.name} failed otherwise ({_first_line(rank)})"
        if not any(match in _own_words(rank) for rank in failed):
            return f"no rank of case {run.case_id} failed with it"
    return None


def _own_words(rank: RankResult) -> str:
    """What the rank itself said: its error report, else its log's tail (a signal, an abort)."""
    if rank.error is None:
        return rank.log_tail()
    return f"{rank.error.type}: {rank.error.message}\n{rank.error.traceback}"


def _lost_its_peer(run: RunResult, rank: RankResult) -> bool:
    """A rank that failed only because another did, as the failure text words it: its collective
    lost the connection or aborted, or (after the first failure) timed out or was stopped."""
    from pytest_fsdp_turbo_contract.results import HANG_MARKS  # on a known failure only

    if rank.lost_peer:
        return True
    if rank.rank == run.first_failure:
        return False
    return rank.error is None or any(m in rank.error.message.lower() for m in HANG_MARKS)


def _first_line(rank: RankResult) -> str:
    if rank.error is None:
        return f"{rank.ending()} without an error report"
    message = (rank.error.message.strip().splitlines() or [""])[0][:LINE_CHARS]
    return f"phase {rank.error.phase}: {rank.error.type}: {message}"
