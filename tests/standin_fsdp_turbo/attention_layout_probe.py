"""The stand-in's attention wrappers against the Ulysses layouts' behaviour, over two gloo ranks:
`python attention_layout_probe.py STORE` (rank 1 forked). Rank 0 prints a JSON report.

The expectations are written from the middle layout's published wrapper, not read off the
stand-in: `fn` sees K/V repeated to the query's head count (GQA 4:2 here), the caller's mask and
keywords as the very objects passed, and a [B, H, S, D] output exchanged back; each rank's output
equals its chunk of plain attention over the whole sequence.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
from fsdp_turbo_standin_ulysses import full_attention, middle_layout_attention
from two_ranks import run_on_two_ranks

WORLD, BATCH, SEQ, DIM = 2, 2, 8, 4


def attention_bhsd(module, query, key, value, mask, *, seen: dict, marker=None):
    """The middle layout's contract for `fn`: [B, H, S, D] in and out, K/V as many heads as Q,
    the whole sequence's additive mask."""
    seen.update(
        query_heads=query.shape[1],
        key_heads=key.shape[1],
        seq=query.shape[2],
        mask_is_callers=mask is seen.get("callers_mask"),
        marker_is_callers=marker is seen.get("callers_marker"),
    )
    scores = query @ key.transpose(-1, -2) / DIM**0.5
    if mask is not None:
        scores = scores + mask
    return scores.softmax(-1) @ value, None


def attention_bshd(module, query, key, value, mask, **kwargs):
    """transformers' eager output layout: [B, S, H, D]."""
    out, weights = attention_bhsd(module, query, key, value, mask, **kwargs)
    return out.transpose(1, 2), weights


def whole(query, key, value, mask, groups):
    """Plain attention over the whole sequence, K/V repeated by the GQA ratio."""
    key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
    scores = query @ key.transpose(-1, -2) / DIM**0.5 + mask
    return scores.softmax(-1) @ value


def causal(length: int) -> torch.Tensor:
    return torch.full((length, length), torch.finfo(torch.float32).min).triu(1)[None, None]


def probe(rank: int) -> dict:
    store = dist.FileStore(sys.argv[1], WORLD)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    group = dist.group.WORLD
    torch.manual_seed(0)
    chunk = slice(rank * SEQ // WORLD, (rank + 1) * SEQ // WORLD)
    found: dict = {}

    def worst(out: torch.Tensor, expected: torch.Tensor) -> float:
        error = torch.tensor((out - expected).abs().max().item())
        dist.all_reduce(error, op=dist.ReduceOp.MAX)
        return error.item()

    # the middle layout's default wrapper: GQA 4 query heads to 2 key/value heads
    gqa = SimpleNamespace(config=SimpleNamespace(num_attention_heads=4, num_key_value_heads=2))
    q, k, v = (
        torch.randn(BATCH, 4, SEQ, DIM),
        torch.randn(BATCH, 2, SEQ, DIM),
        torch.randn(BATCH, 2, SEQ, DIM),
    )
    mask, marker = causal(SEQ), object()
    seen = {"callers_mask": mask, "callers_marker": marker}
    wrapped = middle_layout_attention(attention_bhsd, group)
    out, _ = wrapped(
        gqa, q[:, :, chunk], k[:, :, chunk], v[:, :, chunk], mask, seen=seen, marker=marker
    )
    expected = whole(q, k, v, mask, 2)[:, :, chunk]
    found["middle/output"] = worst(out, expected)
    found["middle/output_shape"] = list(out.shape)
    found["middle/fn_saw"] = {key: seen[key] for key in ("query_heads", "key_heads", "seq")}
    found["middle/mask_passed_through"] = seen["mask_is_callers"]
    found["middle/kwargs_passed_through"] = seen["marker_is_callers"]

    # the newest layout's full_attention (assumed): either output layout, told apart by shape
    mha = SimpleNamespace(config=SimpleNamespace(num_attention_heads=4, num_key_value_heads=4))
    k4, v4 = torch.randn(BATCH, 4, SEQ, DIM), torch.randn(BATCH, 4, SEQ, DIM)
    expected = whole(q, k4, v4, causal(SEQ), 1)[:, :, chunk]
    local_mask = causal(SEQ // WORLD)  # what transformers builds for the chunk
    for name, fn in (("bhsd", attention_bhsd), ("bshd", attention_bshd)):
        seen = {"callers_marker": marker}
        out, _ = full_attention(fn, group)(
            mha,
            q[:, :, chunk],
            k4[:, :, chunk],
            v4[:, :, chunk],
            local_mask,
            seen=seen,
            marker=marker,
        )
        out = out if name == "bhsd" else out.transpose(1, 2)
        found[f"newest/{name}/output"] = worst(out, expected)
        found[f"newest/{name}/kwargs_passed_through"] = seen["marker_is_callers"]
    found.update(middle_layout_rules())
    return found


def core_attention(module, query, key, value, mask, **kwargs):
    """What a middle-layout config names as its core-attention function (this module's)."""
    return attention_bhsd(module, query, key, value, mask, seen={})


def middle_layout_rules() -> dict:
    """The middle layout's FSDPTurbo itself (not its wrapper alone) on ulysses_attention_type:
    "default" replaces the named function in its module, any other string is refused with the
    library's words, "with_compressor" is named as not modelled, no function means no Ulysses."""
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent / "core_attention"))
    from fsdp_turbo.fsdp_turbo import FSDPTurbo
    from fsdp_turbo.fsdp_turbo_config import FSDPTurboConfig, _dict_to_dataclass

    this = sys.modules["attention_layout_probe"]  # registered under its name by main()
    original = this.core_attention

    def build(cp_plan: dict):
        config = _dict_to_dataclass(
            FSDPTurboConfig,
            {
                "distributed": {
                    "fully_shard_parallel_size": 1,
                    "ulysses_parallel_size": WORLD,
                    "cp_plan": cp_plan,
                    "fsdp_plan": {"apply_modules": {"0": {}}},
                }
            },
        )
        try:
            FSDPTurbo(config, torch.nn.Sequential(torch.nn.Linear(DIM, DIM)))
            return "built"
        except Exception as exc:  # noqa: BLE001 - the refusal is what is reported
            return f"{type(exc).__name__}: {exc}"

    target = "attention_layout_probe.core_attention"
    found = {
        "rules/gdn": build(
            {"ulysses_core_attention_function": target, "ulysses_attention_type": "GDN"}
        ),
        "rules/compressor": build(
            {"ulysses_core_attention_function": target, "ulysses_attention_type": "with_compressor"}
        ),
        "rules/no_function": build({}),
        "rules/untouched_without_function": this.core_attention is original,
        "rules/missing_function": build(
            {"ulysses_core_attention_function": "attention_layout_probe.nowhere"}
        ),
        "rules/default": build({"ulysses_core_attention_function": target}),
    }
    found["rules/default_replaced"] = this.core_attention is not original
    return found


def main() -> None:
    sys.modules.setdefault("attention_layout_probe", sys.modules[__name__])
    run_on_two_ranks(probe)


if __name__ == "__main__":
    main()
