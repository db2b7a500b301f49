"""The stand-in Ulysses check over two gloo ranks: `python ulysses_probe.py STORE` (rank 1 forked).

Builds the tiny vision-language Qwen3.5 (fixed seed, the same on every rank), then runs one
gated-delta-net layer and one full-attention layer twice: whole-sequence on every rank, and
sequence-sharded over the two ranks, once unpatched (each rank sees only its chunk: the control a
missed patch would give) and once through the stand-in's Ulysses wrappers. Rank 0 prints, as JSON,
the worst rank's largest differences in outputs, input gradients and (summed over ranks)
parameter gradients.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from fsdp_turbo_standin_ulysses import full_attention, gated_delta_net
from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen
from two_ranks import run_on_two_ranks

from pytest_fsdp_turbo_engine.core.hf_model import from_config
from pytest_fsdp_turbo_engine.tiny_models import load_spec, tiny_config

WORLD, SEQ, BATCH = 2, 12, 2


def run(layer, call, x: torch.Tensor, weights: torch.Tensor) -> tuple:
    """Output, input gradient and parameter gradients of sum(call(layer, x) * weights)."""
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    out = call(layer, x)
    (out * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    return out.detach(), x.grad, grads


def compare(name: str, full: tuple, sharded: tuple, rank: int, chunk: slice) -> dict:
    out, x_grad, grads = sharded
    for grad in grads.values():  # each rank holds its chunk's share: the sum is the whole
        dist.all_reduce(grad)
    errors = torch.tensor(
        [
            (out - full[0][:, chunk]).abs().max().item(),
            (x_grad - full[1][:, chunk]).abs().max().item(),
            max((grads[n] - g).abs().max().item() for n, g in full[2].items()),
        ]
    )
    dist.all_reduce(errors, op=dist.ReduceOp.MAX)  # the worst rank's
    return {
        f"{name}/output": errors[0].item(),
        f"{name}/input_grad": errors[1].item(),
        f"{name}/param_grad": errors[2].item(),
        f"{name}/params_with_grad": sorted(grads) == sorted(full[2]),
    }


def whole_model(model, rank: int, chunk: slice) -> dict:
    """FSDPTurbo with the SP config the harness generates for Qwen3.5 (its own patch tables),
    against an unpatched copy's whole-sequence step computed first (the patches are global)."""
    import copy

    from fsdp_turbo.fsdp_turbo import FSDPTurbo
    from fsdp_turbo.fsdp_turbo_config import FSDPTurboConfig, _dict_to_dataclass
    from torch.distributed.tensor import DTensor

    from pytest_fsdp_turbo_contract.turbo_config import (
        LOSS_FUNCTIONS,
        MODULE_PATCHES,
        ULYSSES_FUNCTIONS,
    )

    ids = torch.randint(0, 64, (BATCH, SEQ))
    weights = torch.randn(BATCH, SEQ, 64)
    reference = copy.deepcopy(model)
    expected = reference(input_ids=ids).logits
    (expected * weights).sum().backward()
    patches = {
        name: [{"target_functions": [t], "type": k} for t, k in table["qwen3_5"]]
        for name, table in (
            ("ulysses_function_patches", ULYSSES_FUNCTIONS),
            ("loss_function_patches", LOSS_FUNCTIONS),
        )
    }
    config = {
        "module_patches": MODULE_PATCHES["qwen3_5"],
        "distributed": {
            "fully_shard_parallel_size": WORLD,
            "ulysses_parallel_size": WORLD,
            "fsdp_plan": {
                "param_dtype": "fp32",
                "reduce_dtype": "fp32",
                "apply_modules": {"model.language_model.layers.{*}": {}},
            },
            "cp_plan": patches,
        },
    }
    wrapped = FSDPTurbo(_dict_to_dataclass(FSDPTurboConfig, config), model).model
    logits = wrapped(input_ids=ids).logits  # this rank's chunk of the sequence
    (logits * weights[:, chunk]).sum().backward()
    pieces = [torch.empty_like(logits) for _ in range(WORLD)]
    dist.all_gather(pieces, logits.detach().contiguous())
    worst = 0.0
    for name, param in wrapped.named_parameters():
        if param.grad is None:
            continue
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        want = dict(reference.named_parameters())[name].grad
        worst = max(worst, (grad * WORLD - want).abs().max().item())  # FSDP averaged the ranks
    from transformers.loss import loss_utils

    sharded_loss = loss_utils.ForCausalLMLoss  # wrapped by causal_lm_loss now
    shifted = torch.cat([ids[:, 1:], torch.full((BATCH, 1), -100)], dim=1)
    local_loss = sharded_loss(logits.detach(), None, 64, shift_labels=shifted[:, chunk])
    whole_loss = sharded_loss.__wrapped__(expected.detach(), ids, 64)
    return {
        "model/loss": abs(local_loss.item() - whole_loss.item()),
        "model/local_logits_shape": list(logits.shape),
        "model/logits": (torch.cat(pieces, dim=1) - expected).abs().max().item(),
        "model/param_grad": worst,
    }


def main() -> None:
    run_on_two_ranks(probe)


def probe(rank: int) -> dict:
    store = dist.FileStore(sys.argv[1], WORLD)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    group = dist.group.WORLD
    torch.manual_seed(0)
    config = tiny_config(load_spec("tiny-qwen3_5"), vocab_size=64)
    config.text_config._attn_implementation = "eager"
    model = from_config(config, dtype=torch.float32)
    text = model.model.language_model
    hidden = config.text_config.hidden_size
    x = torch.randn(BATCH, SEQ, hidden)
    weights = torch.randn(BATCH, SEQ, hidden)
    chunk = slice(rank * SEQ // WORLD, (rank + 1) * SEQ // WORLD)
    found = {}

    gdn = text.layers[0].linear_attn
    original = type(gdn).forward
    full = run(gdn, lambda m, t: m(t), x, weights)
    local = run(gdn, lambda m, t: m(t), x[:, chunk], weights[:, chunk])  # no patch: the control
    found.update(compare("gated_delta_net_unpatched", full, local, rank, chunk))
    type(gdn).forward = gated_delta_net(original, group)
    sharded = run(gdn, lambda m, t: m(t), x[:, chunk], weights[:, chunk])
    type(gdn).forward = original
    found.update(compare("gated_delta_net", full, sharded, rank, chunk))

    attention = text.layers[3].self_attn
    positions = torch.arange(SEQ)[None].expand(BATCH, -1)
    cos, sin = text.rotary_emb(x, positions)
    eager = qwen.eager_attention_forward

    def attend(length: int, part: slice):
        mask = torch.full((length, length), torch.finfo(x.dtype).min).triu(1)[None, None]
        return lambda m, t: m(t, (cos[:, part], sin[:, part]), mask)[0]

    full = run(attention, attend(SEQ, slice(None)), x, weights)
    local = run(attention, attend(SEQ // WORLD, chunk), x[:, chunk], weights[:, chunk])
    found.update(compare("full_attention_unpatched", full, local, rank, chunk))
    qwen.eager_attention_forward = full_attention(eager, group)
    sharded = run(attention, attend(SEQ // WORLD, chunk), x[:, chunk], weights[:, chunk])
    qwen.eager_attention_forward = eager
    found.update(compare("full_attention", full, sharded, rank, chunk))
    found.update(whole_model(model, rank, chunk))
    return found


if __name__ == "__main__":
    main()
