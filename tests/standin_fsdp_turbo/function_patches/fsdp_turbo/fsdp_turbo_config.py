"""STAND-IN config schema (the newest layout: Ulysses and loss patches as {target_functions, type} entries). Self-contained: the harness
loads this module alone to read the schema."""

import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fsdp_turbo_standin_core import (  # noqa: E402
    CheckpointConfig,
    DataConfig,
    EPPlanConfig,
    FSDPPlanConfig,
    MemoryConfig,
    ModelConfig,
    OptimizerConfig,
    QuantizationConfig,
    TPPlanConfig,
    TrainRunConfig,
    _dict_to_dataclass,  # noqa: F401
    finish_config,
)


@dataclass
class CPPlanConfig:
    ulysses_function_patches: list = field(default_factory=list)
    loss_function_patches: list = field(default_factory=list)


@dataclass
class DistributedConfig:
    data_parallel_size: int = 1
    fully_shard_parallel_size: int = 1
    fsdp_plan: FSDPPlanConfig = None
    tensor_parallel_size: int = 1
    tp_plan: TPPlanConfig = None
    kv_allgather_parallel_size: int = 1
    ulysses_parallel_size: int = 1
    cp_plan: CPPlanConfig = None
    expert_parallel_size: int = 1
    expert_fully_shard_parallel_size: int = 1
    expert_data_parallel_size: int = 1
    ep_plan: EPPlanConfig = None


@dataclass
class FSDPTurboConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    run: TrainRunConfig = field(default_factory=TrainRunConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    module_patches: list = field(default_factory=list)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    quantization: QuantizationConfig = field(default_factory=QuantizationConfig)

    def __post_init__(self):
        finish_config(self)
