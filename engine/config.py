"""What a rank is asked to do: the case's engine and PPO settings, as plain dataclasses."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class EngineConfig:
    backend: str = "fsdp"
    world_size: int = 1
    fsdp_size: int = 1
    sp_size: int = 1
    dtype: str = "fp32"  # fp32 | bf16 (bf16 params, fp32 gradient reduction)
    sync_policy: str = "deferred"  # deferred | every_micro_batch
    lr: float = 1e-4
    grad_clip: float = 1.0
    weight_decay: float = 0.0  # AdamW; the reference step uses the same
    turbo_config: dict = field(default_factory=dict)


@dataclass(frozen=True)
class PPOConfig:
    prompts: str = "nearest_char"
    num_prompts: int = 4  # global, split across data-parallel ranks
    n: int = 4  # responses per prompt (a GRPO group)
    max_new_tokens: int = 12
    micro_batches: int = 2
    clip_ratio: float = 0.2
    clip_ratio_c: float = 3.0
    kl_coef: float = 0.001
    entropy_coef: float = 0.0
    rollout: str = "hf"  # hf | vllm
    seed: int = 7
    reference_checks: bool = True  # single-process reference gradients, fingerprint (tiny models)
    replay: str = ""  # twin runs: the main run's artifact folder, whose saved batch is replayed
