"""Numbers from options, variables and ini keys, read once and bounded: a NaN, an infinity, a
negative timeout or a count no machine has is one line naming where it came from, before any rank
starts (a NaN collective timeout killed every rank; 1e10 s overflowed a wait)."""

from __future__ import annotations

import math

from pytest_fsdp_turbo_contract.errors import ConfigError

DAY_S = 86400.0


def number_in(
    text: object, origin: str, low: float, high: float, *, low_open: bool = False
) -> float:
    """`text` as a finite number in [low, high] (or (low, high] with low_open)."""
    try:
        value = float(str(text).strip())
    except ValueError:
        value = math.nan
    above_low = value > low if low_open else value >= low
    if not (math.isfinite(value) and above_low and value <= high):
        bracket = "(" if low_open else "["
        raise ConfigError(
            f"{origin}: expected a number in {bracket}{low:g}, {high:g}]; got {text!r}"
        )
    return value


def seconds(text: object, origin: str, high: float = 7 * DAY_S) -> float:
    """A positive, finite number of seconds, at most a week unless said otherwise."""
    return number_in(text, origin, 0.0, high, low_open=True)
