"""A downstream-style engine whose optimizer is not a `torch.optim.Optimizer`: AdamW and the clip
by the global norm in plain tensor math on each parameter's local shard. The healthy one passes
every check (the harness reads the gradients its step used without a torch optimizer's hook: the
engine protocol's Engine.optimizer_step says how); two broken ones show that check k still reads
them: a clip coefficient 0.2% short, and an engine that zeroes the gradient tensors in place after
its step, which breaks the protocol's promise. Registered under their own backend names; ranks
import this module only in tests/test_handwritten_optimizer.py (engine_modules).
"""

import math

import torch
import torch.distributed as dist

from pytest_fsdp_turbo_engine.engines.fsdp2 import FSDPEngineWithLMHead, local_tensor
from pytest_fsdp_turbo_engine.engines.registry import register

EVERYWHERE = ["cpu", "cuda", "npu"]


class HandwrittenAdamW:
    """AdamW as torch computes it (decoupled weight decay, bias-corrected moments), on the local
    shards, with moments of its own: m <- b1 m + (1 - b1) g, v <- b2 v + (1 - b2) g^2,
    p <- p (1 - lr wd) - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)."""

    def __init__(self, params, lr: float, betas: tuple[float, float], eps: float, wd: float):
        self.params = list(params)
        self.lr, self.betas, self.eps, self.wd = lr, betas, eps, wd
        self.state: dict[int, tuple[int, torch.Tensor, torch.Tensor]] = {}

    @torch.no_grad()
    def step(self) -> None:
        b1, b2 = self.betas
        for index, param in enumerate(self.params):
            if param.grad is None:
                continue  # no gradient: not stepped, moments kept, as in torch
            p, g = local_tensor(param), local_tensor(param.grad)
            t, m, v = self.state.get(index, (0, torch.zeros_like(p), torch.zeros_like(p)))
            t += 1
            p.mul_(1 - self.lr * self.wd)
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = (v.sqrt() / math.sqrt(1 - b2**t)).add_(self.eps)
            p.addcdiv_(m, denom, value=-self.lr / (1 - b1**t))
            self.state[index] = (t, m, v)


@register(backend="handwritten_adamw", device=EVERYWHERE)
class HandwrittenAdamWEngine(FSDPEngineWithLMHead):
    """Our FSDP2 model and sync policy, with its own optimizer and clip (no torch optimizer)."""

    CLIP_EPS = 1e-6  # torch's clip_grad_norm_: min(1, max_norm / (norm + 1e-6))

    def build(self, model_path: str, *, trainable: bool = True) -> torch.nn.Module:
        wrapped = super().build(model_path, trainable=trainable)
        if trainable:
            cfg = self.config
            self.optimizer = None  # no torch optimizer: torch's step hooks never fire
            self.adamw = HandwrittenAdamW(
                wrapped.parameters(),
                cfg.lr,
                (cfg.adam_beta1, cfg.adam_beta2),
                cfg.adam_eps,
                cfg.weight_decay,
            )
        return wrapped

    def _shard_group(self) -> dist.ProcessGroup:
        """The ranks whose shards make up one whole gradient (HSDP replicas hold the same)."""
        names = self.mesh.mesh_dim_names or ()
        return self.mesh.get_group("shard") if "shard" in names else dist.group.WORLD

    @torch.no_grad()
    def _clip_grad_norm(self) -> float:
        """The global L2 norm, summed from each rank's local shards over the shard group; every
        gradient scaled in place, in the tensors the backward left in .grad (the protocol)."""
        grads = [local_tensor(p.grad) for p in self.module.parameters() if p.grad is not None]
        squares = torch.zeros((), dtype=torch.float32, device=self.device)
        for g in grads:
            squares += g.float().pow(2).sum()
        dist.all_reduce(squares, group=self._shard_group())
        norm = float(squares.sqrt())
        if math.isfinite(norm):
            coef = min(1.0, self.config.grad_clip / (norm + self.CLIP_EPS))
            for g in grads:
                g.mul_(coef)
        return norm

    def _drop_gradients(self) -> None:
        for p in self.module.parameters():
            p.grad = None

    def optimizer_step(self) -> float:
        norm = self._clip_grad_norm()
        if math.isfinite(norm):
            self.adamw.step()
        self._drop_gradients()
        return norm


@register(backend="handwritten_adamw_clip_loose_eps", device=EVERYWHERE)
class HandwrittenClipLooseEpsEngine(HandwrittenAdamWEngine):
    """The clip coefficient as max_norm / (norm + 1e-3): where the clip engages, every gradient
    is 0.2% short, which Adam's first step does not show; only check k can."""

    CLIP_EPS = 1e-3


@register(backend="handwritten_adamw_zeroes_gradients_in_place", device=EVERYWHERE)
class HandwrittenZeroesGradientsInPlaceEngine(HandwrittenAdamWEngine):
    """Steps correctly, then zeroes the gradient tensors in place (as zero_grad(set_to_none=False)
    does) instead of dropping them: against the engine protocol's promise for an optimizer that
    is not a torch one, so the harness reads zeros as the gradients the step used."""

    def _drop_gradients(self) -> None:
        for p in self.module.parameters():
            if p.grad is not None:
                p.grad.zero_()
