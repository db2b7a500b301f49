"""The project's names, defined once and torch-free, so the plugin and the ranks import the same
ones: device kinds, sync policies, launchers, twins, golden statuses, environment variables and
metric keys. The small closed sets are StrEnums (their members are the strings themselves, for
JSON, dict keys and comparisons); env variables and metric keys are plain string constants. Pytest
never imports this module at start-up: what it reads on every start lives in options.py."""

from __future__ import annotations

from enum import StrEnum

# the pytest-facing names live with the options (pytest reads them on every start)
from pytest_fsdp_turbo.options import KIND_BY_MARKER, MARKER_BY_KIND, SUMMARY_PROPERTY  # noqa: F401


class DeviceKind(StrEnum):
    CPU = "cpu"
    CUDA = "cuda"
    NPU = "npu"


class SyncPolicy(StrEnum):
    DEFERRED = "deferred"  # reduce-scatter only on the last micro-batch
    EVERY_MICRO_BATCH = "every_micro_batch"


class Launcher(StrEnum):
    LOCAL = "local"  # forked from this process's warm parent
    SPAWN = "spawn"  # fresh interpreters
    RAY = "ray"


class TwinKind(StrEnum):
    SINGLE = "single"
    EVERY_MICRO_BATCH = "every_micro_batch"
    NONE = "none"


# verl:<name>: an engine from verl's own EngineRegistry (verl:fsdp2, verl:fsdp_turbo)
VERL_PREFIX = "verl:"


class GoldenStatus(StrEnum):
    MATCHED = "matched"
    RECORDED = "recorded"
    MISSING = "missing"
    NOT_COMPARED = "not compared"


class Env:
    """Environment variables the harness reads or sets (options have their own, in settings)."""

    STATE_DIR = "PYTEST_FSDP_TURBO_STATE_DIR"
    ENGINE_MODULES = "PYTEST_FSDP_TURBO_ENGINE_MODULES"
    COLLECTIVE_TIMEOUT_S = "PYTEST_FSDP_TURBO_COLLECTIVE_TIMEOUT_S"
    CHECKOUT = "PYTEST_FSDP_TURBO_CHECKOUT"
    FAULT = "PYTEST_FSDP_TURBO_FAULT"
    LAUNCHED_AT = "PYTEST_FSDP_TURBO_LAUNCHED_AT"
    NO_FORK = "PYTEST_FSDP_TURBO_NO_FORK"
    WARM_SOCKET = "PYTEST_FSDP_TURBO_WARM_SOCKET"  # set by the harness for its descendants
    VLLM_MEMORY = "PYTEST_FSDP_TURBO_VLLM_MEMORY"


class Metric:
    """Keys of rankN.metrics.json, as the training world names them (plain strings, so a rank's
    metrics dict is plain JSON without conversion)."""

    ACTOR_ENTROPY = "actor/entropy"
    ACTOR_GRAD_NORM = "actor/grad_norm"
    ACTOR_GRAD_NORM_FINITE = "actor/grad_norm_finite"
    ACTOR_KL_LOSS = "actor/kl_loss"
    ACTOR_LOCAL_PARAM_NUMEL = "actor/local_param_numel"
    ACTOR_LOSS = "actor/loss"
    ACTOR_PARAM_UPDATE_MAX_ABS = "actor/param_update_max_abs"
    ACTOR_PG_CLIPFRAC = "actor/pg_clipfrac"
    ACTOR_PG_CLIPFRAC_FIRST_MICRO_BATCH = "actor/pg_clipfrac_first_micro_batch"
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
    SYNC_MICRO_BATCH_ROWS = "sync/micro_batch_rows"
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


def timing_key(phase: str) -> str:
    return f"timing_s/{phase}"


def metric_keys() -> list[str]:
    return [v for k, v in vars(Metric).items() if k.isupper()]
