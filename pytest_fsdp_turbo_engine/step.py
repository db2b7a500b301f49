"""One PPO step inside one rank, split at its natural seams. Each phase is a function that takes
what it needs and returns what it measured; `run_ppo_step` alone turns those into metrics.

rollout -> reward -> advantages -> logprobs -> micro-batches under the case's gradient-sync policy
-> (reference gradients) -> optimizer step -> (reference step) -> post-step checks -> metrics.

A twin run (`ppo.replay` set) skips rollout and reward and trains on the batch the main run saved.
Every measurement a check depends on is taken here, never inside an engine method.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from pytest_fsdp_turbo_contract.artifacts import RunFolder
from pytest_fsdp_turbo_contract.records import (
    PARTIAL_METRICS_ATTR,
    CaseRecord,
    LossRecord,
    Metric,
    OptimizerRecord,
    PerfRecord,
    PostStepRecord,
    ReferenceRecord,
    StepMetrics,
    TrainRecord,
    timing_key,
)
from pytest_fsdp_turbo_contract.spec import EngineSpec, PPOSpec, RankSpec
from pytest_fsdp_turbo_contract.vocab import DeviceKind, Dtype, Env, Rollout
from pytest_fsdp_turbo_engine import fsdp_probe, ppo, weight_handoff
from pytest_fsdp_turbo_engine.faults import Fault
from pytest_fsdp_turbo_engine.fsdp_engine import local_tensor
from pytest_fsdp_turbo_engine.reductions import all_max, all_sum, gather_rows
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

SUMMED_PARTS = (
    Metric.ACTOR_LOSS,
    Metric.ACTOR_PG_LOSS,
    Metric.ACTOR_PG_CLIPFRAC,
    Metric.ACTOR_PPO_KL,
    Metric.ACTOR_KL_LOSS,
    Metric.ACTOR_ENTROPY,
)


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
        """timing_s/<phase> for every phase entered so far; timing_s/startup is the time from
        launch (interpreter, imports, process group) to loading the model."""
        names = list(self.started)
        ends = [self.started[n] for n in names[1:]] + [time.time()]
        out = {
            timing_key(name): end - self.started[name]
            for name, end in zip(names, ends)
            if name != "init"
        }
        if launched_at is not None and "load" in self.started:
            out[Metric.TIMING_S_STARTUP] = self.started["load"] - launched_at
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


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == DeviceKind.CUDA:
        return int(torch.cuda.max_memory_allocated(device))
    if device.type == DeviceKind.NPU:
        return int(torch.npu.max_memory_allocated(device))  # type: ignore[attr-defined]
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


@dataclass
class Rank:
    """What every phase of one rank shares: its configs, device, engine and data-parallel place."""

    spec: RankSpec
    rank: int
    phase: Phase
    out: Path
    engine_cfg: EngineSpec
    cfg: PPOSpec
    device: torch.device
    engine: Any = None  # an pytest_fsdp_turbo_engine/protocol.py Engine, once loaded
    tokenizer: Any = None
    reference_module: torch.nn.Module | None = None  # frozen initial policy, for ref logprobs
    rollout: Any = None
    dp_rank: int = 0
    dp_size: int = 1
    sp: int = 1

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
    from pytest_fsdp_turbo_engine.registry import VERL_PREFIX, load_engines, lookup

    engine_cfg, cfg, kind = spec.engine, spec.ppo, spec.device_kind
    device = device_for(kind, int(os.environ.get("LOCAL_RANK", rank)))
    torch.manual_seed(cfg.seed)
    ctx = Rank(spec, rank, phase, out, engine_cfg, cfg, device)

    phase.enter("load")
    if engine_cfg.backend.startswith(VERL_PREFIX):
        from pytest_fsdp_turbo_engine.verl_cpu_platform import prepare

        prepare(kind)  # before any engine module imports verl
    load_engines(EngineCatalog.from_ranks(spec.engine_modules), engine_cfg.backend)
    engine_class = require_protocol(
        lookup(spec.model_type, engine_cfg.backend, kind), engine_cfg.backend
    )
    engine = engine_class(engine_cfg, device)
    ctx.engine = engine
    ctx.tokenizer = AutoTokenizer.from_pretrained(spec.model_path)
    engine.build(spec.model_path)
    if not ctx.replaying:
        ctx.reference_module = engine.build(spec.model_path, trainable=False)
        ctx.rollout = make_rollout(cfg, engine_cfg, spec.model_path, device, ctx.tokenizer)
    ctx.dp_rank, ctx.dp_size = engine.data_parallel_rank(), engine.data_parallel_size()
    ctx.sp = max(1, engine_cfg.sp_size)
    return ctx


def make_rollout(cfg: PPOSpec, engine_cfg: EngineSpec, model_path: str, device, tokenizer):
    if cfg.rollout == Rollout.VLLM:
        from pytest_fsdp_turbo_engine.vllm_rollout import VLLMRollout

        return VLLMRollout(
            model_path, tokenizer.eos_token_id, tokenizer.pad_token_id, engine_cfg.dtype, cfg.seed
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
    batch = TrainBatch(
        rolled.input_ids, rolled.prompt_len, rolled.response_mask, advantages, old, ref
    )
    return Collected(batch, scores, rows)


def replayed(ctx: Rank) -> Collected:
    """This rank's share of the main run's global batch (ranks hold equal, contiguous blocks)."""
    ctx.phase.enter("replay")
    whole = TrainBatch.load(RunFolder(Path(ctx.cfg.replay)).batch)
    block = whole.size // ctx.dp_size
    rows = torch.arange(ctx.dp_rank * block, (ctx.dp_rank + 1) * block)
    return Collected(whole.rows(rows).to(ctx.device), None, rows.tolist())


@dataclass
class Trained:
    parts: dict[str, float]  # this rank's sums over its micro-batches
    first_micro_batch: dict[str, float]
    reduce_scatters_by_micro_batch: list[int]
    all_gathers: int  # forward and backward, all micro-batches
    retained_grad_bytes: int  # peak unsharded gradient bytes held between micro-batches
    fsdp_units: int  # trainable units whose forward ran (a vision tower on text does not)
    shard_group_size: int
    layer_tokens: int  # most tokens a decoder layer was handed at once (0: no layer is a unit)
    loss_grad_max_rel_err: float  # the loss's gradient on the logprobs against the closed form


class MicroBatchProbe:
    """Harness code an engine's micro-batch loop calls as each micro-batch's loss is computed
    (ours calls it, verl's calls it through the loss function the harness hands it).

    It moves the collective counter on to the next micro-batch, so reduce-scatters are attributed
    to the micro-batch whose backward issued them; measures the unsharded gradients the previous
    backward left behind; and computes the PPO loss parts itself from the engine's log-probabilities.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        tokens: float,
        cfg: PPOSpec,
        counter: fsdp_probe.CollectiveCounter,
        loss_scale: float,
    ):
        self.module, self.tokens, self.cfg, self.counter = module, tokens, cfg, counter
        self.loss_scale = loss_scale  # FSDP averages over data ranks: each backs the sum times this
        self.count = 0
        self.retained = 0
        self.parts: dict[str, float] = {}
        self.first: dict[str, float] = {}
        self.loss_gradients_seen = 0
        self.loss_grad_err = 0.0

    @property
    def loss_grad_max_rel_err(self) -> float:
        """Worst over micro-batches; infinite when a micro-batch's loss gradient never reached
        the log-probabilities the engine reported (they were not what its loss was built on)."""
        return self.loss_grad_err if self.loss_gradients_seen == self.count else math.inf

    def loss_computed(
        self, logprobs, entropy, mb: TrainBatch, lm_mean=None, gradient_of=None
    ) -> None:
        """`lm_mean`: the model's own causal-LM loss, when the engine computed that term through
        the model (its gradient reaches the logits, not the log-probabilities). `gradient_of`:
        (tensor, to_rows) when the loss reads another tensor than `logprobs` (verl's unpadded
        log-probabilities), to_rows turning that tensor's gradient into `logprobs`' layout."""
        self._expect_loss_gradient(logprobs, entropy, mb, lm_mean, gradient_of)
        if self.count:  # the previous micro-batch's backward is done; this one's has not started
            self.retained = max(self.retained, fsdp_probe.unsharded_grad_bytes(self.module))
        self.counter.next_micro_batch()
        with torch.no_grad():
            ent = entropy.detach() if entropy is not None else None
            _, values = ppo_loss(logprobs.detach(), ent, mb, self.tokens, self.cfg)
        for key, value in values.items():
            self.parts[key] = self.parts.get(key, 0.0) + float(value)
        if not self.count:
            self.first = {key: float(value) for key, value in values.items()}
            log_ratio = (logprobs.detach().float() - mb.old_logprobs).abs()
            self.first[Metric.ACTOR_PPO_LOG_RATIO_ABS_MAX_FIRST_MICRO_BATCH] = float(
                torch.where(mb.mask.bool(), log_ratio, 0.0).max()
            )
        self.count += 1

    def _expect_loss_gradient(self, logprobs, entropy, mb, lm_mean, gradient_of) -> None:
        """The PPO loss's gradient on each log-probability in closed form (autograd over the
        harness's loss on a detached copy), compared with the gradient the engine's backward
        delivers to it: a hook on the tensor, so nothing the engine can override is asked. On an
        on-policy update the ratio is 1 and the KL gradient 0; from the second update on, PPO's
        clip, the KL term and the response mask each shape it."""
        source, to_rows = gradient_of if gradient_of is not None else (logprobs, None)
        if not source.requires_grad:
            return  # counted as never reached
        with torch.enable_grad():
            leaf = logprobs.detach().float().requires_grad_()
            ent = None if entropy is None else entropy.detach().float()
            lm = None if lm_mean is None else lm_mean.detach()
            loss, _ = ppo_loss(leaf, ent, mb, self.tokens, self.cfg, lm)
            (want,) = torch.autograd.grad(loss, leaf)
        want = want * self.loss_scale
        scale = max(float(want.abs().max()), 1e-30)

        def arrived(grad: torch.Tensor) -> None:
            got = (to_rows(grad) if to_rows is not None else grad).float()
            err = float((got - want).abs().max()) / scale
            self.loss_grad_err = max(self.loss_grad_err, err if math.isfinite(err) else math.inf)
            self.loss_gradients_seen += 1

        source.register_hook(arrived)


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


def train(ctx: Rank, batch: TrainBatch, tokens: float, update: int = 1) -> Trained:
    """Forward and backward per micro-batch under the engine's sync policy. Engines that run their
    own loop (verl's) get the probe through their loss function; the rest run the harness's loop."""
    ctx.phase.enter(phase_name("train", update))
    engine, module = ctx.engine, ctx.engine.module
    with fsdp_probe.CollectiveCounter() as counter, fsdp_probe.UnitsThatRan(module) as ran:
        probe = MicroBatchProbe(module, tokens, ctx.cfg, counter, ctx.dp_size)
        if engine.drives_micro_batches:
            engine.forward_backward(batch, tokens, ctx.cfg, probe)
        else:
            harness_micro_batches(ctx, batch, tokens, probe)
    if ctx.faulty("nan"):
        grad = next(p.grad for p in module.parameters() if p.grad is not None)
        local_tensor(grad).view(-1)[0] = float("nan")
    return Trained(
        probe.parts,
        probe.first,
        counter.reduce_scatters,
        counter.all_gathers_total,
        probe.retained,
        ran.count,
        fsdp_probe.shard_group_size(module),
        ran.layer_tokens,
        probe.loss_grad_max_rel_err,
    )


def phase_name(phase: str, update: int) -> str:
    """train, train2, ...: each update's phases timed apart."""
    return phase if update == 1 else f"{phase}{update}"


@dataclass
class Referenced:
    grads: dict[str, torch.Tensor]
    norm: float
    grad_max_rel_err: float
    grad_max_rel_err_param: str
    grad_rel_l2_err: float
    fingerprint: dict | None  # rank 0, first update only


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

    @classmethod
    def of(cls, ctx: Rank) -> ReferenceRun:
        copy = single_process_copy(ctx)
        initial = {n: p.detach().clone() for n, p in copy.named_parameters()}
        return cls(copy, initial, ReferenceOptimizer(copy, ctx.engine_cfg))

    def step(self, referenced: Referenced, norm_finite: bool) -> None:
        """The engine skips the update on a non-finite norm; so does the reference."""
        if norm_finite:
            self.optimizer.step(referenced.grads, referenced.norm)


def reference(
    ctx: Rank, global_batch: TrainBatch, tokens: float, copy, update: int = 1
) -> Referenced:
    ctx.phase.enter(phase_name("reference", update))
    sharded = fsdp_probe.unsharded_gradients(ctx.engine.module)  # read by the harness
    grads = reference_gradients(copy, global_batch, tokens, ctx.cfg)
    err, name = max_abs_error(sharded, grads)
    names = fsdp_probe.parameter_names(ctx.engine.module)
    if mismatch := name_mismatch(names, [n for n, _ in copy.named_parameters()]):
        err, name = math.inf, mismatch  # check c says which tensors, not a KeyError later
    return Referenced(
        grads,
        gradient_norm(grads),
        err,
        name,
        relative_l2_error(sharded, grads),
        fingerprint(sharded) if ctx.rank == 0 and update == 1 else None,  # the first update's
    )


@dataclass
class Stepped:
    reported_norm: float  # what the engine says (pre-clip)
    measured_norm: float  # what the harness computes from the sharded gradients
    update_max_abs: float  # this rank's own largest parameter change
    update_l2: float  # the whole model's update, each shard counted once
    local_numel: int  # parameters this rank holds
    seconds: float
    adamw_step_err_lr: float | None  # against AdamW in closed form; None: no finite norm
    clip_err: float | None  # stepped-on gradients against the harness's clip; None: not observed
    clip_coef: float | None
    moments: AdamMoments | None  # the harness's own AdamW moments after this step


def optimizer(ctx: Rank, update: int = 1, moments: AdamMoments | None = None) -> Stepped:
    """The engine's optimizer_step, measured around: the harness's own norm, clip and AdamW in
    closed form from the parameters and gradients it read (`moments`: its own AdamW state from
    the previous updates, None before the first)."""
    ctx.phase.enter(phase_name("optimizer", update))
    module = ctx.engine.module
    measured = fsdp_probe.global_grad_norm(module)
    before = [local_tensor(p.detach()).to("cpu", copy=True) for p in module.parameters()]
    grads = [
        None if p.grad is None else local_tensor(p.grad.detach()).to("cpu", copy=True)
        for p in module.parameters()
    ]
    start = time.perf_counter()
    with stepped_gradients(module) as stepped_on:
        reported = float(ctx.engine.optimizer_step())
    seconds = time.perf_counter() - start
    after = [local_tensor(p.detach()).cpu() for p in module.parameters()]
    moved = max((float((a - b).abs().max()) for a, b in zip(after, before) if b.numel()), default=0)
    squares = sum(float((a.double() - b.double()).pow(2).sum()) for a, b in zip(after, before))
    copies = torch.distributed.get_world_size() // fsdp_probe.shard_group_size(module)
    update_l2 = math.sqrt(max(all_sum(squares, ctx.device) / copies, 0.0))
    adamw_err = clip_err = clip_coef = None
    if math.isfinite(measured):
        clip_coef = clip_coefficient(measured, ctx.engine_cfg.grad_clip)
        clipped = [None if g is None else g.float() * clip_coef for g in grads]
        expected, moments = adamw_closed_form(before, clipped, ctx.engine_cfg, moments)
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
    numel = sum(b.numel() for b in before)
    return Stepped(
        reported,
        measured,
        moved,
        update_l2,
        numel,
        seconds,
        adamw_err,
        clip_err,
        clip_coef,
        moments,
    )


@contextlib.contextmanager
def stepped_gradients(module: torch.nn.Module):
    """The module's local gradients as an optimizer steps on them (after the engine's clip),
    caught by a process-wide pre-step hook the harness registers for the engine's optimizer_step
    call: the engine's own objects are not asked. Empty when no torch optimizer stepped."""
    seen: list[list[torch.Tensor | None]] = []

    def before_step(*_):
        if not seen:
            seen.append(
                [
                    None if p.grad is None else local_tensor(p.grad.detach()).to("cpu", copy=True)
                    for p in module.parameters()
                ]
            )

    handle = register_optimizer_step_pre_hook(before_step)
    try:
        yield seen
    finally:
        handle.remove()


def clip_error(raw, stepped_on, coef: float) -> float:
    """Largest distance between the gradients the optimizer stepped on and the raw gradients the
    harness read scaled by its own clip coefficient (global norm, the case's max_norm), relative
    to the largest clipped entry on this rank."""
    pairs = [(r.float() * coef, s.float()) for r, s in zip(raw, stepped_on) if r is not None]
    pairs = [(want, got) for want, got in pairs if want.numel()]
    if not pairs:
        return 0.0
    scale = max(max(float(want.abs().max()) for want, _ in pairs), 1e-30)
    return max(float((got - want).abs().max()) for want, got in pairs) / scale


@dataclass
class AdamMoments:
    """AdamW's state as the harness computes it from its own readings, per local parameter."""

    steps: list[int]  # per parameter: one without a gradient is not stepped
    exp_avg: list[torch.Tensor | None]
    exp_avg_sq: list[torch.Tensor | None]


def adamw_closed_form(
    before: list[torch.Tensor],
    grads: list[torch.Tensor | None],
    cfg: EngineSpec,
    moments: AdamMoments | None,
) -> tuple[list[torch.Tensor], AdamMoments]:
    """Each parameter after one AdamW step, from the parameters and (clipped) gradients the
    harness read and its own moments: m <- b1 m + (1 - b1) g, v <- b2 v + (1 - b2) g^2, then
    p <- p (1 - lr wd) - lr (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps). On the first step
    the betas cancel out (m / (1 - b1) = g); from the second on they do not, so the case's betas
    are proven there. A parameter without a gradient stays and keeps its moments, as in torch."""
    if moments is None:
        moments = AdamMoments([0] * len(before), [None] * len(before), [None] * len(before))
    b1, b2 = cfg.adam_beta1, cfg.adam_beta2
    expected, steps, exp_avg, exp_avg_sq = [], [], [], []
    for p0, g, t, m, v in zip(before, grads, moments.steps, moments.exp_avg, moments.exp_avg_sq):
        if g is None:
            expected.append(p0.float())
            steps.append(t)
            exp_avg.append(m)
            exp_avg_sq.append(v)
            continue
        t += 1
        m = (1 - b1) * g if m is None else b1 * m + (1 - b1) * g
        v = (1 - b2) * g * g if v is None else b2 * v + (1 - b2) * g * g
        denom = (v / (1 - b2**t)).sqrt() + cfg.adam_eps
        step = cfg.lr * (m / (1 - b1**t)) / denom
        expected.append(p0.float() * (1 - cfg.lr * cfg.weight_decay) - step)
        steps.append(t)
        exp_avg.append(m)
        exp_avg_sq.append(v)
    return expected, AdamMoments(steps, exp_avg, exp_avg_sq)


@dataclass
class PostStep:
    replica_max_abs_diff: float | None  # None: no replicas
    rollout_logprob_max_abs_diff: float | None  # None: no rollout (twin)
    rollout_logprob_sum: float | None  # over this rank's response tokens
    step_max_err: float | None  # in units of lr; None: no reference step
    step_rel_l2_err: float | None  # of the update, against the reference update
    logprobs: torch.Tensor  # post-step logprobs of this rank's batch
    handoff: weight_handoff.HandOff | None  # handed vs trainer weights; None: no rollout (twin)
    served: weight_handoff.HandOff | None  # served vs trainer weights; None: no rollout (twin)


def post_step(ctx: Rank, batch: TrainBatch, ref_run: ReferenceRun | None) -> PostStep:
    ctx.phase.enter("checks")
    engine = ctx.engine
    trainer: dict[str, torch.Tensor] = {}
    full: dict[str, torch.Tensor] = {}
    if ref_run is not None or ctx.rollout is not None:  # a replay twin has neither: no gathering
        # the parameters as the harness reads them off the module (aliases: every name of a tied
        # one), and one name per tied group
        trainer = fsdp_probe.unsharded_parameters(engine.module, aliases=True)
        full = {n: trainer[n] for n in fsdp_probe.parameter_names(engine.module)}
    step_err = step_l2 = None
    if ref_run is not None:  # every update stepped the copy as the engine's was stepped
        initial = ref_run.initial
        want = {n: p.detach() for n, p in ref_run.copy.named_parameters()}
        step_err, _ = max_abs_error(full, want, scale=ctx.engine_cfg.lr)
        shared = [n for n in full if n in initial]  # names that differ fail check c by name
        step_l2 = relative_l2_error(
            {n: full[n].cpu() - initial[n].cpu() for n in shared},
            {n: want[n] - initial[n] for n in want},
        )
    with torch.no_grad():
        logprobs, _ = engine.forward_logprobs(batch.input_ids, batch.prompt_len)
    rollout_diff = rollout_sum = handoff = served_diff = None
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
        rollout_diff = all_max(diff, ctx.device)
        rollout_sum = float((rollout_lp * batch.mask).sum())
    return PostStep(
        replica_max_abs_diff(engine, ctx.device),
        rollout_diff,
        rollout_sum,
        step_err,
        step_l2,
        logprobs,
        handoff,
        served_diff,
    )


def replica_max_abs_diff(engine, device: torch.device) -> float | None:
    """Spread of each local shard across the ranks that should hold the same values (HSDP)."""
    group = engine.replicate_group()
    if group is None:
        return None
    worst = torch.zeros((), dtype=torch.float32, device=device)
    for param in engine.module.parameters():
        shard = local_tensor(param.detach()).float()
        hi, lo = shard.clone(), shard.clone()
        torch.distributed.all_reduce(hi, op=torch.distributed.ReduceOp.MAX, group=group)
        torch.distributed.all_reduce(lo, op=torch.distributed.ReduceOp.MIN, group=group)
        worst = torch.maximum(worst, (hi - lo).abs().max() if hi.numel() else worst)
    return all_max(float(worst), device)


def twin_comparison(ctx: Rank, batch: TrainBatch, logprobs: torch.Tensor) -> float:
    """Twin only: post-step logprobs against the main run's, on the same global batch."""
    group = ctx.engine.data_parallel_group()
    mine, mask = gather_rows(logprobs, group), gather_rows(batch.mask, group)
    main = torch.load(RunFolder(Path(ctx.cfg.replay)).post_step, weights_only=True)
    return float(((mine - main["logprobs"]).abs() * mask).max())


# --- the step -------------------------------------------------------------------------------------


@dataclass
class StepOutput:
    metrics: StepMetrics
    grads_fingerprint: dict | None = None


@dataclass
class Update:
    """What one optimizer update on the batch measured."""

    trained: Trained
    sketch: dict[str, list[float]] | None  # rank 0, runs without a reference
    referenced: Referenced | None
    stepped: Stepped


def worst(values) -> float | None:
    """The largest of the measured values (None: not measured; NaN counts as infinite)."""
    measured = [math.inf if v != v else v for v in values if v is not None]
    return max(measured) if measured else None


def update_records(
    ctx: Rank, collected: Collected, done: list[Update]
) -> tuple[TrainRecord, ReferenceRecord | None, OptimizerRecord]:
    """The train, reference and optimizer records of the updates so far. Counts, norms and the
    loss are the first update's (on-policy: what checks a, b, f, g and h read); the errors
    against the closed forms and the reference are the worst of every update; the twin's
    sketch holds every update's, the later ones named `<parameter> (update N)`."""
    first, batch = done[0], collected.batch
    trained = first.trained
    sketch = None
    if first.sketch is not None:
        sketch = dict(first.sketch)
        for number, later in enumerate(done[1:], start=2):
            sketch.update({f"{n} (update {number})": v for n, v in (later.sketch or {}).items()})
    train_record = TrainRecord(
        reduce_scatter_calls_by_micro_batch=trained.reduce_scatters_by_micro_batch,
        reduce_scatter_calls=sum(trained.reduce_scatters_by_micro_batch),
        all_gather_calls=trained.all_gathers,
        fsdp_units=trained.fsdp_units,
        shard_group_size=trained.shard_group_size,
        layer_tokens=trained.layer_tokens,
        seq_len=int(batch.input_ids.shape[1]),
        # rows of the largest micro-batch: both loops split as torch.chunk does
        micro_batch_rows=-(-batch.size // ctx.cfg.micro_batches),
        data_rows=collected.rows,
        grad_sketch=sketch,
        sp_size=ctx.sp,
        retained_grad_bytes=trained.retained_grad_bytes,
        loss_grad_max_rel_err=worst(u.trained.loss_grad_max_rel_err for u in done),
    )
    reference_record = None
    referenced = [u.referenced for u in done if u.referenced is not None]
    if referenced:
        worst_update = max(referenced, key=lambda r: worst([r.grad_max_rel_err]) or 0.0)
        reference_record = ReferenceRecord(
            grad_max_rel_err=worst_update.grad_max_rel_err,
            grad_max_rel_err_param=worst_update.grad_max_rel_err_param,
            reference_grad_norm=referenced[0].norm,
            grad_rel_l2_err=worst(r.grad_rel_l2_err for r in referenced),
        )
    stepped = first.stepped
    optimizer_record = OptimizerRecord(
        grad_norm=stepped.reported_norm,
        grad_norm_finite=math.isfinite(stepped.reported_norm),
        grad_norm_measured=stepped.measured_norm,
        param_update_max_abs=stepped.update_max_abs,
        update_l2=stepped.update_l2,
        local_param_numel=stepped.local_numel,
        adamw_step_max_err_lr=worst(u.stepped.adamw_step_err_lr for u in done),
        clip_max_rel_err=worst(u.stepped.clip_err for u in done),
        clip_coef=stepped.clip_coef,
    )
    return train_record, reference_record, optimizer_record


def reduced_loss(ctx: Rank, collected: Collected, done: list[Update], tokens: float) -> LossRecord:
    """Per-rank sums and maxima reduced to the whole run (sequence-parallel ranks counted once):
    the first update's, and how far off-policy the last one trained."""
    device, sp, batch = ctx.device, ctx.sp, collected.batch
    trained = done[0].trained
    summed = {key: all_sum(trained.parts.get(key, 0.0), device) / sp for key in SUMMED_PARTS}
    clipfrac_last = kl_last = None
    if len(done) > 1:
        last = done[-1].trained.parts
        clipfrac_last = all_sum(last.get(Metric.ACTOR_PG_CLIPFRAC, 0.0), device) / sp
        kl_last = all_sum(last.get(Metric.ACTOR_PPO_KL, 0.0), device) / sp
    first = trained.first_micro_batch
    responses = all_sum(float(batch.size), device) / sp
    score_mean = None
    if collected.scores is not None:
        score_mean = all_sum(float(collected.scores.sum()), device) / sp / responses
    key = Metric.ACTOR_PPO_LOG_RATIO_ABS_MAX_FIRST_MICRO_BATCH
    return LossRecord(
        loss=summed[Metric.ACTOR_LOSS],
        pg_loss=summed[Metric.ACTOR_PG_LOSS],
        pg_clipfrac=summed[Metric.ACTOR_PG_CLIPFRAC],
        ppo_kl=summed[Metric.ACTOR_PPO_KL],
        kl_loss=summed[Metric.ACTOR_KL_LOSS],
        entropy=summed[Metric.ACTOR_ENTROPY],
        ppo_kl_first_micro_batch=all_max(abs(first[Metric.ACTOR_PPO_KL]), device),
        pg_clipfrac_first_micro_batch=all_max(abs(first[Metric.ACTOR_PG_CLIPFRAC]), device),
        ppo_log_ratio_abs_max_first_micro_batch=all_max(first[key], device),
        response_length_mean=tokens / responses,
        advantages_abs_max=all_max(float(batch.advantages.abs().max()), device),
        score_mean=score_mean,
        pg_clipfrac_last_update=clipfrac_last,
        ppo_kl_last_update=kl_last,
    )


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
        sync_policy=ctx.engine_cfg.sync_policy,
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
    group = ctx.engine.data_parallel_group()
    # Ranks of one sequence-parallel group share their batch: count it once per data-parallel rank.
    tokens = all_sum(float(batch.mask.sum()), device, group)
    global_batch = batch.gather(group) if not ctx.replaying else None
    if global_batch is not None and rank == 0:
        global_batch.save(folder.batch)

    sketching = not cfg.reference_checks or ctx.replaying  # the twin judges per parameter
    ref_run: ReferenceRun | None = None
    done: list[Update] = []
    for number in range(1, cfg.updates + 1):
        trained = train(ctx, batch, tokens, number)
        sketch = fsdp_probe.gradient_sketch(ctx.engine.module) if sketching else None
        referenced = None
        if cfg.reference_checks and global_batch is not None:  # not when replaying
            with ctx.unsharded():
                ref_run = ref_run or ReferenceRun.of(ctx)  # after the first train: its memory
                referenced = reference(ctx, global_batch, tokens, ref_run.copy, number)
        stepped = optimizer(ctx, number, done[-1].stepped.moments if done else None)
        done.append(Update(trained, sketch if rank == 0 else None, referenced, stepped))
        metrics.train, metrics.reference, metrics.optimizer = update_records(ctx, collected, done)
        if number == 1:
            step_time = time.perf_counter() - step_start  # one update: what cases compare
        if ref_run is not None and referenced is not None:
            ref_run.step(referenced, math.isfinite(stepped.reported_norm))

    after = post_step(ctx, batch, ref_run)
    # token means over the global batch (sequence-parallel ranks counted once)
    post_mean = all_sum(float((after.logprobs * batch.mask).sum()), device) / ctx.sp / tokens
    record = PostStepRecord(
        replica_max_abs_diff=after.replica_max_abs_diff,
        rollout_logprob_max_abs_diff=after.rollout_logprob_max_abs_diff,
        post_step_logprob_mean=post_mean,
        step_max_err_lr=after.step_max_err,
        step_rel_l2_err=after.step_rel_l2_err,
    )
    metrics.post_step = record  # filled on below: what a failure there leaves is kept
    if after.rollout_logprob_sum is not None:
        rollout_sum = all_sum(after.rollout_logprob_sum, device)
        record.rollout_logprob_mean = rollout_sum / ctx.sp / tokens
    if after.handoff is not None and after.served is not None:
        record.handoff_weight_max_abs_diff = after.handoff.max_abs_diff
        record.handoff_weight_worst = after.handoff.worst
        record.rollout_weight_max_abs_diff = after.served.max_abs_diff
        record.rollout_weight_worst = after.served.worst
        record.rollout_weights_compared = after.served.compared
    if ctx.replaying:
        record.twin_post_step_logprob_max_abs_diff = twin_comparison(ctx, batch, after.logprobs)
    else:
        logprobs = gather_rows(after.logprobs, group)
        if rank == 0:
            torch.save({"logprobs": logprobs}, folder.post_step)

    phase.enter("metrics")
    metrics.loss = reduced_loss(ctx, collected, done, tokens)
    global_tokens = all_sum(float(batch.input_ids.numel()), device) / ctx.sp
    metrics.perf = PerfRecord(
        step_time_s=step_time,
        tokens_per_s=global_tokens / step_time,
        peak_memory_bytes=peak_memory_bytes(device),
    )
    launched = os.environ.get(Env.LAUNCHED_AT)
    metrics.timings = phase.timings(float(launched) if launched else None)
    first_reference = done[0].referenced
    return StepOutput(metrics, first_reference.fingerprint if first_reference else None)
