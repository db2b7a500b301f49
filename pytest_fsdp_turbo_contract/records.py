"""What a rank measured: the step's typed records, each field written under its metric key in
rankN.metrics.json (`Metric` names the keys), and `StepMetrics`, the records of one rank."""

from __future__ import annotations

import typing
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

# how the reference phase says the engine's parameter names are not the checkpoint's (check c)
NAMES_DIFFER = "parameter names differ from the reference's"
# The StepMetrics a failed step had filled ride on its exception under this attribute (the step
# sets it, the worker writes them as rankN.partial-metrics.json), so nothing measured is lost.
PARTIAL_METRICS_ATTR = "partial_metrics"

# --- metric keys ----------------------------------------------------------------------------------


class Metric:
    """Keys of rankN.metrics.json, as the training world names them (plain strings, so a rank's
    metrics are plain JSON that goldens, junit and older artifacts read alike)."""

    ACTOR_ENTROPY = "actor/entropy"
    ACTOR_GRAD_NORM = "actor/grad_norm"
    ACTOR_GRAD_NORM_FINITE = "actor/grad_norm_finite"
    ACTOR_KL_LOSS = "actor/kl_loss"
    ACTOR_LOCAL_PARAM_NUMEL = "actor/local_param_numel"
    ACTOR_LOSS = "actor/loss"
    ACTOR_PARAM_UPDATE_MAX_ABS = "actor/param_update_max_abs"
    ACTOR_PG_CLIPFRAC = "actor/pg_clipfrac"
    ACTOR_PG_CLIPFRAC_FIRST_MICRO_BATCH = "actor/pg_clipfrac_first_micro_batch"
    # the last of several updates on one rollout: how far off-policy it trained
    ACTOR_PG_CLIPFRAC_LAST_UPDATE = "actor/pg_clipfrac_last_update"
    ACTOR_PPO_KL_LAST_UPDATE = "actor/ppo_kl_last_update"
    ACTOR_PG_LOSS = "actor/pg_loss"
    ACTOR_PPO_KL = "actor/ppo_kl"
    ACTOR_PPO_KL_FIRST_MICRO_BATCH = "actor/ppo_kl_first_micro_batch"
    # largest |logprob - old logprob| over the first micro-batch's response tokens
    ACTOR_PPO_LOG_RATIO_ABS_MAX_FIRST_MICRO_BATCH = "actor/ppo_log_ratio_abs_max_first_micro_batch"
    ACTOR_POST_STEP_LOGPROB_MEAN = "actor/post_step_logprob_mean"  # token mean, global batch
    ACTOR_UPDATE_L2 = "actor/update_l2"  # L2 norm of the whole model's parameter update
    CASE_DEVICE = "case/device"
    CASE_DTYPE = "case/dtype"
    CASE_MEMORY_BUDGET_MB = "case/memory_budget_mb"
    CASE_MICRO_BATCHES = "case/micro_batches"
    CASE_REFERENCE = "case/reference"
    CASE_REPLICAS = "case/replicas"
    CASE_SP_SIZE = "case/sp_size"
    CASE_SYNC_POLICY = "case/sync_policy"
    CASE_UPDATES = "case/updates"  # optimizer updates on the one rollout (2: the second off-policy)
    CASE_WORLD_SIZE = "case/world_size"
    COMM_ALL_GATHER_CALLS = "comm/all_gather_calls"
    COMM_FSDP_UNITS = "comm/fsdp_units"
    COMM_REDUCE_SCATTER_CALLS = "comm/reduce_scatter_calls"
    COMM_REDUCE_SCATTER_CALLS_BY_MICRO_BATCH = "comm/reduce_scatter_calls_by_micro_batch"
    COMM_SHARD_GROUP_SIZE = "comm/shard_group_size"
    CRITIC_SCORE_MEAN = "critic/score/mean"
    PERF_PEAK_MEMORY_BYTES = "perf/peak_memory_bytes"
    PERF_STEP_TIME_S = "perf/step_time_s"
    PERF_TOKENS_PER_S = "perf/tokens_per_s"
    PPO_ADVANTAGES_ABS_MAX = "ppo/advantages_abs_max"
    RESPONSE_LENGTH_MEAN = "response_length/mean"
    SYNC_GRAD_MAX_REL_ERR = "sync/grad_max_rel_err"
    SYNC_GRAD_MAX_REL_ERR_PARAM = "sync/grad_max_rel_err_param"
    SYNC_GRAD_NORM_MEASURED = "sync/grad_norm_measured"
    SYNC_GRAD_REL_L2_ERR = "sync/grad_rel_l2_err"
    SYNC_ADAMW_STEP_MAX_ERR_LR = "sync/adamw_step_max_err_lr"
    SYNC_HANDOFF_WEIGHT_MAX_ABS_DIFF = "sync/handoff_weight_max_abs_diff"
    SYNC_HANDOFF_WEIGHT_WORST = "sync/handoff_weight_worst"
    SYNC_LAYER_TOKENS = "sync/layer_tokens"
    # the loss's gradient on the log-probabilities the engine reported, against the harness's
    # closed form, relative to its largest entry; worst over updates and micro-batches
    SYNC_LOSS_GRAD_MAX_REL_ERR = "sync/loss_grad_max_rel_err"
    SYNC_MICRO_BATCH_ROWS = "sync/micro_batch_rows"
    # the gradients the optimizer stepped on against the harness's clip of the raw ones
    SYNC_CLIP_MAX_REL_ERR = "sync/clip_max_rel_err"
    SYNC_CLIP_COEF = "sync/clip_coef"  # min(1, max_norm / (measured norm + 1e-6))
    SYNC_DATA_ROWS = "sync/data_rows"  # the global batch rows this rank trained on
    # per parameter [norm, positional projection] of the whole gradient (no-reference runs, rank 0)
    SYNC_GRAD_SKETCH = "sync/grad_sketch"
    SYNC_REFERENCE_GRAD_NORM = "sync/reference_grad_norm"
    SYNC_REPLICA_MAX_ABS_DIFF = "sync/replica_max_abs_diff"
    SYNC_RETAINED_GRAD_BYTES = "sync/retained_grad_bytes"
    SYNC_SEQ_LEN = "sync/seq_len"
    SYNC_ROLLOUT_LOGPROB_MAX_ABS_DIFF = "sync/rollout_logprob_max_abs_diff"
    SYNC_ROLLOUT_LOGPROB_MEAN = "sync/rollout_logprob_mean"  # the rollout's, after the push
    SYNC_ROLLOUT_WEIGHT_MAX_ABS_DIFF = "sync/rollout_weight_max_abs_diff"
    SYNC_ROLLOUT_WEIGHT_WORST = "sync/rollout_weight_worst"
    SYNC_ROLLOUT_WEIGHTS_COMPARED = "sync/rollout_weights_compared"
    SYNC_STEP_MAX_ERR_LR = "sync/step_max_err_lr"
    SYNC_STEP_REL_L2_ERR = "sync/step_rel_l2_err"
    TIMING_PREFIX = "timing_s/"
    TIMING_S_STARTUP = "timing_s/startup"
    TWIN_POST_STEP_LOGPROB_MAX_ABS_DIFF = "twin/post_step_logprob_max_abs_diff"


# Written only by the in-rank single-process reference (reference_checks on): without them the checks
# judge a run as a run without a reference, whatever else it measured.
REFERENCE_METRICS = (
    Metric.SYNC_GRAD_MAX_REL_ERR,
    Metric.SYNC_GRAD_MAX_REL_ERR_PARAM,
    Metric.SYNC_GRAD_REL_L2_ERR,
    Metric.SYNC_REFERENCE_GRAD_NORM,
    Metric.SYNC_STEP_MAX_ERR_LR,
    Metric.SYNC_STEP_REL_L2_ERR,
)


RANK_KEY = "rank"  # which rank wrote the file (not a measurement, so not a Metric)


def timing_key(phase: str) -> str:
    return f"{Metric.TIMING_PREFIX}{phase}"


# --- the step's measurements as typed records -----------------------------------------------------


def metric(key: str, *, optional: bool = False) -> Any:
    """A record field written under `key` in rankN.metrics.json; an optional one only when it was
    measured (not None), the others always, None included (measured as not applicable)."""
    return field(default=None, metadata={"key": key, "optional": optional})


class Record:
    """A group of measurements one phase takes: `to_json` writes today's metric keys and
    `from_json` reads them back (None when the file holds none of them: the phase never ran)."""

    def to_json(self) -> dict[str, Any]:
        out = {}
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if value is not None or not f.metadata["optional"]:
                out[f.metadata["key"]] = value
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Any:
        keys = {f.name: f.metadata["key"] for f in fields(cls)}  # type: ignore[arg-type]
        if not any(key in data for key in keys.values()):
            return None
        return cls(**{name: data.get(key) for name, key in keys.items()})


@dataclass
class CaseRecord(Record):
    """What the run was, as the rank saw it (so a golden or a reader never needs the spec)."""

    rank: int | None = metric(RANK_KEY)
    device: str | None = metric(Metric.CASE_DEVICE)
    dtype: str | None = metric(Metric.CASE_DTYPE)
    sync_policy: str | None = metric(Metric.CASE_SYNC_POLICY)
    world_size: int | None = metric(Metric.CASE_WORLD_SIZE)
    micro_batches: int | None = metric(Metric.CASE_MICRO_BATCHES)
    reference: bool | None = metric(Metric.CASE_REFERENCE)
    memory_budget_mb: float | None = metric(Metric.CASE_MEMORY_BUDGET_MB)
    replicas: int | None = metric(Metric.CASE_REPLICAS)
    updates: int | None = metric(Metric.CASE_UPDATES)


@dataclass
class TrainRecord(Record):
    """The micro-batch loop: collectives per micro-batch and what the sync policy held back."""

    reduce_scatter_calls_by_micro_batch: list[int] | None = metric(
        Metric.COMM_REDUCE_SCATTER_CALLS_BY_MICRO_BATCH
    )
    reduce_scatter_calls: int | None = metric(Metric.COMM_REDUCE_SCATTER_CALLS)
    all_gather_calls: int | None = metric(Metric.COMM_ALL_GATHER_CALLS)
    fsdp_units: int | None = metric(Metric.COMM_FSDP_UNITS)
    shard_group_size: int | None = metric(Metric.COMM_SHARD_GROUP_SIZE)
    layer_tokens: int | None = metric(Metric.SYNC_LAYER_TOKENS)
    seq_len: int | None = metric(Metric.SYNC_SEQ_LEN)
    micro_batch_rows: int | None = metric(Metric.SYNC_MICRO_BATCH_ROWS)
    data_rows: list[int] | None = metric(Metric.SYNC_DATA_ROWS)
    grad_sketch: dict[str, list[float]] | None = metric(Metric.SYNC_GRAD_SKETCH, optional=True)
    sp_size: int | None = metric(Metric.CASE_SP_SIZE)
    retained_grad_bytes: int | None = metric(Metric.SYNC_RETAINED_GRAD_BYTES)
    loss_grad_max_rel_err: float | None = metric(Metric.SYNC_LOSS_GRAD_MAX_REL_ERR)


@dataclass
class ReferenceRecord(Record):
    """Gradients against the single-process reference (reference_checks on)."""

    grad_max_rel_err: float | None = metric(Metric.SYNC_GRAD_MAX_REL_ERR)
    grad_max_rel_err_param: str | None = metric(Metric.SYNC_GRAD_MAX_REL_ERR_PARAM)
    reference_grad_norm: float | None = metric(Metric.SYNC_REFERENCE_GRAD_NORM)
    grad_rel_l2_err: float | None = metric(Metric.SYNC_GRAD_REL_L2_ERR)


@dataclass
class OptimizerRecord(Record):
    grad_norm: float | None = metric(Metric.ACTOR_GRAD_NORM)  # what the engine reports
    grad_norm_finite: bool | None = metric(Metric.ACTOR_GRAD_NORM_FINITE)
    grad_norm_measured: float | None = metric(Metric.SYNC_GRAD_NORM_MEASURED)  # the harness's
    param_update_max_abs: float | None = metric(Metric.ACTOR_PARAM_UPDATE_MAX_ABS)
    update_l2: float | None = metric(Metric.ACTOR_UPDATE_L2)
    local_param_numel: int | None = metric(Metric.ACTOR_LOCAL_PARAM_NUMEL)
    adamw_step_max_err_lr: float | None = metric(Metric.SYNC_ADAMW_STEP_MAX_ERR_LR)
    clip_max_rel_err: float | None = metric(Metric.SYNC_CLIP_MAX_REL_ERR)
    clip_coef: float | None = metric(Metric.SYNC_CLIP_COEF)


@dataclass
class PostStepRecord(Record):
    """After the step: replicas, the weights handed to and served by the rollout, logprobs."""

    replica_max_abs_diff: float | None = metric(Metric.SYNC_REPLICA_MAX_ABS_DIFF)
    rollout_logprob_max_abs_diff: float | None = metric(Metric.SYNC_ROLLOUT_LOGPROB_MAX_ABS_DIFF)
    post_step_logprob_mean: float | None = metric(Metric.ACTOR_POST_STEP_LOGPROB_MEAN)
    rollout_logprob_mean: float | None = metric(Metric.SYNC_ROLLOUT_LOGPROB_MEAN, optional=True)
    handoff_weight_max_abs_diff: float | None = metric(
        Metric.SYNC_HANDOFF_WEIGHT_MAX_ABS_DIFF, optional=True
    )
    handoff_weight_worst: str | None = metric(Metric.SYNC_HANDOFF_WEIGHT_WORST, optional=True)
    rollout_weight_max_abs_diff: float | None = metric(
        Metric.SYNC_ROLLOUT_WEIGHT_MAX_ABS_DIFF, optional=True
    )
    rollout_weight_worst: str | None = metric(Metric.SYNC_ROLLOUT_WEIGHT_WORST, optional=True)
    rollout_weights_compared: int | None = metric(
        Metric.SYNC_ROLLOUT_WEIGHTS_COMPARED, optional=True
    )
    step_max_err_lr: float | None = metric(Metric.SYNC_STEP_MAX_ERR_LR, optional=True)
    step_rel_l2_err: float | None = metric(Metric.SYNC_STEP_REL_L2_ERR, optional=True)
    twin_post_step_logprob_max_abs_diff: float | None = metric(
        Metric.TWIN_POST_STEP_LOGPROB_MAX_ABS_DIFF, optional=True
    )


@dataclass
class LossRecord(Record):
    """The PPO loss parts over the global batch, and the first micro-batch's own values."""

    loss: float | None = metric(Metric.ACTOR_LOSS)
    pg_loss: float | None = metric(Metric.ACTOR_PG_LOSS)
    pg_clipfrac: float | None = metric(Metric.ACTOR_PG_CLIPFRAC)
    ppo_kl: float | None = metric(Metric.ACTOR_PPO_KL)
    kl_loss: float | None = metric(Metric.ACTOR_KL_LOSS)
    entropy: float | None = metric(Metric.ACTOR_ENTROPY)
    ppo_kl_first_micro_batch: float | None = metric(Metric.ACTOR_PPO_KL_FIRST_MICRO_BATCH)
    pg_clipfrac_first_micro_batch: float | None = metric(Metric.ACTOR_PG_CLIPFRAC_FIRST_MICRO_BATCH)
    ppo_log_ratio_abs_max_first_micro_batch: float | None = metric(
        Metric.ACTOR_PPO_LOG_RATIO_ABS_MAX_FIRST_MICRO_BATCH
    )
    response_length_mean: float | None = metric(Metric.RESPONSE_LENGTH_MEAN)
    advantages_abs_max: float | None = metric(Metric.PPO_ADVANTAGES_ABS_MAX)
    score_mean: float | None = metric(Metric.CRITIC_SCORE_MEAN, optional=True)
    pg_clipfrac_last_update: float | None = metric(
        Metric.ACTOR_PG_CLIPFRAC_LAST_UPDATE, optional=True
    )
    ppo_kl_last_update: float | None = metric(Metric.ACTOR_PPO_KL_LAST_UPDATE, optional=True)


@dataclass
class PerfRecord(Record):
    step_time_s: float | None = metric(Metric.PERF_STEP_TIME_S)
    tokens_per_s: float | None = metric(Metric.PERF_TOKENS_PER_S)
    peak_memory_bytes: int | None = metric(Metric.PERF_PEAK_MEMORY_BYTES)


@dataclass
class StepMetrics:
    """Everything one rank measured, a record per phase filled as the phase ends (None: it has not
    run, or does not apply); `to_json` is rankN.metrics.json, or after a failure the partial
    metrics, the records filled so far."""

    case: CaseRecord | None = None
    train: TrainRecord | None = None
    reference: ReferenceRecord | None = None  # reference_checks on
    optimizer: OptimizerRecord | None = None
    post_step: PostStepRecord | None = None
    loss: LossRecord | None = None
    perf: PerfRecord | None = None
    timings: dict[str, float] = field(default_factory=dict)  # timing_s/<phase>

    RECORDS: ClassVar[dict[str, type[Record]]] = {}  # field name -> record type, set below

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in self.RECORDS:
            record = getattr(self, name)
            if record is not None:
                out.update(record.to_json())
        out.update(self.timings)
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StepMetrics:
        records = {name: kind.from_json(data) for name, kind in cls.RECORDS.items()}
        timings = {k: v for k, v in data.items() if k.startswith(Metric.TIMING_PREFIX)}
        return cls(**records, timings=timings)


StepMetrics.RECORDS.update(
    (name, kind)
    for name, hint in typing.get_type_hints(StepMetrics).items()
    for kind in typing.get_args(hint)  # `CaseRecord | None` -> CaseRecord
    if isinstance(kind, type) and issubclass(kind, Record)
)
