"""The layout a case declares, in ranks: who shares rows (sequence parallelism), who holds other
rows (data parallelism) and who holds the same shard (HSDP replicas). The ranks build their process
groups from it (pytest_fsdp_turbo_engine/step/rank.py) and checks d and j judge by it
(pytest_fsdp_turbo/checks/sync.py), so both read one definition, never the engine's groups."""

from __future__ import annotations


def data_parallel_ranks(rank: int, world_size: int, sp_size: int) -> list[int]:
    """The ranks holding other rows than `rank`'s, one per data-parallel rank, `rank` among them:
    a sequence-parallel group is sp_size consecutive ranks sharing rows (data rank = rank //
    sp_size), and these are the ranks at `rank`'s place in each group."""
    return list(range(rank % sp_size, world_size, sp_size))


def sp_group(rank: int, sp_size: int) -> list[int]:
    """The ranks sharing `rank`'s rows."""
    first = rank // sp_size * sp_size
    return list(range(first, first + sp_size))


def replica_ranks(rank: int, world_size: int, shard_size: int) -> list[int]:
    """The ranks holding the same shard as `rank`, itself included: a shard group is shard_size
    consecutive ranks (the parameters laid on a (world_size / shard_size, shard_size) mesh), and
    these are the ranks at `rank`'s place in each."""
    return list(range(rank % shard_size, world_size, shard_size))
