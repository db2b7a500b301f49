"""The single-process reference: the same loss over the whole global batch on an unsharded copy of
the initial policy, and the same optimizer step on its gradients. What every sharded run must match.
"""

from __future__ import annotations

import copy
import math

import torch

from pytest_fsdp_turbo_contract.records import NAMES_DIFFER
from pytest_fsdp_turbo_contract.spec import EngineSpec, PPOSpec
from pytest_fsdp_turbo_engine.core import ppo
from pytest_fsdp_turbo_engine.core.train_batch import TrainBatch, ppo_loss

FINGERPRINT_VALUES = 16


def reference_gradients(
    model: torch.nn.Module, batch: TrainBatch, tokens: float, cfg: PPOSpec
) -> dict[str, torch.Tensor]:
    """Gradients of the PPO loss over the whole global batch in one process, no sharding."""
    model.zero_grad(set_to_none=True)
    device = next(model.parameters()).device
    batch = batch.to(device)
    logits = (
        model(input_ids=batch.input_ids, use_cache=False)
        .logits[:, batch.prompt_len - 1 : -1]
        .float()
    )
    logprobs = ppo.response_logprobs(logits, batch.input_ids[:, batch.prompt_len :])
    loss, _ = ppo_loss(logprobs, ppo.entropy_from_logits(logits), batch, tokens, cfg)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def low_precision_gradients(
    model: torch.nn.Module, batch: TrainBatch, tokens: float, cfg: PPOSpec, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """The same gradients computed with the parameters in the engine's compute dtype, as FSDP's
    mixed precision hands them to forward and backward: how far rounding alone moves each
    parameter's gradient from the fp32 reference, measured on this batch at these parameters."""
    low = copy.deepcopy(model).to(dtype)
    grads = reference_gradients(low, batch, tokens, cfg)
    del low
    return {name: grad.float() for name, grad in grads.items()}


def per_parameter_distance(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]
) -> dict[str, float]:
    """Per parameter, ||got - want|| / ||want||: a scale-free error, so a parameter whose gradient
    is 1e-5 of the largest is judged against itself (a missing gradient is a zero one)."""
    out = {}
    for name, ref in want.items():
        ref = ref.double().cpu()
        value = got.get(name)
        diff = ref if value is None else value.double().cpu() - ref
        off, size = float(diff.norm()), float(ref.norm())
        out[name] = off / size if size > 0 else (0.0 if off == 0 else math.inf)
    return out


def name_mismatch(engine_names, reference_names) -> str | None:
    """The tensors one side has and the other lacks (an engine that unties, ties or adds a
    parameter the checkpoint does not have), said by name; None when the sets agree."""
    only_engine = sorted(set(engine_names) - set(reference_names))
    only_reference = sorted(set(reference_names) - set(engine_names))
    if not only_engine and not only_reference:
        return None
    return (
        f"{NAMES_DIFFER}: only in the engine: {', '.join(only_engine) or '-'}; only in the "
        f"reference: {', '.join(only_reference) or '-'}"
    )


def clip_coefficient(norm: float, max_norm: float) -> float:
    """torch's clip by the global norm: the factor gradients are scaled by."""
    return min(1.0, max_norm / (norm + 1e-6))


def gradient_norm(grads: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values()))


class ReferenceOptimizer:
    """The engine's contract for each step, on the single-process copy: clip by the global norm of
    the reference gradients, then AdamW with the case's settings, its moments carried from one
    update to the next."""

    def __init__(self, model: torch.nn.Module, config: EngineSpec):
        self.model, self.config = model, config
        # built here from the spec, not by our engine's helper: the reference must not share a
        # bug of the engine it judges
        self.adamw = torch.optim.AdamW(
            model.parameters(),
            lr=config.lr,
            betas=(config.adam_beta1, config.adam_beta2),
            eps=config.adam_eps,
            weight_decay=config.weight_decay,
        )

    def step(self, grads: dict[str, torch.Tensor], norm: float) -> None:
        scale = clip_coefficient(norm, self.config.grad_clip)
        for name, param in self.model.named_parameters():
            param.grad = grads[name] * scale if name in grads else None
        self.adamw.step()  # a parameter without a gradient is skipped, as in the engine
        self.model.zero_grad(set_to_none=True)


# A parameter's gradient judged against at least this share of the largest reference entry of
# any parameter: where its own gradient is smaller, its entries are what is left of cancelling
# terms and fp32 reduction order is all its error (measured: a gated delta-net A_log at 1e-5 of
# the largest entry, 4.5e-10 off, 5e-4 of itself, whole gradients 2.5e-7 apart).
CANCELLED_SHARE = 1e-3


def max_abs_error(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], scale: float | None = None
) -> tuple[float, str]:
    """Largest per-parameter error, relative to `scale`, or to that parameter's largest reference
    entry (at least CANCELLED_SHARE of the largest anywhere) when no scale is given. A missing
    parameter is an infinite error, unless its reference is all zero: no gradient is a zero
    gradient (a vision tower a text batch never ran, or ran with a zero weight as verl's Qwen3.5
    forward does)."""
    worst, worst_name = 0.0, ""
    largest = max((float(ref.abs().max()) for ref in want.values() if ref.numel()), default=0.0)
    for name, ref in want.items():
        value = got.get(name)
        if value is None and not bool(ref.eq(0).all()):
            return math.inf, f"{name} (missing)"
        if value is None:
            continue
        own = max(float(ref.abs().max()), CANCELLED_SHARE * largest, 1e-12)
        denom = scale if scale is not None else own
        err = float((value.float().cpu() - ref.float().cpu()).abs().max()) / denom
        if not math.isfinite(err):
            return math.inf, name
        if err > worst:
            worst, worst_name = err, name
    return worst, worst_name


def relative_l2_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """||got - want|| / ||want|| over all parameters together: robust to entries whose reference
    is tiny (where bf16 compute flips signs), unlike the per-parameter maximum."""
    num = den = 0.0
    for name, ref in want.items():
        if name not in got and not bool(ref.eq(0).all()):
            return math.inf
        if name not in got:
            continue  # no gradient is a zero gradient (max_abs_error)
        ref = ref.double().cpu()
        num += float((got[name].double().cpu() - ref).pow(2).sum())
        den += float(ref.pow(2).sum())
    return math.sqrt(num / max(den, 1e-300))


def fingerprint(grads: dict[str, torch.Tensor]) -> dict[str, dict]:
    return {
        name: {
            "norm": float(g.float().norm()),
            "head": [float(v) for v in g.flatten()[:FINGERPRINT_VALUES]],
        }
        for name, g in grads.items()
    }
