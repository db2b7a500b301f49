"""FSDPEngineWithLMHead: FSDP2 (fully_shard per decoder layer, then the root) on a 1-D or HSDP mesh."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import ClassVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from pytest_fsdp_turbo_contract.spec import EngineSpec
from pytest_fsdp_turbo_contract.vocab import Dtype, SyncPolicy
from pytest_fsdp_turbo_engine.core.ppo import entropy_from_logits, response_logprobs
from pytest_fsdp_turbo_engine.engines.registry import register


def full_tensor(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


def local_tensor(value: torch.Tensor) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else value


def adamw(params, config: EngineSpec) -> torch.optim.AdamW:
    """AdamW with the case's settings (the reference step and the harness's closed form read the
    same ones)."""
    return torch.optim.AdamW(
        params,
        lr=config.lr,
        betas=(config.adam_beta1, config.adam_beta2),
        eps=config.adam_eps,
        weight_decay=config.weight_decay,
    )


def materialize_unsharded_params(module: torch.nn.Module) -> None:
    """Give every FSDP2 unit its unsharded parameters once, by one all-gather and reshard per unit.

    A unit whose forward never runs (a vision tower on a text batch) never creates them, and when
    gradients are held across micro-batches in a reduce dtype other than the parameters' (bf16
    parameters, fp32 reduction, deferred sync), FSDP2's final post-backward reads them anyway:
    `AttributeError: 'FSDPParam' object has no attribute '_unsharded_param'` on torch 2.11 to 2.14
    (`to_accumulated_grad_if_needed`; pytorch#194058). Created here, they are empty after the
    reshard, the unit's gradient stays None, and the callback passes over it.
    """
    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            unit.unshard()
            unit.reshard()


def _of_the_response(logits: torch.Tensor, input_ids: torch.Tensor, prompt_len: int):
    """Log-probabilities of the response tokens, and their entropy when asked (a callable)."""
    logits = logits[:, prompt_len - 1 : -1].float()
    return response_logprobs(logits, input_ids[:, prompt_len:]), lambda: entropy_from_logits(logits)


@register(backend="fsdp", device=["cpu", "cuda", "npu"])
class FSDPEngineWithLMHead:
    """Our FSDP2 engine; it meets pytest_fsdp_turbo_engine/engines/protocol.py's HarnessLoopEngine."""

    # the harness runs the micro-batch loop, asking gradient_sync_context per micro-batch
    drives_micro_batches: ClassVar[bool] = False

    def __init__(self, config: EngineSpec, device: torch.device):
        self.config = config
        self.device = device
        self.module: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.mesh = self._build_mesh()

    # --- topology -------------------------------------------------------------------------------
    def _build_mesh(self) -> DeviceMesh:
        cfg = self.config
        if cfg.fsdp_size < cfg.world_size:
            return init_device_mesh(
                self.device.type,
                (cfg.world_size // cfg.fsdp_size, cfg.fsdp_size),
                mesh_dim_names=("replicate", "shard"),
            )
        return init_device_mesh(self.device.type, (cfg.world_size,), mesh_dim_names=("shard",))

    def data_parallel_rank(self) -> int:
        return dist.get_rank()

    def data_parallel_size(self) -> int:
        return dist.get_world_size()

    def data_parallel_group(self) -> dist.ProcessGroup:
        return dist.group.WORLD

    def replicate_group(self) -> dist.ProcessGroup | None:
        """Ranks holding the same shard (HSDP replicas); None for plain FSDP."""
        if "replicate" in (self.mesh.mesh_dim_names or ()):
            return self.mesh.get_group("replicate")
        return None

    # --- model ----------------------------------------------------------------------------------
    def _mixed_precision(self) -> MixedPrecisionPolicy:
        if self.config.dtype == Dtype.BF16:
            return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        return MixedPrecisionPolicy()

    def _wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        policy = self._mixed_precision()
        block_names = set(getattr(model, "_no_split_modules", None) or ())
        for module in model.modules():
            if type(module).__name__ in block_names:
                fully_shard(module, mesh=self.mesh, mp_policy=policy)
        fully_shard(model, mesh=self.mesh, mp_policy=policy)
        return model

    def _prepare_units_that_may_not_run(self, module: torch.nn.Module) -> None:
        materialize_unsharded_params(module)

    def load_options(self) -> dict:
        """Extra from_pretrained arguments this engine's parallel layout needs (none here)."""
        return {}

    def build(self, model_path: str, *, trainable: bool = True) -> torch.nn.Module:
        from pytest_fsdp_turbo_engine.core.hf_model import load_pretrained

        model = load_pretrained(model_path, dtype=torch.float32, **self.load_options())
        model.to(self.device)
        wrapped = self._wrap(model)
        if trainable:
            self._prepare_units_that_may_not_run(wrapped)
            self.module = wrapped
            self.optimizer = adamw(wrapped.parameters(), self.config)
        else:
            wrapped.requires_grad_(False)
            wrapped.eval()
        return wrapped

    def forward_logprobs(
        self,
        input_ids: torch.Tensor,
        prompt_len: int,
        *,
        module: torch.nn.Module | None = None,
        with_entropy: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probabilities (and entropy) of the response tokens under `module` (the policy)."""
        logits = self._logits(module or self.module, input_ids)
        logprobs, entropy = _of_the_response(logits, input_ids, prompt_len)
        return logprobs, (entropy() if with_entropy else None)

    def forward_logprobs_with_lm_loss(
        self, input_ids: torch.Tensor, prompt_len: int, response_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Log-probabilities and entropy of the response tokens under the policy, and the model's
        own causal-LM loss (its loss function, given `labels`) over the response tokens the mask
        keeps: the mean the model computes, in the same forward."""
        labels = torch.full_like(input_ids, -100)
        labels[:, prompt_len:] = torch.where(
            response_mask.bool(), input_ids[:, prompt_len:], labels[:, prompt_len:]
        )
        logits, lm_mean = self._logits_and_loss(self.module, input_ids, labels)
        logprobs, entropy = _of_the_response(logits, input_ids, prompt_len)
        return logprobs, entropy(), lm_mean

    def _logits(self, model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits over the whole sequence (a sequence-parallel engine gathers its chunks)."""
        return model(input_ids=input_ids, use_cache=False).logits

    def _logits_and_loss(
        self, model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out = model(input_ids=input_ids, labels=labels, use_cache=False)
        return out.logits, out.loss

    # --- gradient synchronisation ---------------------------------------------------------------
    def _set_gradient_sync(self, enabled: bool) -> None:
        self.module.set_requires_gradient_sync(enabled)

    @contextmanager
    def gradient_sync_context(self, is_last_micro_batch: bool) -> Iterator[None]:
        """deferred: reduce-scatter only on the last micro-batch; every_micro_batch: always.

        Sync is switched back on when the body ends, even when the backward raised, so a failed
        micro-batch never leaves the module silently accumulating unsynchronised gradients.
        """
        sync = is_last_micro_batch or self.config.gradient_sync == SyncPolicy.EVERY_MICRO_BATCH
        self._set_gradient_sync(sync)
        try:
            yield
        finally:
            self._set_gradient_sync(True)

    # --- optimizer ------------------------------------------------------------------------------
    def _clip_grad_norm(self) -> float:
        params = [p for p in self.module.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, self.config.grad_clip, foreach=False)
        return float(full_tensor(norm))

    def optimizer_step(self) -> float:
        """Clip by the global norm; a non-finite norm skips the update on every rank alike."""
        norm = self._clip_grad_norm()
        if math.isfinite(norm):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded parameters, as a rollout engine loads them."""
        return {name: full_tensor(p.detach()) for name, p in self.module.named_parameters()}
