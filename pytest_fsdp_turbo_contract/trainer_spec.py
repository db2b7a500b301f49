"""What a verl trainer run is asked to do (trainer_spec.json), and where the observer verl loads in
each of its processes finds it. Torch-free: the plugin writes it, the trainer entry and the
observer read it."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pytest_fsdp_turbo_contract.errors import ConfigError
from pytest_fsdp_turbo_contract.vocab import DeviceKind, GoldenTier

# the run folder, for the observer verl imports in every process of the run (Ray hands the driver's
# environment to its workers, vLLM to its engine cores)
RUN_DIR_VARIABLE = "PYTEST_FSDP_TURBO_TRAINER_RUN"
OBSERVER_MODULE = "pytest_fsdp_turbo_engine.trainer.observer"
ENTRY_MODULE = "pytest_fsdp_turbo_engine.trainer.main"
# what a case's overrides may name, filled by the trainer entry
PLACEHOLDERS = {
    "{model}": "the case's model directory",
    "{data}": "the tiny trainer data the harness builds (train.parquet, val.parquet)",
    "{reward}": "the harness's reward function file (a reward with spread, for tiny models)",
}


@dataclass(frozen=True)
class TrainerSpec:
    case_id: str
    device_kind: DeviceKind
    world_size: int
    model_path: str
    overrides: tuple[str, ...]  # the case's, as its script writes them
    cores: int = 2  # CPUs Ray may hand the run's actors (cpu runs)
    total_training_steps: int = 1
    # the collective environment of the lease (NCCL / HCCL / gloo settings, HCCL port ranges),
    # handed to every Ray worker over verl's own runtime env (which sets HCCL ranges to "auto")
    worker_env: dict[str, str] = field(default_factory=dict)
    ray_temp_dir: str = ""  # Ray's session folder for this run (its logs are copied into actors/)
    timeout_s: float = 900.0  # the case's, for the run's spec.json (progress, readers)
    golden_tier: GoldenTier = GoldenTier.RELATIVE  # the case's, for the run's spec.json (compare)
    # what verl imports in every process: the user's VERL_USE_EXTERNAL_MODULES (a platform
    # plug-in, say), then the case's; the entry puts the harness's observer before them
    external_modules: tuple[str, ...] = ()
    # the case declares the single-process reference: the observer captures what it replays
    reference: bool = False
    # the case declares the micro-batch pair: the observer runs each mini-batch again in one pass
    micro_batch_pair: bool = False

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TrainerSpec:
        return cls(
            **{
                **data,
                "device_kind": DeviceKind(data["device_kind"]),
                "overrides": tuple(data["overrides"]),
                "external_modules": tuple(data.get("external_modules", ())),
                "golden_tier": GoldenTier(data.get("golden_tier", GoldenTier.RELATIVE)),
            }
        )

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=1))

    @classmethod
    def read(cls, path: Path) -> TrainerSpec:
        return cls.from_json(json.loads(path.read_text()))


def config_value(config: dict, dotted: str, default: Any = None) -> Any:
    """A key of verl's resolved config by its dotted path, or `default` where it is absent: the
    plugin's reading and the replay's read the same config the same way."""
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


ACTOR = "actor_rollout_ref.actor"
REF = "actor_rollout_ref.ref"  # the reference policy (the KL loss's)


def ulysses_key(config: dict) -> str:
    """The key that holds the actor's Ulysses group size as verl's engine applies it: the library's
    own under fsdp_turbo; under FSDP the actor's (deprecated) key where it is over 1, which verl
    copies into its engine config, else the engine config's."""
    if config_value(config, f"{ACTOR}.strategy") == "fsdp_turbo":
        return f"{ACTOR}.fsdp_config.turbo_config.distributed.ulysses_parallel_size"
    legacy = f"{ACTOR}.ulysses_sequence_parallel_size"
    value = config_value(config, legacy)
    if isinstance(value, int) and value > 1:
        return legacy
    return f"{ACTOR}.fsdp_config.ulysses_sequence_parallel_size"


def precision_key(config: dict, role: str = ACTOR) -> str:
    """The key of the dtype a role's forward (and backward) runs in, the actor's or the reference
    policy's (`actor_rollout_ref.ref`): mixed precision's parameter dtype; verl's FSDP engines
    compute in bf16 where it holds none."""
    if config_value(config, f"{role}.strategy") == "fsdp_turbo":
        return f"{role}.fsdp_config.turbo_config.distributed.fsdp_plan.param_dtype"
    return f"{role}.fsdp_config.mixed_precision.param_dtype"


# verl's precision names (verl.utils.torch_dtypes: HALF_LIST, FLOAT_LIST, BFLOAT_LIST), as read from
# its config (a YAML number stays a number)
PRECISIONS: dict[int | str, str] = {
    **dict.fromkeys((16, "16", "fp16", "float16"), "fp16"),
    **dict.fromkeys((32, "32", "fp32", "float32"), "fp32"),
    **dict.fromkeys(("bf16", "bfloat16"), "bf16"),
}


def precision(config: dict, key: str, unset: str = "bf16") -> str:
    """The dtype a key of verl's config names, as verl reads it: "fp32", "bf16" or "fp16" (`unset`
    where the config holds none; the name as written where verl would refuse it)."""
    value = config_value(config, key)
    if value is None:
        return unset
    return PRECISIONS.get(value, str(value))


def clip_key(config: dict) -> str:
    """The key of the max norm verl's engine clips at: the optimizer's deprecated `grad_clip`
    where set (verl copies it over `clip_grad`), else `clip_grad`. The actor's own `grad_clip`
    is the legacy actor's, unused by the engines."""
    if config_value(config, f"{ACTOR}.optim.grad_clip") is not None:
        return f"{ACTOR}.optim.grad_clip"
    return f"{ACTOR}.optim.clip_grad"


def updates_per_step(config: dict) -> int:
    """Optimizer steps in one training step: verl splits the step's prompts into mini-batches of
    `ppo_mini_batch_size` prompts and runs them `ppo_epochs` times; only the first trains on the
    parameters that computed the old log-probs."""
    prompts = whole_number(config, "data.train_batch_size") or 1
    mini = whole_number(config, f"{ACTOR}.ppo_mini_batch_size") or prompts
    epochs = whole_number(config, f"{ACTOR}.ppo_epochs") or 1
    return max(1, prompts // mini) * epochs


def whole_number(config: dict, key: str) -> int | None:
    """A count the config holds (None where it holds none); a word for one is one line naming it."""
    value = config_value(config, key)
    if value is None:
        return None
    whole = isinstance(value, int) and not isinstance(value, bool)
    if not whole and not (isinstance(value, str) and value.strip().isdigit()):
        raise ConfigError(f"verl's config: {key}: expected a whole number; got {value!r}")
    return int(value)
