"""STAND-IN for the Ascend `fsdp_turbo` library's Ulysses sequence parallelism: a test double, never
the library, never evidence about hardware. It does for real, over any process group that has
`all_to_all_single` (gloo included), what the library's function-patch layout promises
(FACTS-fsdp_turbo.md, "Ulysses / context parallel"): each rank of the ulysses group holds a
contiguous chunk of the sequence, and the functions named in `cp_plan` exchange it for a share of
the heads around the part that needs the whole sequence.

- `all_to_all(x, group, scatter_dim, gather_dim)`: split `scatter_dim` over the group, gather
  `gather_dim`; its backward is the inverse exchange.
- `middle_layout_attention(fn, group)`: the middle layout's `default` wrapper as its source
  publishes it (K/V repeated to the query head count, mask and kwargs passed through, output
  exchanged as [B, H, S, D]).
- `full_attention(fn, group)`, for the newest layout's `type: full_attention`, whose source is
  not published: the middle layout's exchange around transformers' eager attention, with what
  that target forces (K/V unrepeated, the chunk's causal mask widened to the whole sequence, the
  [B, S, H, D] output exchanged as the middle layout's transposed form), each said in its
  docstring as an assumption about the newest layout.
- `gated_delta_net(fn, group)`, for `type: gated_delta_net` on `Qwen3_5GatedDeltaNet.forward`:
  projections run on the local chunk; the convolution and the gated delta rule, which need the
  whole sequence, run head-parallel between two exchanges, per packed sequence when `cu_seqlens`
  (bounds over the whole sequence, as verl passes them) is given; norm and output projection run
  local. A forward with a cache (generation) is not sequence-sharded and runs `fn` unchanged.
  How the library treats packed sequences is not in its published sources seen so far: verl's SP
  path packs, so the stand-in keeps the sequences apart, as the library must for verl's NPU run.
"""

from __future__ import annotations

import functools
import importlib
import sys

import torch
import torch.distributed as dist
import torch.distributed.nn as dist_nn
import torch.nn.functional as F


def _exchange(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    size = dist.get_world_size(group)
    sent = torch.stack(x.chunk(size, dim=scatter_dim)).contiguous()
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent, group=group)
    return torch.cat(received.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim):
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _exchange(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _exchange(grad, ctx.group, gather_dim, scatter_dim), None, None, None


def all_to_all(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    size = dist.get_world_size(group)
    if x.shape[scatter_dim] % size:
        raise ValueError(
            f"[Context Parallel] dimension {scatter_dim} of size {x.shape[scatter_dim]} does not "
            f"split over a ulysses group of {size}"
        )
    return _AllToAll.apply(x, group, scatter_dim, gather_dim)


def _gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank's chunk of dimension 1, in rank order (no gradient: positions and bounds)."""
    chunks = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(chunks, x.contiguous(), group=group)
    return torch.cat(chunks, dim=1)


def _blocked(positions: torch.Tensor | None, seq: int, device) -> torch.Tensor:
    """[batch or 1, 1, seq, seq], True where a query may not see a key: the future, and with
    packed sequences (positions that restart, as transformers detects them) other sequences."""
    blocked = torch.ones(seq, seq, dtype=torch.bool, device=device).triu(1)[None, None]
    if positions is None:
        return blocked
    segment = (torch.diff(positions, dim=-1, prepend=positions[:, :1] - 1) != 1).cumsum(-1)
    return blocked | (segment[:, None, :, None] != segment[:, None, None, :])


def _additive(blocked: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    mask = torch.zeros(blocked.shape, dtype=like.dtype, device=like.device)
    return mask.masked_fill(blocked, torch.finfo(like.dtype).min)


def _segments(cu_seqlens: torch.Tensor | None, seq: int) -> list[slice]:
    """The packed sequences of a row (one when the row is not packed)."""
    if cu_seqlens is None:
        return [slice(0, seq)]
    bounds = cu_seqlens.tolist()
    if bounds[-1] != seq:
        raise ValueError(f"[Context Parallel] cu_seqlens ends at {bounds[-1]}, sequence is {seq}")
    return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def _repeat_kv_as_middle_layout(module, key, value, size):
    """GQA as the middle layout does it before the exchange: K/V repeated by the query-to-key head
    ratio when that ratio is above 1 or the group outnumbers the key/value heads."""
    groups = int(module.config.num_attention_heads / module.config.num_key_value_heads)
    if groups > 1 or size > module.config.num_key_value_heads:
        key = torch.repeat_interleave(key, dim=1, repeats=groups)
        value = torch.repeat_interleave(value, dim=1, repeats=groups)
    return key, value


def middle_layout_attention(fn, group):
    """The middle layout's `default` Ulysses wrapper, rule for rule as its source publishes it
    (get_ulysses_attention_fn): K/V repeated to the query head count (above), then query, key and
    value exchanged [B, H, S, D] heads for sequence (scatter 1, gather 2); `fn` gets every other
    argument, the attention mask included, unchanged; its output is taken as [B, H, S, D] and
    exchanged back (scatter 2, gather 1). So `fn` must take the whole sequence's mask and return
    [B, H, S, D] without repeating K/V itself: transformers' eager function does neither (it
    repeats K/V by `num_key_value_groups` and returns [B, S, H, D]), which is why the harness
    never points this layout's Ulysses at it (its config refuses sp_size > 1 for this layout)."""

    @functools.wraps(fn)
    def wrapper(module, query, key, value, *args, **kwargs):
        size = dist.get_world_size(group) if group is not None else 1
        key, value = _repeat_kv_as_middle_layout(module, key, value, size)
        if size > 1:
            query, key, value = (all_to_all(t, group, 1, 2) for t in (query, key, value))
        out, weights = fn(module, query, key, value, *args, **kwargs)
        if size > 1:
            out = all_to_all(out, group, 2, 1)
        return out, weights

    return wrapper


def full_attention(fn, group):
    """`type: full_attention` of the newest layout, whose wrapper's source is not published (only
    its callers are: verl points it at transformers' `eager_attention_forward`). Built on the
    middle layout's exchange, with three differences that eager target forces, each an assumption
    about the newest layout, not a fact:
    - K/V are exchanged with their own head count (which must divide by the group): the eager
      function repeats them by `num_key_value_groups` itself, so the middle layout's repeat before
      the exchange would repeat them twice and fail on any GQA model;
    - the mask transformers built covers only this rank's chunk (the text model sees the chunk):
      it must be the chunk's causal block (of packed sequences, by the gathered `position_ids`),
      else it is refused; `fn` gets that mask widened to the whole sequence; every other argument
      and keyword passes through unchanged;
    - the eager function returns [B, S, H, D]: the output exchange is the middle layout's
      `attn_output_transposed` one (scatter 1, gather 2); a [B, H, S, D] output is exchanged as
      the middle layout's default, and a shape that could be either is refused.
    """

    @functools.wraps(fn)
    def wrapper(module, query, key, value, attention_mask, *args, **kwargs):
        size = dist.get_world_size(group)
        if size == 1:
            return fn(module, query, key, value, attention_mask, *args, **kwargs)
        if key.shape[1] % size:
            raise ValueError(
                f"[Context Parallel] {key.shape[1]} key/value heads do not split over a ulysses "
                f"group of {size}"
            )
        local, rank = query.shape[2], dist.get_rank(group)
        whole, heads = local * size, query.shape[1] // size
        if heads == whole:
            raise ValueError(
                f"[Context Parallel] {heads} heads per rank over a sequence of {whole}: the "
                "attention output's layout cannot be told apart"
            )
        positions = kwargs.get("position_ids")  # the chunk's; they mark packed sequences
        if positions is not None:
            positions = _gather_sequence(positions.reshape(positions.shape[0], -1), group)
        blocked = _blocked(positions, whole, query.device)
        mine = slice(rank * local, (rank + 1) * local)
        if attention_mask is not None and not bool(
            ((attention_mask[..., :local, :local] != 0) == blocked[..., mine, mine]).all()
        ):
            raise ValueError(
                "[Context Parallel] stand-in Ulysses takes causal masks (of packed sequences) only"
            )
        query, key, value = (all_to_all(t, group, 1, 2) for t in (query, key, value))
        out, weights = fn(module, query, key, value, _additive(blocked, query), *args, **kwargs)
        transposed = tuple(out.shape[1:3]) == (whole, heads)  # [B, S, H, D]
        return all_to_all(out, group, *((1, 2) if transposed else (2, 1))), weights

    return wrapper


def _chunk_rule(layer):
    """The gated delta rule the layer itself would run: an attribute up to transformers 5.23, the
    modeling module's function from 5.24 on (the `fla` kernel when installed, else torch's)."""
    rule = getattr(layer, "chunk_gated_delta_rule", None)
    if rule is None:
        rule = getattr(sys.modules[type(layer).__module__], "torch_chunk_gated_delta_rule", None)
    if rule is None:
        raise AttributeError(
            f"[Context Parallel] {type(layer).__name__} has no chunk_gated_delta_rule, nor its "
            "modeling module a torch_chunk_gated_delta_rule: a transformers release this stand-in "
            "does not know"
        )
    return rule


def gated_delta_net(fn, group):
    @functools.wraps(fn)
    def forward(self, hidden_states, *args, cu_seqlens=None, **kwargs):
        # the cache is the second argument; transformers 5.24 renamed it cache_params -> cache
        names = [n for n in ("cache", "cache_params") if n in kwargs]
        cache = args[0] if args else (kwargs[names[0]] if names else None)
        attention_mask = args[1] if len(args) > 1 else kwargs.get("attention_mask")
        size = dist.get_world_size(group)
        if size == 1 or cache is not None:
            if cu_seqlens is not None:
                kwargs["cu_seqlens"] = cu_seqlens
            return fn(self, hidden_states, *args, **kwargs)
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("[Context Parallel] stand-in Ulysses takes unpadded batches only")
        if self.num_k_heads % size:
            raise ValueError(
                f"[Context Parallel] {self.num_k_heads} linear-attention key heads do not split "
                f"over a ulysses group of {size}"
            )
        batch, local_seq, _ = hidden_states.shape
        rank = dist.get_rank(group)
        k_heads, v_heads = self.num_k_heads // size, self.num_v_heads // size
        key_dim, value_dim = k_heads * self.head_k_dim, v_heads * self.head_v_dim

        def heads(t: torch.Tensor, count: int, dim: int) -> torch.Tensor:
            """[batch, local_seq, count * dim] -> this rank's heads over the whole sequence."""
            t = t.reshape(batch, local_seq, size, count * dim // size)
            return all_to_all(t, group, 2, 1).squeeze(2)

        q, k, v = self.in_proj_qkv(hidden_states).split(
            [self.key_dim, self.key_dim, self.value_dim], dim=-1
        )
        q, k = (
            heads(q, self.num_k_heads, self.head_k_dim),
            heads(k, self.num_k_heads, self.head_k_dim),
        )
        v = heads(v, self.num_v_heads, self.head_v_dim)
        b = heads(self.in_proj_b(hidden_states), self.num_v_heads, 1)
        a = heads(self.in_proj_a(hidden_states), self.num_v_heads, 1)
        seq = q.shape[1]
        segments = _segments(cu_seqlens, seq)  # verl packs a micro-batch into one row
        # the depthwise convolution, on this rank's channels of q, k and v
        weight = self.conv1d.weight
        channels = torch.cat(
            [
                weight[rank * key_dim : (rank + 1) * key_dim],
                weight[self.key_dim + rank * key_dim : self.key_dim + (rank + 1) * key_dim],
                weight[
                    2 * self.key_dim + rank * value_dim : 2 * self.key_dim + (rank + 1) * value_dim
                ],
            ]
        )
        mixed = torch.cat([q, k, v], dim=-1).transpose(1, 2)
        pad = self.conv_kernel_size - 1
        mixed = torch.cat(
            [
                F.conv1d(mixed[:, :, part], channels, padding=pad, groups=mixed.shape[1])[
                    :, :, : part.stop - part.start
                ]
                for part in segments
            ],
            dim=2,
        )
        mixed = F.silu(mixed).transpose(1, 2)
        q, k, v = mixed.split([key_dim, key_dim, value_dim], dim=-1)
        q = q.reshape(batch, seq, k_heads, self.head_k_dim)
        k = k.reshape(batch, seq, k_heads, self.head_k_dim)
        v = v.reshape(batch, seq, v_heads, self.head_v_dim)
        mine = slice(rank * v_heads, (rank + 1) * v_heads)
        rule = _chunk_rule(self)
        beta = b.sigmoid()
        g = -self.A_log[mine].float().exp() * F.softplus(a.float() + self.dt_bias[mine])
        if v_heads // k_heads > 1:
            q = q.repeat_interleave(v_heads // k_heads, dim=2)
            k = k.repeat_interleave(v_heads // k_heads, dim=2)
        out = torch.cat(
            [
                rule(
                    q[:, part], k[:, part], v[:, part], g=g[:, part], beta=beta[:, part],
                    initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=True,
                )[0]
                for part in segments
            ],
            dim=1,
        )  # fmt: skip
        out = all_to_all(out.reshape(batch, seq, 1, value_dim), group, 1, 2)
        out = out.reshape(batch, local_seq, self.num_v_heads, self.head_v_dim)
        z = self.in_proj_z(hidden_states).reshape(-1, self.head_v_dim)
        out = self.norm(out.reshape(-1, self.head_v_dim), z)
        return self.out_proj(out.reshape(batch, local_seq, -1))

    return forward


def causal_lm_loss(fn, group):
    """`type: causal_lm_loss` on transformers' ForCausalLMLoss (the newest layout's; its source is
    not published). Under Ulysses the logits are this rank's chunk of the sequence. The labels come
    as callers of the library pass them, `labels` over the whole sequence: they are shifted over the
    whole sequence and this rank's chunk taken (or `shift_labels`, already this rank's chunk). The
    token-loss sum is reduced over the group, gradient included, and divided by
    `num_items_in_batch`, or by the group's count of labelled tokens: every rank of the group gets
    the whole sequence's loss, as the gathered logits give every rank the whole sequence's."""

    @functools.wraps(fn)
    def loss(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, **kwargs):
        size = dist.get_world_size(group)
        if size == 1:
            return fn(logits, labels, vocab_size, num_items_in_batch, ignore_index, **kwargs)
        local = logits.shape[1]
        shift_labels = kwargs.get("shift_labels")
        if shift_labels is None:
            if labels is None or labels.shape[-1] != local * size:
                raise ValueError(
                    "[Context Parallel] causal_lm_loss takes labels over the whole sequence "
                    f"({local * size} tokens) or shift_labels for this rank's {local}; got "
                    f"{None if labels is None else tuple(labels.shape)}"
                )
            shifted = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
            rank = dist.get_rank(group)
            shift_labels = shifted[..., rank * local : (rank + 1) * local]
        shift_labels = shift_labels.reshape(-1).to(logits.device)
        total = F.cross_entropy(
            logits.float().reshape(-1, vocab_size),
            shift_labels,
            ignore_index=ignore_index,
            reduction="sum",
        )
        total = dist_nn.all_reduce(total, group=group)
        if num_items_in_batch is None:
            counted = (shift_labels != ignore_index).sum().to(total.dtype)
            dist.all_reduce(counted, group=group)
            num_items_in_batch = counted
        return total / num_items_in_batch

    return loss


WRAPPERS = {
    "full_attention": full_attention,
    "gated_delta_net": gated_delta_net,
    "causal_lm_loss": causal_lm_loss,
}


def apply_function_patches(cp_plan, group) -> None:
    """Wrap every target `cp_plan` names, by its type, where it lives (a module's function or a
    class's method), as found now: a second FSDPTurbo in one process wraps the wrapped function
    again, as the library's in-place replacement does."""
    for field_name in ("ulysses_function_patches", "loss_function_patches"):
        for entry in getattr(cp_plan, field_name) or []:
            wrap = WRAPPERS.get(entry["type"])
            if wrap is None:
                raise ValueError(
                    f"[Context Parallel] unknown {field_name} type {entry['type']!r}; known: "
                    f"{sorted(WRAPPERS)}"
                )
            for target in entry["target_functions"]:
                owner, name = _owner(target)
                original = getattr(owner, name)
                wrapped = wrap(original, group)
                setattr(owner, name, wrapped)
                if field_name == "loss_function_patches":
                    _rebind_loss_mapping(original, wrapped)


def apply_core_attention(cp_plan, group) -> None:
    """The middle layout's Ulysses: each function ulysses_core_attention_function names (a string
    or a list; none: no Ulysses, silently, as there) is replaced in its module by its wrapper for
    ulysses_attention_type: "default" (middle_layout_attention), a callable (called with the
    function and the group), "with_compressor" (its compressed-KV exchange is not modelled here);
    any other value raises as the library raises."""
    from fsdp_turbo_standin_core import NotModelledByStandIn

    functions = cp_plan.ulysses_core_attention_function or []
    functions = [functions] if isinstance(functions, str) else list(functions)
    if not functions:
        return  # the library runs no Ulysses then, and checks no attention type
    kind = cp_plan.ulysses_attention_type
    if kind == "default":
        wrap = middle_layout_attention
    elif callable(kind):
        wrap = kind
    elif kind == "with_compressor":
        raise NotModelledByStandIn(
            "distributed.cp_plan.ulysses_attention_type = 'with_compressor': not modelled by the "
            "stand-in"
        )
    else:
        raise ValueError(
            f"[Context Parallel] Invalid ulysses_attention_type: {kind!r}. Expected 'default', "
            "'with_compressor', or a callable."
        )
    for path in functions:
        if "." not in path:
            raise ValueError(f"Invalid function path {path!r}")
        module_path, name = path.rsplit(".", 1)
        module = importlib.import_module(module_path)
        if not hasattr(module, name):
            raise AttributeError(
                f"[Context Parallel] Function {name!r} not found in module {module_path!r}."
            )
        setattr(module, name, wrap(getattr(module, name), group))


def _rebind_loss_mapping(original, wrapped) -> None:
    """A model reaches its loss through transformers' LOSS_MAPPING (`model.loss_function`), which
    holds the function object itself: replacing the module attribute alone would never reach a
    model, so the mapping's entries that hold the target are replaced too. How the newest layout
    reaches the model's loss is not published; that it must is what this stand-in assumes."""
    from transformers.loss import loss_utils

    for key, value in list(loss_utils.LOSS_MAPPING.items()):
        if value is original:
            loss_utils.LOSS_MAPPING[key] = wrapped


def _owner(dotted: str):
    """(module or class, attribute name) of a dotted function path."""
    path, _, name = dotted.rpartition(".")
    try:
        owner = importlib.import_module(path)
    except ImportError:
        module_path, _, class_name = path.rpartition(".")
        owner = getattr(importlib.import_module(module_path), class_name)
    if not callable(getattr(owner, name, None)):
        raise AttributeError(f"[Context Parallel] Function {name!r} not found in {path!r}.")
    return owner, name


def qwen3_5_model_forward(
    self,
    input_ids=None,
    attention_mask=None,
    position_ids=None,
    past_key_values=None,
    inputs_embeds=None,
    pixel_values=None,
    pixel_values_videos=None,
    **kwargs,
):
    """The module patch for `Qwen3_5Model.forward` (fsdp_turbo.models.qwen.qwen3_5): the whole
    sequence is embedded and given its 3-D positions, then each rank of the ulysses group keeps its
    contiguous chunk for the language model. Text only (pixel inputs are refused); a cached
    forward (generation) runs the class's own forward."""
    from fsdp_turbo.distributed.parallel_state import get_parallel_state

    group = get_parallel_state().get_ulysses_group()
    size = dist.get_world_size(group)
    cache = past_key_values if past_key_values is not None else kwargs.get("cache")
    if size == 1 or cache is not None:
        return type(self).forward(
            self, input_ids, attention_mask, position_ids, past_key_values, inputs_embeds,
            pixel_values, pixel_values_videos, **kwargs,
        )  # fmt: skip
    kwargs.pop("cache", None)  # None here; transformers 5.24 renamed past_key_values to cache
    if pixel_values is not None or pixel_values_videos is not None:
        raise NotImplementedError("stand-in fsdp_turbo: Ulysses over image or video inputs")
    if inputs_embeds is None:
        inputs_embeds = self.get_input_embeddings()(input_ids)
    if position_ids is None:  # keywords both releases take (5.24 renamed the cache argument)
        position_ids = self.compute_3d_position_ids(
            input_ids=input_ids, inputs_embeds=inputs_embeds, attention_mask=attention_mask
        )
    seq = inputs_embeds.shape[1]
    if position_ids is None:  # text only: transformers leaves them to the language model
        position_ids = torch.arange(seq, device=inputs_embeds.device)
        position_ids = position_ids.expand(inputs_embeds.shape[0], -1)
    if seq % size:
        raise ValueError(
            f"[Context Parallel] sequence length {seq} does not split over a ulysses group of {size}"
        )
    rank = dist.get_rank(group)
    chunk = slice(rank * seq // size, (rank + 1) * seq // size)
    if attention_mask is not None:
        attention_mask = attention_mask[:, chunk]
    kwargs["use_cache"] = False  # a sequence-sharded forward cannot fill a generation cache
    outputs = self.language_model(
        input_ids=None,
        position_ids=position_ids[..., chunk],
        attention_mask=attention_mask,
        inputs_embeds=inputs_embeds[:, chunk],
        **kwargs,
    )
    from transformers.models.qwen3_5 import modeling_qwen3_5 as modeling

    if hasattr(modeling, "Qwen3_5ModelOutputWithPast"):  # up to transformers 5.22
        return modeling.Qwen3_5ModelOutputWithPast(**outputs, rope_deltas=self.rope_deltas)
    if hasattr(modeling, "MultimodalBaseModelOutputWithPast"):  # from 5.24
        return modeling.MultimodalBaseModelOutputWithPast(**outputs)
    return outputs  # 5.23: the model returns its language model's output as it is
