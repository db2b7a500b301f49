"""The contract between the plugin and its ranks, torch-free so both sides import it: what a rank is
asked to do (`RankSpec`), what it measured (`Metric` keys and the step's typed records), what it
left behind (`RunFolder`, the one owner of artifact file names), and how a run ended (`RankError`,
`RankResult`, `RunResult`). Both sides read and write these types; nothing else names a metric key
or an artifact file."""

from __future__ import annotations

import json
import os
import typing
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar, overload

from pytest_fsdp_turbo.vocab import DeviceKind, Dtype, Rollout, SyncPolicy

# how the reference phase says the engine's parameter names are not the checkpoint's (check c)
NAMES_DIFFER = "parameter names differ from the reference's"
LOG_TAIL_LINES = 30
LOG_TAIL_BYTES = 8192  # a rank that printed megabytes without a newline still gets a short tail
FOLLOWER_CHARS = 160  # a rank that failed after the first one: its exception line, cut
# what a rank's collective says when a peer it waits on died (gloo, NCCL, HCCL, the store)
PEER_GONE = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Socket Timeout",
    "connection refused",
    "communicator was aborted",
    "NCCL error",
    "HCCL",
)
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


def metric_keys() -> list[str]:
    return [v for k, v in vars(Metric).items() if k.isupper() and not k.endswith("_PREFIX")]


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


# --- what a rank is asked to do -------------------------------------------------------------------


@dataclass(frozen=True)
class EngineSpec:
    """The engine's part of a rank's spec: what an engine's constructor is handed."""

    world_size: int
    fsdp_size: int  # ranks one parameter is sharded over (the whole world for plain FSDP)
    backend: str = "fsdp"
    sp_size: int = 1
    dtype: Dtype = Dtype.FP32  # bf16: bf16 params, fp32 gradient reduction
    sync_policy: SyncPolicy = SyncPolicy.DEFERRED
    lr: float = 1e-4
    grad_clip: float = 1.0
    weight_decay: float = 0.0  # AdamW; the reference step and the closed form use the same
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    turbo_config: dict = field(default_factory=dict)
    packed: bool = False  # one packed row per micro-batch, with position_ids and cu_seqlens


@dataclass(frozen=True)
class PPOSpec:
    prompts: str = "nearest_char"
    num_prompts: int = 4  # global, split across data-parallel ranks
    n: int = 4  # responses per prompt (a GRPO group)
    max_new_tokens: int = 12
    micro_batches: int = 2
    clip_ratio: float = 0.2
    clip_ratio_c: float = 3.0
    kl_coef: float = 0.001
    entropy_coef: float = 0.0
    # a causal-LM (NLL) term on the response tokens, token mean over the global batch; our engines
    # compute it through the model's own loss path with labels (the library's SP loss patch)
    lm_loss_coef: float = 0.0
    # optimizer updates on the one rollout's batch: from the second on, the policy has moved away
    # from the one that sampled it, so PPO's clip, the KL term and the response mask shape the loss
    updates: int = 1
    rollout: Rollout = Rollout.HF
    seed: int = 7
    reference_checks: bool = True  # single-process reference gradients, fingerprint (tiny models)
    replay: str = ""  # twin runs: the main run's artifact folder, whose saved batch is replayed


@dataclass(frozen=True)
class RankSpec:
    """spec.json: everything a rank needs, built by the case for one device kind."""

    case_id: str
    model_path: str
    model_type: str
    device_kind: DeviceKind
    engine: EngineSpec
    ppo: PPOSpec
    memory_budget_mb: float | None = None
    engine_modules: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RankSpec:
        engine, ppo = data["engine"], data["ppo"]
        return cls(
            **{
                **data,
                "device_kind": DeviceKind(data["device_kind"]),
                "engine": EngineSpec(
                    **{
                        **engine,
                        "dtype": Dtype(engine["dtype"]),
                        "sync_policy": SyncPolicy(engine["sync_policy"]),
                    }
                ),
                "ppo": PPOSpec(**{**ppo, "rollout": Rollout(ppo["rollout"])}),
                "engine_modules": tuple(data.get("engine_modules", ())),
            }
        )

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=1))

    @classmethod
    def read(cls, path: Path) -> RankSpec:
        return cls.from_json(json.loads(path.read_text()))


# --- what a run leaves behind ---------------------------------------------------------------------


class _File:
    """One file of a run folder: its path on a folder, its name on the class (for globs)."""

    def __init__(self, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, folder: None, owner: type) -> str: ...

    @overload
    def __get__(self, folder: RunFolder, owner: type) -> Path: ...

    def __get__(self, folder: RunFolder | None, owner: type) -> Path | str:
        return self.name if folder is None else folder.path / self.name


class _RankFile:
    """One file per rank, rank<N>.<suffix>: on a folder, the function from a rank to its path."""

    def __init__(self, suffix: str) -> None:
        self.suffix = suffix

    def __get__(self, folder: RunFolder, owner: type) -> Callable[[int], Path]:
        return lambda rank: folder.path / f"rank{rank}.{self.suffix}"


@dataclass(frozen=True)
class RunFolder:
    """One run's artifact folder: the one place its file names are spelled."""

    path: Path

    spec = _File("spec.json")  # the RankSpec every rank reads
    case = _File("case.json")  # the case as resolved, overrides applied
    env = _File("env.json")  # the ranks' environment, secrets masked
    timeline = _File("timeline.json")  # (rank, phase, start, end) rows
    launcher_log = _File("launcher.log")  # port retries
    batch = _File("batch.pt")  # the global training batch, for a twin to replay
    post_step = _File("post_step.pt")  # the global post-step logprobs on that batch
    log = _RankFile("log")
    metrics = _RankFile("metrics.json")  # written last: the rank's success marker
    partial_metrics = _RankFile("partial-metrics.json")  # what a failed rank measured
    error = _RankFile("error.json")  # a RankError
    phases = _RankFile("phases.jsonl")  # followed live by the progress reporter
    grads = _RankFile("grads.json")  # the gradient fingerprint (rank 0, with a reference)
    RANK_FILES: ClassVar[str] = "rank*"  # everything per rank, moved aside on a retried attempt

    @property
    def twin(self) -> RunFolder:
        return RunFolder(self.path / "twin")


def read_json(path: Path) -> Any:
    """A result file, or None when it is missing or half-written (a rank killed mid-write)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# --- how a run ended ------------------------------------------------------------------------------


@dataclass
class RankError:
    """rankN.error.json: where a rank was and what it raised."""

    rank: int
    phase: str
    type: str
    message: str
    traceback: str = ""
    time: float | None = None  # wall clock: which rank raised first

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> RankError | None:
        if not isinstance(data, dict):
            return None
        known = {f.name for f in fields(cls)}
        try:
            error = cls(**{k: v for k, v in data.items() if k in known})
        except TypeError:  # a half-written or foreign file: no error we can read
            return None
        if not isinstance(error.time, int | float):
            error.time = None
        return error


@dataclass
class RankResult:
    rank: int
    exit_code: int | None
    duration_s: float
    log_path: Path
    metrics: dict | None = None  # rankN.metrics.json as written (StepMetrics.from_json types it)
    error: RankError | None = None

    @classmethod
    def read(
        cls, folder: RunFolder, rank: int, exit_code: int | None, duration_s: float, log: Path
    ) -> RankResult:
        metrics = read_json(folder.metrics(rank))
        error = RankError.from_json(read_json(folder.error(rank)))
        return cls(rank, exit_code, duration_s, log, metrics, error)

    @property
    def step(self) -> StepMetrics | None:
        return StepMetrics.from_json(self.metrics) if self.metrics else None

    def log_tail(self, lines: int = LOG_TAIL_LINES, without: str = "") -> str:
        """The log's last lines; `without`: a text (the traceback already shown) left out."""
        try:
            with open(self.log_path, "rb") as log:
                size = log.seek(0, os.SEEK_END)
                # enough for the traceback to be recognised and left out, then cut to the tail
                log.seek(max(0, size - LOG_TAIL_BYTES - 4 * len(without)))
                text = log.read().decode(errors="replace")
        except OSError:
            return "(no log)"
        if without.strip():
            text = text.replace(without.strip(), "(the traceback above)")
        tail = "\n".join(text.splitlines()[-lines:])
        if len(tail) > LOG_TAIL_BYTES:
            tail = f"(... {len(tail) - LOG_TAIL_BYTES} characters cut)" + tail[-LOG_TAIL_BYTES:]
        return tail


@dataclass
class RunResult:
    case_id: str
    world_size: int
    ranks: list[RankResult]
    artifacts_dir: Path
    duration_s: float
    timed_out: bool = False
    timeout_s: float = 0.0
    first_failure: int | None = None
    notes: list[str] = field(default_factory=list)
    twin: RunResult | None = None  # the replay twin's run, when the case has one
    twin_kind: str = ""  # single | every_micro_batch
    failure: str = ""  # why the group as a whole failed (its launcher died), when it did

    @classmethod
    def launcher_failed(
        cls, case_id: str, world_size: int, artifacts_dir: Path, why: str, duration_s: float = 0.0
    ) -> RunResult:
        """A run whose ranks never reported: the launcher (warm parent, Ray driver) is gone."""
        folder = RunFolder(artifacts_dir)
        ranks = [
            RankResult(
                rank,
                None,
                duration_s,
                folder.log(rank),
                error=RankError.from_json(read_json(folder.error(rank))),
            )
            for rank in range(world_size)
        ]
        return cls(case_id, world_size, ranks, artifacts_dir, duration_s, failure=why)

    @property
    def folder(self) -> RunFolder:
        return RunFolder(self.artifacts_dir)

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(r.exit_code == 0 and r.metrics for r in self.ranks)

    @property
    def metrics(self) -> dict:
        """Rank 0's metrics (every key is reduced across ranks where it needs to be)."""
        return self.ranks[0].metrics or {}

    def spec(self) -> RankSpec | None:
        """What the ranks were launched with (a run that failed before its metrics still has it)."""
        try:
            return RankSpec.read(self.folder.spec)
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def first_failed(self) -> RankResult | None:
        """The rank that failed first (None when no single rank did: a timeout, the group)."""
        return next((r for r in self.ranks if r.rank == self.first_failure), None)

    def _followers_in_one_line(self, first: RankResult | None) -> bool:
        """Whether the ranks that failed after the first get one line each: not after a hang
        (the case's timeout, or a collective that timed out), where every rank's stacks are the
        story, nor when the group as a whole failed."""
        hang = (
            first is not None
            and first.error is not None
            and ("timed out" in first.error.message.lower())
        )
        return not (self.timed_out or self.failure or hang or first is None)

    def _follower_line(self, rank: RankResult, told: dict) -> str:
        error = rank.error
        if error is None:
            return f"stopped after rank {self.first_failure} failed"
        key = (error.phase, error.type, error.message)
        if key in told:
            return f"phase {error.phase}: {error.type}: as rank {told[key]}"
        told[key] = rank.rank
        line = (error.message.strip().splitlines() or [""])[0][:FOLLOWER_CHARS]
        waiting = any(mark in error.message for mark in PEER_GONE)
        tail = f" (waiting for rank {self.first_failure})" if waiting else ""
        return f"phase {error.phase}: {error.type}: {line}{tail}"

    def failure_text(self) -> str:
        if self.ok:
            return ""
        if self.failure:
            head = f"case {self.case_id}: {self.failure}"
        elif self.timed_out:
            head = (
                f"case {self.case_id}: timed out after {self.timeout_s:g}s; Python stacks of "
                "every rank are in the log tails below"
            )
        else:
            head = f"case {self.case_id}: rank {self.first_failure} failed first"
        first = self.first_failed()
        group_failed = self.failure or self.timed_out
        first_error = first.error if first is not None and not group_failed else None
        if first_error is not None:  # the first rank's cause, before anything else
            head += f" in phase {first_error.phase}: {first_error.type}: {first_error.message}"
        one_line = self._followers_in_one_line(first)
        parts = [head, f"artifacts: {self.artifacts_dir}"]
        told: dict[tuple[str, str, str], int] = {}  # an error every rank raised is shown once
        # the rank that failed first, then the others in rank order
        for rank in sorted(self.ranks, key=lambda r: r.rank != self.first_failure):
            if rank.exit_code == 0 and rank.metrics and not self.timed_out:
                continue
            where = f"--- rank {rank.rank}: exit {rank.exit_code}, log {rank.log_path}"
            if one_line and rank is not first:  # what it did, not its traceback or log tail
                parts.append(f"{where}: {self._follower_line(rank, told)}")
                continue
            parts.append(where)
            if rank.exit_code == 0 and not rank.metrics:
                parts.append("exited with code 0 without writing its results (did it call exit?)")
            error = rank.error
            if error is None:
                parts.append("log tail:\n" + rank.log_tail())
                continue
            key = (error.phase, error.type, error.message)
            if key in told:
                parts.append(f"phase {error.phase}: {error.type}: as rank {told[key]}")
                continue
            told[key] = rank.rank
            trace = error.traceback.rstrip().splitlines()
            if trace and error.message and trace[-1].endswith(error.message):
                trace = trace[:-1]  # the exception line: its message is in the head line
            cause = f"phase {error.phase}: {error.type}: {error.message}"
            shown = [] if first_error is error else [cause]  # the head has the first one
            parts.append("\n".join([*shown, *trace]))
            parts.append("log tail:\n" + rank.log_tail(without=error.traceback))
        return "\n".join(parts)
