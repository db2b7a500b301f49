"""The one place a rank reads its environment: where torch's rendezvous put it in the group, and
when its launcher started it (and, for a warm parent, what it imported under). Everything else a
rank is asked comes from its spec (spec.json); an engine or the library may read what it reads
itself (fsdp_turbo reads WORLD_SIZE)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from pytest_fsdp_turbo_contract.vocab import Env
from pytest_fsdp_turbo_contract.warm_protocol import IMPORT_TIME_ENV


@dataclass(frozen=True)
class RankEnv:
    rank: int  # RANK
    local_rank: int  # LOCAL_RANK (the device index on its node); RANK where it is unset
    launched_at: float | None  # the launcher's wall clock when it started the rank (startup time)

    @classmethod
    def read(cls, env: Mapping[str, str] | None = None) -> RankEnv:
        env = os.environ if env is None else env
        rank = int(env["RANK"])
        launched = env.get(Env.LAUNCHED_AT)
        return cls(
            rank=rank,
            local_rank=int(env.get("LOCAL_RANK", rank)),
            launched_at=float(launched) if launched else None,
        )


def import_time_env(env: Mapping[str, str] | None = None) -> dict[str, str | None]:
    """The variables a warm parent imported under (a session forks from it only when its own
    match): read once, when it says hello."""
    env = os.environ if env is None else env
    return {name: env.get(name) for name in IMPORT_TIME_ENV}
