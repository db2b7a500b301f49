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
from pytest_fsdp_turbo_contract.layout import data_parallel_ranks, replica_ranks
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
class Layout:
    """Where a rank sits in the layout the case declares (world_size, fsdp_size, sp_size), with the
    harness's own process groups over it: the rows it is handed, the ranks its tokens and rows are
    reduced and gathered over, and the replicas whose parameters must agree. Built by the harness
    from the spec, never asked of the engine (what the engine reports is recorded beside it, and
    checks d and j hold it to this)."""

    data_rank: int
    data_size: int
    data_group: Any  # a ProcessGroup over data_parallel_ranks
    replica_ranks: list[int]
    replica_group: Any  # None where the declared layout has no replicas

    @classmethod
    def declared(cls, engine_cfg: EngineSpec, rank: int) -> Layout:
        """Every rank builds every group, in the same order (a collective)."""
        world, sp = engine_cfg.world_size, max(1, engine_cfg.sp_size)
        replicas = engine_cfg.shard_size * sp < world  # as check d declares them (HSDP)
        shard = engine_cfg.shard_size if replicas else world
        data = [data_parallel_ranks(r, world, sp) for r in range(sp)]
        held = [replica_ranks(r, world, shard) for r in range(shard)]
        return cls(
            data_rank=rank // sp,
            data_size=world // sp,
            data_group=_group_of(rank, data, world),
            replica_ranks=replica_ranks(rank, world, shard),
            replica_group=_group_of(rank, held, world) if replicas else None,
        )


def _group_of(rank: int, partition: list[list[int]], world: int):
    """This rank's group of `partition` (every rank creates all of them, as new_group asks)."""
    if len(partition) == 1 and len(partition[0]) == world:
        return torch.distributed.group.WORLD
    mine, _ = torch.distributed.new_subgroups_by_enumeration(partition)
    return mine


def reported_layout(engine, rank: int) -> dict[str, Any]:
    """What the engine says of its place (RankRecord's engine_* fields): its data-parallel rank,
    size and group, and its replica group ([rank] alone where it says there is none)."""
    replicas = engine.replicate_group()
    return {
        "engine_data_rank": int(engine.data_parallel_rank()),
        "engine_data_size": int(engine.data_parallel_size()),
        "engine_data_group": _ranks_of(engine.data_parallel_group()),
        "engine_replica_group": [rank] if replicas is None else _ranks_of(replicas),
    }


def _ranks_of(group) -> list[int]:
    return sorted(torch.distributed.get_process_group_ranks(group))


@dataclass(frozen=True)
class Rank:
    """What every phase of one rank shares, built once by `load`: its spec, device, engine, rollout
    and its place in the declared layout."""

    spec: RankSpec
    rank: int
    phase: Phase
    out: Path
    device: torch.device
    engine: Any  # a pytest_fsdp_turbo_engine/engines/protocol.py Engine, built
    tokenizer: Any
    reference_module: torch.nn.Module | None  # frozen initial policy, for ref logprobs (not a twin)
    rollout: Any  # None for a twin, which replays the main run's batch
    layout: Layout  # the declared layout, the harness's groups over it

    @property
    def dp_rank(self) -> int:
        return self.layout.data_rank

    @property
    def dp_size(self) -> int:
        return self.layout.data_size

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
        Layout.declared(engine_cfg, rank),
    )


def make_rollout(cfg: PPOSpec, engine_cfg: EngineSpec, model_path: str, device, tokenizer):
    if cfg.rollout == Rollout.VLLM:
        from pytest_fsdp_turbo_engine.rollout.vllm_rollout import VLLMRollout

        eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
        return VLLMRollout(
            model_path, eos, pad, engine_cfg.dtype, cfg.seed, memory_share=cfg.vllm_memory_share
        )
    return HFRollout(model_path, device, tokenizer.eos_token_id, tokenizer.pad_token_id)
