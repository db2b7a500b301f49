"""FSDPTurboEngineWithLMHead: the FSDP engine with parallel state, wrapping and clipping delegated to
the Ascend `fsdp_turbo` library. Imported only when a case selects backend "fsdp_turbo".

The library cannot run on a CPU box, so this adapter stays thin: every call into the library is in
this file, and everything that does not need it (config validation, error text) is tested directly.
"""

from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from pytest_fsdp_turbo_engine.fsdp_engine import FSDPEngineWithLMHead
from pytest_fsdp_turbo_engine.registry import register

CHECKOUT_VAR = "PYTEST_FSDP_TURBO_CHECKOUT"


def import_fsdp_turbo() -> SimpleNamespace:
    """The library entry points this engine uses; a failed import names where we looked."""
    try:
        from fsdp_turbo.distributed.parallel_state import get_parallel_state, init_parallel_state
        from fsdp_turbo.fsdp_turbo import FSDPTurbo
        from fsdp_turbo.fsdp_turbo_config import FSDPTurboConfig, _dict_to_dataclass
        from fsdp_turbo.training.clip_grads import clip_grad_norm
    except ImportError as exc:
        checkout = os.environ.get(CHECKOUT_VAR) or "(no FSDPTurbo checkout resolved)"
        raise ImportError(
            f"backend fsdp_turbo needs the fsdp_turbo library: {exc}; tried checkout {checkout} "
            f"and PYTHONPATH={os.environ.get('PYTHONPATH', '')!r}"
        ) from exc
    return SimpleNamespace(
        FSDPTurbo=FSDPTurbo,
        FSDPTurboConfig=FSDPTurboConfig,
        dict_to_dataclass=_dict_to_dataclass,
        init_parallel_state=init_parallel_state,
        get_parallel_state=get_parallel_state,
        clip_grad_norm=clip_grad_norm,
    )


def unknown_config_keys(config_type: type, given: dict[str, Any], prefix: str = "") -> list[str]:
    """Keys of `given` that the library's config dataclasses do not declare (it would drop them)."""
    if not dataclasses.is_dataclass(config_type):
        return []
    fields = {f.name: f for f in dataclasses.fields(config_type)}
    unknown = []
    for key, value in given.items():
        if key not in fields:
            unknown.append(prefix + key)
            continue
        field_type = fields[key].type
        if isinstance(field_type, str):  # postponed annotations: resolve from the default
            default = (
                fields[key].default_factory
                if fields[key].default_factory is not dataclasses.MISSING
                else None
            )
            field_type = type(default()) if default else None
        if (
            isinstance(value, dict)
            and field_type is not None
            and dataclasses.is_dataclass(field_type)
        ):
            unknown += unknown_config_keys(field_type, value, f"{prefix}{key}.")
    return unknown


@register(backend="fsdp_turbo", device=["cuda", "npu"])
class FSDPTurboEngineWithLMHead(FSDPEngineWithLMHead):
    def _build_mesh(self):
        self.turbo = import_fsdp_turbo()
        unknown = unknown_config_keys(self.turbo.FSDPTurboConfig, self.config.turbo_config)
        if unknown:
            raise ValueError(f"turbo_config: keys fsdp_turbo would silently drop: {unknown}")
        self.turbo_config = self.turbo.dict_to_dataclass(
            self.turbo.FSDPTurboConfig, self.config.turbo_config
        )
        self.turbo.init_parallel_state(self.turbo_config)
        self.parallel_state = self.turbo.get_parallel_state()
        return None

    def data_parallel_rank(self) -> int:
        return self.parallel_state.get_data_rank()

    def data_parallel_size(self) -> int:
        return self.parallel_state.get_data_group_size()

    def data_parallel_group(self) -> dist.ProcessGroup:
        return self.parallel_state.get_data_group()

    def replicate_group(self) -> dist.ProcessGroup | None:
        return None

    def _wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return self.turbo.FSDPTurbo(self.turbo_config, model).model

    def _clip_grad_norm(self) -> float:
        return float(self.turbo.clip_grad_norm(model=self.module, max_norm=self.config.grad_clip))
