"""The project's names, defined once and torch-free, so the plugin and the ranks import the same
ones: device kinds, sync policies, launchers, twins, golden statuses and environment variables
(metric keys are part of the rank contract, in records.py). The small closed sets are StrEnums
(their members are the strings themselves, for JSON, dict keys and comparisons); env variables are
plain string constants. Pytest never imports this module at start-up: what it reads on every start
lives in pytest_fsdp_turbo/options.py."""

from __future__ import annotations

from enum import StrEnum


class DeviceKind(StrEnum):
    CPU = "cpu"
    CUDA = "cuda"
    NPU = "npu"


class CaseKindName(StrEnum):
    """Which kind of case a run is (spec.json's `kind`): what launched it and which checks judge
    it. A downstream kind may name itself anything else."""

    PPO_STEP = "ppo_step"  # the harness's own PPO step through an engine
    VERL_TRAINER = "verl_trainer"  # verl's own trainer, main_ppo


class SyncPolicy(StrEnum):
    DEFERRED = "deferred"  # reduce-scatter only on the last micro-batch
    EVERY_MICRO_BATCH = "every_micro_batch"


class Dtype(StrEnum):
    AUTO = "auto"  # fp32 on cpu, bf16 on accelerators
    FP32 = "fp32"
    BF16 = "bf16"  # bf16 parameters, fp32 gradient reduction


class Rollout(StrEnum):
    HF = "hf"  # the harness's own HF generate
    VLLM = "vllm"


class GoldenTier(StrEnum):
    EXACT = "exact"
    RELATIVE = "relative"
    NONE = "none"


class Launcher(StrEnum):
    LOCAL = "local"  # forked from this process's warm parent
    SPAWN = "spawn"  # fresh interpreters
    RAY = "ray"


class TwinKind(StrEnum):
    SINGLE = "single"
    EVERY_MICRO_BATCH = "every_micro_batch"
    NONE = "none"


# verl:<name>: an engine from verl's own EngineRegistry (verl:fsdp2, verl:fsdp_turbo)
VERL_PREFIX = "verl:"


class Capability(StrEnum):
    """What an engine declares on its catalog entry, read by case validation before any rank
    starts (a device kind among them limits the devices it runs on)."""

    SP = "sp"  # Ulysses sequence parallelism: sp_size > 1
    TURBO_CONFIG = "turbo_config"  # built on the fsdp_turbo library: a turbo_config and a checkout
    PACKING = "packing"  # packs a micro-batch into one row when a case asks (packed = true)
    ALWAYS_PACKS = "always_packs"  # every micro-batch is one packed row (verl's engines)
    OWN_LOOP = "own_loop"  # runs its own micro-batch loop: measured through the probe
    # creates the unsharded parameters of FSDP units that never run forward, so deferred bf16 runs
    # survive FSDP2's post-backward on torch < 2.15 (pytorch#194058)
    GUARDS_IDLE_UNITS = "guards_idle_units"


class GoldenStatus(StrEnum):
    MATCHED = "matched"
    RECORDED = "recorded"
    MISSING = "missing"
    NOT_COMPARED = "not compared"


class Env:
    """Environment variables the harness reads or sets (options have their own, in settings)."""

    STATE_DIR = "PYTEST_FSDP_TURBO_STATE_DIR"
    ENGINE_MODULES = "PYTEST_FSDP_TURBO_ENGINE_MODULES"
    COLLECTIVE_TIMEOUT_S = "PYTEST_FSDP_TURBO_COLLECTIVE_TIMEOUT_S"
    FAULT = "PYTEST_FSDP_TURBO_FAULT"
    FAULT_STALL_S = "PYTEST_FSDP_TURBO_FAULT_STALL_S"  # how long a stall fault sleeps
    LAUNCHED_AT = "PYTEST_FSDP_TURBO_LAUNCHED_AT"
    CASE_TOKEN = "PYTEST_FSDP_TURBO_CASE_TOKEN"  # inherited by all a case starts: reaped by it
    NO_FORK = "PYTEST_FSDP_TURBO_NO_FORK"
    WARM_SOCKET = "PYTEST_FSDP_TURBO_WARM_SOCKET"  # set by the harness for its descendants
    VLLM_MEMORY = "PYTEST_FSDP_TURBO_VLLM_MEMORY"
