"""The batch a rank trains on: its share of the prompts, rolled out and rewarded, GRPO advantages,
old and reference log-probabilities; or, for a twin, its share of the main run's saved batch. And
what the rollout handed the trainer, over the global batch."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from pytest_fsdp_turbo_contract.artifacts import RunFolder
from pytest_fsdp_turbo_contract.records import ReplayRecord, RolloutRecord
from pytest_fsdp_turbo_contract.spec import PPOSpec
from pytest_fsdp_turbo_contract.vocab import Capability
from pytest_fsdp_turbo_engine.core import ppo
from pytest_fsdp_turbo_engine.core.reductions import all_max, all_sum, gather_objects
from pytest_fsdp_turbo_engine.core.train_batch import TrainBatch
from pytest_fsdp_turbo_engine.rollout.hf_rollout import RolloutBatch
from pytest_fsdp_turbo_engine.rollout.reward import closeness_reward, load_prompts
from pytest_fsdp_turbo_engine.step.measurements import sp_boundaries_in_responses
from pytest_fsdp_turbo_engine.step.rank import Rank


def score_batch(batch: RolloutBatch, tokenizer, targets: list[str]) -> torch.Tensor:
    scores = []
    for row, prompt in zip(range(batch.input_ids.shape[0]), batch.prompt_index.tolist()):
        ids = batch.response_ids[row][batch.response_mask[row].bool()].tolist()
        text = tokenizer.decode(ids, skip_special_tokens=True)
        scores.append(closeness_reward(text.encode("utf-8", errors="replace"), targets[prompt]))
    return torch.tensor(scores, dtype=torch.float32)


@dataclass
class Collected:
    batch: TrainBatch
    scores: torch.Tensor | None  # None when replayed
    rows: list[int]  # the global batch's rows this rank holds, as the harness handed them out


def collect(ctx: Rank) -> Collected:
    """rollout -> reward -> GRPO advantages -> old and reference logprobs, for this rank's prompts
    (its data rank's share in the layout the case declares, never the rank the engine reports)."""
    cfg, engine = ctx.cfg, ctx.engine
    ctx.phase.enter("rollout")
    prompts = load_prompts(cfg.prompts)[: cfg.num_prompts]
    local = prompts[ctx.dp_rank :: ctx.dp_size]
    indices = range(len(prompts))[ctx.dp_rank :: ctx.dp_size]
    rows = [prompt * cfg.n + response for prompt in indices for response in range(cfg.n)]
    prompt_ids = torch.tensor(
        [ctx.tokenizer(p.text, add_special_tokens=False).input_ids for p in local]
    )
    torch.manual_seed(cfg.seed + 1000 * ctx.dp_rank)
    with ctx.unsharded():
        rolled = ctx.rollout.generate(prompt_ids.to(ctx.device), cfg.n, cfg.max_new_tokens)

    ctx.phase.enter("reward")
    scores = score_batch(rolled, ctx.tokenizer, [p.target for p in local]).to(ctx.device)
    advantages = ppo.grpo_advantages(scores, cfg.n)[:, None] * rolled.response_mask

    ctx.phase.enter("logprobs")
    with torch.no_grad():
        old, _ = engine.forward_logprobs(rolled.input_ids, rolled.prompt_len)
        ref, _ = engine.forward_logprobs(
            rolled.input_ids, rolled.prompt_len, module=ctx.reference_module
        )
        ref = ref - cfg.kl_reference_shift * reference_shift(cfg, rows, ref.shape[1]).to(ref)
    batch = TrainBatch(
        rolled.input_ids, rolled.prompt_len, rolled.response_mask, advantages, old, ref
    )
    return Collected(batch, scores, rows)


def reference_shift(cfg: PPOSpec, rows: list[int], width: int) -> torch.Tensor:
    """|N(0, 1)| per response token of the global batch's `rows`, from the case's seed alone: the
    same tokens get the same shift whatever the layout, so every rank, reference and twin sees
    one KL reference."""
    generator = torch.Generator().manual_seed(cfg.seed + 4242)
    whole = torch.randn(cfg.num_prompts * cfg.n, width, generator=generator).abs()
    return whole[rows]


def replayed(ctx: Rank) -> Collected:
    """This rank's share of the main run's global batch (data ranks of the declared layout hold
    equal, contiguous blocks)."""
    ctx.phase.enter("replay")
    whole = TrainBatch.load(RunFolder(Path(ctx.cfg.replay)).batch)
    block = whole.size // ctx.dp_size
    rows = torch.arange(ctx.dp_rank * block, (ctx.dp_rank + 1) * block)
    return Collected(whole.rows(rows).to(ctx.device), None, rows.tolist())


def replay_record(ctx: Rank, collected: Collected) -> ReplayRecord:
    """The twin's own forward of its rows against the old log-probs the run's ranks recorded for
    them, before it trains: the worst token and the row it is in."""
    batch = collected.batch
    with torch.no_grad():
        mine, _ = ctx.engine.forward_logprobs(batch.input_ids, batch.prompt_len)
    per_row = ((mine.float() - batch.old_logprobs.float()).abs() * batch.mask).amax(dim=1)
    local = int(per_row.argmax())
    worst = (float(per_row[local]), collected.rows[local])
    diff, row = max(gather_objects(worst, ctx.layout.data_group))
    return ReplayRecord(old_logprob_max_abs_diff=diff, old_logprob_worst_row=row)


def rollout_record(ctx: Rank, collected: Collected, tokens: float) -> RolloutRecord:
    """What the rollout handed the trainer, over the global batch (SP ranks counted once)."""
    device, sp, batch = ctx.device, ctx.sp, collected.batch
    responses = all_sum(float(batch.size), device) / sp
    score_mean = None
    if collected.scores is not None:
        score_mean = all_sum(float(collected.scores.sum()), device) / sp / responses
    gap = ppo.token_sum(batch.old_logprobs - batch.ref_logprobs, batch.mask)
    boundaries = None
    if sp > 1:
        packed = ctx.engine_cfg.packed or Capability.ALWAYS_PACKS in ctx.engine_cfg.capabilities
        hits = sp_boundaries_in_responses(batch, sp, ctx.cfg.micro_batches, packed)
        boundaries = round(all_sum(float(hits), device) / sp)
    return RolloutRecord(
        response_length_mean=tokens / responses,
        advantages_abs_max=all_max(float(batch.advantages.abs().max()), device),
        score_mean=score_mean,
        kl_reference_gap_mean=all_sum(float(gap), device) / sp / tokens,
        sp_boundaries_in_responses=boundaries,
    )
