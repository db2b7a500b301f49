"""The batch a PPO step trains on, and the loss over it; saved with the run so a twin can replay it."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from pytest_fsdp_turbo_contract.spec import PPOSpec
from pytest_fsdp_turbo_engine.core import ppo
from pytest_fsdp_turbo_engine.core.reductions import gather_rows

TENSOR_FIELDS = ("input_ids", "mask", "advantages", "old_logprobs", "ref_logprobs")


@dataclass
class TrainBatch:
    input_ids: torch.Tensor  # [B, P + R]
    prompt_len: int
    mask: torch.Tensor  # [B, R] response tokens that count
    advantages: torch.Tensor  # [B, R]
    old_logprobs: torch.Tensor  # [B, R]
    ref_logprobs: torch.Tensor  # [B, R]

    def _map(self, fn) -> TrainBatch:
        return replace(self, **{name: fn(getattr(self, name)) for name in TENSOR_FIELDS})

    def rows(self, index) -> TrainBatch:
        return self._map(lambda t: t[index])

    def to(self, device: torch.device) -> TrainBatch:
        return self._map(lambda t: t.to(device))

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    def gather(self, group=None) -> TrainBatch:
        """The rows of every rank in `group`, in rank order (on CPU), on every rank."""
        return self._map(lambda t: gather_rows(t, group))

    def save(self, path: Path) -> None:
        payload = {name: getattr(self, name).detach().cpu() for name in TENSOR_FIELDS}
        torch.save({**payload, "prompt_len": self.prompt_len}, path)

    @classmethod
    def load(cls, path: Path) -> TrainBatch:
        data = torch.load(path, weights_only=True)
        return cls(**{name: data[name] for name in (*TENSOR_FIELDS, "prompt_len")})


def ppo_loss(
    logprobs: torch.Tensor,
    entropy: torch.Tensor | None,
    mb: TrainBatch,
    tokens: float,
    cfg: PPOSpec,
    lm_mean: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss, and its parts under their LossRecord field names. Token-mean over the global batch
    (`tokens`), so any split into ranks and micro-batches sums to the same loss. With cfg.lm_loss_coef, the causal-LM term: `lm_mean`, the model's own loss
    over this micro-batch's response tokens (a mean), rescaled to the global token mean; without
    it, the same term in closed form from the log-probabilities."""
    pg_loss, clipfrac, ppo_kl = ppo.policy_loss(
        logprobs, mb.old_logprobs, mb.advantages, mb.mask, tokens, cfg.clip_ratio, cfg.clip_ratio_c
    )
    kl_loss = ppo.token_sum(ppo.low_var_kl(logprobs, mb.ref_logprobs), mb.mask) / tokens
    loss = pg_loss + cfg.kl_coef * kl_loss
    parts = {"pg_loss": pg_loss, "pg_clipfrac": clipfrac, "ppo_kl": ppo_kl, "kl_loss": kl_loss}
    if entropy is not None:
        ent = ppo.token_sum(entropy, mb.mask) / tokens
        loss = loss - cfg.entropy_coef * ent
        parts["entropy"] = ent
    if cfg.lm_loss_coef:
        if lm_mean is None:
            lm = ppo.token_sum(-logprobs, mb.mask) / tokens
        else:
            lm = lm_mean * mb.mask.sum() / tokens
        loss = loss + cfg.lm_loss_coef * lm
    parts["loss"] = loss
    return loss, {k: v.detach() for k, v in parts.items()}
