"""The fault-injection spec, torch-free, so the pytest process validates it before any rank starts
(a spec the ranks would ignore must never pass as a tested crash).

PYTEST_FSDP_TURBO_FAULT=KIND:RANK[:PHASE], e.g. "crash:1:rollout". PHASE defaults to init, the first
phase. Kinds: crash (raise), hang (block forever), nan (non-finite gradients), stall (sleep
PYTEST_FSDP_TURBO_FAULT_STALL_S seconds, then go on), exit (the rank ends with code 0 and writes
nothing, as an engine or library calling exit would), signal (the rank is killed by SIGKILL, as
the kernel's OOM killer ends it: no error file, no last word), kill_parent (the rank kills the warm parent
it was forked from; the local launcher only).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pytest_fsdp_turbo_contract.errors import ConfigError
from pytest_fsdp_turbo_contract.vocab import Env

FAULT_VAR = Env.FAULT
STALL_SECONDS_VAR = Env.FAULT_STALL_S  # read here; the ranks get it in their spec
KINDS = ("crash", "hang", "nan", "stall", "exit", "signal", "kill_parent")
# every phase a rank enters, in order (pytest_fsdp_turbo_engine/worker.py and pytest_fsdp_turbo_engine/step/)
PHASES = (
    "init",
    "load",
    "rollout",
    "reward",
    "logprobs",
    "replay",
    "train",
    "reference",
    "optimizer",
    "checks",
    "metrics",
    "write",
)
FORMS = f"KIND:RANK[:PHASE] with KIND in {', '.join(KINDS)} and PHASE in {', '.join(PHASES)}"


@dataclass(frozen=True)
class FaultSpec:
    kind: str
    rank: int
    phase: str = PHASES[0]
    stall_s: float = 5.0  # how long a stall sleeps


def parse_fault(value: str, world_size: int | None = None, stall: str = "") -> FaultSpec | None:
    """None when unset; ConfigError naming the variable and the accepted forms otherwise.
    `stall`: the stall variable's value (the plugin's settings read both, RunEnv)."""
    value = value.strip()
    if not value:
        return None
    parts = value.split(":")
    if len(parts) not in (2, 3) or parts[0] not in KINDS or not parts[1].isdigit():
        raise ConfigError(f"{FAULT_VAR}: expected {FORMS}; got {value!r}")
    spec = FaultSpec(parts[0], int(parts[1]), parts[2] if len(parts) == 3 else PHASES[0])
    if spec.phase not in PHASES:
        raise ConfigError(f"{FAULT_VAR}: unknown phase {spec.phase!r}; expected {FORMS}")
    if spec.kind == "stall" and stall:  # the rank sleeps it: checked before any rank starts
        from pytest_fsdp_turbo_contract.bounds import DAY_S, number_in

        spec = replace(spec, stall_s=number_in(stall, STALL_SECONDS_VAR, 0.0, DAY_S))
    if world_size is not None and spec.rank >= world_size:
        raise ConfigError(
            f"{FAULT_VAR}: rank {spec.rank} is outside the case's {world_size} ranks "
            f"(0..{world_size - 1}); got {value!r}"
        )
    return spec
