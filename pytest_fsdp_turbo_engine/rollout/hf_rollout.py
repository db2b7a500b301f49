"""Rollout: generate n responses per prompt and report the rollout's own logprobs.

HFRollout runs a non-sharded copy of the policy on each rank's share of the prompts; a vLLM rollout
plugs in behind the same interface.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from pytest_fsdp_turbo_engine.core.ppo import response_logprobs


@dataclass
class RolloutBatch:
    input_ids: torch.Tensor  # [B, P + R] prompt followed by response (right-padded)
    prompt_len: int
    response_mask: torch.Tensor  # [B, R] 1.0 up to and including the first EOS
    rollout_logprobs: torch.Tensor  # [B, R]
    prompt_index: torch.Tensor  # [B] which local prompt each row answers

    @property
    def response_ids(self) -> torch.Tensor:
        return self.input_ids[:, self.prompt_len :]


class Rollout(Protocol):
    def generate(self, prompt_ids: torch.Tensor, n: int, max_new_tokens: int) -> RolloutBatch: ...

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None: ...

    def logprobs(self, input_ids: torch.Tensor, prompt_len: int) -> torch.Tensor: ...

    def served_weights(self) -> tuple[dict[str, torch.Tensor], dict[str, list[str]]]:
        """The tensors the rollout computes with, by its own names, and how it fuses trainer
        tensors into them (weight_handoff.compare)."""
        ...


def response_mask(response_ids: torch.Tensor, eos_id: int) -> torch.Tensor:
    """1 for tokens up to and including the first EOS, 0 after it."""
    is_eos = (response_ids == eos_id).int()
    after_eos = (torch.cumsum(is_eos, dim=1) - is_eos) > 0
    return (~after_eos).float()


def runs_transformers_forwards(model: torch.nn.Module) -> bool:
    """Whether every transformers module of the model runs the forward transformers wrote for it.
    Engines patch model classes process-wide (verl's monkey patches for packed sequences replace
    Qwen3.5's decoder and gated-delta-net forwards), and a replaced forward need not keep
    transformers' KV-cache contract (verl's reads a cache layout transformers no longer has)."""
    for module in model.modules():
        cls = type(module)
        if cls.__module__.startswith("transformers.") and not getattr(
            cls.forward, "__module__", ""
        ).startswith("transformers."):
            return False
    return True


class HFRollout:
    def __init__(self, model_path: str, device: torch.device, eos_id: int, pad_id: int):
        from pytest_fsdp_turbo_engine.core.hf_model import load_pretrained

        self.model = load_pretrained(model_path, dtype=torch.float32)
        self.model.to(device).eval()
        self.eos_id, self.pad_id = eos_id, pad_id

    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, n: int, max_new_tokens: int) -> RolloutBatch:
        prompts = prompt_ids.repeat_interleave(n, dim=0)
        out = self.model.generate(
            input_ids=prompts,
            attention_mask=torch.ones_like(prompts),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_new_tokens,
            eos_token_id=self.eos_id,
            pad_token_id=self.pad_id,
            return_dict_in_generate=True,
            output_logits=True,
            # without the cache each new token re-reads the whole prefix: slower, never wrong
            use_cache=runs_transformers_forwards(self.model),
        )
        prompt_len = prompts.shape[1]
        responses = out.sequences[:, prompt_len:]
        logits = torch.stack(out.logits, dim=1).float()
        pad = max_new_tokens - responses.shape[1]
        if pad:
            responses = torch.nn.functional.pad(responses, (0, pad), value=self.pad_id)
            logits = torch.nn.functional.pad(logits, (0, 0, 0, pad))
        mask = response_mask(responses, self.eos_id)
        logprobs = response_logprobs(logits, responses) * mask
        index = torch.arange(prompt_ids.shape[0]).repeat_interleave(n)
        return RolloutBatch(
            torch.cat([prompts, responses], dim=1), prompt_len, mask, logprobs, index
        )

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        # partial, as vLLM's load_weights is: what was not handed over keeps its old value, and
        # check e names it (the hand-off and the served weights are compared by the harness)
        self.model.load_state_dict(state_dict, strict=False)

    def served_weights(self) -> tuple[dict[str, torch.Tensor], dict[str, list[str]]]:
        return {n: p.detach() for n, p in self.model.named_parameters()}, {}

    @torch.no_grad()
    def logprobs(self, input_ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
        logits = self.model(input_ids=input_ids, use_cache=False).logits[:, prompt_len - 1 : -1]
        return response_logprobs(logits, input_ids[:, prompt_len:])
