"""The engine's optimizer step, measured around by the harness: its own gradient norm, the clip
(the gradients the step used, read as measurements.SteppedGradients says, whatever the
optimizer's class), and AdamW in closed form (measurements.py) from the parameters and gradients
it read."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pytest_fsdp_turbo_contract.records import OptimizerRecord
from pytest_fsdp_turbo_engine.core.reductions import all_max, all_sum
from pytest_fsdp_turbo_engine.engines.fsdp2 import local_tensor
from pytest_fsdp_turbo_engine.step import fsdp_probe
from pytest_fsdp_turbo_engine.step.measurements import (
    AdamMoments,
    adamw_closed_form,
    clip_error,
    stepped_gradients,
)
from pytest_fsdp_turbo_engine.step.phases import phase_name
from pytest_fsdp_turbo_engine.step.rank import Rank
from pytest_fsdp_turbo_engine.step.reference import clip_coefficient


@dataclass
class HarnessAdamW:
    """The harness's own AdamW state across updates, from the gradients it read."""

    moments: AdamMoments | None = None  # None before the first update


def optimizer(ctx: Rank, adamw: HarnessAdamW, update: int = 1) -> OptimizerRecord:
    """The engine's optimizer_step, measured around: the harness's own norm, clip and AdamW in
    closed form from the parameters and gradients it read, with its own moments (`adamw`)."""
    ctx.phase.enter(phase_name("optimizer", update))
    module = ctx.engine.module
    measured = fsdp_probe.global_grad_norm(module)
    before = [local_tensor(p.detach()).to("cpu", copy=True) for p in module.parameters()]
    grads = [
        None if p.grad is None else local_tensor(p.grad.detach()).to("cpu", copy=True)
        for p in module.parameters()
    ]
    with stepped_gradients(module) as stepped:
        reported = float(ctx.engine.optimizer_step())
    stepped_on = stepped.read()  # whatever the optimizer's class (Engine.optimizer_step)
    after = [local_tensor(p.detach()).cpu() for p in module.parameters()]
    moved = max((float((a - b).abs().max()) for a, b in zip(after, before) if b.numel()), default=0)
    squares = sum(float((a.double() - b.double()).pow(2).sum()) for a, b in zip(after, before))
    copies = torch.distributed.get_world_size() // fsdp_probe.shard_group_size(module)
    update_l2 = math.sqrt(max(all_sum(squares, ctx.device) / copies, 0.0))
    adamw_err = clip_err = clip_coef = None
    if math.isfinite(measured):
        clip_coef = clip_coefficient(measured, ctx.engine_cfg.grad_clip)
        clipped = [None if g is None else g.float() * clip_coef for g in grads]
        expected, adamw.moments = adamw_closed_form(before, clipped, ctx.engine_cfg, adamw.moments)
        adamw_err = (
            max(
                (beyond_one_spacing(p1, want) for p1, want in zip(after, expected) if p1.numel()),
                default=0.0,
            )
            / ctx.engine_cfg.lr
        )
        clip_err = all_max(clip_error(grads, stepped_on, clip_coef), ctx.device)
    return OptimizerRecord(
        grad_norm=reported,
        grad_norm_finite=math.isfinite(reported),
        grad_norm_measured=measured,
        param_update_max_abs=moved,
        update_l2=update_l2,
        local_param_numel=sum(b.numel() for b in before),
        adamw_step_max_err_lr=adamw_err,
        clip_max_rel_err=clip_err,
        clip_coef=clip_coef,
    )


def beyond_one_spacing(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest |got - want| beyond one spacing of got's dtype at its value: the engine's
    AdamW and the closed form round the same step separately, and two correct roundings of one
    value may sit a spacing apart (a weight near 1 in fp32: 1.2e-7, 1.2e-3 lr at lr 1e-4, which
    healthy engines reach). Beyond it the step itself differs."""
    size = got.abs()
    spacing = torch.nextafter(size, torch.full_like(size, math.inf)) - size
    return float(((got.float() - want).abs() - spacing.float()).clamp_min(0).max())
