"""STAND-IN config schema (the middle layout: one Ulysses core-attention function list, no loss patch). Self-contained: the harness
loads this module alone to read the schema."""

import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fsdp_turbo_standin_core import (  # noqa: E402
    NOT_MODELLED,  # noqa: F401 - what the stand-in refuses, read by the harness's inspection
    DistributedConfigBase,
    FSDPTurboConfigBase,
    _dict_to_dataclass,  # noqa: F401
)


@dataclass
class CPPlanConfig:
    ulysses_core_attention_function: str | list = None
    ulysses_attention_type: str = "default"
    ulysses_attn_output_transposed: bool = False
    kv_allgather_core_attention_function: str | list = None
    kv_allgather_attention_type: str = "default"


@dataclass
class DistributedConfig(DistributedConfigBase):
    cp_plan: CPPlanConfig = None


@dataclass
class FSDPTurboConfig(FSDPTurboConfigBase):
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
