"""What the checks read: each rank's measurements through typed `Reading`s (an attribute path of
its records, which mypy checks and which knows its metric key and phase), and what the run declared
through its spec. A check that applies and finds its reading missing fails, naming it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, TypeVar, cast

from pytest_fsdp_turbo.checks.verdicts import CheckFailure
from pytest_fsdp_turbo_contract.records import Reading, StepMetrics
from pytest_fsdp_turbo_contract.results import RankResult, RunResult
from pytest_fsdp_turbo_contract.spec import RankSpec
from pytest_fsdp_turbo_contract.vocab import TwinKind

# The readings the checks judge: each an attribute path of a rank's records (mypy checks it),
# which also knows its metric key and the phase that writes it.
ADAMW_STEP_MAX_ERR_LR = Reading(lambda m: m.optimizer.adamw_step_max_err_lr)
ADVANTAGES_ABS_MAX = Reading(lambda m: m.rollout.advantages_abs_max)
CLIP_COEF = Reading(lambda m: m.optimizer.clip_coef)
CLIP_MAX_REL_ERR = Reading(lambda m: m.optimizer.clip_max_rel_err)
DATA_ROWS = Reading(lambda m: m.train.data_rows)
FSDP_UNITS = Reading(lambda m: m.train.fsdp_units)
GRAD_MAX_REL_ERR = Reading(lambda m: m.reference.grad_max_rel_err)
REFERENCE_GRAD_NORM = Reading(lambda m: m.reference.reference_grad_norm)
GRAD_NORM = Reading(lambda m: m.optimizer.grad_norm)
GRAD_NORM_MEASURED = Reading(lambda m: m.optimizer.grad_norm_measured)
GRAD_REL_L2_ERR = Reading(lambda m: m.reference.grad_rel_l2_err)
GRAD_PARAM_REL_L2 = Reading(lambda m: m.reference.grad_param_rel_l2)
GRAD_SKETCH = Reading(lambda m: m.train.grad_sketch)
GRAD_SKETCH_LOW = Reading(lambda m: m.train.grad_sketch_low)
# what the engine reports of its place, beside the harness's own layout (checks d and j)
ENGINE_DATA_RANK = Reading(lambda m: m.rank.engine_data_rank)
ENGINE_DATA_SIZE = Reading(lambda m: m.rank.engine_data_size)
ENGINE_DATA_GROUP = Reading(lambda m: m.rank.engine_data_group)
ENGINE_REPLICA_GROUP = Reading(lambda m: m.rank.engine_replica_group)
# every collective that carried parameter gradients, per micro-batch (check h)
GRADIENT_COLLECTIVES_BY_MICRO_BATCH = Reading(lambda m: m.train.gradient_collectives_by_micro_batch)
REPLICATE_GROUP_SIZE = Reading(lambda m: m.train.replicate_group_size)
HANDOFF_WEIGHT_MAX_ABS_DIFF = Reading(lambda m: m.post_step.handoff_weight_max_abs_diff)
KL_REFERENCE_GAP_MEAN = Reading(lambda m: m.rollout.kl_reference_gap_mean)
LAYER_TOKENS = Reading(lambda m: m.train.layer_tokens)
LOCAL_PARAM_NUMEL = Reading(lambda m: m.optimizer.local_param_numel)
LOSS = Reading(lambda m: m.loss.loss)
LOSS_GRAD_MAX_REL_ERR = Reading(lambda m: m.train.loss_grad_max_rel_err)
MICRO_BATCH_PAIR_REL_L2 = Reading(lambda m: m.train.micro_batch_pair_rel_l2)
MICRO_BATCH_ROWS = Reading(lambda m: m.train.micro_batch_rows)
OLD_LOGPROB_MAX_ABS_DIFF = Reading(lambda m: m.replay.old_logprob_max_abs_diff)
OLD_LOGPROB_WORST_ROW = Reading(lambda m: m.replay.old_logprob_worst_row)
PARAM_UPDATE_MAX_ABS = Reading(lambda m: m.optimizer.param_update_max_abs)
PEAK_MEMORY_BYTES = Reading(lambda m: m.perf.peak_memory_bytes)
PG_CLIPFRAC = Reading(lambda m: m.loss.pg_clipfrac)
PG_CLIPFRAC_FIRST_MICRO_BATCH = Reading(lambda m: m.loss.pg_clipfrac_first_micro_batch)
PG_CLIPFRAC_LAST_UPDATE = Reading(lambda m: m.loss.pg_clipfrac_last_update)
POST_STEP_LOGPROB_MAX_ABS_DIFF = Reading(lambda m: m.post_step.post_step_logprob_max_abs_diff)
PPO_KL = Reading(lambda m: m.loss.ppo_kl)
PPO_KL_FIRST_MICRO_BATCH = Reading(lambda m: m.loss.ppo_kl_first_micro_batch)
PPO_LOG_RATIO_ABS_MAX_FIRST_MICRO_BATCH = Reading(
    lambda m: m.loss.ppo_log_ratio_abs_max_first_micro_batch
)
REDUCE_SCATTER_CALLS_BY_MICRO_BATCH = Reading(lambda m: m.train.reduce_scatter_calls_by_micro_batch)
REPLICA_MAX_ABS_DIFF = Reading(lambda m: m.post_step.replica_max_abs_diff)
RETAINED_GRAD_BYTES = Reading(lambda m: m.train.retained_grad_bytes)
ROLLOUT_LOGPROB_MAX_ABS_DIFF = Reading(lambda m: m.post_step.rollout_logprob_max_abs_diff)
ROLLOUT_WEIGHT_MAX_ABS_DIFF = Reading(lambda m: m.post_step.rollout_weight_max_abs_diff)
SEQ_LEN = Reading(lambda m: m.train.seq_len)
SHARD_GROUP_SIZE = Reading(lambda m: m.train.shard_group_size)
SP_BOUNDARIES_IN_RESPONSES = Reading(lambda m: m.rollout.sp_boundaries_in_responses)
STEP_MAX_ERR_LR = Reading(lambda m: m.post_step.step_max_err_lr)
STEP_REL_L2_ERR = Reading(lambda m: m.post_step.step_rel_l2_err)

T = TypeVar("T")


def declared(result: RunResult) -> RankSpec:
    """What the ranks were asked to do: the declared values every check reads."""
    spec = result.spec()
    if spec is None:
        raise CheckFailure(
            f"case {result.case_id}: no readable spec.json in {result.artifacts_dir}, which "
            "says what the ranks were asked to do"
        )
    return spec


def declares_reference(result: RunResult) -> bool:
    """The case asked for the in-rank single-process reference (reference_checks)."""
    return bool(declared(result).ppo.reference_checks)  # a rank's spec holds the answer


def declares_twin(result: RunResult) -> bool:
    """The case asked for a replay twin (single or every_micro_batch)."""
    return result.twin_kind in (TwinKind.SINGLE, TwinKind.EVERY_MICRO_BATCH)


def declares_replicas(result: RunResult) -> bool:
    """HSDP: a parameter is sharded over fewer ranks than the world (fsdp_size x sp_size)."""
    engine = declared(result).engine
    return engine.fsdp_size * engine.sp_size < engine.world_size


def _dtype(result: RunResult) -> str:
    """The parameters' dtype the run declared; a spec that declares none (a trainer run whose
    config could not be read) is the device kind's default, as a case's `auto` is."""
    spec = declared(result)
    return str(spec.engine.dtype_on(spec.device_kind))


def _rank0(result: RunResult) -> StepMetrics:
    return result.ranks[0].step


def _read(result: RunResult, rank: int, reading: Reading[T], required: bool) -> T | None:
    """One rank's `reading`. A rank whose record holds nothing (or, `required`, whose reading
    holds nothing) fails, naming the metric and the rank's log."""
    step = result.ranks[rank].step
    value = reading.of(step)
    if not step.record(reading.record).measured() or (required and value is None):
        raise CheckFailure(missing(result, rank, reading))
    return value


def missing(result: RunResult, rank: int, reading: Reading) -> str:
    """A check that applies found no reading: it fails, naming the reading and the phase."""
    return (
        f"rank {rank}: metric {reading.key!r} missing: the case declares what this check "
        f"judges, and phase {reading.record.PHASE!r} should have written it "
        f"(log {result.ranks[rank].log_path})"
    )


def _per_rank(
    result: RunResult, reading: Reading[T], required: bool = False
) -> Iterator[tuple[int, T | None]]:
    """(rank, its reading) for every rank, read as _read reads it."""
    for ranked in result.ranks:
        yield ranked.rank, _read(result, ranked.rank, reading, required)


def _measured(result: RunResult, reading: Reading[T]) -> Iterator[tuple[int, T]]:
    """(rank, its reading) for every rank, each of which must hold a value."""
    for ranked in result.ranks:
        yield ranked.rank, _value(result, ranked.rank, reading)


def _value(result: RunResult, rank: int, reading: Reading[T]) -> T:
    """One rank's reading, which must hold a value."""
    return cast(T, _read(result, rank, reading, required=True))


def _first_above(
    result: RunResult, reading: Reading[float], tolerance: float
) -> tuple[int, float] | None:
    """The first rank whose reading is above `tolerance` (NaN counts as above), or None; a rank
    without the reading fails."""
    for rank, value in _measured(result, reading):
        if not value <= tolerance:
            return rank, value
    return None


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def first_missing(
    result: RunResult, readings: tuple[Reading[Any], ...]
) -> tuple[RankResult, Reading[Any]] | None:
    """The first rank, in rank order, without one of `readings`, and the reading; None when every
    rank has them all (checks that apply by declaration name what is missing)."""
    for ranked in result.ranks:
        for reading in readings:
            if reading.of(ranked.step) is None:
                return ranked, reading
    return None
