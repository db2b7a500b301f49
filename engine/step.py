"""One PPO step inside one rank: rollout -> reward -> advantages -> logprobs -> micro-batches under
the case's gradient-sync policy -> optimizer step -> in-rank checks -> metrics."""

from __future__ import annotations

import math
import os
import resource
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from pytest_fsdp_turbo_engine import ppo
from pytest_fsdp_turbo_engine.config import EngineConfig, PPOConfig
from pytest_fsdp_turbo_engine.faults import Fault
from pytest_fsdp_turbo_engine.fsdp_engine import local_tensor
from pytest_fsdp_turbo_engine.reward import closeness_reward, load_prompts
from pytest_fsdp_turbo_engine.rollout import HFRollout, RolloutBatch

FINGERPRINT_VALUES = 16


@dataclass
class Phase:
    """Where the rank is, so a failure report can say so."""

    rank: int
    fault: Fault | None = None
    name: str = "init"

    def enter(self, name: str) -> None:
        self.name = name
        print(f"[rank {self.rank}] phase {name}", flush=True)
        if self.fault:
            self.fault.at_phase(self.rank, name)


def device_for(kind: str, local_rank: int) -> torch.device:
    if kind == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    if kind == "npu":
        import torch_npu  # noqa: F401  registers the npu device

        torch.npu.set_device(local_rank)
        return torch.device("npu", local_rank)
    return torch.device("cpu")


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    if device.type == "npu":
        return int(torch.npu.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _all_sum(value: float, device: torch.device, group=None) -> float:
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, group=group)
    return float(tensor.item())


def _all_max(value: float, device: torch.device) -> float:
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


def _count_reduce_scatters(profile) -> int:
    return sum(
        1 for e in profile.events() if e.name.startswith("c10d::") and "reduce_scatter" in e.name
    )


def score_batch(batch: RolloutBatch, tokenizer, targets: list[str]) -> torch.Tensor:
    scores = []
    for row, prompt in zip(range(batch.input_ids.shape[0]), batch.prompt_index.tolist()):
        ids = batch.response_ids[row][batch.response_mask[row].bool()].tolist()
        text = tokenizer.decode(ids, skip_special_tokens=True)
        scores.append(closeness_reward(text.encode("utf-8", errors="replace"), targets[prompt]))
    return torch.tensor(scores, dtype=torch.float32)


@dataclass
class TrainBatch:
    input_ids: torch.Tensor
    prompt_len: int
    mask: torch.Tensor
    advantages: torch.Tensor
    old_logprobs: torch.Tensor
    ref_logprobs: torch.Tensor

    def rows(self, index: torch.Tensor) -> TrainBatch:
        return TrainBatch(
            self.input_ids[index],
            self.prompt_len,
            self.mask[index],
            self.advantages[index],
            self.old_logprobs[index],
            self.ref_logprobs[index],
        )


def ppo_loss(
    logprobs: torch.Tensor,
    entropy: torch.Tensor | None,
    mb: TrainBatch,
    tokens: float,
    cfg: PPOConfig,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    pg_loss, clipfrac, ppo_kl = ppo.policy_loss(
        logprobs, mb.old_logprobs, mb.advantages, mb.mask, tokens, cfg.clip_ratio, cfg.clip_ratio_c
    )
    kl_loss = ppo.token_sum(ppo.low_var_kl(logprobs, mb.ref_logprobs), mb.mask) / tokens
    loss = pg_loss + cfg.kl_coef * kl_loss
    parts = {
        "actor/pg_loss": pg_loss,
        "actor/pg_clipfrac": clipfrac,
        "actor/ppo_kl": ppo_kl,
        "actor/kl_loss": kl_loss,
    }
    if entropy is not None:
        ent = ppo.token_sum(entropy, mb.mask) / tokens
        loss = loss - cfg.entropy_coef * ent
        parts["actor/entropy"] = ent
    return loss, {k: v.detach() for k, v in parts.items()}


def _gather_rows(batch: TrainBatch) -> TrainBatch:
    """The global batch on every rank, for the single-process reference."""
    local = [
        t.detach().cpu()
        for t in (
            batch.input_ids,
            batch.mask,
            batch.advantages,
            batch.old_logprobs,
            batch.ref_logprobs,
        )
    ]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    cat = [torch.cat([g[i] for g in gathered]) for i in range(5)]
    return TrainBatch(cat[0], batch.prompt_len, cat[1], cat[2], cat[3], cat[4])


def reference_gradients(model: torch.nn.Module, batch: TrainBatch, tokens: float, cfg: PPOConfig):
    """Gradients of the same loss over the whole global batch in one process, no sharding."""
    model.zero_grad(set_to_none=True)
    device = next(model.parameters()).device
    logits = (
        model(input_ids=batch.input_ids.to(device)).logits[:, batch.prompt_len - 1 : -1].float()
    )
    logprobs = ppo.response_logprobs(logits, batch.input_ids[:, batch.prompt_len :].to(device))
    on_device = TrainBatch(
        batch.input_ids,
        batch.prompt_len,
        batch.mask.to(device),
        batch.advantages.to(device),
        batch.old_logprobs.to(device),
        batch.ref_logprobs.to(device),
    )
    loss, _ = ppo_loss(logprobs, ppo.entropy_from_logits(logits), on_device, tokens, cfg)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def compare_gradients(sharded: dict, reference: dict) -> tuple[float, str]:
    """Largest per-parameter error, relative to that parameter's largest reference gradient."""
    worst, worst_name = 0.0, ""
    for name, ref in reference.items():
        got = sharded.get(name)
        if got is None:
            return math.inf, f"{name} (no gradient after sync)"
        scale = max(float(ref.abs().max()), 1e-12)
        err = float((got.float().cpu() - ref.float().cpu()).abs().max()) / scale
        if not math.isfinite(err) or err > worst:
            worst, worst_name = err, name
            if not math.isfinite(err):
                break
    return worst, worst_name


def fingerprint(grads: dict[str, torch.Tensor]) -> dict[str, dict]:
    return {
        name: {
            "norm": float(g.float().norm()),
            "head": [float(v) for v in g.flatten()[:FINGERPRINT_VALUES]],
        }
        for name, g in grads.items()
    }


def make_rollout(cfg: PPOConfig, engine_cfg: EngineConfig, model_path: str, device, tokenizer):
    if cfg.rollout == "vllm":
        from pytest_fsdp_turbo_engine.vllm_rollout import VLLMRollout

        return VLLMRollout(
            model_path, tokenizer.eos_token_id, tokenizer.pad_token_id, engine_cfg.dtype, cfg.seed
        )
    return HFRollout(model_path, device, tokenizer.eos_token_id, tokenizer.pad_token_id)


def _single_process_copy(rollout, spec: dict, device: torch.device) -> torch.nn.Module:
    """The initial policy, unsharded: the HF rollout already holds one; otherwise load it."""
    if isinstance(rollout, HFRollout):
        return rollout.model
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(spec["model_path"], dtype=torch.float32).to(device)


def run_ppo_step(
    spec: dict, rank: int, phase: Phase, metrics: dict[str, Any]
) -> tuple[dict[str, Any], dict | None]:
    """Fills `metrics` as it goes, so a failure late in the step still leaves what was measured."""
    from pytest_fsdp_turbo_engine.registry import load_engine_plugins, lookup
    from transformers import AutoTokenizer

    engine_cfg = EngineConfig(**spec["engine"])
    cfg = PPOConfig(**spec["ppo"])
    kind = spec["device_kind"]
    device = device_for(kind, int(os.environ.get("LOCAL_RANK", rank)))
    torch.manual_seed(cfg.seed)

    phase.enter("load")
    load_engine_plugins(spec.get("engine_modules", ()))
    engine_cls = lookup(spec["model_type"], engine_cfg.backend, kind)
    engine = engine_cls(engine_cfg, device)
    tokenizer = AutoTokenizer.from_pretrained(spec["model_path"])
    engine.build(spec["model_path"])
    reference = engine.build(spec["model_path"], trainable=False)
    rollout = make_rollout(cfg, engine_cfg, spec["model_path"], device, tokenizer)
    dp_rank, dp_size = engine.data_parallel_rank(), engine.data_parallel_size()
    sp = max(1, engine_cfg.sp_size)

    step_start = time.perf_counter()
    phase.enter("rollout")
    prompts = load_prompts(cfg.prompts)[: cfg.num_prompts]
    local = prompts[dp_rank::dp_size]
    prompt_ids = torch.tensor(
        [tokenizer(p.text, add_special_tokens=False).input_ids for p in local]
    )
    torch.manual_seed(cfg.seed + 1000 * dp_rank)
    batch = rollout.generate(prompt_ids.to(device), cfg.n, cfg.max_new_tokens)

    phase.enter("reward")
    scores = score_batch(batch, tokenizer, [p.target for p in local]).to(device)
    advantages = ppo.grpo_advantages(scores, cfg.n)[:, None] * batch.response_mask

    phase.enter("logprobs")
    with torch.no_grad():
        old_logprobs, _ = engine.forward_logprobs(batch.input_ids, batch.prompt_len)
        ref_logprobs, _ = engine.forward_logprobs(
            batch.input_ids, batch.prompt_len, module=reference
        )
    train = TrainBatch(
        batch.input_ids,
        batch.prompt_len,
        batch.response_mask,
        advantages,
        old_logprobs,
        ref_logprobs,
    )
    # Ranks of one sequence-parallel group share their batch: count it once per data-parallel rank.
    tokens = _all_sum(float(batch.response_mask.sum()), device, engine.data_parallel_group())

    phase.enter("train")
    totals: dict[str, float] = {}
    chunks = torch.arange(batch.input_ids.shape[0]).chunk(cfg.micro_batches)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for i, rows in enumerate(chunks):
            mb = train.rows(rows)
            with engine._gradient_sync_context(is_last_micro_batch=i == len(chunks) - 1):
                logprobs, entropy = engine.forward_logprobs(
                    mb.input_ids, mb.prompt_len, with_entropy=True
                )
                loss, parts = ppo_loss(logprobs, entropy, mb, tokens, cfg)
                (loss * dp_size).backward()  # FSDP averages over ranks; the loss is a global sum
            for key, value in parts.items():
                totals[key] = totals.get(key, 0.0) + float(value)
            if i == 0:
                totals["actor/ppo_kl_first_micro_batch"] = float(parts["actor/ppo_kl"])
                totals["actor/pg_clipfrac_first_micro_batch"] = float(parts["actor/pg_clipfrac"])
    if phase.fault and phase.fault.kind == "nan" and phase.fault.rank == rank:
        first = next(p for p in engine.module.parameters() if p.grad is not None)
        local_tensor(first.grad).view(-1)[0] = float("nan")

    grads_report = None
    if cfg.reference_checks:
        phase.enter("reference")
        sharded = engine.full_gradients()
        global_batch = _gather_rows(train)
        ref_grads = reference_gradients(
            _single_process_copy(rollout, spec, device), global_batch, tokens, cfg
        )
        err, name = compare_gradients(sharded, ref_grads)
        metrics["sync/grad_max_rel_err"] = err
        metrics["sync/grad_max_rel_err_param"] = name
        if rank == 0:
            grads_report = fingerprint(sharded)
        before = {n: local_tensor(p.detach()).clone() for n, p in engine.module.named_parameters()}

    phase.enter("optimizer")
    grad_norm = engine.optimizer_step()
    metrics["actor/grad_norm"] = grad_norm
    step_time = time.perf_counter() - step_start

    phase.enter("checks")
    if cfg.reference_checks:
        moved = max(
            float((local_tensor(p.detach()) - before[n]).abs().max())
            for n, p in engine.module.named_parameters()
        )
        metrics["actor/param_update_max_abs"] = _all_max(moved, device)
    metrics["sync/replica_max_abs_diff"] = replica_max_abs_diff(engine, device)
    rollout.load_weights(engine.full_state_dict())
    with torch.no_grad():
        trainer_lp, _ = engine.forward_logprobs(batch.input_ids, batch.prompt_len)
    rollout_lp = rollout.logprobs(batch.input_ids, batch.prompt_len)
    diff = float(((trainer_lp - rollout_lp).abs() * batch.response_mask).max())
    metrics["sync/rollout_logprob_max_abs_diff"] = _all_max(diff, device)

    for key in (
        "actor/pg_loss",
        "actor/pg_clipfrac",
        "actor/ppo_kl",
        "actor/kl_loss",
        "actor/entropy",
    ):
        metrics[key] = _all_sum(totals[key], device) / sp
    for key in ("actor/ppo_kl_first_micro_batch", "actor/pg_clipfrac_first_micro_batch"):
        metrics[key] = _all_max(abs(totals[key]), device)
    responses = _all_sum(float(scores.numel()), device) / sp
    global_tokens = _all_sum(float(batch.input_ids.numel()), device) / sp
    metrics.update(
        {
            "actor/grad_norm": grad_norm,
            "actor/grad_norm_finite": math.isfinite(grad_norm),
            "critic/score/mean": _all_sum(float(scores.sum()), device) / sp / responses,
            "response_length/mean": tokens / responses,
            "perf/step_time_s": step_time,
            "perf/tokens_per_s": global_tokens / step_time,
            "perf/peak_memory_bytes": peak_memory_bytes(device),
            "sync/retained_grad_bytes": engine.retained_grad_bytes_peak,
            "comm/reduce_scatter_calls": _count_reduce_scatters(prof),
            "case/sync_policy": engine_cfg.sync_policy,
            "case/world_size": engine_cfg.world_size,
            "case/dtype": engine_cfg.dtype,
            "case/device": kind,
            "rank": rank,
        }
    )
    return metrics, grads_report


def replica_max_abs_diff(engine, device: torch.device) -> float:
    """Spread of each local shard across the ranks that should hold the same values (HSDP)."""
    group = engine.replicate_group()
    if group is None:
        return 0.0
    worst = torch.zeros((), dtype=torch.float32, device=device)
    for param in engine.module.parameters():
        shard = local_tensor(param.detach()).float()
        hi, lo = shard.clone(), shard.clone()
        dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
        dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
        worst = torch.maximum(worst, (hi - lo).abs().max() if hi.numel() else worst)
    return _all_max(float(worst), device)
