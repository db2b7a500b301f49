"""One PPO step inside one rank, split at its natural seams. Each phase is a function that takes
what it needs and returns the typed record of what it measured (pytest_fsdp_turbo_contract/
records.py); the measuring itself is in measurements.py. `run_ppo_step` keeps the records as they
come, so a failure keeps every record filled before it.

rollout -> reward -> advantages -> logprobs -> micro-batches under the case's gradient-sync policy
-> (reference gradients) -> optimizer step -> (reference step) -> post-step checks -> metrics.

A twin run (`ppo.replay` set) skips rollout and reward and trains on the batch the main run saved.
Every measurement a check depends on is taken here, never inside an engine method.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pytest_fsdp_turbo_contract.artifacts import RunFolder
from pytest_fsdp_turbo_contract.records import (
    PARTIAL_METRICS_ATTR,
    STARTUP,
    CaseRecord,
    LossRecord,
    OptimizerRecord,
    PerfRecord,
    PostStepRecord,
    ReferenceRecord,
    ReplayRecord,
    RolloutRecord,
    StepMetrics,
    TrainRecord,
)
from pytest_fsdp_turbo_contract.spec import EngineSpec, PPOSpec, RankSpec
from pytest_fsdp_turbo_contract.vocab import (
    Capability,
    DeviceKind,
    Dtype,
    Env,
    Rollout,
)
from pytest_fsdp_turbo_engine import fsdp_probe, ppo, weight_handoff
from pytest_fsdp_turbo_engine.faults import Fault
from pytest_fsdp_turbo_engine.fsdp_engine import local_tensor
from pytest_fsdp_turbo_engine.measurements import (
    AdamMoments,
    MicroBatchProbe,
    adamw_closed_form,
    clip_error,
    peak_memory_bytes,
    replica_max_abs_diff,
    sp_boundaries_in_responses,
    stepped_gradients,
)
from pytest_fsdp_turbo_engine.reductions import all_max, all_sum, gather_objects, gather_rows
from pytest_fsdp_turbo_engine.reference import (
    ReferenceOptimizer,
    clip_coefficient,
    fingerprint,
    gradient_norm,
    max_abs_error,
    name_mismatch,
    reference_gradients,
    relative_l2_error,
)
from pytest_fsdp_turbo_engine.reward import closeness_reward, load_prompts
from pytest_fsdp_turbo_engine.rollout import HFRollout, RolloutBatch
from pytest_fsdp_turbo_engine.train_batch import TrainBatch, ppo_loss
from pytest_fsdp_turbo_engine.ulysses_lift import library_patches_lifted

# LossRecord fields summed over micro-batches and ranks (each a token mean over the global batch)
SUMMED_PARTS = ("loss", "pg_loss", "pg_clipfrac", "ppo_kl", "kl_loss", "entropy")


@dataclass
class Phase:
    """Where the rank is, so a failure report can say so, and when it got there."""

    rank: int
    fault: Fault | None = None
    name: str = "init"
    started: dict[str, float] = field(default_factory=dict)  # phase -> wall clock
    report: Path | None = None  # rankN.phases.jsonl: the launcher follows it while the case runs

    def enter(self, name: str) -> None:
        self.name = name
        self.started[name] = time.time()
        print(f"[rank {self.rank}] phase {name}", flush=True)
        if self.report is not None:
            with open(self.report, "a") as report:
                report.write(json.dumps({"phase": name, "t": self.started[name]}) + "\n")
        if self.fault:
            self.fault.at_phase(self.rank, name)

    def timings(self, launched_at: float | None) -> dict[str, float]:
        """Seconds in every phase entered so far; `startup` is the time from launch (interpreter,
        imports, process group) to loading the model."""
        names = list(self.started)
        ends = [self.started[n] for n in names[1:]] + [time.time()]
        out = {name: end - self.started[name] for name, end in zip(names, ends) if name != "init"}
        if launched_at is not None and "load" in self.started:
            out[STARTUP] = self.started["load"] - launched_at
        return out


def device_for(kind: str, local_rank: int) -> torch.device:
    if kind == DeviceKind.CUDA:
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    if kind == DeviceKind.NPU:
        import torch_npu  # noqa: F401  registers the npu device

        torch.npu.set_device(local_rank)  # type: ignore[attr-defined]  # torch_npu adds it
        return torch.device("npu", local_rank)
    return torch.device("cpu")


@dataclass(frozen=True)
class Rank:
    """What every phase of one rank shares, built once by `load`: its spec, device, engine, rollout
    and data-parallel place."""

    spec: RankSpec
    rank: int
    phase: Phase
    out: Path
    device: torch.device
    engine: Any  # a pytest_fsdp_turbo_engine/protocol.py Engine, built
    tokenizer: Any
    reference_module: torch.nn.Module | None  # frozen initial policy, for ref logprobs (not a twin)
    rollout: Any  # None for a twin, which replays the main run's batch
    dp_rank: int
    dp_size: int

    @property
    def engine_cfg(self) -> EngineSpec:
        return self.spec.engine

    @property
    def cfg(self) -> PPOSpec:
        return self.spec.ppo

    @property
    def sp(self) -> int:
        return max(1, self.spec.engine.sp_size)

    @property
    def replaying(self) -> bool:
        return bool(self.cfg.replay)

    def faulty(self, kind: str) -> bool:
        fault = self.phase.fault
        return fault is not None and fault.kind == kind and fault.rank == self.rank

    def unsharded(self):
        """Around the harness's own whole-sequence models (rollout, single-process reference): the
        FSDP-Turbo library's Ulysses patches lifted (pytest_fsdp_turbo_engine/ulysses_lift.py); a no-op without SP."""
        return library_patches_lifted(self.engine_cfg.turbo_config)


# --- phases ---------------------------------------------------------------------------------------


def load(spec: RankSpec, rank: int, phase: Phase, out: Path) -> Rank:
    from transformers import AutoTokenizer

    from pytest_fsdp_turbo_contract.engines import EngineCatalog
    from pytest_fsdp_turbo_engine.protocol import require_protocol
    from pytest_fsdp_turbo_engine.registry import VERL_PREFIX, RegistryError, load_engines, lookup

    engine_cfg, cfg, kind = spec.engine, spec.ppo, spec.device_kind
    device = device_for(kind, int(os.environ.get("LOCAL_RANK", rank)))
    torch.manual_seed(cfg.seed)

    phase.enter("load")
    if engine_cfg.backend.startswith(VERL_PREFIX):
        from pytest_fsdp_turbo_engine.verl_cpu_platform import prepare

        prepare(kind)  # before any engine module imports verl
    load_engines(EngineCatalog.from_ranks(spec.engine_modules), engine_cfg.backend)
    engine_class = require_protocol(
        lookup(spec.model_type, engine_cfg.backend, kind), engine_cfg.backend
    )
    declared = engine_cfg.capabilities
    drives = bool(getattr(engine_class, "drives_micro_batches", False))
    if declared and (Capability.OWN_LOOP in declared) != drives:
        raise RegistryError(
            f"backend {engine_cfg.backend}: its catalog entry declares "
            f"[{', '.join(declared)}], but {engine_class.__qualname__}.drives_micro_batches is "
            f"{drives}: declare own_loop exactly when the engine runs its own micro-batch loop"
        )
    engine = engine_class(engine_cfg, device)
    tokenizer = AutoTokenizer.from_pretrained(spec.model_path)
    engine.build(spec.model_path)
    reference_module = rollout = None
    if not cfg.replay:
        reference_module = engine.build(spec.model_path, trainable=False)
        rollout = make_rollout(cfg, engine_cfg, spec.model_path, device, tokenizer)
    return Rank(
        spec,
        rank,
        phase,
        out,
        device,
        engine,
        tokenizer,
        reference_module,
        rollout,
        engine.data_parallel_rank(),
        engine.data_parallel_size(),
    )


def make_rollout(cfg: PPOSpec, engine_cfg: EngineSpec, model_path: str, device, tokenizer):
    if cfg.rollout == Rollout.VLLM:
        from pytest_fsdp_turbo_engine.vllm_rollout import VLLMRollout

        eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
        return VLLMRollout(
            model_path, eos, pad, engine_cfg.dtype, cfg.seed, memory_share=cfg.vllm_memory_share
        )
    return HFRollout(model_path, device, tokenizer.eos_token_id, tokenizer.pad_token_id)


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
    """rollout -> reward -> GRPO advantages -> old and reference logprobs, for this rank's prompts."""
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
    """This rank's share of the main run's global batch (ranks hold equal, contiguous blocks)."""
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
    diff, row = max(gather_objects(worst, ctx.engine.data_parallel_group()))
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


def harness_micro_batches(ctx: Rank, batch: TrainBatch, tokens: float, probe: MicroBatchProbe):
    """The micro-batch loop for engines that leave it to the harness (ours and subclasses)."""
    engine = ctx.engine
    chunks = torch.arange(batch.size).chunk(ctx.cfg.micro_batches)
    for i, rows in enumerate(chunks):
        mb = batch.rows(rows)
        with engine.gradient_sync_context(is_last_micro_batch=i == len(chunks) - 1):
            lm_mean = None
            if ctx.cfg.lm_loss_coef and hasattr(engine, "forward_logprobs_with_lm_loss"):
                logprobs, entropy, lm_mean = engine.forward_logprobs_with_lm_loss(
                    mb.input_ids, mb.prompt_len, mb.mask
                )
            else:  # an engine without the model's loss path: the term in closed form
                logprobs, entropy = engine.forward_logprobs(
                    mb.input_ids, mb.prompt_len, with_entropy=True
                )
            loss, _ = ppo_loss(logprobs, entropy, mb, tokens, ctx.cfg, lm_mean)
            probe.loss_computed(logprobs, entropy, mb, lm_mean)
            (loss * ctx.dp_size).backward()  # FSDP averages over ranks; the loss is a sum


def train(
    ctx: Rank, collected: Collected, tokens: float, update: int = 1
) -> tuple[TrainRecord, LossRecord]:
    """Forward and backward per micro-batch under the engine's sync policy. Engines that run their
    own loop (verl's) get the probe through their loss function; the rest run the harness's loop.
    A run without a reference (or a twin) sketches rank 0's whole gradient for the twin to judge."""
    ctx.phase.enter(phase_name("train", update))
    engine, module, batch = ctx.engine, ctx.engine.module, collected.batch
    with fsdp_probe.CollectiveCounter() as counter, fsdp_probe.UnitsThatRan(module) as ran:
        probe = MicroBatchProbe(module, tokens, ctx.cfg, counter, ctx.dp_size)
        if engine.drives_micro_batches:
            engine.forward_backward(batch, tokens, ctx.cfg, probe)
        else:
            harness_micro_batches(ctx, batch, tokens, probe)
    if ctx.faulty("nan"):
        grad = next(p.grad for p in module.parameters() if p.grad is not None)
        local_tensor(grad).view(-1)[0] = float("nan")
    sketching = not ctx.cfg.reference_checks or ctx.replaying  # the twin judges per parameter
    sketch = fsdp_probe.gradient_sketch(module) if sketching else None  # every rank: collectives
    trained = TrainRecord(
        reduce_scatter_calls_by_micro_batch=counter.reduce_scatters,
        reduce_scatter_calls=sum(counter.reduce_scatters),
        all_gather_calls=counter.all_gathers_total,
        fsdp_units=ran.count,
        shard_group_size=fsdp_probe.shard_group_size(module),
        layer_tokens=ran.layer_tokens,
        seq_len=int(batch.input_ids.shape[1]),
        # rows of the largest micro-batch: both loops split as torch.chunk does
        micro_batch_rows=-(-batch.size // ctx.cfg.micro_batches),
        data_rows=collected.rows,
        grad_sketch=sketch if ctx.rank == 0 else None,  # rank 0 writes it
        sp_size=ctx.sp,
        retained_grad_bytes=probe.retained,
        loss_grad_max_rel_err=probe.loss_grad_max_rel_err,
    )
    return trained, reduced_loss(ctx, probe)


def reduced_loss(ctx: Rank, probe: MicroBatchProbe) -> LossRecord:
    """The probe's per-rank sums and first-micro-batch values reduced to the whole run
    (sequence-parallel ranks counted once)."""
    device, sp, first = ctx.device, ctx.sp, probe.first
    if not probe.count:  # the engine's own loop never called the probe: nothing was measured
        return LossRecord()
    summed = {name: all_sum(probe.parts.get(name, 0.0), device) / sp for name in SUMMED_PARTS}
    return LossRecord(
        **summed,
        ppo_kl_first_micro_batch=all_max(abs(first["ppo_kl"]), device),
        pg_clipfrac_first_micro_batch=all_max(abs(first["pg_clipfrac"]), device),
        ppo_log_ratio_abs_max_first_micro_batch=all_max(probe.first_log_ratio_abs_max, device),
    )


def phase_name(phase: str, update: int) -> str:
    """train, train2, ...: each update's phases timed apart."""
    return phase if update == 1 else f"{phase}{update}"


def single_process_copy(ctx: Rank) -> torch.nn.Module:
    """The initial policy, unsharded: the HF rollout already holds one; otherwise load it."""
    if isinstance(ctx.rollout, HFRollout):
        return ctx.rollout.model
    from pytest_fsdp_turbo_engine.hf_model import load_pretrained

    model = load_pretrained(ctx.spec.model_path, dtype=torch.float32)
    return model.to(ctx.device)


@dataclass
class ReferenceRun:
    """The single-process reference across updates: its copy of the policy, the copy's parameters
    before the first update, and AdamW stepping the copy on the reference's own gradients."""

    copy: torch.nn.Module
    initial: dict[str, torch.Tensor]
    optimizer: ReferenceOptimizer
    grads: dict[str, torch.Tensor] = field(default_factory=dict)  # the latest update's
    norm: float = 0.0  # their global norm
    fingerprint: dict | None = None  # rank 0: the engine's first-update gradients, for policies

    @classmethod
    def of(cls, ctx: Rank) -> ReferenceRun:
        copy = single_process_copy(ctx)
        initial = {n: p.detach().clone() for n, p in copy.named_parameters()}
        return cls(copy, initial, ReferenceOptimizer(copy, ctx.engine_cfg))

    def step(self, norm_finite: bool) -> None:
        """The engine skips the update on a non-finite norm; so does the reference."""
        if norm_finite:
            self.optimizer.step(self.grads, self.norm)


def reference(
    ctx: Rank, ref_run: ReferenceRun, global_batch: TrainBatch, tokens: float, update: int = 1
) -> ReferenceRecord:
    """The engine's gradients, read by the harness, against the copy's on the global batch."""
    ctx.phase.enter(phase_name("reference", update))
    sharded = fsdp_probe.unsharded_gradients(ctx.engine.module)  # read by the harness
    ref_run.grads = grads = reference_gradients(ref_run.copy, global_batch, tokens, ctx.cfg)
    ref_run.norm = gradient_norm(grads)
    err, name = max_abs_error(sharded, grads)
    names = fsdp_probe.parameter_names(ctx.engine.module)
    if mismatch := name_mismatch(names, [n for n, _ in ref_run.copy.named_parameters()]):
        err, name = math.inf, mismatch  # check c says which tensors, not a KeyError later
    if ctx.rank == 0 and update == 1:
        ref_run.fingerprint = fingerprint(sharded)
    return ReferenceRecord(
        grad_max_rel_err=err,
        grad_max_rel_err_param=name,
        reference_grad_norm=ref_run.norm,
        grad_rel_l2_err=relative_l2_error(sharded, grads),
    )


@dataclass
class HarnessAdamW:
    """The harness's own AdamW state across updates, from the gradients it read."""

    moments: AdamMoments | None = None  # None before the first update


def optimizer(ctx: Rank, adamw: HarnessAdamW, update: int = 1) -> OptimizerRecord:
    """The engine's optimizer_step, measured around: the harness's own norm, clip and AdamW in
    closed form from the parameters and gradients it read, with its own moments (`adamw`)."""
    ctx.phase.enter(phase_name("optimizer", update))
    module = ctx.engine.module
    measured = fsdp_probe.global_grad_norm(module)
    before = [local_tensor(p.detach()).to("cpu", copy=True) for p in module.parameters()]
    grads = [
        None if p.grad is None else local_tensor(p.grad.detach()).to("cpu", copy=True)
        for p in module.parameters()
    ]
    with stepped_gradients(module) as stepped_on:
        reported = float(ctx.engine.optimizer_step())
    after = [local_tensor(p.detach()).cpu() for p in module.parameters()]
    moved = max((float((a - b).abs().max()) for a, b in zip(after, before) if b.numel()), default=0)
    squares = sum(float((a.double() - b.double()).pow(2).sum()) for a, b in zip(after, before))
    copies = torch.distributed.get_world_size() // fsdp_probe.shard_group_size(module)
    update_l2 = math.sqrt(max(all_sum(squares, ctx.device) / copies, 0.0))
    adamw_err = clip_err = clip_coef = None
    if math.isfinite(measured):
        clip_coef = clip_coefficient(measured, ctx.engine_cfg.grad_clip)
        clipped = [None if g is None else g.float() * clip_coef for g in grads]
        expected, adamw.moments = adamw_closed_form(before, clipped, ctx.engine_cfg, adamw.moments)
        adamw_err = (
            max(
                (
                    float((p1.float() - want).abs().max())
                    for p1, want in zip(after, expected)
                    if p1.numel()
                ),
                default=0.0,
            )
            / ctx.engine_cfg.lr
        )
        # collectives on every rank alike, whether or not its optimizer stepped
        local = clip_error(grads, stepped_on[0], clip_coef) if stepped_on else 0.0
        observed = all_sum(1.0 if stepped_on else 0.0, ctx.device)
        clip_err = all_max(local, ctx.device) if observed else None
    return OptimizerRecord(
        grad_norm=reported,
        grad_norm_finite=math.isfinite(reported),
        grad_norm_measured=measured,
        param_update_max_abs=moved,
        update_l2=update_l2,
        local_param_numel=sum(b.numel() for b in before),
        adamw_step_max_err_lr=adamw_err,
        clip_max_rel_err=clip_err,
        clip_coef=clip_coef,
    )


def post_step(
    ctx: Rank,
    batch: TrainBatch,
    tokens: float,
    ref_run: ReferenceRun | None,
    record: PostStepRecord,
) -> None:
    """Replicas, the reference's steps, the weights handed to and served by the rollout, and the
    post-step log-probabilities (a twin's against the main run's, which it saves for the twin).
    Token means are over the global batch, sequence-parallel ranks counted once. `record` is the
    step's own, filled as each measurement is taken: a failure half-way keeps what it measured."""
    ctx.phase.enter("checks")
    engine, device = ctx.engine, ctx.device
    record.replica_max_abs_diff = replica_max_abs_diff(engine, device)
    trainer: dict[str, torch.Tensor] = {}
    full: dict[str, torch.Tensor] = {}
    if ref_run is not None or ctx.rollout is not None:  # a replay twin has neither: no gathering
        # the parameters as the harness reads them off the module (aliases: every name of a tied
        # one), and one name per tied group
        trainer = fsdp_probe.unsharded_parameters(engine.module, aliases=True)
        full = {n: trainer[n] for n in fsdp_probe.parameter_names(engine.module)}
    if ref_run is not None:  # every update stepped the copy as the engine's was stepped
        initial = ref_run.initial
        want = {n: p.detach() for n, p in ref_run.copy.named_parameters()}
        record.step_max_err_lr, _ = max_abs_error(full, want, scale=ctx.engine_cfg.lr)
        shared = [n for n in full if n in initial]  # names that differ fail check c by name
        record.step_rel_l2_err = relative_l2_error(
            {n: full[n].cpu() - initial[n].cpu() for n in shared},
            {n: want[n] - initial[n] for n in want},
        )
    with torch.no_grad():
        logprobs, _ = engine.forward_logprobs(batch.input_ids, batch.prompt_len)
    record.post_step_logprob_mean = (
        all_sum(float((logprobs * batch.mask).sum()), device) / ctx.sp / tokens
    )
    if ctx.rollout is not None:
        handoff_dtype = torch.bfloat16 if ctx.engine_cfg.dtype == Dtype.BF16 else torch.float32
        handed = engine.full_state_dict()  # the engine's hand-off: the thing under test
        handoff = weight_handoff.compare_handoff(handed, trainer, set(full), handoff_dtype)
        ctx.rollout.load_weights(handed)
        served, packed = ctx.rollout.served_weights()
        served_diff = weight_handoff.compare(served, trainer, packed, handoff_dtype)
        with ctx.unsharded():
            rollout_lp = ctx.rollout.logprobs(batch.input_ids, batch.prompt_len)
        diff = float(((logprobs - rollout_lp).abs() * batch.mask).max())
        record.rollout_logprob_max_abs_diff = all_max(diff, device)
        rollout_sum = all_sum(float((rollout_lp * batch.mask).sum()), device)
        record.rollout_logprob_mean = rollout_sum / ctx.sp / tokens
        record.handoff_weight_max_abs_diff = handoff.max_abs_diff
        record.handoff_weight_worst = handoff.worst
        record.rollout_weight_max_abs_diff = served_diff.max_abs_diff
        record.rollout_weight_worst = served_diff.worst
        record.rollout_weights_compared = served_diff.compared
    if ctx.replaying:
        compared = twin_comparison(ctx, batch, logprobs)
        record.post_step_logprob_max_abs_diff, record.post_step_logprob_moved = compared
    else:
        gathered = gather_rows(logprobs, engine.data_parallel_group())
        if ctx.rank == 0:
            torch.save({"logprobs": gathered}, RunFolder(ctx.out).post_step)


def twin_comparison(ctx: Rank, batch: TrainBatch, logprobs: torch.Tensor) -> tuple[float, float]:
    """Twin only: post-step logprobs against the main run's, on the same global batch; and how
    far the twin's own updates moved them from the rollout's (the scale of what could differ)."""
    group = ctx.engine.data_parallel_group()
    mine, mask = gather_rows(logprobs, group), gather_rows(batch.mask, group)
    old = gather_rows(batch.old_logprobs, group)
    main = torch.load(RunFolder(Path(ctx.cfg.replay)).post_step, weights_only=True)
    diff = float(((mine - main["logprobs"]).abs() * mask).max())
    return diff, float(((mine - old).abs() * mask).max())


# --- the step -------------------------------------------------------------------------------------


@dataclass
class StepOutput:
    metrics: StepMetrics
    grads_fingerprint: dict | None = None


def run_ppo_step(spec: RankSpec, rank: int, phase: Phase, out: Path) -> StepOutput:
    """What was measured so far rides on any exception as `partial_metrics`, so nothing is lost."""
    metrics = StepMetrics()
    try:
        return _run(spec, rank, phase, out, metrics)
    except BaseException as exc:
        setattr(exc, PARTIAL_METRICS_ATTR, metrics)
        raise


def _run(spec: RankSpec, rank: int, phase: Phase, out: Path, metrics: StepMetrics) -> StepOutput:
    ctx = load(spec, rank, phase, out)
    cfg, device, folder = ctx.cfg, ctx.device, RunFolder(out)
    replicas = ctx.engine.replicate_group()
    metrics.case = CaseRecord(
        rank=rank,
        device=spec.device_kind,
        dtype=ctx.engine_cfg.dtype,
        gradient_sync=ctx.engine_cfg.gradient_sync,
        world_size=ctx.engine_cfg.world_size,
        micro_batches=cfg.micro_batches,
        reference=cfg.reference_checks and not ctx.replaying,
        memory_budget_mb=spec.memory_budget_mb,
        replicas=1 if replicas is None else torch.distributed.get_world_size(replicas),
        updates=cfg.updates,
    )
    step_start = time.perf_counter()
    collected = replayed(ctx) if ctx.replaying else collect(ctx)
    batch = collected.batch
    if ctx.replaying:
        metrics.replay = replay_record(ctx, collected)
    group = ctx.engine.data_parallel_group()
    # Ranks of one sequence-parallel group share their batch: count it once per data-parallel rank.
    tokens = all_sum(float(batch.mask.sum()), device, group)
    metrics.rollout = rollout_record(ctx, collected, tokens)
    global_batch = batch.gather(group) if not ctx.replaying else None
    if global_batch is not None and rank == 0:
        global_batch.save(folder.batch)

    # Every update trains the same batch; the step's records combine the updates' own, each field
    # as its record declares (the first, on-policy update's counts; the worst errors).
    ref_run: ReferenceRun | None = None
    adamw = HarnessAdamW()
    trained: list[TrainRecord] = []
    losses: list[LossRecord] = []
    referenced: list[ReferenceRecord] = []
    stepped: list[OptimizerRecord] = []
    for number in range(1, cfg.updates + 1):
        train_record, loss_record = train(ctx, collected, tokens, number)
        trained.append(train_record)
        losses.append(loss_record)
        metrics.train = TrainRecord.over_updates(trained)
        metrics.loss = LossRecord.over_updates(losses)
        if cfg.reference_checks and global_batch is not None:  # not when replaying
            with ctx.unsharded():
                ref_run = ref_run or ReferenceRun.of(ctx)  # after the first train: its memory
                referenced.append(reference(ctx, ref_run, global_batch, tokens, number))
            metrics.reference = ReferenceRecord.over_updates(referenced)
        stepped.append(optimizer(ctx, adamw, number))
        metrics.optimizer = OptimizerRecord.over_updates(stepped)
        if number == 1:
            step_time = time.perf_counter() - step_start  # one update: what cases compare
        if ref_run is not None:
            ref_run.step(bool(stepped[-1].grad_norm_finite))

    post_step(ctx, batch, tokens, ref_run, metrics.post_step)
    phase.enter("metrics")
    global_tokens = all_sum(float(batch.input_ids.numel()), device) / ctx.sp
    metrics.perf = PerfRecord(
        step_time_s=step_time,
        tokens_per_s=global_tokens / step_time,
        peak_memory_bytes=peak_memory_bytes(device),
    )
    launched = os.environ.get(Env.LAUNCHED_AT)
    metrics.timings = phase.timings(float(launched) if launched else None)
    return StepOutput(metrics, ref_run.fingerprint if ref_run is not None else None)
