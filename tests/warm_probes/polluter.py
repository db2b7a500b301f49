"""Imported by one case's ranks (engine_modules) to dirty every kind of process state a later case
could inherit if ranks or their parent were reused: environment, RNG, engine registry, imports."""

import os
import sys

import torch

from pytest_fsdp_turbo_engine.engines.fsdp2 import FSDPEngineWithLMHead
from pytest_fsdp_turbo_engine.engines.registry import register

os.environ["PYTEST_FSDP_TURBO_POLLUTED"] = "1"
torch.manual_seed(12345)
torch.rand(1000)
sys.modules["pytest_fsdp_turbo_polluted_marker"] = sys.modules[__name__]


@register(backend="fsdp_polluted", device=["cpu"])
class PollutedEngine(FSDPEngineWithLMHead):
    pass
