"""FSDPTurboEngineWithLMHead: the FSDP engine with parallel state, wrapping and clipping delegated to
the Ascend `fsdp_turbo` library. Imported only when a case selects backend "fsdp_turbo".

Written against the library's published API (shared/FACTS-fsdp_turbo.md): every call into it is in
this file. The turbo_config arrives complete from the harness (pytest_fsdp_turbo_contract.turbo_config, for
the layout the checkout declares); here it is checked once more against the dataclasses of the
library actually imported, so config drift fails before the library silently drops a key.
"""

from __future__ import annotations

import copy
import os
from types import SimpleNamespace

import torch
import torch.distributed as dist

from pytest_fsdp_turbo_contract.turbo_config import (
    attention_implementation,
    entry_problems,
    schema_problems,
)
from pytest_fsdp_turbo_engine.engines.fsdp2 import FSDPEngineWithLMHead
from pytest_fsdp_turbo_engine.engines.registry import register
from pytest_fsdp_turbo_engine.engines.turbo_inspect import schema_of
from pytest_fsdp_turbo_engine.engines.ulysses_lift import library_patches_lifted

# The older layout has no data-parallel getters; its cdp mesh is the same group of ranks.
DATA_GETTERS = {
    "rank": ("get_data_rank", "get_cdp_rank"),
    "size": ("get_data_group_size", "get_cdp_group_size"),
    "group": ("get_data_group", "get_cdp_group"),
}


class FSDPTurboAPIChanged(RuntimeError):
    pass


def import_fsdp_turbo(checkout: str = "") -> SimpleNamespace:
    """The library entry points this engine uses; a failed import names where we looked
    (`checkout`: the FSDPTurbo checkout the spec names)."""
    try:
        from fsdp_turbo.distributed import parallel_state
        from fsdp_turbo.fsdp_turbo import FSDPTurbo
        from fsdp_turbo.fsdp_turbo_config import FSDPTurboConfig, _dict_to_dataclass
        from fsdp_turbo.training.clip_grads import clip_grad_norm
    except ImportError as exc:
        checkout = checkout or "(no FSDPTurbo checkout resolved)"
        raise ImportError(
            f"backend fsdp_turbo needs the fsdp_turbo library: {exc}; tried checkout {checkout} "
            f"and PYTHONPATH={os.environ.get('PYTHONPATH', '')!r}"
        ) from exc
    return SimpleNamespace(
        FSDPTurbo=FSDPTurbo,
        FSDPTurboConfig=FSDPTurboConfig,
        dict_to_dataclass=_dict_to_dataclass,
        parallel_state=parallel_state,
        clip_grad_norm=clip_grad_norm,
    )


def reset_parallel_state(parallel_state) -> None:
    """ParallelState is a process-wide singleton: a second init with another config would silently
    return the first. Drop the instance so this engine's config is the one that counts."""
    cls = parallel_state.ParallelState
    store = getattr(type(cls), "_instances", None)
    if not isinstance(store, dict):
        raise FSDPTurboAPIChanged(
            "fsdp_turbo's ParallelState is no longer a metaclass singleton with an _instances "
            "store; update pytest_fsdp_turbo_engine.engines.turbo.reset_parallel_state"
        )
    store.pop(cls, None)


class GatherSequence(torch.autograd.Function):
    """Each rank's chunk of the sequence, gathered in group-rank order. Every rank of the group then
    computes the same loss on the whole sequence, so backward sums the group's gradients and keeps
    this rank's chunk (with FSDP averaging over all ranks, the step is the unsharded one)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(pieces, local.contiguous(), group=group)
        return torch.cat(pieces, dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(size, dim=1)[rank], None


@register(backend="fsdp_turbo", device=["cpu", "cuda", "npu"])
class FSDPTurboEngineWithLMHead(FSDPEngineWithLMHead):
    sequence_gather = GatherSequence  # how this rank's logits chunk joins the others (Ulysses)

    def _build_mesh(self):
        self.turbo = import_fsdp_turbo(self.config.turbo_checkout)
        world = dist.get_world_size()
        if os.environ.get("WORLD_SIZE") != str(world):
            raise RuntimeError(
                f"WORLD_SIZE={os.environ.get('WORLD_SIZE')!r} but the process group has {world} "
                "ranks; fsdp_turbo derives its gradient divide factor from WORLD_SIZE"
            )
        turbo_config = self.config.turbo_config
        problems = schema_problems(schema_of(self.turbo.FSDPTurboConfig), turbo_config)
        problems += entry_problems(turbo_config)
        if problems:
            raise ValueError(
                "turbo_config does not fit the installed fsdp_turbo: " + "; ".join(problems)
            )
        reset_parallel_state(self.turbo.parallel_state)
        self.turbo_config = self.turbo.dict_to_dataclass(
            self.turbo.FSDPTurboConfig, copy.deepcopy(self.config.turbo_config)
        )
        self.parallel_state = self.turbo.parallel_state.init_parallel_state(self.turbo_config)
        return None

    def load_options(self) -> dict:
        """Eager attention when the Ulysses patch targets it (as verl does when the library's
        Ulysses group is on); otherwise the model's default."""
        attention = attention_implementation(self.config.turbo_config)
        return {"attn_implementation": attention} if attention else {}

    def _data(self, what: str):
        for name in DATA_GETTERS[what]:
            getter = getattr(self.parallel_state, name, None)
            if getter is not None:
                return getter()
        raise FSDPTurboAPIChanged(f"fsdp_turbo's ParallelState has none of {DATA_GETTERS[what]}")

    def data_parallel_rank(self) -> int:
        return self._data("rank")

    def data_parallel_size(self) -> int:
        return self._data("size")

    def data_parallel_group(self) -> dist.ProcessGroup:
        return self._data("group")

    def replicate_group(self) -> dist.ProcessGroup | None:
        """HSDP layouts (fsdp < world / tp): the replicas are the library's dp mesh."""
        if self.parallel_state.is_group_enable("dp"):
            return self.parallel_state.get_group("dp")
        return None

    def _wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return self.turbo.FSDPTurbo(self.turbo_config, model).model

    # --- Ulysses sequence parallelism (the library's; this engine only gathers its output) -------
    def _ulysses_group(self) -> dist.ProcessGroup | None:
        if self.parallel_state.is_group_enable("ulysses"):
            group = self.parallel_state.get_group("ulysses")
            return group if dist.get_world_size(group) > 1 else None
        return None

    def build(self, model_path: str, *, trainable: bool = True) -> torch.nn.Module:
        """Under Ulysses the frozen KL reference stays unwrapped: a second FSDPTurbo would wrap the
        library's already-wrapped functions again (it replaces them in place), and every model in
        the process would then exchange its sequence twice."""
        if trainable or self._ulysses_group() is None:
            return super().build(model_path, trainable=trainable)
        from pytest_fsdp_turbo_engine.core.hf_model import load_pretrained

        model = load_pretrained(model_path, dtype=torch.float32, **self.load_options())
        model.to(self.device).requires_grad_(False)
        return model.eval()

    def _logits(self, model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        group = self._ulysses_group()
        if group is None:
            return super()._logits(model, input_ids)
        if model is not self.module:  # the unwrapped KL reference: the whole sequence, unpatched
            with library_patches_lifted(self.config.turbo_config):
                return super()._logits(model, input_ids)
        return self._sharded_forward(model, input_ids, group)[0]

    def _logits_and_loss(self, model, input_ids: torch.Tensor, labels: torch.Tensor):
        """Under Ulysses the labels cover the whole sequence, as callers of the library pass them;
        the library's causal_lm_loss patch takes this rank's chunk of them and reduces over the
        group, so every rank of the group gets the whole sequence's loss."""
        group = self._ulysses_group()
        if group is None:
            return super()._logits_and_loss(model, input_ids, labels)
        return self._sharded_forward(model, input_ids, group, labels)

    def _sharded_forward(self, model, input_ids: torch.Tensor, group, labels=None):
        """(logits over the whole sequence, the model's loss or None) from this rank's chunk."""
        if self.config.packed:
            return self._packed_logits(model, input_ids, group, labels)
        size, length = dist.get_world_size(group), input_ids.shape[1]
        padded = torch.nn.functional.pad(input_ids, (0, -length % size))  # after it: causal
        extra = {}
        if labels is not None:
            extra["labels"] = torch.nn.functional.pad(labels, (0, -length % size), value=-100)
        out = model(input_ids=padded, use_cache=False, **extra)  # this rank's chunk of the sequence
        return self.sequence_gather.apply(out.logits, group)[:, :length], out.loss

    def _packed_logits(self, model, input_ids: torch.Tensor, group, labels=None):
        """The rows as verl feeds the library: one packed row, `position_ids` restarting at each
        row (4 rows of them for a multimodal-RoPE model: text, then temporal, height, width, all
        the text positions for a text batch), and `cu_seqlens`, the rows' bounds. Each padded row
        is one sequence (verl also drops the padding; here it stays, after each row's response,
        where causal attention keeps it from the tokens that count). The packed row is padded at
        its end to split over the group; the pad extends the last sequence."""
        rows, length = input_ids.shape
        total = rows * length
        padded_total = total + (-total % dist.get_world_size(group))
        packed = torch.nn.functional.pad(input_ids.reshape(1, total), (0, padded_total - total))
        positions = torch.arange(length, device=input_ids.device).repeat(rows)
        tail = torch.arange(padded_total - total, device=input_ids.device) + length
        positions = torch.cat([positions, tail])[None]
        if getattr(model.config, "model_type", "") == "qwen3_5":
            positions = positions.expand(4, 1, padded_total)
        bounds = [*range(0, total, length), padded_total]
        cu_seqlens = torch.tensor(bounds, dtype=torch.int32, device=input_ids.device)
        extra = {}
        if labels is not None:  # packed alike; each row's first label is a prompt token's -100
            pad = (0, padded_total - total)
            extra["labels"] = torch.nn.functional.pad(labels.reshape(1, total), pad, value=-100)
        out = model(
            input_ids=packed,
            position_ids=positions,
            cu_seqlens=cu_seqlens,
            use_cache=False,
            **extra,
        )
        whole = self.sequence_gather.apply(out.logits, group)[:, :total]
        return whole.reshape(rows, length, -1), out.loss

    def _clip_grad_norm(self) -> float:
        return float(self.turbo.clip_grad_norm(model=self.module, max_norm=self.config.grad_clip))
