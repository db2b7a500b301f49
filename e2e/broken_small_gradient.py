"""One wrong gradient of one small parameter, as an SP bug in the gated delta-net leaves it: the
bf16 mutants of e2e/test_mutations.py (e2e/broken_turbo_small_gradient.py on our FSDP-Turbo
engine, e2e/broken_verl_turbo_small_gradient.py on verl's). Which parameter and how it goes wrong
come from SMALL_GRADIENT_BUG, `<name suffix>*<factor>`: 0 zeroes it, 0.5 leaves it unreduced over
an SP group of 2, 2 counts it twice."""

import os

from pytest_fsdp_turbo_engine.engines.fsdp2 import local_tensor

BUG = "SMALL_GRADIENT_BUG"


def spoil_small_gradient(module) -> None:
    """Scales the named parameter's gradient shard on this rank, after the engine's backward."""
    suffix, factor = os.environ[BUG].split("*")
    spoiled = [p for n, p in module.named_parameters() if n.endswith(suffix) and p.grad is not None]
    if not spoiled:
        raise RuntimeError(f"{BUG}: no parameter with a gradient ends with {suffix!r}")
    for param in spoiled:
        local_tensor(param.grad).mul_(float(factor))
