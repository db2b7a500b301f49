"""PPO / GRPO math as pure tensor functions (no process group, no model) so each is testable by hand.

Aggregation is token-mean over the *global* batch: callers pass the global token count, which makes the
result independent of how the batch is split into ranks and micro-batches.
"""

from __future__ import annotations

import torch


def grpo_advantages(scores: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """Scores of n responses per prompt, normalised within each prompt's group."""
    groups = scores.view(-1, group_size)
    mean = groups.mean(dim=1, keepdim=True)
    std = groups.std(dim=1, keepdim=True) if group_size > 1 else torch.ones_like(mean)
    return ((groups - mean) / (std + eps)).reshape(-1)


def gae_advantages(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over response tokens; returns (advantages, returns)."""
    advantages = torch.zeros_like(rewards)
    last = torch.zeros_like(rewards[:, 0])
    next_value = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last = delta + gamma * lam * last
        last = last * mask[:, t]
        advantages[:, t] = last
        next_value = values[:, t] * mask[:, t] + next_value * (1 - mask[:, t])
    return advantages, advantages + values


def token_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum()


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    global_tokens: float,
    clip_ratio: float = 0.2,
    clip_ratio_c: float = 3.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Clipped surrogate with dual clip; (loss, clipfrac, ppo_kl) as sums / global_tokens."""
    log_ratio = (logprobs - old_logprobs).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_ratio, 1.0 + clip_ratio)
    pessimistic = torch.maximum(unclipped, clipped)
    dual = torch.minimum(pessimistic, -advantages * clip_ratio_c)
    per_token = torch.where(advantages < 0, dual, pessimistic)
    loss = token_sum(per_token, mask) / global_tokens
    clipfrac = token_sum((clipped > unclipped).float(), mask) / global_tokens
    ppo_kl = token_sum(-log_ratio, mask) / global_tokens
    return loss, clipfrac.detach(), ppo_kl.detach()


def low_var_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k3 estimator of KL(policy || reference): non-negative, low variance."""
    log_ratio = ref_logprobs - logprobs
    return (torch.exp(log_ratio) - log_ratio - 1.0).clamp(-10.0, 10.0)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def response_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Log-probability of each taken token, from the logits that predicted it."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
