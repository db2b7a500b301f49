"""What the harness reads off an FSDP2 model, whatever engine built it.

The measurements the checks depend on live here, in harness code, never in a method an engine can
override. Public structure (the module tree, DTensor placements) is used where it suffices; the one
reach into FSDP2 private state (unsharded gradients held between micro-batches) is asserted and
fails naming the torch version when the internals move, instead of silently counting 0.
"""

from __future__ import annotations

import math
import sys
import threading
from types import FrameType

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from pytest_fsdp_turbo_engine.engines.fsdp2 import full_tensor, local_tensor


class FSDPInternalsChanged(RuntimeError):
    pass


def _managed_parameters(unit: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Parameters a fully_shard unit owns: its subtree minus nested units' subtrees."""
    owned: list[torch.nn.Parameter] = []
    stack = [unit]
    while stack:
        module = stack.pop()
        owned.extend(module.parameters(recurse=False))
        stack.extend(c for c in module.children() if not isinstance(c, FSDPModule))
    return owned


def _trainable_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [
        module
        for module in model.modules()
        if isinstance(module, FSDPModule)
        and any(p.requires_grad for p in _managed_parameters(module))
    ]


def fsdp_units(model: torch.nn.Module) -> int:
    """fully_shard units holding trainable parameters."""
    return len(_trainable_units(model))


class UnitsThatRan:
    """The trainable fully_shard units whose forward ran while installed: each of them, and only
    they, reduce-scatters once per synced backward. A unit that never runs (a vision tower on a
    text-only batch) holds no gradient, so FSDP2 issues nothing for it. Installed by the harness
    around the train phase with plain forward pre-hooks, removed after."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._units = _trainable_units(model)
        self._ran: set[int] = set()
        self._handles: list = []
        # the most tokens (rows x sequence) a decoder layer was handed at once: under sequence
        # parallelism, a chunk of each row, or of the one packed row (verl)
        self.layer_tokens = 0

    @property
    def count(self) -> int:
        return len(self._ran)

    def __enter__(self) -> UnitsThatRan:
        for unit in self._units:
            self._handles.append(unit.register_forward_pre_hook(self._seen(id(unit))))
        return self

    def _seen(self, key: int):
        def hook(module, args) -> None:
            self._ran.add(key)
            hidden = args[0] if args else None
            is_layer = type(module).__name__.endswith("DecoderLayer")
            if is_layer and isinstance(hidden, torch.Tensor) and hidden.dim() >= 2:
                self.layer_tokens = max(self.layer_tokens, hidden.shape[0] * hidden.shape[1])

        return hook

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def shard_group_size(model: torch.nn.Module) -> int:
    """Ranks each parameter is sharded over (1: FSDP2 skips the reduce-scatter altogether)."""
    for param in model.parameters():
        if isinstance(param, DTensor):
            return math.prod(
                param.device_mesh.size(i) for i, p in enumerate(param.placements) if p.is_shard()
            )
    return 1


def replicate_group_size(model: torch.nn.Module) -> int:
    """Ranks holding the same shard of each parameter (HSDP replicas, itself included): the mesh
    dimensions a parameter is Replicate over. FSDP2 all-reduces a unit's reduced gradients over
    them after its reduce-scatter (none when 1)."""
    for param in model.parameters():
        if isinstance(param, DTensor):
            return math.prod(
                param.device_mesh.size(i)
                for i, p in enumerate(param.placements)
                if p.is_replicate()
            )
    return 1


# The torch.distributed functions FSDP2 issues its collectives through, looked up on the module at
# call time (`dist.<name>(...)` in torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py):
# torch >= 2.12 calls reduce_scatter_single / all_gather_single from its Default*/ProcessGroupAlloc*
# comm classes; earlier FSDP2 called reduce_scatter_tensor / all_gather_into_tensor directly.
# These are backend-independent Python entry points: gloo, NCCL and HCCL alike dispatch from them
# to the group's backend. torch_npu/__init__.py registers ProcessGroupHCCL as the "hccl" c10d
# backend (torch.distributed.Backend.register_backend("hccl", ..., devices=["npu"])) and FSDP2 on
# NPU runs this same torch code; where torch_npu's import-time distributed patches replace one of
# these functions, the counter wraps the replacement as it finds it at the train phase. So counting
# calls here counts what FSDP2 issues on gloo, NCCL and HCCL alike (not run on an NPU here).
REDUCE_SCATTER_FUNCTIONS = ("reduce_scatter_single", "reduce_scatter_tensor")
ALL_GATHER_FUNCTIONS = ("all_gather_single", "all_gather_into_tensor")
# Every entry point a collective can carry a tensor through, by the kind the gradient collectives
# are counted under: torch.distributed's, and the functional collectives DTensor redistributes
# through (torch.distributed._functional_collectives: a Partial gradient made Replicate is an
# all-reduce there, never through torch.distributed).
COLLECTIVE_KINDS = {
    "reduce_scatter": ("reduce_scatter_single", "reduce_scatter_tensor", "reduce_scatter"),
    "all_reduce": ("all_reduce", "all_reduce_coalesced"),
    "reduce": ("reduce",),
    "all_gather": ("all_gather_single", "all_gather_into_tensor", "all_gather"),
    "all_to_all": ("all_to_all_single", "all_to_all"),
    "broadcast": ("broadcast",),
}
FUNCTIONAL_KINDS = {
    "reduce_scatter": ("reduce_scatter_tensor", "reduce_scatter_tensor_autograd"),
    "all_reduce": ("all_reduce", "all_reduce_coalesced", "all_reduce_inplace"),
    "all_gather": ("all_gather_tensor", "all_gather_tensor_autograd"),
    "all_to_all": ("all_to_all_single", "all_to_all_single_autograd"),
    "broadcast": ("broadcast",),
}
# FSDP2's own functions that issue collectives: the one that reduces a unit's gradients
# (reduce-scatter over the shard group, then under HSDP all-reduce over the replicas) and the one
# that gathers a unit's parameters (in forward, and again in backward after a reshard)
FSDP_REDUCES, FSDP_GATHERS = "foreach_reduce", "foreach_all_gather"
FSDP_CALLER_DEPTH = 4  # frames above the collective's call searched for them


def _issued_by_fsdp() -> str | None:
    """FSDP_REDUCES or FSDP_GATHERS when FSDP2 issued the collective being called, else None."""
    frame: FrameType | None = sys._getframe(3)  # above _count and the wrapper: its caller
    for _ in range(FSDP_CALLER_DEPTH):
        if frame is None:
            return None
        code = frame.f_code
        if code.co_name in (FSDP_REDUCES, FSDP_GATHERS) and "fsdp" in code.co_filename:
            return code.co_name
        frame = frame.f_back
    return None


def _tensors(values) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for value in values:
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, list | tuple):
            out.extend(v for v in value if isinstance(v, torch.Tensor))
    return out


def _unsharded_grads(model: torch.nn.Module):
    """The unsharded gradients FSDP2 holds right now: accumulated across micro-batches under
    deferred sync, or the one a backward just produced before its reduce-scatter."""
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        group = _param_group(module)
        for param in group.fsdp_params if group else ():
            if not hasattr(param, "unsharded_accumulated_grad") or not hasattr(
                param, "init_unsharded_param"
            ):
                raise FSDPInternalsChanged(
                    f"torch {torch.__version__}: FSDPParam has no unsharded_accumulated_grad / "
                    "init_unsharded_param; update pytest_fsdp_turbo_engine.step.fsdp_probe"
                )
            grad = param.unsharded_accumulated_grad
            # `_unsharded_param` exists only after the first all-gather (torch tests it the same
            # way): a unit that never ran forward, like a vision tower on text, holds nothing
            unsharded = getattr(param, "_unsharded_param", None)
            if grad is None and unsharded is not None:
                grad = unsharded.grad
            if grad is not None:
                yield grad


class CollectiveCounter:
    """Counts, per micro-batch, the reduce-scatters and every collective that carries parameter
    gradients; the all-gathers as one total.

    Installed by the harness around the train phase (never inside an engine method): each hooked
    function (torch.distributed's and the functional collectives') is wrapped for the duration and
    restored after. `next_micro_batch()` is called as each micro-batch's loss is computed, so a
    collective issued by a backward (after its loss) or after it (an engine's sync context closing)
    lands on the micro-batch whose backward produced the gradients; one issued before the first
    loss lands on the first micro-batch. All-gathers run in forward too, before the loss is known,
    so they are counted as one total. Costs one Python call per collective, nothing per op.

    A gradient collective is one that carries a parameter's gradient, whatever its kind
    (reduce-scatter, all-reduce, reduce, all-gather, all-to-all, broadcast), decided by what it
    carries, never by when it runs:
    - FSDP2's reduction of a unit's gradients (issued from its `foreach_reduce`): the reduce-scatter
      over the shard group and, under HSDP, the all-reduce over the replicas, one each per unit
      per synced backward. FSDP2's all-gathers (`foreach_all_gather`, in forward and again in
      backward after a reshard) carry parameters, not gradients: never counted.
    - any other collective handed a floating tensor that is a parameter's gradient: it shares
      storage with a gradient the watched module holds at that moment (a parameter's `.grad`, or
      an unsharded gradient FSDP2 holds), or has the shape of a trainable parameter, whole or its
      local shard. So an engine that syncs by hand (all-reduces each gradient, gathers it, sends it
      from one rank) is counted.
    Activations are not: sequence parallelism's all-to-alls (4-D and up), the gathered logits and
    the all-reduce of their gradient (rows x sequence x vocabulary), a loss's scalar sums and the
    integer token counts match no parameter's shape or storage. Not seen: a gradient copied into a
    buffer shaped like no parameter (a flat bucket of several) before its collective.
    """

    def __init__(self) -> None:
        self.reduce_scatters: list[int] = []
        self.all_gathers_total = 0
        # per micro-batch, collective kind -> the gradient collectives of that kind
        self.gradient_collectives: list[dict[str, int]] = []
        self._before: dict[str, int] = {}  # issued before the first micro-batch's loss
        self._module: torch.nn.Module | None = None
        self._shapes: set[tuple[int, ...]] = set()
        self._saved: list[tuple[object, str, object]] = []
        self._inside = threading.local()  # a collective calling another is counted once

    def watch(self, module: torch.nn.Module) -> None:
        """The module whose parameters' gradients the gradient collectives carry."""
        self._module = module
        self._shapes = set()
        for param in module.parameters():
            if param.requires_grad and param.numel():
                self._shapes.add(tuple(param.shape))
                self._shapes.add(tuple(local_tensor(param).shape))

    def next_micro_batch(self) -> None:
        self.reduce_scatters.append(0)
        self.gradient_collectives.append(self._before)
        self._before = {}

    def _carries_gradients(self, args, kwargs) -> bool:
        tensors = [
            local_tensor(t)
            for t in _tensors([*args, *kwargs.values()])
            if t.is_floating_point() and t.numel()
        ]
        if self._module is None or not tensors:
            return False
        if any(tuple(t.shape) in self._shapes for t in tensors):
            return True
        held = [local_tensor(p.grad) for p in self._module.parameters() if p.grad is not None]
        storages = {g.untyped_storage().data_ptr() for g in held}
        storages.update(g.untyped_storage().data_ptr() for g in _unsharded_grads(self._module))
        return any(t.untyped_storage().data_ptr() in storages for t in tensors)

    def _count(self, name: str, kind: str, args, kwargs) -> None:
        if name in ALL_GATHER_FUNCTIONS:
            self.all_gathers_total += 1
        elif name in REDUCE_SCATTER_FUNCTIONS and self.reduce_scatters:
            self.reduce_scatters[-1] += 1  # none is due before the first micro-batch's loss
        fsdp = _issued_by_fsdp()
        if fsdp == FSDP_GATHERS or (fsdp is None and not self._carries_gradients(args, kwargs)):
            return
        bucket = self.gradient_collectives[-1] if self.gradient_collectives else self._before
        bucket[kind] = bucket.get(kind, 0) + 1

    def _wrap(self, owner, name: str, kind: str, counts_reduce_scatters: bool) -> None:
        original = getattr(owner, name)
        inside = self._inside

        def counted(*args, **kwargs):
            if getattr(inside, "busy", False):  # issued by a collective already counted
                return original(*args, **kwargs)
            inside.busy = True
            try:
                self._count(name if counts_reduce_scatters else "", kind, args, kwargs)
                return original(*args, **kwargs)
            finally:
                inside.busy = False

        self._saved.append((owner, name, original))
        setattr(owner, name, counted)

    def __enter__(self) -> CollectiveCounter:
        if not any(hasattr(dist, n) for n in REDUCE_SCATTER_FUNCTIONS):
            raise FSDPInternalsChanged(
                f"torch {torch.__version__}: torch.distributed has none of "
                f"{REDUCE_SCATTER_FUNCTIONS}; update pytest_fsdp_turbo_engine.step.fsdp_probe"
            )
        for owner, kinds in ((dist, COLLECTIVE_KINDS), (funcol, FUNCTIONAL_KINDS)):
            for kind, names in kinds.items():
                for name in names:
                    if hasattr(owner, name):
                        self._wrap(owner, name, kind, owner is dist)
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()


def _param_group(unit: FSDPModule):
    try:
        return unit._get_fsdp_state()._fsdp_param_group
    except AttributeError as exc:
        raise FSDPInternalsChanged(
            f"torch {torch.__version__}: FSDP2 state no longer exposes _get_fsdp_state()."
            f"_fsdp_param_group ({exc}); update pytest_fsdp_turbo_engine.step.fsdp_probe"
        ) from None


def unsharded_grad_bytes(model: torch.nn.Module) -> int:
    """Bytes of unsharded gradients FSDP2 holds right now (non-zero only under deferred sync)."""
    return sum(grad.numel() * grad.element_size() for grad in _unsharded_grads(model))


def global_grad_norm(module: torch.nn.Module) -> float:
    """L2 norm of all gradients, from each rank's local shards and explicit sums over shard groups.

    Written independently of torch's clip_grad_norm_, so an engine that reduces its norm wrongly
    cannot agree with it by construction. Replicated mesh dimensions contribute once.
    """
    device = next(module.parameters()).device
    plain = torch.zeros((), dtype=torch.float64, device=device)
    sharded: dict[tuple, list] = {}
    for param in module.parameters():
        grad = param.grad
        if grad is None:
            continue
        if not isinstance(grad, DTensor):
            plain += grad.detach().double().pow(2).sum()
            continue
        if any(p.is_partial() for p in grad.placements):
            raise ValueError("gradient with a Partial placement: not reduced yet, norm undefined")
        dims = tuple(i for i, p in enumerate(grad.placements) if p.is_shard())
        key = (id(grad.device_mesh), dims)
        entry = sharded.setdefault(
            key, [grad.device_mesh, dims, torch.zeros((), dtype=torch.float64, device=device)]
        )
        entry[2] += grad.to_local().detach().double().pow(2).sum()
    total = float(plain)
    for mesh, dims, local_sum in sharded.values():
        for dim in dims:
            dist.all_reduce(local_sum, group=mesh.get_group(dim))
        total += float(local_sum)
    return math.sqrt(total)


# segments wrappers add to parameter names (activation checkpointing, torch.compile)
WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module.", "_orig_mod.")


def _plain_name(name: str) -> str:
    for segment in WRAPPER_SEGMENTS:
        name = name.replace(segment, "")
    return name


def parameter_names(module: torch.nn.Module) -> list[str]:
    """One name per parameter (a tied parameter under its first name), wrapper segments removed."""
    return [_plain_name(n) for n, _ in module.named_parameters()]


def unsharded_parameters(module: torch.nn.Module, aliases: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter of the module, gathered whole (a collective: every rank calls it). With
    `aliases`, a tied parameter appears under each of its names."""
    named = module.named_parameters(remove_duplicate=not aliases)
    return {_plain_name(n): full_tensor(p.detach()) for n, p in named}


def unsharded_gradients(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The gradient of every parameter that has one, gathered whole (a collective)."""
    return {
        _plain_name(n): full_tensor(p.grad.detach())
        for n, p in module.named_parameters()
        if p.grad is not None
    }


SKETCH_STRIDE = 0.6180339887498949  # the golden ratio: positional weights that never repeat


def gradient_sketch(module: torch.nn.Module) -> dict[str, list[float]]:
    """Per parameter, [norm, projection] of its whole gradient (`sketch`). One parameter is
    gathered at a time (a collective: every rank calls it), so the probe holds at most one whole
    gradient."""
    out = {}
    for name, param in module.named_parameters():
        if param.grad is not None:
            plain = _plain_name(name)
            out[plain] = sketch(plain, full_tensor(param.grad.detach()))
    return out


def sketch(name: str, grad: torch.Tensor) -> list[float]:
    """[norm, projection] of one gradient: the projection weighs element i by cos(i * golden ratio
    + a phase from the name), so gradients that trade places inside a tensor (heads sent to the
    wrong rank) move it while the norm stays."""
    flat = grad.double().flatten()
    phase = sum(name.encode()) % 97
    index = torch.arange(flat.numel(), device=flat.device, dtype=torch.float64)
    return [float(flat.norm()), float((flat * torch.cos(index * SKETCH_STRIDE + phase)).sum())]
