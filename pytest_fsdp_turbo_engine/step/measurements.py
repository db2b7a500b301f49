"""The harness's own measurements inside a rank: what the checks judge is read here, from the
tensors and collectives the harness observes, never asked of the engine's objects (its optimizer,
its state-dict copy) or taken in a method an engine can override.
"""

from __future__ import annotations

import contextlib
import math
import resource
from dataclasses import dataclass

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from pytest_fsdp_turbo_contract.spec import EngineSpec, PPOSpec
from pytest_fsdp_turbo_contract.vocab import DeviceKind
from pytest_fsdp_turbo_engine.core.reductions import all_max, gather_objects
from pytest_fsdp_turbo_engine.core.train_batch import TrainBatch, ppo_loss
from pytest_fsdp_turbo_engine.engines.fsdp2 import local_tensor
from pytest_fsdp_turbo_engine.step import fsdp_probe


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == DeviceKind.CPU:
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
    return int(torch.get_device_module(device.type).max_memory_allocated(device))


def sp_boundaries_in_responses(batch: TrainBatch, sp: int, micro_batches: int, packed: bool) -> int:
    """How many of the sequence-parallel chunk boundaries fall on a response token that counts
    (the token a chunk's first position holds, predicted from the chunk before): where none does,
    an engine that shifts its labels per chunk, not per sequence, changes only prompt tokens and
    no check can see it. Padded rows are each split `sp` ways; a packed micro-batch (our packed
    layout, verl's engines) is one row of its rows end to end, split `sp` ways."""
    rows, length = batch.input_ids.shape
    hits = 0

    def counts(row: int, position: int) -> bool:
        response = position - batch.prompt_len
        return 0 <= response < batch.mask.shape[1] and bool(batch.mask[row, response])

    for chunk_rows in torch.arange(rows).chunk(micro_batches):
        total = len(chunk_rows) * length if packed else length
        step = -(-total // sp)
        for boundary in range(step, total, step):
            if packed:
                hits += counts(int(chunk_rows[boundary // length]), boundary % length)
            else:
                hits += sum(counts(int(row), boundary) for row in chunk_rows)
    return hits


class MicroBatchProbe:
    """Harness code an engine's micro-batch loop calls as each micro-batch's loss is computed
    (ours calls it, verl's calls it through the loss function the harness hands it).

    It moves the collective counter on to the next micro-batch, so reduce-scatters and every other
    gradient collective are attributed to the micro-batch whose backward issued them; measures the unsharded gradients the previous
    backward left behind; and computes the PPO loss parts itself from the engine's log-probabilities.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        tokens: float,
        cfg: PPOSpec,
        counter: fsdp_probe.CollectiveCounter,
        loss_scale: float,
    ):
        self.module, self.tokens, self.cfg, self.counter = module, tokens, cfg, counter
        counter.watch(module)  # the parameters whose gradients a gradient collective carries
        self.loss_scale = loss_scale  # FSDP averages over data ranks: each backs the sum times this
        self.count = 0
        self.retained = 0
        self.parts: dict[str, float] = {}  # LossRecord field -> this rank's sum over micro-batches
        self.first: dict[str, float] = {}  # LossRecord field -> the first micro-batch's value
        self.first_log_ratio_abs_max = 0.0  # over the first micro-batch's response tokens
        self.loss_gradients_seen = 0
        self.loss_grad_err = 0.0

    @property
    def loss_grad_max_rel_err(self) -> float | None:
        """Worst over micro-batches; infinite when a micro-batch's loss gradient never reached
        the log-probabilities the engine reported (they were not what its loss was built on);
        None when the engine never called the probe (its own loop skipped the harness)."""
        if not self.count:
            return None
        return self.loss_grad_err if self.loss_gradients_seen == self.count else math.inf

    def loss_computed(
        self, logprobs, entropy, mb: TrainBatch, lm_mean=None, gradient_of=None
    ) -> None:
        """`lm_mean`: the model's own causal-LM loss, when the engine computed that term through
        the model (its gradient reaches the logits, not the log-probabilities). `gradient_of`:
        (tensor, to_rows) when the loss reads another tensor than `logprobs` (verl's unpadded
        log-probabilities), to_rows turning that tensor's gradient into `logprobs`' layout."""
        self._expect_loss_gradient(logprobs, entropy, mb, lm_mean, gradient_of)
        if self.count:  # the previous micro-batch's backward is done; this one's has not started
            self.retained = max(self.retained, fsdp_probe.unsharded_grad_bytes(self.module))
        self.counter.next_micro_batch()
        with torch.no_grad():
            ent = entropy.detach() if entropy is not None else None
            _, values = ppo_loss(logprobs.detach(), ent, mb, self.tokens, self.cfg)
        for name, value in values.items():
            self.parts[name] = self.parts.get(name, 0.0) + float(value)
        if not self.count:
            self.first = {name: float(value) for name, value in values.items()}
            log_ratio = (logprobs.detach().float() - mb.old_logprobs).abs()
            self.first_log_ratio_abs_max = float(torch.where(mb.mask.bool(), log_ratio, 0.0).max())
        self.count += 1

    def _expect_loss_gradient(self, logprobs, entropy, mb, lm_mean, gradient_of) -> None:
        """The PPO loss's gradient on each log-probability in closed form (autograd over the
        harness's loss on a detached copy), compared with the gradient the engine's backward
        delivers to it: a hook on the tensor, so nothing the engine can override is asked. On an
        on-policy update the ratio is 1 and the KL gradient 0; from the second update on, PPO's
        clip, the KL term and the response mask each shape it."""
        source, to_rows = gradient_of if gradient_of is not None else (logprobs, None)
        if not source.requires_grad:
            return  # counted as never reached
        with torch.enable_grad():
            leaf = logprobs.detach().float().requires_grad_()
            ent = None if entropy is None else entropy.detach().float()
            lm = None if lm_mean is None else lm_mean.detach()
            loss, _ = ppo_loss(leaf, ent, mb, self.tokens, self.cfg, lm)
            (want,) = torch.autograd.grad(loss, leaf)
        want = want * self.loss_scale
        scale = max(float(want.abs().max()), 1e-30)

        def arrived(grad: torch.Tensor) -> None:
            got = (to_rows(grad) if to_rows is not None else grad).float()
            err = float((got - want).abs().max()) / scale
            self.loss_grad_err = max(self.loss_grad_err, err if math.isfinite(err) else math.inf)
            self.loss_gradients_seen += 1

        source.register_hook(arrived)


class SteppedGradients:
    """The gradients the engine's optimizer stepped on, as the harness reads them around its
    optimizer_step call, whatever the optimizer's class (Engine.optimizer_step says what an
    engine promises for it):

    - a torch.optim.Optimizer: as its step begins, by a process-wide pre-step hook the harness
      registers for the call (the first step that runs);
    - any other optimizer: the gradient tensors the engine's backward left in each parameter's
      `.grad`, which the harness holds across the call and reads once it returns, as the engine
      left them (clipped in place, as torch.nn.utils.clip_grad_norm_ does, then dropped).

    The engine's own objects (its optimizer, its state) are never asked."""

    HOOK = "a torch optimizer's pre-step hook"
    HELD = "the gradient tensors the backward left in .grad, after optimizer_step"

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.held: list[torch.Tensor | None] = [p.grad for p in module.parameters()]
        self.hooked: list[torch.Tensor | None] | None = None

    def _before_step(self, *_) -> None:
        if self.hooked is None:
            self.hooked = [_cpu_copy(p.grad) for p in self.module.parameters()]

    @property
    def source(self) -> str:
        return self.HOOK if self.hooked is not None else self.HELD

    def read(self) -> list[torch.Tensor | None]:
        """The stepped-on gradients (local shards, on the CPU), read once optimizer_step has
        returned; the held tensors are let go."""
        held, self.held = self.held, []
        return self.hooked if self.hooked is not None else [_cpu_copy(g) for g in held]


def _cpu_copy(grad: torch.Tensor | None) -> torch.Tensor | None:
    return None if grad is None else local_tensor(grad.detach()).to("cpu", copy=True)


@contextlib.contextmanager
def stepped_gradients(module: torch.nn.Module):
    """Around the engine's optimizer_step call: yields the SteppedGradients to read after it."""
    seen = SteppedGradients(module)
    handle = register_optimizer_step_pre_hook(seen._before_step)
    try:
        yield seen
    finally:
        handle.remove()


def clip_error(raw, stepped_on, coef: float) -> float:
    """Largest distance between the gradients the optimizer stepped on and the raw gradients the
    harness read scaled by its own clip coefficient (global norm, the case's max_norm), relative
    to the largest clipped entry on this rank."""
    pairs = [(r.float() * coef, s.float()) for r, s in zip(raw, stepped_on) if r is not None]
    pairs = [(want, got) for want, got in pairs if want.numel()]
    if not pairs:
        return 0.0
    scale = max(max(float(want.abs().max()) for want, _ in pairs), 1e-30)
    return max(float((got - want).abs().max()) for want, got in pairs) / scale


@dataclass
class AdamMoments:
    """AdamW's state as the harness computes it from its own readings, per local parameter."""

    steps: list[int]  # per parameter: one without a gradient is not stepped
    exp_avg: list[torch.Tensor | None]
    exp_avg_sq: list[torch.Tensor | None]


def adamw_closed_form(
    before: list[torch.Tensor],
    grads: list[torch.Tensor | None],
    cfg: EngineSpec,
    moments: AdamMoments | None,
) -> tuple[list[torch.Tensor], AdamMoments]:
    """Each parameter after one AdamW step, from the parameters and (clipped) gradients the
    harness read and its own moments: m <- b1 m + (1 - b1) g, v <- b2 v + (1 - b2) g^2, then
    p <- p (1 - lr wd) - lr (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps). On the first step
    the betas cancel out (m / (1 - b1) = g); from the second on they do not, so the case's betas
    are proven there. A parameter without a gradient stays and keeps its moments, as in torch."""
    if moments is None:
        moments = AdamMoments([0] * len(before), [None] * len(before), [None] * len(before))
    b1, b2 = cfg.adam_beta1, cfg.adam_beta2
    expected, steps, exp_avg, exp_avg_sq = [], [], [], []
    for p0, g, t, m, v in zip(before, grads, moments.steps, moments.exp_avg, moments.exp_avg_sq):
        if g is None:
            expected.append(p0.float())
            steps.append(t)
            exp_avg.append(m)
            exp_avg_sq.append(v)
            continue
        t += 1
        m = (1 - b1) * g if m is None else b1 * m + (1 - b1) * g
        v = (1 - b2) * g * g if v is None else b2 * v + (1 - b2) * g * g
        denom = (v / (1 - b2**t)).sqrt() + cfg.adam_eps
        step = cfg.lr * (m / (1 - b1**t)) / denom
        expected.append(p0.float() * (1 - cfg.lr * cfg.weight_decay) - step)
        steps.append(t)
        exp_avg.append(m)
        exp_avg_sq.append(v)
    return expected, AdamMoments(steps, exp_avg, exp_avg_sq)


def replica_max_abs_diff(module: torch.nn.Module, group, device: torch.device) -> float | None:
    """Spread of each local shard across the ranks that must hold the same values: `group`, the
    replicas of the layout the case declares (step/rank.py Layout), never a group the engine
    reports. Infinite where the replicas' local shards differ in shape (the engine laid its shards
    out otherwise than declared); None where the layout has no replicas."""
    if group is None:
        return None
    shards = [local_tensor(p.detach()).float() for p in module.parameters()]
    shapes = gather_objects([tuple(s.shape) for s in shards], group)
    worst = torch.zeros((), dtype=torch.float32, device=device)
    if any(other != shapes[0] for other in shapes):  # the group's ranks all see the same list
        worst.fill_(math.inf)
        shards = []
    for shard in shards:
        hi, lo = shard.clone(), shard.clone()
        torch.distributed.all_reduce(hi, op=torch.distributed.ReduceOp.MAX, group=group)
        torch.distributed.all_reduce(lo, op=torch.distributed.ReduceOp.MIN, group=group)
        worst = torch.maximum(worst, (hi - lo).abs().max() if hi.numel() else worst)
    return all_max(float(worst), device)
