"""Hardware-keyed goldens: metrics recorded per case, device kind, dtype and world size (as the
run's spec.json declares them), before and after the optimizer step (the update's size, the
post-step logprobs of the trainer and of the rollout it pushed to), so a wrong step fails g as well
as a wrong loss.

Tiers: exact (bit-equal floats, same hardware and versions) and relative. NaN never passes. A
golden that lacks a metric the run measured predates it and fails until re-recorded; under
--fsdp-turbo-strict a missing golden fails too.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from pytest_fsdp_turbo.checks import FAILED, PASSED, CheckFailure, check_completed, judge
from pytest_fsdp_turbo_contract.records import Reading
from pytest_fsdp_turbo_contract.results import RunResult
from pytest_fsdp_turbo_contract.spec import RankSpec
from pytest_fsdp_turbo_contract.vocab import GoldenStatus, GoldenTier

# a golden file is plain JSON under the metric keys, so any reader (or an older golden) reads it
GOLDEN_KEYS = (
    Reading(lambda m: m.optimizer.grad_norm).key,
    Reading(lambda m: m.loss.pg_loss).key,
    Reading(lambda m: m.loss.entropy).key,
    Reading(lambda m: m.loss.kl_loss).key,
    Reading(lambda m: m.loss.pg_clipfrac).key,
    Reading(lambda m: m.rollout.score_mean).key,
    Reading(lambda m: m.rollout.response_length_mean).key,
    Reading(lambda m: m.optimizer.update_l2).key,
    Reading(lambda m: m.post_step.post_step_logprob_mean).key,
    Reading(lambda m: m.post_step.rollout_logprob_mean).key,
)
RECORD_COMMAND = "pytest -m <device>_e2e -k <case> --fsdp-turbo-record-golden"
RELATIVE_TOL = 1e-3
# bf16 keeps 8 bits of mantissa (a unit roundoff of 3.9e-3): the same bf16 run on another torch
# release moved pg_loss by 1.3e-3 relative here (2.13 against 2.14), so its goldens allow 1e-2
RELATIVE_TOL_BY_DTYPE = {"bf16": 1e-2}
ABSOLUTE_FLOOR = 1e-6


def relative_tolerance(dtype: str) -> float:
    return RELATIVE_TOL_BY_DTYPE.get(str(dtype), RELATIVE_TOL)


def golden_path(case_id: str, kind: str, dtype: str, world_size: int, root: Path) -> Path:
    return root / case_id / f"{kind}-{dtype}-ws{world_size}.json"


def within(tier: str, expected: float, actual: float, relative: float = RELATIVE_TOL) -> bool:
    if not (isinstance(actual, int | float) and math.isfinite(actual)):
        return False
    if not math.isfinite(expected):
        return False
    if tier == GoldenTier.EXACT:
        return actual == expected
    return abs(actual - expected) <= max(relative * abs(expected), ABSOLUTE_FLOOR)


def record_golden(path: Path, metrics: dict, root: Path | None = None) -> None:
    """Write a golden under `root`, never through a symbolic link (a committed golden that links
    elsewhere would have the recording overwrite its target outside the repository); every
    refusal is one line and writes nothing."""
    refused = f"check g: refusing to record golden {path}"
    values = {key: metrics[key] for key in GOLDEN_KEYS if key in metrics}
    for key, value in values.items():
        if not math.isfinite(value):
            raise CheckFailure(f"{refused}: {key} = {value}")
    if root is not None:
        inside = path.parent.resolve().is_relative_to(root.resolve())
        if not inside or path.is_symlink():
            what = "is a symbolic link, in" if path.is_symlink() else "resolves outside"
            raise CheckFailure(f"{refused}: it {what} the goldens folder {root}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
        with os.fdopen(os.open(path, flags, 0o644), "w") as out:
            out.write(json.dumps(values, indent=1, sort_keys=True) + "\n")
    except OSError as exc:
        raise CheckFailure(f"{refused}: {exc.strerror} ({exc.filename or path})") from None


def read_golden(path: Path) -> dict[str, float]:
    """A golden file: a JSON object of metric key to number, or one line naming what is wrong."""
    fix = f"re-record it: {RECORD_COMMAND}"
    try:
        golden = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckFailure(f"check g: golden {path} cannot be read ({exc}); {fix}") from None
    if not isinstance(golden, dict):
        raise CheckFailure(
            f"check g: golden {path}: expected a JSON object of metric to number; got "
            f"{type(golden).__name__}; {fix}"
        )
    for key, value in golden.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise CheckFailure(
                f"check g: golden {path}: metric {key} should be a number; got {value!r}; {fix}"
            )
    return golden


def compare_golden(
    path: Path, metrics: dict, tier: str, relative: float = RELATIVE_TOL
) -> list[str]:
    """Mismatches as messages (empty when everything is within the tier)."""
    expected = read_golden(path)
    problems = [
        f"check g: golden {path} has no {key} (recorded before the harness measured it); "
        f"re-record it: {RECORD_COMMAND}"
        for key in GOLDEN_KEYS
        if key not in expected and metrics.get(key) is not None
    ]
    for key, want in sorted(expected.items()):
        got = metrics.get(key)
        if got is None or not within(tier, want, got, relative):
            tol = "exact" if tier == GoldenTier.EXACT else f"relative {relative:g}"
            problems.append(f"check g: metric {key} = {got!r}, golden {want!r} ({tol}; {path})")
    return problems


@dataclass(frozen=True)
class GoldenOutcome:
    status: GoldenStatus
    path: Path | None = None

    def __str__(self) -> str:
        where = f" {self.path}" if self.path else " (tier none)"
        return f"{self.status}{where}"


@dataclass(frozen=True)
class GoldenKey:
    """What a golden is recorded under, all of it from the run's spec.json: its case, the device
    kind it ran on, the dtype it declared and its ranks; the tier says how close it must come."""

    case_id: str
    kind: str
    dtype: str
    world_size: int
    tier: GoldenTier

    @classmethod
    def of(cls, spec: RankSpec) -> GoldenKey:
        return cls(
            spec.case_id,
            str(spec.device_kind),
            str(spec.golden_dtype or spec.engine.dtype),
            spec.engine.world_size,
            spec.golden_tier,
        )

    def path(self, root: Path) -> Path:
        return golden_path(self.case_id, self.kind, self.dtype, self.world_size, root)


def golden_key(result: RunResult) -> GoldenKey:
    """The key of a completed run, or one line saying its spec.json is unreadable."""
    spec = result.spec()
    if spec is None:
        raise CheckFailure(
            f"check g: case {result.case_id}: its run folder has no readable spec.json "
            f"({result.folder.spec}); the golden is keyed by what the run declared"
        )
    return GoldenKey.of(spec)


def check_or_record(
    result: RunResult, root: Path, record: bool, strict: bool = False
) -> GoldenOutcome:
    """Record the golden (with --fsdp-turbo-record-golden) or check it; says what happened.
    Strict: a case with a golden tier and no golden for this hardware fails. In a test, the
    `fsdp_turbo_golden` fixture calls this with the session's folder and flags."""
    check_completed(result)  # a run that failed says why, never "metric missing" or a golden of it
    key = golden_key(result)
    if key.tier == GoldenTier.NONE:
        return GoldenOutcome(GoldenStatus.NOT_COMPARED)
    path = key.path(root)
    if record:
        record_golden(path, result.metrics, root)
        return GoldenOutcome(GoldenStatus.RECORDED, path)
    if not path.parent.resolve().is_relative_to(root.resolve()):  # the run's spec.json keys it
        raise CheckFailure(
            f"check g: case {result.case_id}: its spec.json keys the golden at {path}, which "
            f"resolves outside the goldens folder {root}: a case id is a name, never a path"
        )
    if not path.is_file() and strict:
        raise CheckFailure(
            f"check g: case {key.case_id}: no golden for {key.kind} {key.dtype} on "
            f"{key.world_size} ranks at {path} (--fsdp-turbo-strict); record it on this "
            f"hardware: {RECORD_COMMAND}"
        )
    if not path.is_file():
        return GoldenOutcome(GoldenStatus.MISSING, path)
    problems = compare_golden(path, result.metrics, key.tier, relative_tolerance(key.dtype))
    if problems:
        judge(result, "g", FAILED, problems[0])
        raise CheckFailure("\n".join(problems))
    judge(result, "g", PASSED)
    return GoldenOutcome(GoldenStatus.MATCHED, path)
