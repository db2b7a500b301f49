"""The single-process reference: an unsharded copy of the initial policy whose gradients on the
global batch the engine's are held to, stepped by its own AdamW across updates."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from pytest_fsdp_turbo_contract.records import ReferenceRecord
from pytest_fsdp_turbo_contract.vocab import Dtype
from pytest_fsdp_turbo_engine.core.reductions import broadcast_tensors
from pytest_fsdp_turbo_engine.core.train_batch import TrainBatch
from pytest_fsdp_turbo_engine.rollout.hf_rollout import HFRollout
from pytest_fsdp_turbo_engine.step import fsdp_probe
from pytest_fsdp_turbo_engine.step.fsdp_probe import sketch
from pytest_fsdp_turbo_engine.step.phases import phase_name
from pytest_fsdp_turbo_engine.step.rank import Rank
from pytest_fsdp_turbo_engine.step.reference import (
    ReferenceOptimizer,
    fingerprint,
    gradient_norm,
    low_precision_gradients,
    max_abs_error,
    name_mismatch,
    per_parameter_distance,
    reference_gradients,
    relative_l2_error,
)


def single_process_copy(ctx: Rank) -> torch.nn.Module:
    """The initial policy, unsharded: the HF rollout already holds one; otherwise load it."""
    if isinstance(ctx.rollout, HFRollout):
        return ctx.rollout.model
    from pytest_fsdp_turbo_engine.core.hf_model import load_pretrained

    model = load_pretrained(ctx.spec.model_path, dtype=torch.float32)
    return model.to(ctx.device)


@dataclass
class ReferenceRun:
    """The single-process reference across updates: its copy of the policy, the copy's parameters
    before the first update, and AdamW stepping the copy on the reference's own gradients."""

    copy: torch.nn.Module
    initial: dict[str, torch.Tensor]
    optimizer: ReferenceOptimizer
    grads: dict[str, torch.Tensor] = field(default_factory=dict)  # the latest update's
    norm: float = 0.0  # their global norm
    fingerprint: dict | None = None  # rank 0: the engine's first-update gradients, for policies

    @classmethod
    def of(cls, ctx: Rank) -> ReferenceRun:
        copy = single_process_copy(ctx)
        initial = {n: p.detach().clone() for n, p in copy.named_parameters()}
        return cls(copy, initial, ReferenceOptimizer(copy, ctx.engine_cfg))

    def step(self, norm_finite: bool) -> None:
        """The engine skips the update on a non-finite norm; so does the reference."""
        if norm_finite:
            self.optimizer.step(self.grads, self.norm)


def shared_reference_gradients(
    ctx: Rank, copy: torch.nn.Module, global_batch: TrainBatch, tokens: float
) -> dict[str, torch.Tensor]:
    """The copy's gradients on the global batch, computed by rank 0 and broadcast: the numbers
    every rank would compute alike (one batch, one checkpoint, one process each), paid once
    instead of once per rank."""
    grads = reference_gradients(copy, global_batch, tokens, ctx.cfg) if ctx.rank == 0 else {}
    return broadcast_tensors(grads, ctx.device)


def reference(
    ctx: Rank, ref_run: ReferenceRun, global_batch: TrainBatch, tokens: float, update: int = 1
) -> ReferenceRecord:
    """The engine's gradients, read by the harness, against the copy's on the global batch."""
    ctx.phase.enter(phase_name("reference", update))
    sharded = fsdp_probe.unsharded_gradients(ctx.engine.module)  # read by the harness
    ref_run.grads = grads = shared_reference_gradients(ctx, ref_run.copy, global_batch, tokens)
    ref_run.norm = gradient_norm(grads)
    err, name = max_abs_error(sharded, grads)
    names = fsdp_probe.parameter_names(ctx.engine.module)
    if mismatch := name_mismatch(names, [n for n, _ in ref_run.copy.named_parameters()]):
        err, name = math.inf, mismatch  # check c says which tensors, not a KeyError later
    if ctx.rank == 0 and update == 1:
        ref_run.fingerprint = fingerprint(sharded)
    return ReferenceRecord(
        grad_max_rel_err=err,
        grad_max_rel_err_param=name,
        reference_grad_norm=ref_run.norm,
        grad_rel_l2_err=relative_l2_error(sharded, grads),
        grad_param_rel_l2=low_precision_noise(
            ctx, ref_run.copy, global_batch, tokens, sharded, grads
        ),
    )


def compute_dtype(ctx: Rank) -> torch.dtype | None:
    """The low precision the engine computes in, or None in fp32."""
    low = ctx.engine_cfg.dtype_on(ctx.spec.device_kind) == Dtype.BF16
    return torch.bfloat16 if low else None


def low_precision_noise(
    ctx: Rank,
    copy: torch.nn.Module,
    batch: TrainBatch,
    tokens: float,
    engine: dict[str, torch.Tensor],
    exact: dict[str, torch.Tensor],
) -> dict[str, list[float]] | None:
    """Rank 0, low precision, per parameter: the engine's gradient's distance from the
    reference's computed in the engine's dtype (both round the parameters alike), beside that
    reference's own distance from fp32: c holds each parameter to the rounding this computation
    shows on this batch, at any scale of parameter."""
    dtype = compute_dtype(ctx)
    if dtype is None or ctx.rank != 0:
        return None
    low = low_precision_gradients(copy, batch, tokens, ctx.cfg, dtype)
    mine, noise = per_parameter_distance(engine, low), per_parameter_distance(low, exact)
    return {name: [mine[name], noise[name]] for name in exact}


def low_precision_sketch(
    ctx: Rank, batch: TrainBatch, tokens: float
) -> dict[str, list[float]] | None:
    """A single twin computing in low precision, on its first update (at the checkpoint's
    parameters): per parameter, the sketch of the reference's gradient computed in the engine's
    dtype on the batch it replays, and that gradient's relative L2 distance from fp32's. A run's
    sketch is held to a multiple of that distance, as the reference holds its gradient in
    `low_precision_noise`."""
    dtype = compute_dtype(ctx)
    if dtype is None:
        return None
    with ctx.unsharded():
        copy = single_process_copy(ctx)
        exact = reference_gradients(copy, batch, tokens, ctx.cfg)
        low = low_precision_gradients(copy, batch, tokens, ctx.cfg, dtype)
    noise = per_parameter_distance(low, exact)
    return {name: [*sketch(name, grad), noise[name]] for name, grad in low.items()}
