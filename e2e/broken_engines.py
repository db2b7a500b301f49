"""Deliberately broken engines: the mutation suite (e2e/test_mutations.py) proves that each check
turns red on the bug it exists for. Each class is named after the bug it models and registered under
its own backend name; ranks import this module only in those tests (engine_modules).
"""

import math
import types
from contextlib import contextmanager
from dataclasses import replace

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from pytest_fsdp_turbo_engine.core.ppo import (
    entropy_from_logits,
    low_var_kl,
    response_logprobs,
    token_sum,
)
from pytest_fsdp_turbo_engine.core.train_batch import ppo_loss
from pytest_fsdp_turbo_engine.engines.fsdp2 import FSDPEngineWithLMHead, full_tensor, local_tensor
from pytest_fsdp_turbo_engine.engines.registry import register

EVERYWHERE = ["cpu", "cuda", "npu"]


@register(backend="fsdp_off_by_one_sync", device=EVERYWHERE)
class OffByOneSyncEngine(FSDPEngineWithLMHead):
    """Reduce-scatters on the first micro-batch instead of the last: the last one's gradients are
    left in the unsharded accumulators and never reach the optimizer."""

    @contextmanager
    def gradient_sync_context(self, is_last_micro_batch: bool):
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
    def gradient_sync_context(self, is_last_micro_batch: bool):
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
    def gradient_sync_context(self, is_last_micro_batch: bool):
        with super().gradient_sync_context(is_last_micro_batch):
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


@register(backend="fsdp_norm_logged_in_bf16_on_rank1", device=EVERYWHERE)
class NormLoggedInBf16OnRankOneEngine(FSDPEngineWithLMHead):
    """Rank 1 reports its gradient norm through a bf16 logging path; clipping used the right norm.
    Gradients, step and weights are all correct: only the reported norm is wrong, and only there."""

    def _clip_grad_norm(self) -> float:
        norm = super()._clip_grad_norm()
        if dist.get_rank() == 1:
            return float(torch.tensor(norm).bfloat16())
        return norm


@register(backend="fsdp_old_logprobs_from_bf16_logits", device=EVERYWHERE)
class OldLogprobsFromBf16LogitsEngine(FSDPEngineWithLMHead):
    """Scores a batch it has not trained on yet (the old logprobs) through an inference path that
    returns bf16 logits; trains, and scores afterwards, in fp32. The harness and the reference both
    take the old logprobs as given, so every gradient is right for them; only the first
    micro-batch's ratio shows that the policy that trains is not the one that scored the batch."""

    def forward_logprobs(self, input_ids, prompt_len, *, module=None, with_entropy=False):
        if torch.is_grad_enabled():
            self._trained = True
        if module is not None or torch.is_grad_enabled() or getattr(self, "_trained", False):
            return super().forward_logprobs(
                input_ids, prompt_len, module=module, with_entropy=with_entropy
            )
        logits = self._logits(self.module, input_ids)[:, prompt_len - 1 : -1]
        logits = logits.bfloat16().float()
        logprobs = response_logprobs(logits, input_ids[:, prompt_len:])
        return logprobs, (entropy_from_logits(logits) if with_entropy else None)


@register(backend="fsdp_norm_weight_gradient_summed", device=EVERYWHERE)
class NormWeightGradientSummedEngine(FSDPEngineWithLMHead):
    """The first decoder layer's post-attention norm weight has its gradient summed over the ranks
    instead of averaged (as a small parameter kept out of FSDP and all-reduced by hand would): one
    small gradient doubled. The norm moves by parts per million and Adam's sign-like first step not
    at all; only per-parameter parity against an independent reference can see it."""

    @contextmanager
    def gradient_sync_context(self, is_last_micro_batch: bool):
        with super().gradient_sync_context(is_last_micro_batch):
            yield
        if is_last_micro_batch:
            for name, param in self.module.named_parameters():
                if name.endswith("layers.0.post_attention_layernorm.weight"):
                    local_tensor(param.grad).mul_(self.config.world_size)


@register(backend="fsdp_fused_optimizer_on_one_replica", device=EVERYWHERE)
class FusedOptimizerOnOneReplicaEngine(FSDPEngineWithLMHead):
    """HSDP replica 1 steps with the fused AdamW kernel, replica 0 with the foreach one: the same
    update to within a few ulp, so the replicas drift apart in the last bits, silently, and further
    on every step."""

    def build(self, model_path: str, *, trainable: bool = True):
        wrapped = super().build(model_path, trainable=trainable)
        if trainable and self._replica_index() == 1:
            self.optimizer = torch.optim.AdamW(
                wrapped.parameters(),
                lr=self.config.lr,
                weight_decay=self.config.weight_decay,
                fused=True,
            )
        return wrapped

    def _replica_index(self) -> int | None:
        """This rank's place among its replicas (None without replicas)."""
        group = self.replicate_group()
        return None if group is None else dist.get_rank(group)


@register(backend="fsdp_entropy_in_bits", device=EVERYWHERE)
class EntropyInBitsEngine(FSDPEngineWithLMHead):
    """Reports entropy in bits (log base 2) where the training world logs nats. The case trains
    with entropy_coef 0, so nothing learns from it: the logged metric is wrong and nothing else,
    which only a golden of that metric can tell."""

    def forward_logprobs(self, input_ids, prompt_len, *, module=None, with_entropy=False):
        logprobs, entropy = super().forward_logprobs(
            input_ids, prompt_len, module=module, with_entropy=with_entropy
        )
        return logprobs, (entropy / math.log(2) if entropy is not None else None)


@register(backend="fsdp_data_rank_from_shard", device=EVERYWHERE)
class DataRankFromShardEngine(FSDPEngineWithLMHead):
    """On an HSDP mesh, the data rank taken from the shard dimension: the two replicas of each
    shard would train on the same rows (8 distinct rows of the 16) in a trainer that asked it, and
    a reference or a twin replaying that batch would agree with every number."""

    def data_parallel_rank(self) -> int:
        return self.mesh.get_local_rank("shard") if self.replicate_group() else dist.get_rank()


@register(backend="fsdp_data_rank_from_replicate_dim", device=EVERYWHERE)
class DataRankFromReplicateDimEngine(FSDPEngineWithLMHead):
    """The data rank and size taken from the mesh's replicate dimension, as on an HSDP mesh, which
    the 1-D mesh of plain FSDP lacks: every rank reports data-parallel rank 0 of 1. A trainer that
    asked it would hand every rank the whole batch; the harness hands the rows by the layout the
    case declares, so the step itself is right and only what the engine reports is wrong."""

    def _replicate_dim(self) -> bool:
        return "replicate" in (self.mesh.mesh_dim_names or ())

    def data_parallel_rank(self) -> int:
        return self.mesh.get_local_rank("replicate") if self._replicate_dim() else 0

    def data_parallel_size(self) -> int:
        return self.mesh.size(0) if self._replicate_dim() else 1


@register(backend="fsdp_replica_group_of_one", device=EVERYWHERE)
class ReplicaGroupOfOneEngine(FusedOptimizerOnOneReplicaEngine):
    """HSDP replicas that drift (replica 1 steps with the fused AdamW kernel, replica 0 with the
    foreach one, as fsdp_fused_optimizer_on_one_replica: a few ulp, silently), while the engine's
    replicate_group() names this rank alone (a per-rank subgroup where the mesh's replicate
    dimension was meant). A harness that compared replicas over the group the engine reports
    would compare each rank with itself and read 0."""

    def __init__(self, config, device):
        super().__init__(config, device)
        self._alone, _ = dist.new_subgroups(group_size=1)  # every rank creates them all

    def replicate_group(self):
        return self._alone

    def _replica_index(self) -> int | None:  # the mesh's, which the reported group hides
        hsdp = "replicate" in (self.mesh.mesh_dim_names or ())
        return self.mesh.get_local_rank("replicate") if hsdp else None


@register(backend="fsdp_all_reduce_each_micro_batch", device=EVERYWHERE)
class AllReduceEachMicroBatchEngine(FSDPEngineWithLMHead):
    """Declares deferral, and FSDP2 reduce-scatters on the last micro-batch alone as it should;
    but after each earlier micro-batch's backward the engine all-reduces every unsharded gradient
    FSDP2 holds, and averages it (a sync by hand, as for a parameter kept out of FSDP). The
    gradients are the same; the communication is a sync every micro-batch, at an all-reduce's
    cost, which reduce-scatter counts never see."""

    @contextmanager
    def gradient_sync_context(self, is_last_micro_batch: bool):
        with super().gradient_sync_context(is_last_micro_batch):
            yield
        if not is_last_micro_batch:
            world = dist.get_world_size()
            for grad in self._held_unsharded_gradients():
                dist.all_reduce(grad)
                grad.div_(world)

    def _held_unsharded_gradients(self):
        for unit in self.module.modules():
            group = (
                unit._get_fsdp_state()._fsdp_param_group if isinstance(unit, FSDPModule) else None
            )
            for param in group.fsdp_params if group else ():
                unsharded = getattr(param, "_unsharded_param", None)
                grad = param.unsharded_accumulated_grad
                if grad is None and unsharded is not None:
                    grad = unsharded.grad
                if grad is not None:
                    yield grad


@register(backend="fsdp_lm_head_bias_added", device=EVERYWHERE)
class LMHeadBiasAddedEngine(FSDPEngineWithLMHead):
    """Loads the checkpoint, then gives lm_head a bias the checkpoint does not have (as an engine
    that unties a tied head adds a tensor): the engine's parameter names and the reference's
    differ, which must be a check naming the tensor, never a KeyError in the harness."""

    def _wrap(self, model):
        head = model.get_output_embeddings()
        head.bias = torch.nn.Parameter(torch.zeros(head.out_features, device=head.weight.device))
        return super()._wrap(model)


@register(backend="fsdp_clip_ignores_max_norm", device=EVERYWHERE)
class ClipIgnoresMaxNormEngine(FSDPEngineWithLMHead):
    """Clips to a norm of 1.0 whatever the case's max_norm says: where clipping engages below 1,
    the step uses gradients 1/max_norm too large (Adam's first step hides the scale)."""

    def _clip_grad_norm(self) -> float:
        params = [p for p in self.module.parameters() if p.grad is not None]
        return float(full_tensor(torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=False)))


@register(backend="fsdp_clip_by_shard_norm", device=EVERYWHERE)
class ClipByShardNormEngine(FSDPEngineWithLMHead):
    """Clips each rank's shards by their own local norm, not the global one: every rank scales
    its shard differently (and reports the global norm, so check a sees nothing)."""

    def _clip_grad_norm(self) -> float:
        params = [p for p in self.module.parameters() if p.grad is not None]
        norm = float(full_tensor(torch.nn.utils.get_total_norm([p.grad for p in params])))
        local = float(torch.nn.utils.get_total_norm([local_tensor(p.grad) for p in params]))
        coef = min(1.0, self.config.grad_clip / (local + 1e-6))
        for p in params:
            local_tensor(p.grad).mul_(coef)
        return norm


@register(backend="fsdp_clip_coef_loose_eps", device=EVERYWHERE)
class ClipCoefLooseEpsEngine(FSDPEngineWithLMHead):
    """The clip coefficient computed as max_norm / (norm + 1e-3) instead of torch's + 1e-6:
    where clipping engages, every gradient is 0.2% short, which Adam's first step does not show."""

    def _clip_grad_norm(self) -> float:
        params = [p for p in self.module.parameters() if p.grad is not None]
        norm = float(full_tensor(torch.nn.utils.get_total_norm([p.grad for p in params])))
        coef = min(1.0, self.config.grad_clip / (norm + 1e-3))
        for p in params:
            p.grad.mul_(coef)
        return norm


@register(backend="fsdp_norm_group_default_betas", device=EVERYWHERE)
class NormGroupDefaultBetasEngine(FSDPEngineWithLMHead):
    """The norm weights in a parameter group of their own (as for no weight decay), built with
    torch's default betas instead of the case's: the first step cannot tell, the second moves
    those few tensors differently, too little for the post-step log-probabilities to show."""

    def build(self, model_path: str, *, trainable: bool = True):
        wrapped = super().build(model_path, trainable=trainable)
        if trainable:
            named = list(wrapped.named_parameters())
            norms = [p for n, p in named if "norm" in n]
            rest = [p for n, p in named if "norm" not in n]
            cfg = self.config
            self.optimizer = torch.optim.AdamW(
                [{"params": rest, "betas": (cfg.adam_beta1, cfg.adam_beta2)}, {"params": norms}],
                lr=cfg.lr,
                eps=cfg.adam_eps,
                weight_decay=cfg.weight_decay,
            )
        return wrapped


# --- engines with their own micro-batch loop and their own PPO loss (as verl's) --------------------


@register(backend="fsdp_own_loss", device=EVERYWHERE)
class OwnLossEngine(FSDPEngineWithLMHead):
    """The healthy control of the loss mutants below: it runs its own micro-batch loop and its own
    copy of the PPO loss, as verl's engines do, handing the harness's probe each micro-batch."""

    drives_micro_batches = True

    def ppo_loss(self, logprobs, entropy, mb, tokens: float, cfg):
        return ppo_loss(logprobs, entropy, mb, tokens, cfg)[0]

    def forward_backward(self, batch, tokens: float, cfg, probe) -> None:
        chunks = torch.arange(batch.size).chunk(cfg.micro_batches)
        for i, rows in enumerate(chunks):
            mb = batch.rows(rows)
            with self.gradient_sync_context(is_last_micro_batch=i == len(chunks) - 1):
                logprobs, entropy = self.forward_logprobs(
                    mb.input_ids, mb.prompt_len, with_entropy=True
                )
                probe.loss_computed(logprobs, entropy, mb)
                loss = self.ppo_loss(logprobs, entropy, mb, tokens, cfg)
                (loss * self.data_parallel_size()).backward()


@register(backend="fsdp_loss_without_clip_range", device=EVERYWHERE)
class LossWithoutClipRangeEngine(OwnLossEngine):
    """PPO's clip range dropped (the ratio never clipped): on-policy nothing is clipped anyway."""

    def ppo_loss(self, logprobs, entropy, mb, tokens: float, cfg):
        return super().ppo_loss(logprobs, entropy, mb, tokens, replace(cfg, clip_ratio=1e9))


@register(backend="fsdp_loss_without_response_mask", device=EVERYWHERE)
class LossWithoutResponseMaskEngine(OwnLossEngine):
    """The loss summed over every response position, padding after EOS included: advantages
    there are 0, so only the KL term (0 on-policy) carries the padding into the gradient."""

    def ppo_loss(self, logprobs, entropy, mb, tokens: float, cfg):
        unmasked = replace(mb, mask=torch.ones_like(mb.mask))
        return super().ppo_loss(logprobs, entropy, unmasked, tokens, cfg)


@register(backend="fsdp_kl_in_fp16", device=EVERYWHERE)
class KLInFp16Engine(OwnLossEngine):
    """The KL penalty computed from log-probabilities rounded to fp16 (the compute dtype on fp16
    hardware): an error per token of a few parts per million, inside the reference's tolerance
    for whole gradients and the twin's for their sketches."""

    def ppo_loss(self, logprobs, entropy, mb, tokens: float, cfg):
        without_kl = super().ppo_loss(logprobs, entropy, mb, tokens, replace(cfg, kl_coef=0.0))
        rounded = logprobs.to(torch.float16).float()
        kl = low_var_kl(rounded, mb.ref_logprobs.to(torch.float16).float())
        return without_kl + cfg.kl_coef * token_sum(kl, mb.mask) / tokens


@register(backend="fsdp_kl_anchored_at_old_logprobs", device=EVERYWHERE)
class KLAnchoredAtOldLogprobsEngine(OwnLossEngine):
    """The KL penalty taken against the rollout's log-probabilities instead of the reference
    policy's (the two tensors sit side by side in the batch). Where the reference is the rollout
    policy itself, as on a one-rollout step from the initial weights, they are equal and nothing
    can tell; a case whose KL reference is a step away (kl_reference_shift) shows it."""

    def ppo_loss(self, logprobs, entropy, mb, tokens: float, cfg):
        return super().ppo_loss(
            logprobs, entropy, replace(mb, ref_logprobs=mb.old_logprobs), tokens, cfg
        )


@register(backend="fsdp_own_loop_skips_probe", device=EVERYWHERE)
class OwnLoopSkipsProbeEngine(OwnLossEngine):
    """Runs the micro-batch loop itself (drives_micro_batches, as verl's engines do) with the right
    loss and sync policy, but never calls the harness's probe: the per-micro-batch readings
    (reduce-scatters, the loss's gradient, the first micro-batch's ratio) are never taken. Their
    checks apply by the case's declaration, so their absence is red, not "not applicable"."""

    def forward_backward(self, batch, tokens, cfg, probe) -> None:
        no_probe = types.SimpleNamespace(loss_computed=lambda *args, **kwargs: None)
        super().forward_backward(batch, tokens, cfg, no_probe)


@register(backend="fsdp_extra_all_reduce_on_rank1", device=EVERYWHERE)
class ExtraAllReduceOnRankOneEngine(FSDPEngineWithLMHead):
    """Rank 1 issues one all_reduce its peers never issue (a debugging sum left in on one rank):
    the collectives no longer line up, and the rank whose collective broke is rank 1, not the
    peer that then lost its connection."""

    def optimizer_step(self) -> float:
        if dist.get_rank() == 1:
            dist.all_reduce(torch.ones(3))
        return super().optimizer_step()


@register(backend="fsdp_rotary_in_bf16_on_rank1", device=EVERYWHERE)
class RotaryInBf16OnRankOneEngine(FSDPEngineWithLMHead):
    """Rank 1's rotary embedding rounds its cos and sin to bf16 (a kernel picked by the rank's
    device, or a cast left in one code path): every forward of rank 1, old log-probs included,
    is off by bf16 rounding, and the same on both sides of its own ratio."""

    def build(self, model_path: str, *, trainable: bool = True):
        module = super().build(model_path, trainable=trainable)
        if dist.get_rank() == 1:
            rotary = module.model.rotary_emb
            exact = rotary.forward

            def rounded(x, position_ids):
                cos, sin = exact(x, position_ids)
                return cos.to(torch.bfloat16).to(cos.dtype), sin.to(torch.bfloat16).to(sin.dtype)

            rotary.forward = rounded
        return module
