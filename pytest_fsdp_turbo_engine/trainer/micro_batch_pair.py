"""The micro-batch pair, inside a verl trainer run: the mini-batch the engine just accumulated over k
micro-batches, run again through the same engine in one pass, from the same parameters, before
its optimizer step. Only the split differs, so the gradients must agree (verl's loss normalises by
the mini-batch's tokens, whatever the split); a loss normalised per micro-batch, gradients dropped
or counted twice between micro-batches, or a sync that loses a micro-batch differ. The pair costs
one more forward and backward of the mini-batch, and one more set of gradient shards while it
runs; the engine's own gradients are put back untouched before its step."""

from __future__ import annotations

from typing import Any


def one_pass_against_accumulated(
    engine: Any, module: Any, units: list, data: Any, loss_function: Any
) -> dict[str, list[float]]:
    """Per parameter of `module`, this rank's shard: [sum of squared differences between the
    one-pass and the accumulated gradient, the accumulated gradient's sum of squares]. Every
    parameter of `units` (the outermost FSDP units) is cleared for the pass and given its own
    gradient back. A collective (verl's pass all-reduces the mini-batch's token count, FSDP2
    reduce-scatters): every rank calls it."""
    import torch
    from verl.utils import tensordict_utils as tu

    from pytest_fsdp_turbo_engine.step.fsdp_probe import _plain_name

    named = [(_plain_name(name), param) for name, param in module.named_parameters()]
    every = list({id(p): p for unit in units for p in unit.parameters()}.values())
    held_by_all = [param.grad for param in every]
    accumulated = [param.grad for _, param in named]
    one = data.copy()  # the actor's batch keeps its own split
    tu.assign_non_tensor(one, use_dynamic_bsz=False, micro_batch_size_per_gpu=len(one))
    try:
        for param in every:
            param.grad = None
        engine.forward_backward_batch(one, loss_function, forward_only=False)
        pair: dict[str, list[float]] = {}
        with torch.no_grad():
            for (name, param), held in zip(named, accumulated):
                if held is None and param.grad is None:
                    continue
                mine, theirs = _local(param.grad), _local(held)
                if mine is None:
                    mine = torch.zeros_like(theirs)
                if theirs is None:
                    theirs = torch.zeros_like(mine)
                pair[name] = [
                    float((mine.float() - theirs.float()).pow(2).sum()),
                    float(theirs.float().pow(2).sum()),
                ]
        return pair
    finally:
        for param, held in zip(every, held_by_all):
            param.grad = held


def _local(grad: Any) -> Any:
    """This rank's shard of a gradient (a DTensor's local tensor), or None."""
    if grad is None:
        return None
    return grad.to_local() if hasattr(grad, "to_local") else grad
