"""Deliberately broken engines: the mutation suite (e2e/test_mutations.py) proves that each check
turns red on the bug it exists for. Each class is named after the bug it models and registered under
its own backend name; ranks import this module only in those tests (engine_modules).
"""

from contextlib import contextmanager

import torch
import torch.distributed as dist
from pytest_fsdp_turbo_engine.fsdp_engine import FSDPEngineWithLMHead, full_tensor, local_tensor
from pytest_fsdp_turbo_engine.registry import register

EVERYWHERE = ["cpu", "cuda", "npu"]


@register(backend="fsdp_off_by_one_sync", device=EVERYWHERE)
class OffByOneSyncEngine(FSDPEngineWithLMHead):
    """Reduce-scatters on the first micro-batch instead of the last: the last one's gradients are
    left in the unsharded accumulators and never reach the optimizer."""

    @contextmanager
    def _gradient_sync_context(self, is_last_micro_batch: bool):
        self._set_gradient_sync(not is_last_micro_batch)
        try:
            yield
        finally:
            self._set_gradient_sync(True)


@register(backend="fsdp_noop_sync_context", device=EVERYWHERE)
class NoOpSyncContextEngine(FSDPEngineWithLMHead):
    """The override the seed PR deleted from the FSDP-Turbo engine: declared deferred, but every
    micro-batch reduce-scatters. Same gradients, the memory and communication of the other policy."""

    @contextmanager
    def _gradient_sync_context(self, is_last_micro_batch: bool):
        yield


@register(backend="fsdp_never_sync", device=EVERYWHERE)
class NeverSyncEngine(FSDPEngineWithLMHead):
    """Gradient sync never switched back on: nothing reaches the shards, the norm is 0, nothing moves."""

    def _set_gradient_sync(self, enabled: bool) -> None:
        self.module.set_requires_gradient_sync(False)


@register(backend="fsdp_gradients_divided_twice", device=EVERYWHERE)
class GradientsDividedTwiceEngine(FSDPEngineWithLMHead):
    """The reduced gradients divided by the world size a second time (a wrong divide factor, as
    when WORLD_SIZE is read wrongly): every gradient halved on 2 ranks. Adam hides the scale from
    the step; only a norm compared with an independent truth can see it."""

    @contextmanager
    def _gradient_sync_context(self, is_last_micro_batch: bool):
        with super()._gradient_sync_context(is_last_micro_batch):
            yield
        if is_last_micro_batch:
            for param in self.module.parameters():
                if param.grad is not None:
                    local_tensor(param.grad).div_(self.config.world_size)


@register(backend="fsdp_norm_max_over_ranks", device=EVERYWHERE)
class NormMaxOverRanksEngine(FSDPEngineWithLMHead):
    """Clips by the largest per-rank norm instead of the global L2 norm: the same value on every
    rank, so agreement between ranks cannot tell."""

    def _clip_grad_norm(self) -> float:
        grads = [local_tensor(p.grad) for p in self.module.parameters() if p.grad is not None]
        norm = torch.sqrt(sum(g.float().pow(2).sum() for g in grads))
        dist.all_reduce(norm, op=dist.ReduceOp.MAX)
        scale = torch.clamp(self.config.grad_clip / (norm + 1e-6), max=1.0)
        for grad in grads:
            grad.mul_(scale)
        return float(norm)


@register(backend="fsdp_skip_step_on_rank1", device=EVERYWHERE)
class SkipStepOnRankOneEngine(FSDPEngineWithLMHead):
    """Rank 1 never calls optimizer.step(): its shard of the model stays at the old weights."""

    def optimizer_step(self) -> float:
        norm = self._clip_grad_norm()
        if dist.get_rank() != 1:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm


@register(backend="fsdp_double_step", device=EVERYWHERE)
class DoubleStepEngine(FSDPEngineWithLMHead):
    """Steps the optimizer twice on the same gradients (a retried step that was not rolled back)."""

    def optimizer_step(self) -> float:
        norm = self._clip_grad_norm()
        self.optimizer.step()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm


@register(backend="fsdp_dropout_in_training_forward", device=EVERYWHERE)
class DropoutInTrainingForwardEngine(FSDPEngineWithLMHead):
    """Training forward differs from the forward that computed the old logprobs (dropout left on):
    the first micro-batch is no longer on-policy."""

    def forward_logprobs(self, input_ids, prompt_len, *, module=None, with_entropy=False):
        if not torch.is_grad_enabled():
            return super().forward_logprobs(
                input_ids, prompt_len, module=module, with_entropy=with_entropy
            )
        model = module or self.module
        logits = model(input_ids=input_ids).logits[:, prompt_len - 1 : -1].float()
        logits = torch.nn.functional.dropout(logits, p=0.1, training=True)
        from pytest_fsdp_turbo_engine.ppo import entropy_from_logits, response_logprobs

        logprobs = response_logprobs(logits, input_ids[:, prompt_len:])
        return logprobs, (entropy_from_logits(logits) if with_entropy else None)


@register(backend="fsdp_drifting_replica", device=EVERYWHERE)
class DriftingReplicaEngine(FSDPEngineWithLMHead):
    """HSDP replica 1 ends the step with slightly different weights (a lost all-reduce)."""

    def optimizer_step(self) -> float:
        norm = super().optimizer_step()
        group = self.replicate_group()
        if group is not None and dist.get_rank(group) == 1:
            with torch.no_grad():
                for param in self.module.parameters():
                    local_tensor(param).add_(1e-3)
        return norm


@register(backend="fsdp_stale_rollout_weights", device=EVERYWHERE)
class StaleRolloutWeightsEngine(FSDPEngineWithLMHead):
    """Hands the rollout the weights it had before the step (a cached state dict)."""

    def build(self, model_path: str, *, trainable: bool = True):
        wrapped = super().build(model_path, trainable=trainable)
        if trainable:
            self._cached = {
                n: full_tensor(p.detach()).clone() for n, p in wrapped.named_parameters()
            }
        return wrapped

    def full_state_dict(self):
        return self._cached


@register(backend="fsdp_hoarding_memory", device=EVERYWHERE)
class HoardingMemoryEngine(FSDPEngineWithLMHead):
    """Keeps 1.25 GiB alive for the whole step (an activation cache nobody frees)."""

    def build(self, model_path: str, *, trainable: bool = True):
        if trainable:
            self._hoard = torch.ones(5 * 2**28 // 4, device=self.device)
        return super().build(model_path, trainable=trainable)


@register(backend="fsdp_undeclared_weight_decay", device=EVERYWHERE)
class UndeclaredWeightDecayEngine(FSDPEngineWithLMHead):
    """Its optimizer decays weights by 0.01 where the case asked for none: every rank and a replay
    twin of the same engine make the same wrong update."""

    def build(self, model_path: str, *, trainable: bool = True):
        wrapped = super().build(model_path, trainable=trainable)
        if trainable:
            for group in self.optimizer.param_groups:
                group["weight_decay"] = 0.01
        return wrapped


@register(backend="fsdp_handoff_missing_tensor", device=EVERYWHERE)
class HandOffMissingTensorEngine(FSDPEngineWithLMHead):
    """Leaves one norm weight out of the weights it hands the rollout, which keeps serving the
    pre-step norm: one small tensor, too little for the logprob comparison to see."""

    def full_state_dict(self):
        handed = super().full_state_dict()
        dropped = next(name for name in handed if name.endswith("norm.weight"))
        return {name: t for name, t in handed.items() if name != dropped}
