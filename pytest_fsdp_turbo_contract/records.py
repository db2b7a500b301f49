"""What a rank measured: one typed record per phase of the step, and `StepMetrics`, the records of
one rank. A measurement has one name end to end: the record's field. Its key in rankN.metrics.json
is derived from it, `<namespace>/<field>` (the record's namespace unless the field names another),
as the training world names metrics (`actor/grad_norm`, `perf/step_time_s`); three keys verl
spells its own way say so where they are declared.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, ClassVar, Generic, TypeVar

# how the reference phase says the engine's parameter names are not the checkpoint's (check c)
NAMES_DIFFER = "parameter names differ from the reference's"
# The StepMetrics a failed step had filled ride on its exception under this attribute (the step
# sets it, the worker writes them as rankN.partial-metrics.json), so nothing measured is lost.
PARTIAL_METRICS_ATTR = "partial_metrics"
TIMING_PREFIX = "timing_s/"  # timing_s/<phase>: seconds from entering a phase to the next
STARTUP = "startup"  # timing_s/startup: launch to the rank's first phase
# How a field of a step with several updates is taken from the updates' own records:
FIRST = "first"  # the first, on-policy update's (counts, norms, the loss)
WORST = "worst"  # the largest over every update (errors against closed forms and references)
EACH = "each"  # every update's entries, the later ones named `<name> (update N)`


def metric(
    namespace: str | None = None,
    *,
    key: str | None = None,
    optional: bool = False,
    over_updates: str = FIRST,
) -> Any:
    """A record field. `namespace`: another than the record's; `key`: a key not derived from the
    field (verl's spelling); `optional`: written only when measured (not None), where the others
    are always written, None included (measured as not applicable)."""
    meta = {"namespace": namespace, "key": key, "optional": optional, "over_updates": over_updates}
    return field(default=None, metadata=meta)


def worst(values: Iterable[float | None]) -> float | None:
    """The largest of the measured values (None: none measured; NaN counts as infinite)."""
    measured = [math.inf if v != v else v for v in values if v is not None]
    return max(measured) if measured else None


_KEYS: dict[str, dict[str, str]] = {}  # record type's name -> field name -> metric key


def _keys_of(kind: type[Record]) -> dict[str, str]:
    """Field name -> metric key, derived once per record type."""
    if kind.__name__ not in _KEYS:
        _KEYS[kind.__name__] = {
            f.name: f.metadata["key"] or f"{f.metadata['namespace'] or kind.NAMESPACE}/{f.name}"
            for f in fields(kind)  # type: ignore[arg-type]
        }
    return _KEYS[kind.__name__]


class Record:
    """A group of measurements one phase takes."""

    NAMESPACE: ClassVar[str]
    PHASE: ClassVar[str]  # the step's phase that writes it (a missing reading names it)

    @classmethod
    def key(cls, name: str) -> str:
        """The metric key of field `name` (a KeyError names a field the record lacks)."""
        return _keys_of(cls)[name]

    @classmethod
    def metric_keys(cls) -> list[str]:
        return list(_keys_of(cls).values())

    def measured(self) -> bool:
        """Whether the phase ran: any field holds a value."""
        return any(getattr(self, f.name) is not None for f in fields(self))  # type: ignore[arg-type]

    def to_json(self) -> dict[str, Any]:
        out = {}
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if value is not None or not f.metadata["optional"]:
                out[_keys_of(type(self))[f.name]] = value
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Any:
        return cls(**{name: data.get(key) for name, key in _keys_of(cls).items()})

    @classmethod
    def over_updates(cls, records: Sequence[Any]) -> Any:
        """One record for a step of several updates, each field taken as it declares."""
        first, changes = records[0], dict[str, Any]()
        for f in fields(cls):  # type: ignore[arg-type]
            how = f.metadata["over_updates"]
            if how == WORST:
                changes[f.name] = worst(getattr(r, f.name) for r in records)
            elif how == EACH and getattr(first, f.name) is not None:
                merged = dict(getattr(first, f.name))
                for number, later in enumerate(records[1:], start=2):
                    entries = getattr(later, f.name) or {}
                    merged.update({f"{n} (update {number})": v for n, v in entries.items()})
                changes[f.name] = merged
        return replace(first, **changes)


@dataclass
class RankRecord(Record):
    """Where the rank ran, as it found itself: what a run declared is its spec (spec.json)."""

    NAMESPACE = "rank"
    PHASE = "load"
    rank: int | None = metric(key="rank")
    device: str | None = metric()  # the device it computed on (cpu, cuda:0, npu:3)
    replicas: int | None = metric()  # ranks holding the same shard as this one (HSDP), itself too
    # what the engine reports of its place, which checks d and j hold to the declared layout: its
    # data-parallel rank and size, the ranks of its data-parallel group, and of its replica group
    # (this rank alone where it reports none)
    engine_data_rank: int | None = metric(optional=True)
    engine_data_size: int | None = metric(optional=True)
    engine_data_group: list[int] | None = metric(optional=True)
    engine_replica_group: list[int] | None = metric(optional=True)
    # the engine class that trained (module.Class), where the harness reads it (a trainer run)
    engine: str | None = metric(optional=True)


@dataclass
class TrainRecord(Record):
    """The micro-batch loop: collectives per micro-batch, what the sync policy held back, and the
    loss's gradient on the log-probabilities against its closed form."""

    NAMESPACE = "sync"
    PHASE = "train"
    reduce_scatter_calls_by_micro_batch: list[int] | None = metric("comm")
    reduce_scatter_calls: int | None = metric("comm")
    all_gather_calls: int | None = metric("comm")
    fsdp_units: int | None = metric("comm")  # trainable units whose forward ran
    shard_group_size: int | None = metric("comm")
    # per micro-batch, collective kind -> the collectives that carried parameter gradients
    # (fsdp_probe.CollectiveCounter says which do)
    gradient_collectives_by_micro_batch: list[dict[str, int]] | None = metric("comm", optional=True)
    replicate_group_size: int | None = metric("comm", optional=True)  # HSDP: a shard's holders
    layer_tokens: int | None = metric()  # most tokens a decoder layer was handed at once
    seq_len: int | None = metric()
    micro_batch_rows: int | None = metric()  # rows of the largest micro-batch
    data_rows: list[int] | None = metric()  # the global batch rows this rank trained on
    # per parameter [norm, positional projection] of the whole gradient (no-reference runs, rank 0)
    grad_sketch: dict[str, list[float]] | None = metric(optional=True, over_updates=EACH)
    # a single twin computing in low precision, its first update: per parameter [norm, projection]
    # of the reference's gradient on the same batch in the engine's dtype, and that gradient's
    # relative L2 distance from fp32's (the run's sketch distance c allows a multiple of)
    grad_sketch_low: dict[str, list[float]] | None = metric(optional=True)
    sp_size: int | None = metric("case")
    retained_grad_bytes: int | None = (
        metric()
    )  # unsharded gradient bytes held between micro-batches
    # relative to its largest entry; worst over updates and micro-batches (inf: never arrived)
    loss_grad_max_rel_err: float | None = metric(over_updates=WORST)
    # a verl trainer run's micro-batch pair: the relative L2 distance between a parameter's
    # gradient over the k micro-batches and over one pass of the same mini-batch, worst parameter
    micro_batch_pair_rel_l2: float | None = metric(optional=True, over_updates=WORST)
    micro_batch_pair_param: str | None = metric(optional=True)


@dataclass
class ReferenceRecord(Record):
    """Gradients against the single-process reference (reference_checks on)."""

    NAMESPACE = "sync"
    PHASE = "reference"
    grad_max_rel_err: float | None = metric()  # worst parameter, relative to its largest entry
    grad_max_rel_err_param: str | None = metric()
    reference_grad_norm: float | None = metric()
    grad_rel_l2_err: float | None = metric(over_updates=WORST)
    # a run computing in low precision, rank 0: per parameter [the relative L2 distance of the
    # engine's gradient from the reference's computed in the engine's dtype, that one's from fp32]
    grad_param_rel_l2: dict[str, list[float]] | None = metric(optional=True, over_updates=EACH)

    @classmethod
    def over_updates(cls, records: Sequence[Any]) -> Any:
        """The worst update's parameter error with the parameter it names."""
        merged = super().over_updates(records)
        worst_update = max(records, key=lambda r: worst([r.grad_max_rel_err]) or 0.0)
        return replace(
            merged,
            grad_max_rel_err=worst_update.grad_max_rel_err,
            grad_max_rel_err_param=worst_update.grad_max_rel_err_param,
        )


@dataclass
class OptimizerRecord(Record):
    NAMESPACE = "actor"
    PHASE = "optimizer"
    grad_norm: float | None = metric()  # what the engine reports
    grad_norm_finite: bool | None = metric()
    grad_norm_measured: float | None = metric("sync")  # the harness's, from the sharded gradients
    param_update_max_abs: float | None = metric()  # this rank's own largest parameter change
    update_l2: float | None = metric()  # L2 norm of the whole model's parameter update
    local_param_numel: int | None = metric()
    # against AdamW in closed form, in units of lr; None: no finite norm
    adamw_step_max_err_lr: float | None = metric("sync", over_updates=WORST)
    # the gradients the optimizer stepped on against the harness's clip of the raw ones
    clip_max_rel_err: float | None = metric("sync", over_updates=WORST)
    clip_coef: float | None = metric("sync")  # min(1, max_norm / (measured norm + 1e-6))


@dataclass
class PostStepRecord(Record):
    """After the step: replicas, the weights handed to and served by the rollout, logprobs."""

    NAMESPACE = "sync"
    PHASE = "checks"
    replica_max_abs_diff: float | None = metric()
    rollout_logprob_max_abs_diff: float | None = metric()
    post_step_logprob_mean: float | None = metric("actor")  # token mean, global batch
    rollout_logprob_mean: float | None = metric(optional=True)  # the rollout's, after the push
    handoff_weight_max_abs_diff: float | None = metric(optional=True)
    handoff_weight_worst: str | None = metric(optional=True)
    rollout_weight_max_abs_diff: float | None = metric(optional=True)
    rollout_weight_worst: str | None = metric(optional=True)
    rollout_weights_compared: int | None = metric(optional=True)
    step_max_err_lr: float | None = metric(optional=True)  # against the reference's steps
    step_rel_l2_err: float | None = metric(optional=True)
    # the replay twin's post-step logprobs against the main run's, on the same batch
    post_step_logprob_max_abs_diff: float | None = metric("twin", optional=True)
    # how far the twin's updates moved its logprobs from the rollout's: the diff's scale
    post_step_logprob_moved: float | None = metric("twin", optional=True)


@dataclass
class ReplayRecord(Record):
    """The replay twin, before it trains: its own forward of the main run's batch against the old
    log-probs each of the run's ranks recorded for its rows. A rank whose numerics differ (one
    rank's kernel, one rank's cast) is off on its rows alone, which no total shows and which its
    own ratio cancels."""

    NAMESPACE = "twin"
    PHASE = "replay"
    old_logprob_max_abs_diff: float | None = metric()
    old_logprob_worst_row: int | None = metric()  # its index in the saved batch (batch.pt)


@dataclass
class RolloutRecord(Record):
    """What the rollout and reward handed the trainer, over the global batch."""

    NAMESPACE = "ppo"
    PHASE = "rollout"
    response_length_mean: float | None = metric(key="response_length/mean")
    advantages_abs_max: float | None = metric()
    score_mean: float | None = metric(key="critic/score/mean", optional=True)  # None: replayed
    # mean over response tokens of old - reference log-prob: > 0 when the KL reference is a step
    # away from the rollout policy (kl_reference_shift), so the KL term pulls on the first update
    kl_reference_gap_mean: float | None = metric()
    # SP chunk boundaries on response tokens that count, over the global batch (None: no SP)
    sp_boundaries_in_responses: int | None = metric(optional=True)


@dataclass
class LossRecord(Record):
    """The PPO loss parts over the global batch, and the first micro-batch's own values."""

    NAMESPACE = "actor"
    PHASE = "train"
    loss: float | None = metric()
    pg_loss: float | None = metric()
    pg_clipfrac: float | None = metric()
    ppo_kl: float | None = metric()
    kl_loss: float | None = metric()
    entropy: float | None = metric()
    ppo_kl_first_micro_batch: float | None = metric()
    pg_clipfrac_first_micro_batch: float | None = metric()
    # largest |logprob - old logprob| over the first micro-batch's response tokens
    ppo_log_ratio_abs_max_first_micro_batch: float | None = metric()
    # the last of several updates on one rollout: how far off-policy it trained
    pg_clipfrac_last_update: float | None = metric(optional=True)
    ppo_kl_last_update: float | None = metric(optional=True)

    @classmethod
    def over_updates(cls, records: Sequence[Any]) -> Any:
        first, last = records[0], records[-1]
        if len(records) == 1:
            return first
        return replace(
            first, pg_clipfrac_last_update=last.pg_clipfrac, ppo_kl_last_update=last.ppo_kl
        )


@dataclass
class PerfRecord(Record):
    NAMESPACE = "perf"
    PHASE = "metrics"
    step_time_s: float | None = metric()  # one update: what cases compare
    tokens_per_s: float | None = metric()
    peak_memory_bytes: int | None = metric()


@dataclass
class StepMetrics:
    """Everything one rank measured, a record per phase (a record nothing was measured in: the
    phase has not run, or does not apply). `to_json` is rankN.metrics.json, or after a failure the
    partial metrics, the records filled so far."""

    rank: RankRecord = field(default_factory=RankRecord)
    rollout: RolloutRecord = field(default_factory=RolloutRecord)
    replay: ReplayRecord = field(default_factory=ReplayRecord)  # a replay twin only
    train: TrainRecord = field(default_factory=TrainRecord)
    reference: ReferenceRecord = field(default_factory=ReferenceRecord)  # reference_checks on
    optimizer: OptimizerRecord = field(default_factory=OptimizerRecord)
    post_step: PostStepRecord = field(default_factory=PostStepRecord)
    loss: LossRecord = field(default_factory=LossRecord)
    perf: PerfRecord = field(default_factory=PerfRecord)
    timings: dict[str, float] = field(default_factory=dict)  # phase -> seconds

    RECORDS: ClassVar[dict[str, type[Record]]] = {}  # field name -> record type, set below

    def record(self, kind: type[Record]) -> Any:
        """This rank's record of type `kind`."""
        return next(getattr(self, name) for name, k in self.RECORDS.items() if k is kind)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in self.RECORDS:
            record = getattr(self, name)
            if record.measured():
                out.update(record.to_json())
        out.update({f"{TIMING_PREFIX}{phase}": s for phase, s in self.timings.items()})
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StepMetrics:
        records = {name: kind.from_json(data) for name, kind in cls.RECORDS.items()}
        timings = {
            k.removeprefix(TIMING_PREFIX): v for k, v in data.items() if k.startswith(TIMING_PREFIX)
        }
        return cls(**records, timings=timings)


StepMetrics.RECORDS.update(
    (name, kind)
    for name, kind in typing.get_type_hints(StepMetrics).items()
    if isinstance(kind, type) and issubclass(kind, Record)
)
# Written only by the in-rank single-process reference (reference_checks on): without them the
# checks judge a run as a run without a reference, whatever else it measured.
REFERENCE_KEYS = (
    *ReferenceRecord.metric_keys(),
    PostStepRecord.key("step_max_err_lr"),
    PostStepRecord.key("step_rel_l2_err"),
)


T = TypeVar("T")


class Reading(Generic[T]):
    """One measurement as a reader names it: `Reading(lambda m: m.optimizer.grad_norm)`, an
    attribute path mypy checks, which also knows its record, its metric key and the phase that
    writes it (for a message that says which reading is missing or off)."""

    def __init__(self, read: Callable[[StepMetrics], T | None]) -> None:
        self.of = read
        # run on metrics whose every field holds its own name: the path's own field
        try:
            named = read(_NAMED)
        except (TypeError, AttributeError, KeyError) as exc:
            raise TypeError(f"{_PATH_ONLY}; {type(exc).__name__}: {exc}") from None
        if not isinstance(named, _Named):
            raise TypeError(f"{_PATH_ONLY}; it gave a {type(named).__name__}")
        self.record, self.name = named.record, named.name

    @property
    def key(self) -> str:
        return self.record.key(self.name)

    def __repr__(self) -> str:
        return f"Reading({self.key})"


_PATH_ONLY = "a Reading reads one field, as `lambda m: m.<record>.<field>`"


@dataclass(frozen=True)
class _Named:
    """What a field of _NAMED holds: which field it is. Anything but reading it is refused, so a
    reader that computes (`or`, arithmetic, indexing) cannot be taken for the field it touched."""

    record: type[Record]
    name: str

    def __bool__(self) -> bool:
        raise TypeError("a field's value was used, not read")


_NAMED = StepMetrics(
    **{
        name: kind(**{f.name: _Named(kind, f.name) for f in fields(kind)})  # type: ignore[arg-type]
        for name, kind in StepMetrics.RECORDS.items()
    }
)
