"""Which checks judge a run: each case kind's check set, found by the kind its spec.json names
(never by what files a run folder holds). A downstream kind registers its own."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from pytest_fsdp_turbo.checks.verdicts import (
    FAILED,
    NOT_APPLICABLE,
    PASSED,
    CheckFailure,
    NotApplicable,
    Outcome,
    Verdict,
    _lettered,
)
from pytest_fsdp_turbo_contract.results import RunResult
from pytest_fsdp_turbo_contract.vocab import CaseKindName

Check = Callable[[RunResult, "float | None"], None]  # a run and its memory budget (MiB)


@dataclass(frozen=True)
class CheckSet:
    """One kind's checks in order, and what its runs cannot have, each with its reason."""

    kind: str
    checks: tuple[tuple[str, Check], ...]
    cannot: Mapping[str, str] = field(default_factory=dict)

    def evaluate(self, result: RunResult, budget_mb: float | None = None) -> Verdict:
        outcomes = []
        for letter, check in self.checks:
            try:
                check(result, budget_mb)
                outcomes.append(Outcome(letter, PASSED))
            except NotApplicable as why:
                outcomes.append(Outcome(letter, NOT_APPLICABLE, str(why)))
            except CheckFailure as failure:
                outcomes.append(Outcome(letter, FAILED, _lettered(letter, failure)))
        outcomes += [Outcome(letter, NOT_APPLICABLE, why) for letter, why in self.cannot.items()]
        return Verdict(tuple(sorted(outcomes, key=lambda o: o.check)))


CHECK_SETS: dict[str, CheckSet] = {}


def register_check_set(check_set: CheckSet) -> None:
    CHECK_SETS[check_set.kind] = check_set


def check_set_of(result: RunResult) -> CheckSet:
    """The check set of the kind the run's spec names; a run without a readable spec failed
    before its ranks started, and is judged as the harness's own step (what applies fails)."""
    spec = result.spec()
    kind = spec.kind if spec is not None else CaseKindName.PPO_STEP
    if kind not in CHECK_SETS:
        raise CheckFailure(
            f"{result.artifacts_dir}: spec.json names case kind {kind!r}, which has no check set "
            f"(known: {', '.join(sorted(CHECK_SETS))})"
        )
    return CHECK_SETS[kind]
