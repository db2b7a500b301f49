"""What every phase of one rank shares, built once: the device, the engine from the registry (checked
against what its catalog entry declares), the tokenizer, the frozen reference policy and the
rollout."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pytest_fsdp_turbo_contract.device_profiles import profile_of
from pytest_fsdp_turbo_contract.spec import EngineSpec, PPOSpec, RankSpec
from pytest_fsdp_turbo_contract.vocab import Capability, DeviceKind, Rollout
from pytest_fsdp_turbo_engine.engines.ulysses_lift import library_patches_lifted
from pytest_fsdp_turbo_engine.rank_env import RankEnv
from pytest_fsdp_turbo_engine.rollout.hf_rollout import HFRollout
from pytest_fsdp_turbo_engine.step.phases import Phase


def device_for(kind: str, local_rank: int) -> torch.device:
    """The rank's device, reached through torch's device module for the kind once what the
    kind's profile names has registered it (torch_npu adds `npu`)."""
    if kind == DeviceKind.CPU:
        return torch.device("cpu")
    for module in profile_of(kind).device_imports:
        importlib.import_module(module)
    torch.get_device_module(kind).set_device(local_rank)
    return torch.device(kind, local_rank)


@dataclass(frozen=True)
class Rank:
    """What every phase of one rank shares, built once by `load`: its spec, device, engine, rollout
    and data-parallel place."""

    spec: RankSpec
    rank: int
    phase: Phase
    out: Path
    device: torch.device
    engine: Any  # a pytest_fsdp_turbo_engine/engines/protocol.py Engine, built
    tokenizer: Any
    reference_module: torch.nn.Module | None  # frozen initial policy, for ref logprobs (not a twin)
    rollout: Any  # None for a twin, which replays the main run's batch
    dp_rank: int
    dp_size: int

    @property
    def engine_cfg(self) -> EngineSpec:
        return self.spec.engine

    @property
    def cfg(self) -> PPOSpec:
        return self.spec.ppo

    @property
    def sp(self) -> int:
        return max(1, self.spec.engine.sp_size)

    @property
    def replaying(self) -> bool:
        return bool(self.cfg.replay)

    def faulty(self, kind: str) -> bool:
        fault = self.phase.fault
        return fault is not None and fault.kind == kind and fault.rank == self.rank

    def unsharded(self):
        """Around the harness's own whole-sequence models (rollout, single-process reference): the
        FSDP-Turbo library's Ulysses patches lifted (pytest_fsdp_turbo_engine/engines/ulysses_lift.py); a no-op without SP."""
        return library_patches_lifted(self.engine_cfg.turbo_config)


def load(spec: RankSpec, place: RankEnv, phase: Phase, out: Path) -> Rank:
    from transformers import AutoTokenizer

    from pytest_fsdp_turbo_contract.engines import EngineCatalog
    from pytest_fsdp_turbo_engine.engines.protocol import require_protocol
    from pytest_fsdp_turbo_engine.engines.registry import (
        VERL_PREFIX,
        RegistryError,
        load_engines,
        lookup,
    )

    engine_cfg, cfg, kind = spec.engine, spec.ppo, spec.device_kind
    rank = place.rank
    device = device_for(kind, place.local_rank)
    torch.manual_seed(cfg.seed)

    phase.enter("load")
    if engine_cfg.backend.startswith(VERL_PREFIX):
        from pytest_fsdp_turbo_engine.verl_cpu_platform import prepare

        prepare(kind)  # before any engine module imports verl
    load_engines(EngineCatalog.from_ranks(spec.engine_modules), engine_cfg.backend)
    engine_class = require_protocol(
        lookup(spec.model_type, engine_cfg.backend, kind), engine_cfg.backend
    )
    declared = engine_cfg.capabilities
    drives = bool(getattr(engine_class, "drives_micro_batches", False))
    if declared and (Capability.OWN_LOOP in declared) != drives:
        raise RegistryError(
            f"backend {engine_cfg.backend}: its catalog entry declares "
            f"[{', '.join(declared)}], but {engine_class.__qualname__}.drives_micro_batches is "
            f"{drives}: declare own_loop exactly when the engine runs its own micro-batch loop"
        )
    engine = engine_class(engine_cfg, device)
    tokenizer = AutoTokenizer.from_pretrained(spec.model_path)
    engine.build(spec.model_path)
    reference_module = rollout = None
    if not cfg.replay:
        reference_module = engine.build(spec.model_path, trainable=False)
        rollout = make_rollout(cfg, engine_cfg, spec.model_path, device, tokenizer)
    return Rank(
        spec,
        rank,
        phase,
        out,
        device,
        engine,
        tokenizer,
        reference_module,
        rollout,
        engine.data_parallel_rank(),
        engine.data_parallel_size(),
    )


def make_rollout(cfg: PPOSpec, engine_cfg: EngineSpec, model_path: str, device, tokenizer):
    if cfg.rollout == Rollout.VLLM:
        from pytest_fsdp_turbo_engine.rollout.vllm_rollout import VLLMRollout

        eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
        return VLLMRollout(
            model_path, eos, pad, engine_cfg.dtype, cfg.seed, memory_share=cfg.vllm_memory_share
        )
    return HFRollout(model_path, device, tokenizer.eos_token_id, tokenizer.pad_token_id)
