"""The exact weight comparison after the push: what the rollout computes with against the
trainer's own parameters, gathered by the harness from the engine's module (never from the state
dict the engine hands over, which is the thing under test).

A rollout reports the tensors it serves under its own names; vLLM fuses some (q/k/v into
`qkv_proj`, gate/up into `gate_up_proj`) and says how in its model's `packed_modules_mapping`, so
the trainer's tensors are fused the same way before comparing. Both sides are rounded to the
narrower of the served and the hand-off dtype (a bf16 case hands bf16), then compared exactly;
vocabulary rows past the trainer's, which vLLM pads to its tile size, are not compared. A served
tensor vLLM keeps only in a kernel's own layout (on CPU it repacks every linear weight for oneDNN
and leaves an empty tensor) is not readable and is not compared; the logprob comparison (check e)
still covers it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class HandOff:
    max_abs_diff: float  # over the compared tensors (inf when a served tensor has no trainer twin)
    worst: str  # the served tensor with the largest difference, or the one without a twin
    compared: int


def _twin(name: str, trainer: dict[str, torch.Tensor], packed: dict[str, list[str]]):
    if name in trainer:
        return trainer[name]
    for fused, parts in packed.items():
        token = f".{fused}."
        if token in name:
            pieces = [trainer.get(name.replace(token, f".{part}.")) for part in parts]
            if all(p is not None for p in pieces):
                return torch.cat(pieces, dim=0)
    return None


def compare(
    served: dict[str, torch.Tensor],
    trainer: dict[str, torch.Tensor],
    packed: dict[str, list[str]] | None = None,
    handoff_dtype: torch.dtype = torch.float32,
) -> HandOff:
    """Exact, after both sides are rounded to the hand-off dtype (a bf16 case hands bf16 weights
    to its rollout, as verl does, even where the rollout model holds fp32)."""
    worst, worst_name, compared = 0.0, "", 0
    for name, tensor in served.items():
        if tensor.numel() == 0:
            continue  # kept only in a kernel's layout: not readable
        want = _twin(name, trainer, packed or {})
        if want is not None and tensor.shape[1:] == want.shape[1:] and len(tensor) > len(want):
            tensor = tensor[: len(want)]  # vocabulary rows vLLM pads to its tile size
        if want is None or want.shape != tensor.shape:
            shape = "none" if want is None else list(want.shape)
            return HandOff(math.inf, f"{name} (trainer: {shape})", compared)
        compared += 1
        dtype = handoff_dtype if handoff_dtype.itemsize < tensor.dtype.itemsize else tensor.dtype
        got, want = tensor.cpu().to(dtype).float(), want.cpu().to(dtype).float()
        diff = float((got - want).abs().max())
        if diff > worst or not worst_name:
            worst, worst_name = diff, name
    return HandOff(worst, worst_name, compared)


def compare_handoff(
    handed: dict[str, torch.Tensor],
    trainer: dict[str, torch.Tensor],
    canonical: set[str],
    handoff_dtype: torch.dtype = torch.float32,
) -> HandOff:
    """What the engine hands its rollout against its own parameters, by name, shape, dtype and
    value: every parameter (`canonical`, one name per tied group) handed over, nothing that is not
    a parameter (`trainer` holds every alias), each in the trainer's or the hand-off dtype and
    equal after rounding to it."""
    for name in sorted(canonical - set(handed)):
        return HandOff(math.inf, f"{name} (not handed over)", 0)
    for name in sorted(set(handed) - set(trainer)):
        return HandOff(math.inf, f"{name} (not a parameter of the trainer)", 0)
    worst, worst_name = 0.0, ""
    for name, tensor in sorted(handed.items()):
        want = trainer[name]
        if tensor.shape != want.shape:
            return HandOff(
                math.inf, f"{name} (shape {list(tensor.shape)}, trainer's {list(want.shape)})", 0
            )
        if tensor.dtype not in (want.dtype, handoff_dtype):
            return HandOff(math.inf, f"{name} (dtype {tensor.dtype}, trainer's {want.dtype})", 0)
        rounded = want.to(tensor.dtype).float().cpu()
        diff = float((tensor.float().cpu() - rounded).abs().max()) if tensor.numel() else 0.0
        if diff > worst or not worst_name:
            worst, worst_name = diff, name
    return HandOff(worst, worst_name, len(handed))
