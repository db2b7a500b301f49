"""c's low-precision rule, per parameter: an engine's gradient held to a multiple of the distance
rounding alone puts the reference's gradient from fp32, measured in the same run on the same
batch (docs/checks.md, "bf16, per parameter"). Shared by the in-rank reference, the single twin,
verl's trainer replay and the benchmark that prints the margins."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from pytest_fsdp_turbo.checks.tolerances import (
    GRAD_PARITY_L2_TOL,
    LATER_UPDATE,
    REFERENCE_NOISE_FACTOR,
)
from pytest_fsdp_turbo_contract.results import RunResult
from pytest_fsdp_turbo_contract.vocab import Dtype


@dataclass(frozen=True)
class RoundingMargin:
    """The parameter furthest beyond its low-precision tolerance: its distance, the noise the
    tolerance scales, the tolerance, and the distance in units of it (above 1: red)."""

    name: str
    distance: float
    noise: float
    tolerance: float

    @property
    def ratio(self) -> float:
        return self.distance / self.tolerance if math.isfinite(self.distance) else math.inf

    def said(self, distance: str) -> str:
        """The verdict's words after "parameter <name>: ", `distance` saying what was measured."""
        return (
            f"{distance} {self.distance:.3g}, {times(self.distance, self.noise)} {ROUNDING_SAID} "
            f"({self.noise:.3g}); tolerance {self.tolerance:.3g} = {REFERENCE_NOISE_FACTOR:g} x "
            "that"
        )


def worst_beyond_rounding(entries: Iterable[tuple[str, float, float]]) -> RoundingMargin | None:
    """Of the entries (name, distance, the reference's own low-precision distance from fp32),
    the one furthest beyond REFERENCE_NOISE_FACTOR x that noise; None without entries.

    A parameter's own noise is one draw: now and then the low-precision reference lands next to
    fp32 by chance (measured: 3.7e-4 where the engine sat 9.6e-3 away), so no parameter is held
    closer than the median parameter's noise in the same run. First updates only: from the second
    on, the engine and the reference train from parameters that rounding already set apart,
    which the noise does not measure."""
    first = [(n, mine, noise) for n, mine, noise in entries if LATER_UPDATE not in n]
    # parameters without a gradient (a vision tower a text batch never ran) round to exactly 0
    rounded = [noise for _, _, noise in first if noise > 0] or [0.0]
    typical = statistics.median(rounded)
    worst: RoundingMargin | None = None
    for name, mine, noise in first:
        scale = max(noise, typical)
        tol = max(REFERENCE_NOISE_FACTOR * scale, GRAD_PARITY_L2_TOL[Dtype.FP32])
        margin = RoundingMargin(name, mine, scale, tol)
        if worst is None or not margin.ratio <= worst.ratio:
            worst = margin
    return worst


def beyond_rounding(entries: Iterable[tuple[str, float, float]]) -> RoundingMargin | None:
    """The worst entry when it is beyond its tolerance (worst_beyond_rounding), else None."""
    worst = worst_beyond_rounding(entries)
    return worst if worst is not None and not worst.ratio <= 1.0 else None


# what the noise a low-precision verdict scales is (beyond_rounding)
ROUNDING_SAID = (
    "the distance rounding alone puts the reference's gradient from its fp32 result (its own, "
    "or the median parameter's where that is larger)"
)


def times(mine: float, noise: float) -> str:
    return f"{mine / noise:.3g} times" if noise > 0 else "where it is 0, beyond"


def pairs(readings: dict[str, list[float]]) -> Iterator[tuple[str, float, float]]:
    """(name, the engine's distance, the reference's own) from sync/grad_param_rel_l2."""
    for name, (mine, noise) in readings.items():
        yield name, mine, noise


def norm_distances(mine: dict, low: dict) -> Iterator[tuple[str, float, float]]:
    """(name, |the run's gradient norm - the low-precision reference's| / the latter, noise)."""
    for name, (norm, _, noise) in low.items():
        off = abs(mine[name][0] - norm)
        yield name, off / norm if norm > 0 else (0.0 if off == 0 else math.inf), noise


def rounding_margins(result: RunResult) -> dict[str, RoundingMargin]:
    """A low-precision run's worst parameter against the rule c holds it to, as measured:
    with the reference ("reference"), against a single twin ("twin"); what the run holds
    (benchmarks/bf16_parameters.py prints them over seeds and broken engines)."""
    out = {}
    readings = result.ranks[0].step.reference.grad_param_rel_l2
    if readings and (worst := worst_beyond_rounding(pairs(readings))):
        out["reference"] = worst
    low = result.twin.ranks[0].step.train.grad_sketch_low if result.twin else None
    mine = result.ranks[0].step.train.grad_sketch
    if low and mine and (worst := worst_beyond_rounding(norm_distances(mine, low))):
        out["twin"] = worst
    return out
