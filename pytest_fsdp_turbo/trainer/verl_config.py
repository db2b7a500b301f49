"""What a trainer run declares, read from verl's own resolved config, never assumed: the sync policy
(`use_no_sync_for_gradient_accumulation`, which verl's trainer YAML leaves false), micro-batches per
optimizer step, the rollout replicas. Two sources, one reading: the config Hydra saved in a run's
folder, or the config composed here from verl's YAML and a case's overrides (`pytest-fsdp-turbo
config` and `doctor`, before any run). Torch-free (Hydra and OmegaConf only).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pytest_fsdp_turbo_contract.errors import ConfigError, Unavailable
from pytest_fsdp_turbo_contract.trainer_spec import (
    ACTOR,
    clip_key,
    config_value,
    precision,
    precision_key,
    ulysses_key,
    updates_per_step,
    whole_number,
)
from pytest_fsdp_turbo_contract.vocab import SyncPolicy

SYNC_FLAG = f"{ACTOR}.fsdp_config.use_no_sync_for_gradient_accumulation"
CONFIG_NAME = "ppo_trainer"  # main_ppo's @hydra.main config


@dataclass(frozen=True)
class TrainerDeclared:
    """What the resolved config promises, in the harness's words."""

    gradient_sync: SyncPolicy
    sync_flag: bool  # verl's own name for it, as resolved
    strategy: str
    world_size: int
    sp_size: int
    micro_batches: int | None  # per rank and optimizer step; None: dynamic batch sizes
    rollout: str
    rollout_replicas: int
    grad_clip: float
    model_dtype: str  # the parameters' (and their gradients'), as verl loads the actor
    compute_dtype: str  # what its forward and backward run in: the FSDP mixed precision's
    # the step's settings, where the config holds them (None: it does not)
    lr: float | None = None
    weight_decay: float | None = None
    betas: tuple[float, float] | None = None
    n: int | None = None  # responses per prompt
    num_prompts: int | None = None  # data.train_batch_size: prompts per step, all ranks
    max_new_tokens: int | None = None  # data.max_response_length
    clip_ratio: float | None = None
    rollout_dtype: str | None = None  # what the rollout serves the weights in (torch's name)
    updates: int = 1  # optimizer steps per training step (mini-batches x ppo_epochs)

    def lines(self) -> list[str]:
        """For `config` and `doctor`: the resolved sync policy first."""
        return [
            f"gradient_sync: {self.gradient_sync} ({SYNC_FLAG} = {str(self.sync_flag).lower()})",
            f"strategy: {self.strategy}, world size {self.world_size}, Ulysses SP {self.sp_size}",
            "micro-batches per rank and optimizer step: "
            + ("dynamic" if self.micro_batches is None else str(self.micro_batches))
            + f"; optimizer steps per training step: {self.updates}",
            f"rollout: {self.rollout}, {self.rollout_replicas} replica(s)",
            f"grad clip: {self.grad_clip:g}, model dtype: {self.model_dtype}, "
            f"compute dtype: {self.compute_dtype}",
        ]


_get = config_value


def declared(config: dict, world_size: int) -> TrainerDeclared:
    """The harness's reading of a resolved verl config (a plain dict)."""
    flag = bool(_get(config, SYNC_FLAG, False))
    strategy = str(_get(config, f"{ACTOR}.strategy", "?"))
    sp = whole_number(config, ulysses_key(config)) or 1
    n = whole_number(config, "actor_rollout_ref.rollout.n") or 1
    dp = max(1, world_size // sp)
    micro = whole_number(config, f"{ACTOR}.ppo_micro_batch_size_per_gpu")
    mini = whole_number(config, f"{ACTOR}.ppo_mini_batch_size")
    dynamic = bool(_get(config, f"{ACTOR}.use_dynamic_bsz", False))
    micro_batches = None
    if not dynamic and micro and mini:
        micro_batches = max(1, int(mini) * n // dp // int(micro))
    rollout = "actor_rollout_ref.rollout"
    per_replica = 1
    for key in ("tensor_model_parallel_size", "data_parallel_size", "pipeline_model_parallel_size"):
        per_replica *= whole_number(config, f"{rollout}.{key}") or 1
    return TrainerDeclared(
        gradient_sync=SyncPolicy.DEFERRED if flag else SyncPolicy.EVERY_MICRO_BATCH,
        sync_flag=flag,
        strategy=strategy,
        world_size=world_size,
        sp_size=sp,
        micro_batches=micro_batches,
        rollout=str(_get(config, f"{rollout}.name", "?")),
        rollout_replicas=max(1, world_size // per_replica),
        grad_clip=_clip(config),
        model_dtype=precision(config, f"{ACTOR}.fsdp_config.model_dtype", unset="fp32"),
        compute_dtype=precision(config, precision_key(config)),
        lr=_number(config, f"{ACTOR}.optim.lr", float),
        weight_decay=_number(config, f"{ACTOR}.optim.weight_decay", float),
        betas=_betas(_get(config, f"{ACTOR}.optim.betas")),
        n=_number(config, "actor_rollout_ref.rollout.n", int),
        num_prompts=_number(config, "data.train_batch_size", int),
        max_new_tokens=_number(config, "data.max_response_length", int),
        clip_ratio=_number(config, f"{ACTOR}.clip_ratio", float),
        rollout_dtype=_torch_dtype(_get(config, f"{rollout}.dtype")),
        updates=updates_per_step(config),
    )


def _clip(config: dict) -> float:
    """The clip's max_norm (verl's default 1.0 where unset); a word for it is one line."""
    key = clip_key(config)
    value = _get(config, key, 1.0)
    try:
        if isinstance(value, bool):
            raise ValueError
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"verl's config: {key}: expected a number; got {value!r}") from None


def _number(config: dict, dotted: str, kind: type) -> Any:
    value = _get(config, dotted)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return kind(value)


def _torch_dtype(value: Any) -> str | None:
    """verl's dtype names (bf16, fp32, bfloat16, float32) as torch names them."""
    names = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "half": "float16"}
    name = names.get(value, value) if isinstance(value, str) else None
    return name if name in ("bfloat16", "float16", "float32") else None  # "auto": as received


def _betas(value: Any) -> tuple[float, float] | None:
    numbers = isinstance(value, list | tuple) and len(value) == 2
    if numbers and all(isinstance(v, int | float) and not isinstance(v, bool) for v in value):
        return float(value[0]), float(value[1])
    return None


def read_resolved(path: Path) -> dict:
    """The config Hydra saved for a run, interpolations resolved."""
    from omegaconf import OmegaConf  # optional: verl brings hydra-core

    try:
        return OmegaConf.to_container(OmegaConf.load(path), resolve=True)  # type: ignore[return-value]
    except Exception as exc:  # noqa: BLE001 - OmegaConf raises many kinds; one line says which file
        said = (str(exc).strip().splitlines() or [type(exc).__name__])[0]  # YAML's: several lines
        raise ConfigError(f"{path}: verl's resolved config cannot be read: {said}") from None


def verl_config_dir() -> Path:
    """verl's trainer YAML, found without importing verl."""
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        raise Unavailable("verl's trainer config needs verl: pip install 'pytest-fsdp-turbo[verl]'")
    return Path(next(iter(spec.submodule_search_locations))) / "trainer" / "config"


def compose(overrides: list[str]) -> dict:
    """verl's trainer config with `overrides`, as main_ppo composes it (placeholders stand in)."""
    if importlib.util.find_spec("hydra") is None:
        raise Unavailable("composing verl's config needs hydra-core (verl brings it)")
    from hydra import compose as hydra_compose  # optional: verl brings hydra-core
    from hydra import initialize_config_dir  # optional: verl brings hydra-core
    from hydra.errors import HydraException  # optional: verl brings hydra-core
    from omegaconf import OmegaConf  # optional: verl brings hydra-core
    from omegaconf.errors import OmegaConfBaseException  # optional: verl brings hydra-core

    try:
        with initialize_config_dir(config_dir=str(verl_config_dir()), version_base=None):
            config = hydra_compose(config_name=CONFIG_NAME, overrides=overrides)
        return OmegaConf.to_container(config, resolve=True)  # type: ignore[return-value]
    except (HydraException, OmegaConfBaseException) as exc:
        first = (str(exc).strip().splitlines() or [""])[0]
        raise ConfigError(f"verl's trainer config with the case's overrides: {first}") from None


# what a placeholder or a shell variable stands for while only composing (no run, no files)
_STAND_INS = {"{model}": "/model", "{data}": "/data", "{reward}": "/reward.py"}


def resolve_case(case) -> TrainerDeclared:
    """A trainer case's declared values from verl's YAML and its overrides, before any run."""

    overrides = []
    for override in case.overrides:
        for placeholder, stand_in in _STAND_INS.items():
            override = override.replace(placeholder, stand_in)
        overrides.append(os.path.expandvars(override))
    return declared(compose(overrides), case.world_size)
