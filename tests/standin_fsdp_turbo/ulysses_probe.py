"""One rank of the stand-in Ulysses check: `python ulysses_probe.py STORE` with RANK set, two ranks.

Builds the tiny vision-language Qwen3.5 (fixed seed, the same on every rank), then runs one
gated-delta-net layer and one full-attention layer twice: whole-sequence on every rank, and
sequence-sharded over the two ranks, once unpatched (each rank sees only its chunk: the control a
missed patch would give) and once through the stand-in's Ulysses wrappers. Rank 0 prints, as JSON,
the worst rank's largest differences in outputs, input gradients and (summed over ranks)
parameter gradients.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from fsdp_turbo_standin_ulysses import full_attention, gated_delta_net
from pytest_fsdp_turbo_engine.hf_model import from_config
from pytest_fsdp_turbo_engine.tiny_models import load_spec, tiny_config
from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

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


def main() -> None:
    rank = int(os.environ["RANK"])
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
    if rank == 0:
        print(json.dumps(found))
    sys.stdout.flush()
    os._exit(0)  # as the harness's ranks do: no interpreter teardown with gloo threads about


if __name__ == "__main__":
    main()
