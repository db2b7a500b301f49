"""What a rank is asked to do: `RankSpec` (spec.json), with the engine's part (`EngineSpec`, what an
engine's constructor is handed) and the step's (`PPOSpec`)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pytest_fsdp_turbo_contract.faults import FaultSpec
from pytest_fsdp_turbo_contract.vocab import DeviceKind, Dtype, Rollout, SyncPolicy


@dataclass(frozen=True)
class EngineSpec:
    """The engine's part of a rank's spec: what an engine's constructor is handed."""

    world_size: int
    fsdp_size: int  # ranks one parameter is sharded over (the whole world for plain FSDP)
    backend: str = "fsdp"
    sp_size: int = 1
    dtype: Dtype = Dtype.FP32  # bf16: bf16 params, fp32 gradient reduction
    gradient_sync: SyncPolicy = SyncPolicy.DEFERRED
    lr: float = 1e-4
    grad_clip: float = 1.0
    weight_decay: float = 0.0  # AdamW; the reference step and the closed form use the same
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    turbo_config: dict = field(default_factory=dict)
    turbo_checkout: str = ""  # where the fsdp_turbo library was found (for the ranks' messages)
    packed: bool = False  # one packed row per micro-batch, with position_ids and cu_seqlens
    # what the engine's catalog entry declares (pytest_fsdp_turbo_contract.vocab.Capability)
    capabilities: tuple[str, ...] = ()


@dataclass(frozen=True)
class PPOSpec:
    prompts: str = "nearest_char"
    num_prompts: int = 4  # global, split across data-parallel ranks
    n: int = 4  # responses per prompt (a GRPO group)
    max_new_tokens: int = 12
    micro_batches: int = 2
    clip_ratio: float = 0.2
    clip_ratio_c: float = 3.0
    kl_coef: float = 0.001
    # the KL reference a known step from the rollout policy: the initial policy's log-probs, each
    # response token's lowered by a seeded |N(0, 1)| x this (0: the initial policy itself)
    kl_reference_shift: float = 0.0
    clip_not_exercised: str = (
        ""  # why the case's later updates cannot engage PPO's clip and be judged
    )
    entropy_coef: float = 0.0
    # a causal-LM (NLL) term on the response tokens, token mean over the global batch; our engines
    # compute it through the model's own loss path with labels (the library's SP loss patch)
    lm_loss_coef: float = 0.0
    # optimizer updates on the one rollout's batch: from the second on, the policy has moved away
    # from the one that sampled it, so PPO's clip, the KL term and the response mask shape the loss
    updates: int = 1
    rollout: Rollout = Rollout.HF
    vllm_memory_share: float = 0.3  # of the device's memory, for a vLLM rollout
    seed: int = 7
    reference_checks: bool = True  # single-process reference gradients, fingerprint (tiny models)
    replay: str = ""  # twin runs: the main run's artifact folder, whose saved batch is replayed


@dataclass(frozen=True)
class RankSpec:
    """spec.json: everything a rank needs, built by the case for one device kind."""

    case_id: str
    model_path: str
    model_type: str
    device_kind: DeviceKind
    engine: EngineSpec
    ppo: PPOSpec
    memory_budget_mb: float | None = None
    engine_modules: tuple[str, ...] = ()
    # seconds a collective may wait before it fails and names its rank (below the case timeout)
    collective_timeout_s: float = 120.0
    fault: FaultSpec | None = None  # the harness's own reliability tests inject one

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RankSpec:
        engine, ppo = data["engine"], data["ppo"]
        return cls(
            **{
                **data,
                "device_kind": DeviceKind(data["device_kind"]),
                "engine": EngineSpec(
                    **{
                        **engine,
                        "dtype": Dtype(engine["dtype"]),
                        "gradient_sync": SyncPolicy(engine["gradient_sync"]),
                    }
                ),
                "ppo": PPOSpec(**{**ppo, "rollout": Rollout(ppo["rollout"])}),
                "engine_modules": tuple(data.get("engine_modules", ())),
                "fault": FaultSpec(**data["fault"]) if data.get("fault") else None,
            }
        )

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=1))

    @classmethod
    def read(cls, path: Path) -> RankSpec:
        return cls.from_json(json.loads(path.read_text()))
