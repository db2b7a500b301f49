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

    from pytest_fsdp_turbo_engine.engines.fsdp2 import local_tensor
    from pytest_fsdp_turbo_engine.step.fsdp_probe import _plain_name

    every = {id(p): p for unit in [module, *units] for p in unit.parameters()}
    held = {key: param.grad for key, param in every.items()}  # the engine's, put back after
    one = data.copy()  # the actor's batch keeps its own split
    tu.assign_non_tensor(one, use_dynamic_bsz=False, micro_batch_size_per_gpu=len(one))
    try:
        for param in every.values():
            param.grad = None
        engine.forward_backward_batch(one, loss_function, forward_only=False)
        pair: dict[str, list[float]] = {}
        with torch.no_grad():
            for name, param in module.named_parameters():
                accumulated = held[id(param)]
                if accumulated is None and param.grad is None:
                    continue
                mine = None if param.grad is None else local_tensor(param.grad)
                theirs = None if accumulated is None else local_tensor(accumulated)
                if mine is None:
                    mine = torch.zeros_like(theirs)
                if theirs is None:
                    theirs = torch.zeros_like(mine)
                pair[_plain_name(name)] = [
                    float((mine.float() - theirs.float()).pow(2).sum()),
                    float(theirs.float().pow(2).sum()),
                ]
        return pair
    finally:
        for key, param in every.items():
            param.grad = held[key]
