"""One PPO step, phase after phase; the records kept as they come, so a failure keeps every record
filled before it."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from pytest_fsdp_turbo_contract.artifacts import RunFolder
from pytest_fsdp_turbo_contract.records import (
    PARTIAL_METRICS_ATTR,
    LossRecord,
    OptimizerRecord,
    PerfRecord,
    RankRecord,
    ReferenceRecord,
    StepMetrics,
    TrainRecord,
)
from pytest_fsdp_turbo_contract.spec import RankSpec
from pytest_fsdp_turbo_engine.core.reductions import all_sum
from pytest_fsdp_turbo_engine.rank_env import RankEnv
from pytest_fsdp_turbo_engine.step.batch import collect, replay_record, replayed, rollout_record
from pytest_fsdp_turbo_engine.step.measurements import peak_memory_bytes
from pytest_fsdp_turbo_engine.step.optimizer_step import HarnessAdamW, optimizer
from pytest_fsdp_turbo_engine.step.phases import Phase
from pytest_fsdp_turbo_engine.step.post_step import post_step
from pytest_fsdp_turbo_engine.step.rank import load, reported_layout
from pytest_fsdp_turbo_engine.step.reference_run import (
    ReferenceRun,
    low_precision_sketch,
    reference,
)
from pytest_fsdp_turbo_engine.step.train import train


@dataclass
class StepOutput:
    metrics: StepMetrics
    grads_fingerprint: dict | None = None


def run_ppo_step(spec: RankSpec, place: RankEnv, phase: Phase, out: Path) -> StepOutput:
    """What was measured so far rides on any exception as `partial_metrics`, so nothing is lost."""
    metrics = StepMetrics()
    try:
        return _run(spec, place, phase, out, metrics)
    except BaseException as exc:
        setattr(exc, PARTIAL_METRICS_ATTR, metrics)
        raise


def _run(
    spec: RankSpec, place: RankEnv, phase: Phase, out: Path, metrics: StepMetrics
) -> StepOutput:
    rank = place.rank
    ctx = load(spec, place, phase, out)
    cfg, device, folder = ctx.cfg, ctx.device, RunFolder(out)
    # the declared layout's replicas, and beside it what the engine reports (checks d and j)
    metrics.rank = RankRecord(
        rank=rank,
        device=str(device),
        replicas=len(ctx.layout.replica_ranks),
        **reported_layout(ctx.engine, rank),
    )
    step_start = time.perf_counter()
    collected = replayed(ctx) if ctx.replaying else collect(ctx)
    batch = collected.batch
    if ctx.replaying:
        metrics.replay = replay_record(ctx, collected)
    group = ctx.layout.data_group  # the declared layout's, never the engine's
    # Ranks of one sequence-parallel group share their batch: count it once per data-parallel rank.
    tokens = all_sum(float(batch.mask.sum()), device, group)
    metrics.rollout = rollout_record(ctx, collected, tokens)
    global_batch = batch.gather(group) if not ctx.replaying else None
    if global_batch is not None and rank == 0:
        global_batch.save(folder.batch)

    # Every update trains the same batch; the step's records combine the updates' own, each field
    # as its record declares (the first, on-policy update's counts; the worst errors).
    ref_run: ReferenceRun | None = None
    adamw = HarnessAdamW()
    trained: list[TrainRecord] = []
    losses: list[LossRecord] = []
    referenced: list[ReferenceRecord] = []
    stepped: list[OptimizerRecord] = []
    for number in range(1, cfg.updates + 1):
        train_record, loss_record = train(ctx, collected, tokens, number)
        if ctx.replaying and number == 1 and ctx.engine_cfg.world_size == 1:  # a single twin
            train_record.grad_sketch_low = low_precision_sketch(ctx, batch, tokens)
        trained.append(train_record)
        losses.append(loss_record)
        metrics.train = TrainRecord.over_updates(trained)
        metrics.loss = LossRecord.over_updates(losses)
        if cfg.reference_checks and global_batch is not None:  # not when replaying
            with ctx.unsharded():
                ref_run = ref_run or ReferenceRun.of(ctx)  # after the first train: its memory
                referenced.append(reference(ctx, ref_run, global_batch, tokens, number))
            metrics.reference = ReferenceRecord.over_updates(referenced)
        stepped.append(optimizer(ctx, adamw, number))
        metrics.optimizer = OptimizerRecord.over_updates(stepped)
        if number == 1:
            step_time = time.perf_counter() - step_start  # one update: what cases compare
        if ref_run is not None:
            ref_run.step(bool(stepped[-1].grad_norm_finite))

    post_step(ctx, batch, tokens, ref_run, metrics.post_step)
    phase.enter("metrics")
    global_tokens = all_sum(float(batch.input_ids.numel()), device) / ctx.sp
    metrics.perf = PerfRecord(
        step_time_s=step_time,
        tokens_per_s=global_tokens / step_time,
        peak_memory_bytes=peak_memory_bytes(device),
    )
    metrics.timings = phase.timings(place.launched_at)
    return StepOutput(metrics, ref_run.fingerprint if ref_run is not None else None)
