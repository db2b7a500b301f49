"""After the step: replicas, the reference's parameters, the weights handed to and served by the
rollout, and the post-step log-probabilities (a twin's against its main run's)."""

from __future__ import annotations

from pathlib import Path

import torch

from pytest_fsdp_turbo_contract.artifacts import RunFolder
from pytest_fsdp_turbo_contract.records import PostStepRecord
from pytest_fsdp_turbo_contract.vocab import Dtype
from pytest_fsdp_turbo_engine.core.reductions import all_max, all_sum, gather_rows
from pytest_fsdp_turbo_engine.core.train_batch import TrainBatch
from pytest_fsdp_turbo_engine.rollout import weight_handoff
from pytest_fsdp_turbo_engine.step import fsdp_probe
from pytest_fsdp_turbo_engine.step.measurements import replica_max_abs_diff
from pytest_fsdp_turbo_engine.step.rank import Rank
from pytest_fsdp_turbo_engine.step.reference import max_abs_error, relative_l2_error
from pytest_fsdp_turbo_engine.step.reference_run import ReferenceRun


def post_step(
    ctx: Rank,
    batch: TrainBatch,
    tokens: float,
    ref_run: ReferenceRun | None,
    record: PostStepRecord,
) -> None:
    """Replicas (the declared layout's), the reference's steps, the weights handed to and served by
    the rollout, and the post-step log-probabilities (a twin's against the main run's, which it
    saves for the twin). Token means are over the global batch, sequence-parallel ranks counted
    once. `record` is the step's own, filled as each measurement is taken: a failure half-way
    keeps what it measured."""
    ctx.phase.enter("checks")
    engine, device = ctx.engine, ctx.device
    record.replica_max_abs_diff = replica_max_abs_diff(
        engine.module, ctx.layout.replica_group, device
    )
    trainer: dict[str, torch.Tensor] = {}
    full: dict[str, torch.Tensor] = {}
    if ref_run is not None or ctx.rollout is not None:  # a replay twin has neither: no gathering
        # the parameters as the harness reads them off the module (aliases: every name of a tied
        # one), and one name per tied group
        trainer = fsdp_probe.unsharded_parameters(engine.module, aliases=True)
        full = {n: trainer[n] for n in fsdp_probe.parameter_names(engine.module)}
    if ref_run is not None:  # every update stepped the copy as the engine's was stepped
        initial = ref_run.initial
        want = {n: p.detach() for n, p in ref_run.copy.named_parameters()}
        record.step_max_err_lr, _ = max_abs_error(full, want, scale=ctx.engine_cfg.lr)
        shared = [n for n in full if n in initial]  # names that differ fail check c by name
        record.step_rel_l2_err = relative_l2_error(
            {n: full[n].cpu() - initial[n].cpu() for n in shared},
            {n: want[n] - initial[n] for n in want},
        )
    with torch.no_grad():
        logprobs, _ = engine.forward_logprobs(batch.input_ids, batch.prompt_len)
    record.post_step_logprob_mean = (
        all_sum(float((logprobs * batch.mask).sum()), device) / ctx.sp / tokens
    )
    if ctx.rollout is not None:
        handoff_dtype = torch.bfloat16 if ctx.engine_cfg.dtype == Dtype.BF16 else torch.float32
        handed = engine.full_state_dict()  # the engine's hand-off: the thing under test
        handoff = weight_handoff.compare_handoff(handed, trainer, set(full), handoff_dtype)
        ctx.rollout.load_weights(handed)
        served, packed = ctx.rollout.served_weights()
        served_diff = weight_handoff.compare(served, trainer, packed, handoff_dtype)
        with ctx.unsharded():
            rollout_lp = ctx.rollout.logprobs(batch.input_ids, batch.prompt_len)
        diff = float(((logprobs - rollout_lp).abs() * batch.mask).max())
        record.rollout_logprob_max_abs_diff = all_max(diff, device)
        rollout_sum = all_sum(float((rollout_lp * batch.mask).sum()), device)
        record.rollout_logprob_mean = rollout_sum / ctx.sp / tokens
        record.handoff_weight_max_abs_diff = handoff.max_abs_diff
        record.handoff_weight_worst = handoff.worst
        record.rollout_weight_max_abs_diff = served_diff.max_abs_diff
        record.rollout_weight_worst = served_diff.worst
        record.rollout_weights_compared = served_diff.compared
    if ctx.replaying:
        compared = twin_comparison(ctx, batch, logprobs)
        record.post_step_logprob_max_abs_diff, record.post_step_logprob_moved = compared
    else:
        gathered = gather_rows(logprobs, ctx.layout.data_group)
        if ctx.rank == 0:
            torch.save({"logprobs": gathered}, RunFolder(ctx.out).post_step)


def twin_comparison(ctx: Rank, batch: TrainBatch, logprobs: torch.Tensor) -> tuple[float, float]:
    """Twin only: post-step logprobs against the main run's, on the same global batch; and how
    far the twin's own updates moved them from the rollout's (the scale of what could differ)."""
    group = ctx.layout.data_group
    mine, mask = gather_rows(logprobs, group), gather_rows(batch.mask, group)
    old = gather_rows(batch.old_logprobs, group)
    main = torch.load(RunFolder(Path(ctx.cfg.replay)).post_step, weights_only=True)
    diff = float(((mine - main["logprobs"]).abs() * mask).max())
    return diff, float(((mine - old).abs() * mask).max())
