"""STAND-IN for the Ascend `fsdp_turbo` library: a test double, never the library, never installed
with the plugin, never evidence about hardware. It reproduces the library's observable contract as
the facts sheet describes it (shared/FACTS-fsdp_turbo.md), so the harness's FSDP-Turbo adapter can be
wired and tested end to end on CPU:

- config dataclasses per layout, and a loader that drops unknown keys with only a warning;
- a process-wide ParallelState singleton (metaclass instance store) that creates an hccl process
  group when none exists, with is_/get_<mesh>_* getters for dp/fsdp/tp, cdp/kvallgather/ulysses and
  the 2-D dp_fsdp mesh; the newest layout adds get_data_rank / get_data_group_size / get_data_group;
- FSDPTurbo(config, model).model: the same HF model, fully_shard-ed in place by apply_modules,
  with the library's matching rules (read from its source, FACTS-fsdp_turbo.md "Matching rules"):
  patterns take {*} (a layer index), {a-b}, * (any text) and ?, match whole names, the root
  included; apply_modules None raises, and it raises only when NO pattern matches any module
  (hook_modules likewise, when given);
- module_patches: entries need a dotted target and replacement (no a:b form) when the config is
  built; a module-level callable target is replaced in its module, `module.Class.member` on every
  instance of Class in the model; a spec that matches nothing raises "Configured module patch did
  not match the model";
- the loader coerces strings to an annotated int or float (never bool), keeping what fails;
- the gradient divide factor from WORLD_SIZE;
- clip_grad_norm(model, max_norm, norm_type, group) returning a Python float;
- no accelerator, no start: it refuses a CPU box unless FSDP_TURBO_STANDIN_ALLOW_CPU=1;
- every fsdp_plan and memory setting applied as the library applies it (recompute, CPU offload,
  mixed precision with output dtype and input casting, ignored modules, prefetch, per-module
  fully_shard options), the library's refusals with its words, and what cannot run on gloo refused
  by name (NOT_MODELLED, also read by the harness before any rank starts).

Ulysses (function-patch layout; the middle layout raises for SP > 1): FSDPTurbo wraps each target
cp_plan names by its type (full_attention, gated_delta_net, causal_lm_loss), in place, before the
module patches; the Qwen3_5Model.forward replacement splits the sequence after the embedding. All
in fsdp_turbo_standin_ulysses.py, checked over gloo against the whole sequence, layer by layer and
for the whole model.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import re
import types
import typing
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

logger = logging.getLogger("fsdp_turbo")
ALLOW_CPU_VAR = "FSDP_TURBO_STANDIN_ALLOW_CPU"
LIBRARY_TORCH = ((2, 9), (2, 12))  # the library's own range, >= 2.9, < 2.12 (requirements.txt)


def _warn_outside_the_librarys_torch() -> None:
    """Loaded on a torch the library does not support, the stand-in still runs (it models the
    library's contract, not its kernels) and says so in the rank's log."""
    version = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    low, high = LIBRARY_TORCH
    if not low <= version < high:
        warnings.warn(
            f"STAND-IN fsdp_turbo loaded on torch {torch.__version__}, outside the library's "
            ">=2.9,<2.12: this run is no evidence for the library on this torch",
            stacklevel=2,
        )


_warn_outside_the_librarys_torch()
# the library's dtype names, exactly (its get_dtype): "bfloat16", "BF16" or a torch.dtype raise
DTYPES = {
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp32": torch.float32,
    "fp64": torch.float64,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
}
# What the stand-in cannot do for real on gloo: a config that sets one is refused by name, before
# any rank starts (the harness reads this table through the checkout's config module) and again
# here. Each rule: {"when": {dotted key: "above_one" | "truthy" | a value}, "why": ...}; all hold.
NOT_MODELLED = [
    {"when": {"distributed.tensor_parallel_size": "above_one"}, "why": "tensor parallel"},
    {"when": {"distributed.expert_parallel_size": "above_one"}, "why": "expert parallel"},
    {"when": {"quantization.quantization_plan.quant_recipe": "truthy"}, "why": "quantization"},
    {"when": {"memory.chunk_batch": "truthy"}, "why": "chunk-batch forward"},
    {
        "when": {"distributed.cp_plan.ulysses_attention_type": "with_compressor"},
        "why": "the middle layout's compressed-KV Ulysses exchange",
    },
    {
        "when": {"distributed.fsdp_plan.fsdp_implementation": "custom"},
        "why": "the library's custom fully_shard (its source is not published)",
    },
    {
        "when": {
            "distributed.fsdp_plan.cpu_offload": "truthy",
            "distributed.fsdp_plan.pin_memory": "truthy",
        },
        "why": "pinned host memory for CPU offload (torch pins only beside an accelerator)",
        "devices": ["cpu"],
    },
]


class NotModelledByStandIn(NotImplementedError):
    """A setting the library applies and the stand-in cannot: the run stops, naming it."""


def get_dtype(name):
    """The library's dtype names; anything else raises as its get_dtype does."""
    if not isinstance(name, str) or name not in DTYPES:
        raise ValueError(f"Unsupported dtype: {name}")
    return DTYPES[name]


def get_accelerator_name() -> str:
    try:
        import torch_npu  # noqa: F401

        return "npu"
    except ImportError:
        pass
    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get(ALLOW_CPU_VAR) == "1":
        return "cpu"
    raise RuntimeError("No available accelerator (NPU/CUDA).")


def _nested_dataclass(annotation):
    if dataclasses.is_dataclass(annotation):
        return annotation
    return next((a for a in typing.get_args(annotation) if dataclasses.is_dataclass(a)), None)


def _coerced(annotation, value):
    """The loader's coercion, as the middle layout's source has it (`_coerce_value`): a string for
    an int or float field (Optional unwrapped to its first type) is converted, one that does not
    convert is kept as the string with a warning; nothing else is coerced, booleans included (the
    string "false" stays a string, which is truthy)."""
    if not isinstance(value, str):
        return value
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        kept = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        annotation = kept[0] if kept else annotation
    if annotation not in (int, float):
        return value
    try:
        return annotation(value)
    except (TypeError, ValueError):
        logger.warning("Cannot convert '%s' to %s, keeping as str", value, annotation.__name__)
        return value


def _dict_to_dataclass(cls, data):
    if not isinstance(data, dict):
        return data
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        if key not in hints:
            logger.warning("Ignoring unknown config key '%s' for %s", key, cls.__name__)
            continue
        nested = _nested_dataclass(hints[key])
        if nested and isinstance(value, dict):
            kwargs[key] = _dict_to_dataclass(nested, value)
        else:
            kwargs[key] = _coerced(hints[key], value)
    return cls(**kwargs)


# --- config dataclasses shared by every layout ---------------------------------------------------


@dataclass
class ModelConfig:
    model_name_or_path: str = ""
    torch_dtype: str = "bf16"


@dataclass
class OptimizerConfig:
    lr: float = 1e-4
    weight_decay: float = 0.01
    clip_grad: float = 1.0


@dataclass
class DataConfig:
    batch_size: int = 1


@dataclass
class TrainRunConfig:
    seed: int = 42


@dataclass
class CheckpointConfig:
    output_dir: str = "./output"


@dataclass
class FSDPPlanConfig:
    ignored_modules: list = dataclasses.field(default_factory=list)
    apply_modules: dict = None
    param_dtype: str = None
    reduce_dtype: str = None
    output_dtype: str = None
    cast_forward_inputs: bool = True
    cpu_offload: bool = False
    pin_memory: bool = True
    num_to_forward_prefetch: int = 0
    num_to_backward_prefetch: int = 0
    hook_modules: list = None
    fsdp_implementation: str = "native"
    gradient_divide_factor: float = None


@dataclass
class TPPlanConfig:
    colwise_parallel: list = None
    rowwise_parallel: list = None


@dataclass
class EPPlanConfig:
    apply_modules: list = None
    dispatcher: str = None


@dataclass
class MemoryConfig:
    recompute: bool = False
    recompute_plan: list = None
    chunk_batch: bool = False
    chunk_batch_plan: dict = None


@dataclass
class QuantizationConfig:
    quantization_plan: dict = None


@dataclass
class DistributedConfigBase:
    """Everything but cp_plan, whose shape is what tells the layouts apart."""

    data_parallel_size: int = 1
    fully_shard_parallel_size: int = 1
    fsdp_plan: FSDPPlanConfig = None
    tensor_parallel_size: int = 1
    tp_plan: TPPlanConfig = None
    kv_allgather_parallel_size: int = 1
    ulysses_parallel_size: int = 1
    expert_parallel_size: int = 1
    expert_fully_shard_parallel_size: int = 1
    expert_data_parallel_size: int = 1
    ep_plan: EPPlanConfig = None


@dataclass
class FSDPTurboConfigBase:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    run: TrainRunConfig = dataclasses.field(default_factory=TrainRunConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    distributed: DistributedConfigBase = None
    module_patches: list = dataclasses.field(default_factory=list)
    memory: MemoryConfig = dataclasses.field(default_factory=MemoryConfig)
    quantization: QuantizationConfig = dataclasses.field(default_factory=QuantizationConfig)

    def __post_init__(self):
        """The library's config validation: module patch entries, a default fsdp_plan, and the
        gradient divide factor (when unset) from the launcher's WORLD_SIZE, an unset WORLD_SIZE
        counting as 1."""
        if self.module_patches is None:
            self.module_patches = []
        elif isinstance(self.module_patches, dict):
            self.module_patches = [self.module_patches]
        elif not isinstance(self.module_patches, list):
            raise ValueError(f"module_patches must be a list of dicts; got {self.module_patches!r}")
        for entry in self.module_patches:
            for key in ("target", "replacement"):
                value = entry.get(key) if isinstance(entry, dict) else None
                if callable(value) and key == "replacement":
                    continue
                if not isinstance(value, str) or "." not in value or ":" in value:
                    raise ValueError(f"module_patches entry needs a dotted {key}; got {entry!r}")
        if self.memory.recompute_plan is None:
            self.memory.recompute_plan = []
        distributed = self.distributed
        if distributed.fsdp_plan is None:
            distributed.fsdp_plan = FSDPPlanConfig()
        if distributed.fsdp_plan.gradient_divide_factor is None:
            world = int(os.environ.get("WORLD_SIZE", "1"))
            fsdp, tp = distributed.fully_shard_parallel_size, distributed.tensor_parallel_size
            distributed.fsdp_plan.gradient_divide_factor = fsdp * (world // (fsdp * tp))


class Singleton(type):
    _instances: dict = {}

    def __call__(cls, *args, **kwargs):
        if cls not in cls._instances:
            cls._instances[cls] = super().__call__(*args, **kwargs)
        return cls._instances[cls]


TWO_D = ("dp_fsdp", "edp_efsdp")


def make_parallel_state(data_getters: bool):
    """(ParallelState, init_parallel_state, get_parallel_state) for one layout."""

    @dataclass
    class ParallelState(metaclass=Singleton):
        data_parallel_size: int = 1
        fully_shard_parallel_size: int = 1
        tensor_parallel_size: int = 1
        kv_allgather_parallel_size: int = 1
        ulysses_parallel_size: int = 1
        expert_parallel_size: int = 1
        expert_fully_shard_parallel_size: int = 1
        expert_data_parallel_size: int = 1
        device_mesh_map: dict = None

        def __post_init__(self):
            """The library's three meshes, each with a leading dimension of what is left of the
            world, then `cp` (kvallgather x ulysses, flattened) and the 2-D `dp_fsdp` and
            `edp_efsdp`; the user's data-parallel sizes are overwritten by the leading dims."""
            if not dist.is_initialized():
                dist.init_process_group(backend="hccl")
            self.device_mesh_map = {}
            world = dist.get_world_size()
            fsdp, tp = self.fully_shard_parallel_size, self.tensor_parallel_size
            efsdp, ep = self.expert_fully_shard_parallel_size, self.expert_parallel_size
            kv, ulysses = self.kv_allgather_parallel_size, self.ulysses_parallel_size
            dense = self._mesh(("dp", "fsdp", "tp"), (fsdp, tp), world)
            expert = self._mesh(("edp", "efsdp", "ep"), (efsdp, ep), world)
            context = self._mesh(("cdp", "kvallgather", "ulysses", "tp"), (kv, ulysses, tp), world)
            self.device_mesh_map["cp"] = context["kvallgather", "ulysses"]._flatten("cp")
            self.device_mesh_map["dp_fsdp"] = dense["dp", "fsdp"]
            self.device_mesh_map["edp_efsdp"] = expert["edp", "efsdp"]
            self.data_parallel_size = dense.size(0)
            self.expert_data_parallel_size = expert.size(0)

        def _mesh(self, names, rest, world):
            product = 1
            for size in rest:
                product *= size
            if world % product:
                raise AssertionError(
                    f"World size is not divisible by mesh group ({dict(zip(names[1:], rest))})"
                )
            shape = (world // product, *rest)
            mesh = init_device_mesh(get_accelerator_name(), shape, mesh_dim_names=names)
            for name in names:
                self.device_mesh_map.setdefault(name, mesh)
            return mesh

        def is_group_enable(self, name: str) -> bool:
            if name not in self.device_mesh_map:
                return False
            mesh = self.device_mesh_map[name]
            if name in TWO_D:
                return any(mesh.size(i) > 1 for i in range(mesh.ndim))
            return mesh.size(mesh.mesh_dim_names.index(name)) > 1

        def get_group(self, name: str):
            mesh = self.device_mesh_map[name]
            if name in TWO_D:
                return [mesh.get_group(d) for d in mesh.mesh_dim_names]
            return mesh.get_group(name)

        def __getattr__(self, attr: str):
            """get_<mesh>_group / _group_size / _rank / _device_mesh and is_<mesh>_enable."""
            match = re.fullmatch(
                r"(get|is)_(\w+?)_(group|group_size|rank|device_mesh|enable)", attr
            )
            if not match or match.group(2) not in (self.__dict__.get("device_mesh_map") or {}):
                raise AttributeError(attr)
            name, what = match.group(2), match.group(3)
            mesh = self.device_mesh_map[name]
            if name in TWO_D:  # not flattened: one group and size per dimension, as there
                dims = mesh.mesh_dim_names
                return {
                    "enable": lambda: any(mesh.size(i) > 1 for i in range(len(dims))),
                    "group": lambda: [mesh.get_group(d) for d in dims],
                    "group_size": lambda: [mesh.size(i) for i in range(len(dims))],
                    "rank": lambda: [mesh.get_local_rank(d) for d in dims],
                    "device_mesh": lambda: mesh,
                }[what]
            return {
                "enable": lambda: self.is_group_enable(name),
                "group": lambda: mesh.get_group(name),
                "group_size": lambda: mesh.size(mesh.mesh_dim_names.index(name)),
                "rank": lambda: mesh.get_local_rank(name),
                "device_mesh": lambda: mesh if name == "cp" else mesh[name],
            }[what]

    if data_getters:  # the newest layout: ranks that see different data, i.e. the cdp mesh
        ParallelState.get_data_rank = lambda self: self.get_cdp_rank()
        ParallelState.get_data_group_size = lambda self: self.get_cdp_group_size()
        ParallelState.get_data_group = lambda self: self.get_cdp_group()

    def init_parallel_state(config):
        wanted = {f.name for f in dataclasses.fields(ParallelState)} - {"device_mesh_map"}
        given = dataclasses.asdict(config.distributed)
        return ParallelState(**{k: v for k, v in given.items() if k in wanted})

    def get_parallel_state():
        return ParallelState()

    return ParallelState, init_parallel_state, get_parallel_state


def _brace(piece: str) -> tuple[str, tuple[int, int] | None]:
    """{*} a layer index, {a-b} an index in an inclusive range; anything else in braces is refused
    as the library refuses it (a malformed range, a reversed one, a bare number)."""
    inner = piece[1:-1]
    if inner == "*":
        return r"(\d+)", None
    if inner.count("-") == 1 and inner[0] != "-":
        low, high = inner.split("-")
        if not (low.isdigit() and high.isdigit()):
            raise ValueError(f"Non-integer in range: {inner}")
        if int(low) > int(high):
            raise ValueError(f"Invalid range: {inner} (low > high)")
        return r"(\d+)", (int(low), int(high))
    if "-" in inner:
        raise ValueError(f"Invalid brace pattern: {piece}")
    raise ValueError(f"Unrecognized brace pattern: {piece}")


def _pattern(name: str) -> tuple[re.Pattern, list]:
    """The library's module-name patterns: {*} a layer index, {a-b} an index in a range, * any
    text (dots included, the empty root name too), ? one character; the whole name must match.
    An unclosed brace or `a..b` is literal text, which matches nothing."""
    out, ranges = [], []
    for piece in re.split(r"(\{[^}]*\}|\*|\?)", name):
        if piece.startswith("{") and piece.endswith("}"):
            regex, bound = _brace(piece)
            out.append(regex)
            ranges.append(bound)
        elif piece == "*":
            out.append(".*")
        elif piece == "?":
            out.append(".")
        else:
            out.append(re.escape(piece))
    return re.compile("^" + "".join(out) + "$"), ranges


def _name_matches(pattern: str, name: str) -> bool:
    regex, ranges = _pattern(pattern)
    found = regex.match(name)
    if not found:
        return False
    return all(
        bound is None or bound[0] <= int(index) <= bound[1]
        for index, bound in zip(found.groups(), ranges)
    )


def _matching(model: torch.nn.Module, patterns, what: str) -> list[torch.nn.Module]:
    """Every module (the root included, as the library walks named_modules()) a pattern matches;
    the library raises only when no pattern matches anything."""
    found = []
    for name, module in model.named_modules():
        if any(_name_matches(p, name) for p in patterns) and module not in found:
            found.append(module)
    if not found:
        raise RuntimeError(f"[FSDP2] No module named {list(patterns)} ({what})")
    return found


def _namespace_member(dotted: str):
    """(module, name) for a module-level callable target, else None (then: a class member)."""
    owner_path, _, member = dotted.rpartition(".")
    try:
        owner = importlib.import_module(owner_path)
    except ImportError:
        return None
    return (owner, member) if callable(getattr(owner, member, None)) else None


def _callable(dotted):
    if callable(dotted):
        return dotted
    module_path, _, name = dotted.rpartition(".")
    found = getattr(importlib.import_module(module_path), name, None)
    if not callable(found):
        raise TypeError(f"Resolved object {dotted!r} is not callable.")
    return found


def _apply_module_patch(model: torch.nn.Module, patch: dict) -> int:
    """A module-level callable is replaced in its module; `module.Class.member` is replaced on
    every instance of Class in the model (bound to it). Returns how many places matched."""
    replacement = _callable(patch["replacement"])
    namespace = _namespace_member(patch["target"])
    if namespace is not None:
        setattr(*namespace, replacement)
        return 1
    class_path, _, member = patch["target"].rpartition(".")
    module_path, _, class_name = class_path.rpartition(".")
    cls = getattr(importlib.import_module(module_path), class_name, None)
    if not isinstance(cls, type):
        raise TypeError(f"Resolved class {class_path!r} is not a type.")
    matched = 0
    for module in model.modules():
        if isinstance(module, cls):
            if not callable(getattr(module, member)):  # a missing member raises, as there
                raise TypeError(f"Target member {patch['target']!r} is not a callable.")
            setattr(module, member, types.MethodType(replacement, module))
            matched += 1
    return matched


def _refuse_not_modelled(config) -> None:
    from pytest_fsdp_turbo_contract.turbo_config import not_modelled

    problems = not_modelled(NOT_MODELLED, config, get_accelerator_name())
    if problems:
        raise NotModelledByStandIn("; ".join(problems))


def _apply_context_parallel(distributed, state) -> None:
    """Ulysses, before the module patches, as there. The newest layout wraps what cp_plan's patch
    lists name by type; the middle layout wraps its core-attention functions by
    ulysses_attention_type, and with none named it runs no Ulysses at all (silently, as there)."""
    if distributed.ulysses_parallel_size <= 1:
        return
    cp_plan = getattr(distributed, "cp_plan", None)
    from fsdp_turbo_standin_ulysses import apply_core_attention, apply_function_patches

    if hasattr(cp_plan, "ulysses_function_patches"):
        apply_function_patches(cp_plan, state.get_ulysses_group())
    elif hasattr(cp_plan, "ulysses_core_attention_function"):
        apply_core_attention(cp_plan, state.get_ulysses_group())
    else:
        raise NotModelledByStandIn(
            "distributed.ulysses_parallel_size > 1 in the oldest layout: not modelled by the stand-in"
        )


def _recompute(model: torch.nn.Module, memory) -> None:
    """Activation checkpointing on every module a recompute_plan pattern matches (a module two
    patterns match is wrapped twice), by replacing the instance's forward with a non-reentrant
    torch checkpoint of it that drops past_key_values; nothing matching raises."""
    if not memory.recompute:
        return
    matched = [
        (name, module)
        for pattern in memory.recompute_plan
        for name, module in model.named_modules()
        if _name_matches(pattern, name)
    ]
    if not matched:
        raise RuntimeError(f"[Recompute] No module named {memory.recompute_plan}.")
    from torch.utils.checkpoint import checkpoint

    for _, module in matched:
        original = module.forward

        def forward(*args, _original=original, **kwargs):
            if "past_key_values" in kwargs:
                kwargs["past_key_values"] = None
            return checkpoint(_original, *args, use_reentrant=False, **kwargs)

        module.forward = forward


def _units(model: torch.nn.Module, plan) -> tuple[dict, set]:
    """({unit: options}, ignored parameters): each module an apply_modules pattern matches (its
    options merged in pattern order) unless ignored_modules names it; every parameter under an
    ignored module is left out of FSDP."""
    ignored_names = {
        name
        for name, _ in model.named_modules()
        if any(_name_matches(p, name) for p in plan.ignored_modules)
    }
    ignored_params = {
        param
        for name, module in model.named_modules()
        if name in ignored_names
        for param in module.parameters()
    }
    units: dict = {}
    for name, module in model.named_modules():
        if name in ignored_names:
            continue
        for pattern, options in plan.apply_modules.items():  # a list has no items(), as there
            if _name_matches(pattern, name):
                units.setdefault(module, {}).update(options)
    if not units:
        raise RuntimeError(f"[FSDP2] No module named {plan.apply_modules.keys()}.")
    return units, ignored_params


def _policies(plan):
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

    def dtype(value):
        return get_dtype(value) if value else None

    mixed = MixedPrecisionPolicy(
        param_dtype=dtype(plan.param_dtype),
        reduce_dtype=dtype(plan.reduce_dtype),
        output_dtype=dtype(plan.output_dtype),
        cast_forward_inputs=plan.cast_forward_inputs,
    )
    offload = CPUOffloadPolicy(pin_memory=plan.pin_memory) if plan.cpu_offload else OffloadPolicy()
    return mixed, offload


def _prefetch(units: list, plan) -> None:
    """Each unit prefetches the next n units in module order (forward) and the previous n
    (backward); 0 sets nothing."""
    for count, setter, order in (
        (plan.num_to_forward_prefetch, "set_modules_to_forward_prefetch", units),
        (plan.num_to_backward_prefetch, "set_modules_to_backward_prefetch", units[::-1]),
    ):
        if count > 0:
            for i, unit in enumerate(order):
                if following := order[i + 1 : i + 1 + count]:
                    getattr(unit, setter)(following)


def _fully_shard(model: torch.nn.Module, plan, state) -> None:
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if plan.fsdp_implementation not in ("native", "custom"):
        raise ValueError(
            f"Unknown FSDP implementation: {plan.fsdp_implementation}. Supported: ['custom', 'native']"
        )
    if plan.apply_modules is None:
        raise AttributeError("'NoneType' object has no attribute 'items'")
    units, ignored_params = _units(model, plan)
    if plan.hook_modules:
        _matching(model, plan.hook_modules, "fsdp_plan.hook_modules")
    hsdp = state.get_dp_group_size() > 1
    mesh = state.device_mesh_map["dp_fsdp"] if hsdp else state.get_fsdp_device_mesh()
    mixed, offload = _policies(plan)
    common = {
        "mesh": mesh,
        "ignored_params": ignored_params,
        "mp_policy": mixed,
        "offload_policy": offload,
    }
    for unit, options in units.items():
        fully_shard(unit, **{**common, **options})  # an unknown option is torch's TypeError
    fully_shard(model, **common)
    _prefetch([m for m in model.modules() if m in units], plan)
    factor = plan.gradient_divide_factor
    if factor != dist.get_world_size():
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(float(factor))


class FSDPTurbo(torch.nn.Module):
    """The library's constructor order: parallel state, quantization, TP, CP, module patches, EP,
    recompute, chunk-batch, FSDP. What the stand-in cannot apply is refused first, by name."""

    def __init__(self, config, model: torch.nn.Module):
        super().__init__()
        from fsdp_turbo.distributed.parallel_state import init_parallel_state

        _refuse_not_modelled(config)
        state = init_parallel_state(config)  # the library builds its parallel state itself
        distributed = config.distributed
        _apply_context_parallel(distributed, state)
        for spec in config.module_patches or []:
            if not _apply_module_patch(model, spec):
                raise RuntimeError(
                    f"Configured module patch did not match the model: target={spec['target']!r}."
                )
        _recompute(model, config.memory)
        _fully_shard(model, distributed.fsdp_plan, state)
        self.model = model


def clip_grad_norm(model, max_norm: float, norm_type: float = 2.0, group=None) -> float:
    """Clips in place, returns the total norm as a float. Without a group the norm comes from the
    DTensor gradients' own meshes (the library's trainer says as much). What the library does
    with a group is not in its published source: here each rank's local gradient shards are
    summed over that group, the usual meaning, so a caller's group reaches the norm at all (a
    group holding replicas counts them more than once)."""
    params = [p for p in model.parameters() if p.grad is not None]
    if group is None:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type, foreach=False)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    local = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params]
    if norm_type == float("inf"):
        total = torch.zeros((), dtype=torch.float32)  # a rank without gradients adds nothing
        for grad in local:
            total = torch.maximum(total, grad.detach().abs().max().float())
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
    else:
        total = torch.zeros((), dtype=torch.float32)
        for grad in local:
            total = total + grad.detach().float().norm(norm_type) ** norm_type
        dist.all_reduce(total, group=group)
        total = total ** (1.0 / norm_type)
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grad in local:
        grad.mul_(coefficient.to(grad.dtype))
    return float(total)
