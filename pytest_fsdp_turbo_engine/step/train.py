"""Forward and backward over the micro-batches, under the engine's gradient-sync policy, measured
by the harness's probes (collectives per micro-batch, units that ran, retained gradients, the loss
and its gradient)."""

from __future__ import annotations

import torch

from pytest_fsdp_turbo_contract.records import LossRecord, TrainRecord
from pytest_fsdp_turbo_engine.core.reductions import all_max, all_sum
from pytest_fsdp_turbo_engine.core.train_batch import TrainBatch, ppo_loss
from pytest_fsdp_turbo_engine.engines.fsdp2 import local_tensor
from pytest_fsdp_turbo_engine.step import fsdp_probe
from pytest_fsdp_turbo_engine.step.batch import Collected
from pytest_fsdp_turbo_engine.step.measurements import MicroBatchProbe
from pytest_fsdp_turbo_engine.step.phases import phase_name
from pytest_fsdp_turbo_engine.step.rank import Rank

# LossRecord fields summed over micro-batches and ranks (each a token mean over the global batch)
SUMMED_PARTS = ("loss", "pg_loss", "pg_clipfrac", "ppo_kl", "kl_loss", "entropy")


def harness_micro_batches(ctx: Rank, batch: TrainBatch, tokens: float, probe: MicroBatchProbe):
    """The micro-batch loop for engines that leave it to the harness (ours and subclasses)."""
    engine = ctx.engine
    chunks = torch.arange(batch.size).chunk(ctx.cfg.micro_batches)
    for i, rows in enumerate(chunks):
        mb = batch.rows(rows)
        with engine.gradient_sync_context(is_last_micro_batch=i == len(chunks) - 1):
            lm_mean = None
            if ctx.cfg.lm_loss_coef and hasattr(engine, "forward_logprobs_with_lm_loss"):
                logprobs, entropy, lm_mean = engine.forward_logprobs_with_lm_loss(
                    mb.input_ids, mb.prompt_len, mb.mask
                )
            else:  # an engine without the model's loss path: the term in closed form
                logprobs, entropy = engine.forward_logprobs(
                    mb.input_ids, mb.prompt_len, with_entropy=True
                )
            loss, _ = ppo_loss(logprobs, entropy, mb, tokens, ctx.cfg, lm_mean)
            probe.loss_computed(logprobs, entropy, mb, lm_mean)
            (loss * ctx.dp_size).backward()  # FSDP averages over ranks; the loss is a sum


def train(
    ctx: Rank, collected: Collected, tokens: float, update: int = 1
) -> tuple[TrainRecord, LossRecord]:
    """Forward and backward per micro-batch under the engine's sync policy. Engines that run their
    own loop (verl's) get the probe through their loss function; the rest run the harness's loop.
    Every run sketches its whole gradient per parameter (rank 0 writes it) for a twin to judge: a
    run with the reference too, so judging it without the reference is a real twin-mode verdict."""
    ctx.phase.enter(phase_name("train", update))
    engine, module, batch = ctx.engine, ctx.engine.module, collected.batch
    with fsdp_probe.CollectiveCounter() as counter, fsdp_probe.UnitsThatRan(module) as ran:
        probe = MicroBatchProbe(module, tokens, ctx.cfg, counter, ctx.dp_size)
        if engine.drives_micro_batches:
            engine.forward_backward(batch, tokens, ctx.cfg, probe)
        else:
            harness_micro_batches(ctx, batch, tokens, probe)
    if ctx.faulty("nan"):
        grad = next(p.grad for p in module.parameters() if p.grad is not None)
        local_tensor(grad).view(-1)[0] = float("nan")
    sketch = fsdp_probe.gradient_sketch(module)  # every rank: collectives
    trained = TrainRecord(
        reduce_scatter_calls_by_micro_batch=counter.reduce_scatters,
        gradient_collectives_by_micro_batch=counter.gradient_collectives,
        replicate_group_size=fsdp_probe.replicate_group_size(module),
        reduce_scatter_calls=sum(counter.reduce_scatters),
        all_gather_calls=counter.all_gathers_total,
        fsdp_units=ran.count,
        shard_group_size=fsdp_probe.shard_group_size(module),
        layer_tokens=ran.layer_tokens,
        seq_len=int(batch.input_ids.shape[1]),
        # rows of the largest micro-batch: both loops split as torch.chunk does
        micro_batch_rows=-(-batch.size // ctx.cfg.micro_batches),
        data_rows=collected.rows,
        grad_sketch=sketch if ctx.rank == 0 else None,  # rank 0 writes it
        sp_size=ctx.sp,
        retained_grad_bytes=probe.retained,
        loss_grad_max_rel_err=probe.loss_grad_max_rel_err,
    )
    return trained, reduced_loss(ctx, probe)


def reduced_loss(ctx: Rank, probe: MicroBatchProbe) -> LossRecord:
    """The probe's per-rank sums and first-micro-batch values reduced to the whole run
    (sequence-parallel ranks counted once)."""
    device, sp, first = ctx.device, ctx.sp, probe.first
    if not probe.count:  # the engine's own loop never called the probe: nothing was measured
        return LossRecord()
    summed = {name: all_sum(probe.parts.get(name, 0.0), device) / sp for name in SUMMED_PARTS}
    return LossRecord(
        **summed,
        ppo_kl_first_micro_batch=all_max(abs(first["ppo_kl"]), device),
        pg_clipfrac_first_micro_batch=all_max(abs(first["pg_clipfrac"]), device),
        ppo_log_ratio_abs_max_first_micro_batch=all_max(probe.first_log_ratio_abs_max, device),
    )
