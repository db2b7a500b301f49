"""Reductions and exchanges across ranks; every helper takes the same optional group argument."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def _reduced(value: float, device: torch.device, op, group) -> float:
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=op, group=group)
    return float(tensor.item())


def all_sum(value: float, device: torch.device, group=None) -> float:
    return _reduced(value, device, dist.ReduceOp.SUM, group)


def all_max(value: float, device: torch.device, group=None) -> float:
    return _reduced(value, device, dist.ReduceOp.MAX, group)


def gather_objects(value: Any, group=None) -> list[Any]:
    """Every rank's `value`, in group-rank order, on every rank of the group."""
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, value, group=group)
    return gathered


def gather_rows(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Every rank's rows of `tensor` concatenated in group-rank order (on CPU), on every rank."""
    return torch.cat(gather_objects(tensor.detach().cpu(), group))


def broadcast_tensors(
    tensors: dict[str, torch.Tensor], device: torch.device, group=None
) -> dict[str, torch.Tensor]:
    """The group's first rank's `tensors` on every rank of the group (the others pass {})."""
    if dist.get_world_size(group) == 1:
        return tensors
    layout = [[(name, tuple(t.shape), t.dtype) for name, t in tensors.items()]]
    source = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast_object_list(layout, src=source, group=group)
    shared = {}
    for name, shape, dtype in layout[0]:
        tensor = tensors.get(name)
        if tensor is None:
            tensor = torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(tensor, src=source, group=group)
        shared[name] = tensor
    return shared
