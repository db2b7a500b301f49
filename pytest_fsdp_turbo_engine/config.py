"""What a rank is asked to do, under the names engines are written against: `EngineConfig` is what
an engine's constructor is handed, `PPOConfig` the step's settings. Both are the rank contract's
types (pytest_fsdp_turbo_contract/), so the spec a case builds is what an engine reads."""

from pytest_fsdp_turbo_contract.spec import EngineSpec as EngineConfig
from pytest_fsdp_turbo_contract.spec import PPOSpec as PPOConfig

__all__ = ["EngineConfig", "PPOConfig"]
