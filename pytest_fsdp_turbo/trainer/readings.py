"""The observer's readings of a trainer run, as the harness's typed records (rankN.metrics.json) and
the run's spec.json, so goldens, the summary table, junit properties and the checks read a trainer
run as they read every case. What was declared comes from verl's resolved config (TrainerDeclared);
what was measured comes from the observer's files; verl's own step metrics fill the loss, rollout
and timing records (the goldens' keys are verl's spelling already)."""

from __future__ import annotations

import json
import math
from typing import Any

from pytest_fsdp_turbo.trainer.verl_config import TrainerDeclared
from pytest_fsdp_turbo_contract.artifacts import RunFolder
from pytest_fsdp_turbo_contract.records import (
    LossRecord,
    OptimizerRecord,
    PerfRecord,
    RankRecord,
    ReferenceRecord,
    RolloutRecord,
    StepMetrics,
    TrainRecord,
)
from pytest_fsdp_turbo_contract.spec import RankSpec
from pytest_fsdp_turbo_contract.trainer_files import TrainerFolder
from pytest_fsdp_turbo_contract.trainer_records import (
    ObservedRank,
    ObservedStep,
    ReplayedStep,
    first_step_metrics,
    read_ranks,
    read_replay,
)
from pytest_fsdp_turbo_contract.trainer_spec import TrainerSpec
from pytest_fsdp_turbo_contract.vocab import CaseKindName, Dtype, Rollout

# verl's step metric -> (record type, field)
FROM_VERL = {
    "actor/pg_loss": (LossRecord, "pg_loss"),
    "actor/entropy": (LossRecord, "entropy"),
    "actor/kl_loss": (LossRecord, "kl_loss"),
    "actor/pg_clipfrac": (LossRecord, "pg_clipfrac"),
    "actor/ppo_kl": (LossRecord, "ppo_kl"),
    "critic/score/mean": (RolloutRecord, "score_mean"),
    "response_length/mean": (RolloutRecord, "response_length_mean"),
    "timing_s/step": (PerfRecord, "step_time_s"),
}


def rank_readings(folder: TrainerFolder) -> dict[int, ObservedRank]:
    """rank -> the observer's record of it (only ranks that wrote a readable one)."""
    return read_ranks(folder.ranks())


def combined_norm(
    readings: dict[int, ObservedRank], world_size: int, index: int = 0
) -> float | None:
    """The global L2 norm from every rank's raw gradient shard (replicas hold the same shards)."""
    steps = [r.steps[index] for r in readings.values() if len(r.steps) > index]
    sums = [s.shard_grad_sq for s in steps]
    if len(steps) < world_size or any(v is None for v in sums):
        return None
    replicas = max(1, world_size // max(1, steps[0].shard_group_size or 1))
    return math.sqrt(sum(v for v in sums if v is not None) / replicas)


def _dtype(precision: str) -> Dtype:
    """verl's precision (trainer_spec.precision) as the tolerances know it: fp16 held to bf16's."""
    return Dtype.FP32 if precision == "fp32" else Dtype.BF16


def run_spec_json(
    declared: TrainerDeclared | None, spec: TrainerSpec, shard: int, refused: bool = False
) -> dict[str, Any]:
    """spec.json of a trainer run, in the harness's terms: what the case and verl's resolved config
    declare, and nothing else (a key the config does not hold is left out, never defaulted; with
    no readable config, what the case declares alone)."""
    base: dict[str, Any] = {
        "kind": CaseKindName.VERL_TRAINER,
        "case_id": spec.case_id,
        "model_path": spec.model_path,
        "device_kind": spec.device_kind,
        "timeout_s": spec.timeout_s,
        "golden_tier": spec.golden_tier,
    }
    if declared is None:
        return {**base, "engine": {"world_size": spec.world_size}, "ppo": {}}
    engine: dict[str, Any] = {
        "world_size": spec.world_size,
        "fsdp_size": shard,
        "backend": f"verl:{declared.strategy}",
        "sp_size": declared.sp_size,
        # the numerics' dtype, which the tolerances follow: FSDP's mixed-precision compute dtype
        # (the fp32 master parameters are the model dtype)
        "dtype": _dtype(declared.compute_dtype),
        "gradient_sync": declared.gradient_sync,
        "grad_clip": declared.grad_clip,
        "lr": declared.lr,
        "weight_decay": declared.weight_decay,
    }
    if declared.betas is not None:
        engine["adam_beta1"], engine["adam_beta2"] = declared.betas
    ppo: dict[str, Any] = {
        "micro_batches": declared.micro_batches or 0,  # 0: dynamic batch sizes
        "rollout": Rollout.VLLM if declared.rollout == "vllm" else Rollout.HF,
        "rollout_replicas": declared.rollout_replicas,
        "rollout_dtype": declared.rollout_dtype,
        # what the reference refuses to model (replay.json says) is no reference to hold it to
        "reference_checks": spec.reference and not refused,
        "micro_batch_pair": spec.micro_batch_pair,
        "updates": declared.updates,
        "n": declared.n,
        "num_prompts": declared.num_prompts,
        "max_new_tokens": declared.max_new_tokens,
        "clip_ratio": declared.clip_ratio,
    }
    return {
        **base,
        "engine": {k: v for k, v in engine.items() if v is not None},
        "ppo": {k: v for k, v in ppo.items() if v is not None},
        "golden_dtype": _dtype(declared.compute_dtype),
    }


def run_spec(declared: TrainerDeclared | None, spec: TrainerSpec, shard: int) -> RankSpec:
    return RankSpec.from_json(json.loads(json.dumps(run_spec_json(declared, spec, shard))))


def write_rank_metrics(
    folder: TrainerFolder, declared: TrainerDeclared | None, spec: TrainerSpec
) -> None:
    """spec.json (always: it names the run's kind), rankN.metrics.json for each rank the observer
    read (its first optimizer step, as every case's), and each later step's beside it."""
    readings = rank_readings(folder)
    run = RunFolder(folder.path)
    shard = next(
        (r.steps[0].shard_group_size or 1 for r in readings.values() if r.steps), spec.world_size
    )
    replay = read_replay(folder.replay) if spec.reference else None
    refused = replay is not None and bool(replay.refused)
    run.spec.write_text(json.dumps(run_spec_json(declared, spec, shard, refused), indent=1))
    replayed = {s.step: s for s in replay.steps} if replay is not None else {}
    clip = None if declared is None else declared.grad_clip
    stepped = max((len(r.steps) for r in readings.values()), default=0)
    for index in range(stepped):
        verl = first_step_metrics(folder.step_metrics) if index == 0 else {}
        for rank, metrics in step_metrics(readings, index, spec, clip, replayed.get(index)):
            for key, (record, name) in FROM_VERL.items():
                if isinstance(verl.get(key), int | float):
                    setattr(metrics.record(record), name, verl[key])
            written = {k: v for k, v in metrics.to_json().items() if v is not None}
            path = run.metrics(rank) if index == 0 else folder.step_metrics_of(index, rank)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(written, indent=1))


def step_metrics(
    readings: dict[int, ObservedRank],
    index: int,
    spec: TrainerSpec,
    clip: float | None,
    replayed: ReplayedStep | None,
) -> list[tuple[int, StepMetrics]]:
    """Each rank's reading of optimizer step `index`, in the records every case writes."""
    measured = combined_norm(readings, spec.world_size, index)
    steps = {rank: r.steps[index] for rank, r in readings.items() if len(r.steps) > index}
    data_rows = _row_ids({rank: step.rows for rank, step in steps.items()})
    peaks = [s.advantages_abs_max for s in steps.values() if s.advantages_abs_max is not None]
    coef = None if measured is None or clip is None else min(1.0, clip / (measured + 1e-6))
    pair = pair_distance([step.micro_batch_pair for step in steps.values()], spec.world_size)
    out = []
    for rank, step in steps.items():
        shard = step.shard_group_size or 1
        metrics = StepMetrics()
        metrics.rank = RankRecord(
            rank=rank,
            device=str(spec.device_kind),
            replicas=spec.world_size // shard,
            engine=readings[rank].engine_class or None,
        )
        calls = step.reduce_scatters_by_micro_batch
        metrics.train = TrainRecord(
            reduce_scatter_calls_by_micro_batch=calls,
            reduce_scatter_calls=sum(calls),
            gradient_collectives_by_micro_batch=step.gradient_collectives_by_micro_batch,
            fsdp_units=step.fsdp_units,
            shard_group_size=step.shard_group_size,
            replicate_group_size=spec.world_size // shard,
            retained_grad_bytes=max(step.retained_grad_bytes or [0]),
            data_rows=data_rows.get(rank),
        )
        if pair is not None:
            metrics.train.micro_batch_pair_rel_l2 = pair[0]
            metrics.train.micro_batch_pair_param = pair[1]
        reported = step.reported_grad_norm
        metrics.optimizer = OptimizerRecord(
            grad_norm=reported,
            grad_norm_finite=None if reported is None else math.isfinite(reported),
            grad_norm_measured=measured,
            clip_coef=coef,
            clip_max_rel_err=_clip_error(step, coef),
        )
        metrics.rollout.advantages_abs_max = max(peaks) if peaks else None
        if replayed is not None:  # the reference's reading of this step, where declared
            metrics.reference = ReferenceRecord(
                grad_max_rel_err=replayed.grad_max_rel_err,
                grad_max_rel_err_param=replayed.grad_max_rel_err_param or None,
                reference_grad_norm=replayed.reference_grad_norm,
                grad_rel_l2_err=replayed.grad_rel_l2_err,
            )
        out.append((rank, metrics))
    return out


def pair_distance(
    shards: list[dict[str, list[float]] | None], world_size: int
) -> tuple[float, str] | None:
    """The micro-batch pair's worst parameter: the relative L2 distance between its gradient in
    one pass and over the k micro-batches, from every rank's shard sums (a replica's shards add
    to both sums alike). None unless every rank paired and some parameter was compared."""
    if len(shards) < world_size or any(shard is None for shard in shards):
        return None
    sums: dict[str, list[float]] = {}
    for shard in shards:
        for name, (diff, norm) in (shard or {}).items():
            total = sums.setdefault(name, [0.0, 0.0])
            total[0] += diff
            total[1] += norm
    distances = [
        (math.sqrt(diff / norm) if norm > 0 else (math.inf if diff > 0 else 0.0), name)
        for name, (diff, norm) in sorted(sums.items())
    ]
    if not distances:  # nothing compared is no reading
        return None
    return max(distances, key=lambda d: math.inf if d[0] != d[0] else d[0])  # NaN: the worst


def _clip_error(step: ObservedStep, coef: float | None) -> float | None:
    """How far the gradients the optimizer stepped on are from the raw ones times the clip
    coefficient: the fitted scale's relative distance from it, or what the scale leaves
    unexplained, whichever is larger."""
    if coef is None or step.stepped_residual is None:
        return None
    if step.stepped_scale is None:  # no raw gradient on this shard: what it stepped on, as is
        return step.stepped_residual
    return max(abs(step.stepped_scale - coef) / coef, step.stepped_residual)


def _row_ids(rows: dict[int, list[str]]) -> dict[int, list[int]]:
    """Row numbers for check j, from each rank's mini-batch (its rows' token digests): ranks
    whose whole mini-batches are equal share one set of numbers (a Ulysses group, or data ranks
    handed the same rows); any other two ranks' numbers are apart, because two sampled responses
    may well be token for token the same (a short answer), and that is no shared row."""
    ids: dict[int, list[int]] = {}
    batches: dict[tuple[str, ...], list[int]] = {}
    for rank, digests in sorted(rows.items()):
        if digests:
            batches.setdefault(tuple(sorted(digests)), []).append(rank)
    first = 0
    for batch, ranks in batches.items():
        for rank in ranks:
            ids[rank] = list(range(first, first + len(batch)))
        first += len(batch)
    return ids
