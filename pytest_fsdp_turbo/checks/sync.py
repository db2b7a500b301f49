"""What the gradient-sync policy promises: h (reduce-scatters and every other gradient collective
per micro-batch, and the unsharded gradients held between them), j (data-parallel ranks train on
disjoint rows, laid out as the case declares) and f (memory within the case's budget)."""

from __future__ import annotations

from pytest_fsdp_turbo.checks.readings import (
    DATA_ROWS,
    ENGINE_DATA_GROUP,
    ENGINE_DATA_RANK,
    ENGINE_DATA_SIZE,
    FSDP_UNITS,
    GRADIENT_COLLECTIVES_BY_MICRO_BATCH,
    LAYER_TOKENS,
    MICRO_BATCH_ROWS,
    PEAK_MEMORY_BYTES,
    REDUCE_SCATTER_CALLS_BY_MICRO_BATCH,
    REPLICATE_GROUP_SIZE,
    RETAINED_GRAD_BYTES,
    SEQ_LEN,
    SHARD_GROUP_SIZE,
    _measured,
    _per_rank,
    _value,
    declared,
)
from pytest_fsdp_turbo.checks.verdicts import (
    CheckFailure,
    NotApplicable,
    judges,
)
from pytest_fsdp_turbo_contract.layout import data_parallel_ranks, sp_group
from pytest_fsdp_turbo_contract.results import RunResult
from pytest_fsdp_turbo_contract.vocab import CaseKindName, SyncPolicy

# FSDP2's collectives per unit on each synced backward (fsdp_probe.CollectiveCounter's kinds)
REDUCE_SCATTER, ALL_REDUCE = "reduce_scatter", "all_reduce"


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


def expected_gradient_collectives(
    policy: str, micro_batches: int, units: int, shard_group_size: int, replicas: int
) -> list[dict[str, int]]:
    """Every collective that carries parameter gradients, per micro-batch and kind: FSDP2's own,
    per FSDP unit that ran and synced backward, a reduce-scatter over the shard group (when it
    spans more than one rank) and, under HSDP, an all-reduce over the replicas; nothing else.
    Deferred syncs only on the last micro-batch: no gradient collective of any kind before it."""
    per_sync = {REDUCE_SCATTER: units} if shard_group_size > 1 else {}
    if replicas > 1:
        per_sync[ALL_REDUCE] = units
    if policy == SyncPolicy.DEFERRED:
        return [{} for _ in range(micro_batches - 1)] + [per_sync]
    return [dict(per_sync) for _ in range(micro_batches)]


def _kinds(per_micro_batch: list[dict[str, int]]) -> str:
    """[none, 5 reduce_scatter + 5 all_reduce]: one entry per micro-batch."""
    entries = [
        " + ".join(f"{n} {kind}" for kind, n in sorted(counts.items()) if n) or "none"
        for counts in per_micro_batch
    ]
    return f"[{', '.join(entries)}]"


@judges("h")
def check_sync_contract(result: RunResult) -> None:
    """h. What the declared gradient-sync policy promises is what the ranks measured: FSDP2's
    reduce-scatters, then every collective that carried parameter gradients, of any kind
    (fsdp_probe.CollectiveCounter says which do), per micro-batch; with sequence parallelism,
    each rank's decoder layers saw only its chunk of the sequence; and the unsharded gradients
    held between micro-batches."""
    spec = declared(result)
    policy, micro_batches = str(spec.engine.gradient_sync), spec.ppo.micro_batches
    head = (
        f"check h: case {result.case_id}: declared gradient_sync {policy!r} with "
        f"{micro_batches} micro-batches"
    )
    check_reduce_scatters(result, policy, micro_batches, head)
    check_gradient_collectives(result, policy, micro_batches, head)
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


def check_gradient_collectives(
    result: RunResult, policy: str, micro_batches: int, head: str
) -> None:
    """h's every gradient collective: an engine that declares deferral yet syncs its gradients
    each micro-batch by another collective than FSDP2's reduce-scatter (an all-reduce of each
    gradient, by hand) is red here, where the reduce-scatter counts alone read right."""
    key = GRADIENT_COLLECTIVES_BY_MICRO_BATCH.key
    for rank, calls in _measured(result, GRADIENT_COLLECTIVES_BY_MICRO_BATCH):
        units = _value(result, rank, FSDP_UNITS)
        shards = _value(result, rank, SHARD_GROUP_SIZE)
        replicas = _value(result, rank, REPLICATE_GROUP_SIZE)
        want = expected_gradient_collectives(policy, micro_batches, units, shards, replicas)
        if [{k: n for k, n in c.items() if n} for c in calls] != want:
            raise CheckFailure(
                f"{head} over {units} FSDP units that ran, sharded {shards} ways, "
                f"{replicas} replica(s): expected gradient collectives per micro-batch "
                f"{_kinds(want)}, measured {_kinds(calls)} on rank {rank} ({key}: every "
                "collective that carried parameter gradients, of any kind)"
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
    """j. Data-parallel ranks train on disjoint rows, laid out as the case declares: the ranks that
    share rows are exactly one sequence-parallel group (sp_size consecutive ranks), and no row is
    trained by two groups. Read from the rows each rank trained on (the harness hands them out by
    the declared layout, never by the rank the engine reports; a trainer's are observed), so a
    reference or twin that replays the same duplicated batch cannot hide it. And the engine's own
    data-parallel rank, size and group (where the run records them: the harness's PPO step does)
    must be the declared layout's: an engine that takes its data rank from elsewhere (an HSDP
    engine's shard dimension) would train other rows than the harness hands it in a trainer that
    asks it."""
    spec = declared(result).engine
    if spec.world_size < 2:
        raise NotApplicable("one rank")
    rows: dict[int, list[int]] = dict(_measured(result, DATA_ROWS))
    world, sp = spec.world_size, max(1, spec.sp_size)
    layout = f"the declared layout (world_size {world}, sp_size {sp})"
    key = DATA_ROWS.key
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank, listed in sorted(rows.items()):
        groups.setdefault(tuple(sorted(listed)), []).append(rank)
    for shared, ranks in groups.items():
        if ranks != sp_group(ranks[0], sp):
            who = (
                f"ranks {ranks} trained on the same rows"
                if len(ranks) > 1
                else f"rank {ranks[0]} alone trained on rows"
            )
            raise CheckFailure(
                f"check j: {who} {list(shared)[:8]}{'...' if len(shared) > 8 else ''} ({key}); "
                f"{layout} has ranks {sp_group(ranks[0], sp)} share them: each row belongs to "
                f"one data-parallel rank of {sp} consecutive rank(s)"
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
    check_reported_data_rank(result, world, sp, layout)


def check_reported_data_rank(result: RunResult, world: int, sp: int, layout: str) -> None:
    """j's engine side: each rank's reported data-parallel rank, size and group against the
    declared layout's. Required of the harness's PPO step, which records them; a run of another
    kind (a trainer, observed from outside) may not have them."""
    required = declared(result).kind == CaseKindName.PPO_STEP
    keys = ", ".join(r.key for r in (ENGINE_DATA_RANK, ENGINE_DATA_SIZE, ENGINE_DATA_GROUP))
    for rank, data_rank in _per_rank(result, ENGINE_DATA_RANK, required):
        if data_rank is None:
            continue
        size = _value(result, rank, ENGINE_DATA_SIZE)
        listed: list[int] = _value(result, rank, ENGINE_DATA_GROUP)
        group = sorted(listed)
        want = (rank // sp, world // sp, data_parallel_ranks(rank, world, sp))
        if (data_rank, size, group) != want:
            raise CheckFailure(
                f"check j: rank {rank}: the engine reports data-parallel rank {data_rank} of "
                f"{size}, over ranks {group} ({keys}); {layout} "
                f"makes it data-parallel rank {want[0]} of {want[1]}, over ranks {want[2]}"
            )
