"""What the gradient-sync policy promises: h (reduce-scatters per micro-batch and the unsharded
gradients held between them), j (data-parallel ranks train on disjoint rows) and f (memory within
the case's budget)."""

from __future__ import annotations

from pytest_fsdp_turbo.checks.readings import (
    DATA_ROWS,
    FSDP_UNITS,
    LAYER_TOKENS,
    MICRO_BATCH_ROWS,
    PEAK_MEMORY_BYTES,
    REDUCE_SCATTER_CALLS_BY_MICRO_BATCH,
    RETAINED_GRAD_BYTES,
    SEQ_LEN,
    SHARD_GROUP_SIZE,
    _measured,
    _value,
    declared,
)
from pytest_fsdp_turbo.checks.verdicts import (
    CheckFailure,
    NotApplicable,
    judges,
)
from pytest_fsdp_turbo_contract.results import RunResult
from pytest_fsdp_turbo_contract.vocab import SyncPolicy


@judges("f")
def check_memory(result: RunResult, budget_mb: float | None) -> None:
    """f. Peak memory within budget."""
    if budget_mb is None:
        raise NotApplicable("no memory budget")
    for rank, value in _measured(result, PEAK_MEMORY_BYTES):
        if value > budget_mb * 2**20:
            raise CheckFailure(
                f"check f: rank {rank}: {PEAK_MEMORY_BYTES.key} = {value / 2**20:.1f} MiB, "
                f"budget {budget_mb:g} MiB"
            )


def expected_reduce_scatters(
    policy: str, micro_batches: int, units: int, shard_group_size: int
) -> list[int]:
    """One reduce-scatter per FSDP unit that ran forward, per synced backward (none when a unit is
    sharded over one rank: FSDP2 skips the collective); deferred syncs only the last micro-batch."""
    per_sync = units if shard_group_size > 1 else 0
    if policy == SyncPolicy.DEFERRED:
        return [0] * (micro_batches - 1) + [per_sync]
    return [per_sync] * micro_batches


@judges("h")
def check_sync_contract(result: RunResult) -> None:
    """h. What the declared gradient-sync policy promises is what the ranks measured; with
    sequence parallelism, each rank's decoder layers saw only its chunk of the sequence."""
    spec = declared(result)
    policy, micro_batches = str(spec.engine.gradient_sync), spec.ppo.micro_batches
    head = (
        f"check h: case {result.case_id}: declared gradient_sync {policy!r} with "
        f"{micro_batches} micro-batches"
    )
    check_reduce_scatters(result, policy, micro_batches, head)
    sp = spec.engine.sp_size
    if sp > 1:  # sequence parallelism: each rank's decoder layers see only its chunk
        rows = _value(result, 0, MICRO_BATCH_ROWS)
        seq = _value(result, 0, SEQ_LEN)
        tokens = rows * seq
        # 1/sp of the micro-batch's tokens, each row (or the one packed row) padded to split evenly
        low, high = -(-tokens // sp), (tokens + rows * (sp - 1)) // sp
        for rank, seen in _measured(result, LAYER_TOKENS):
            if not low <= seen <= high:
                raise CheckFailure(
                    f"{head}: declared sp_size {sp} over micro-batches of {rows} x {seq} tokens: "
                    f"expected each rank's decoder layers to be handed {low}..{high} tokens at "
                    f"once, measured {seen} on rank {rank} ({LAYER_TOKENS.key})"
                )
    check_retained_gradients(result, policy, micro_batches, head)


def check_reduce_scatters(result: RunResult, policy: str, micro_batches: int, head: str) -> None:
    """h's counts: one reduce-scatter per FSDP unit that ran, on each synced backward."""
    for rank, calls in _measured(result, REDUCE_SCATTER_CALLS_BY_MICRO_BATCH):
        units = _value(result, rank, FSDP_UNITS)
        shards = _value(result, rank, SHARD_GROUP_SIZE)
        want = expected_reduce_scatters(policy, micro_batches, units, shards)
        if calls != want:
            raise CheckFailure(
                f"{head} over {units} FSDP units that ran, sharded {shards} ways: expected "
                f"reduce-scatters per micro-batch {want}, measured {calls} on rank {rank} "
                f"({REDUCE_SCATTER_CALLS_BY_MICRO_BATCH.key})"
            )


def check_retained_gradients(result: RunResult, policy: str, micro_batches: int, head: str) -> None:
    """h's memory: deferral holds unsharded gradients between micro-batches, syncing never does."""
    retained_key = RETAINED_GRAD_BYTES.key
    for rank, retained in _measured(result, RETAINED_GRAD_BYTES):
        holds = policy == SyncPolicy.DEFERRED and micro_batches > 1
        if holds and not retained > 0:
            raise CheckFailure(
                f"{head}: expected unsharded gradients held between micro-batches, measured "
                f"{retained_key} = {retained} on rank {rank}"
            )
        if not holds and retained != 0:
            raise CheckFailure(
                f"{head}: expected no unsharded gradients held between micro-batches, measured "
                f"{retained_key} = {retained} on rank {rank}"
            )


@judges("j")
def check_data_rows(result: RunResult) -> None:
    """j. Data-parallel ranks train on disjoint rows: the ranks that share rows are exactly one
    sequence-parallel group (sp_size ranks), and no row is trained by two groups. Read from the
    rows the harness handed each rank, so an engine whose data rank is wrong (an HSDP engine that
    takes it from the shard dimension) cannot hide behind a reference or twin that replays the
    same duplicated batch."""
    if declared(result).engine.world_size < 2:
        raise NotApplicable("one rank")
    rows: dict[int, list[int]] = dict(_measured(result, DATA_ROWS))
    sp = declared(result).engine.sp_size
    key = DATA_ROWS.key
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank, listed in sorted(rows.items()):
        groups.setdefault(tuple(sorted(listed)), []).append(rank)
    for shared, ranks in groups.items():
        if len(ranks) != sp:
            raise CheckFailure(
                f"check j: ranks {ranks} trained on the same rows {list(shared)[:8]}"
                f"{'...' if len(shared) > 8 else ''} ({key}); with sp_size {sp} "
                f"each row belongs to one data-parallel rank of {sp} rank(s)"
            )
    seen: dict[int, list[int]] = {}
    for shared, ranks in groups.items():
        for row in shared:
            if row in seen:
                raise CheckFailure(
                    f"check j: row {row} was trained by ranks {seen[row]} and by ranks {ranks} "
                    f"({key}): data-parallel ranks must hold disjoint rows"
                )
            seen[row] = ranks
