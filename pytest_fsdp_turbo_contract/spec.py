"""What a rank is asked to do: `RankSpec` (spec.json), with the engine's part (`EngineSpec`, what an
engine's constructor is handed) and the step's (`PPOSpec`).

`EngineSpec` and `PPOSpec` are also the case file's schema: each of their fields is a case key (flat
in `[[case]]`, read by pytest_fsdp_turbo/cases.py from these fields), except those a run fills in
(`run_field`). A key's bounds live on its field (`case_key`), so a new field is declared once, here,
and read where it is used."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from enum import StrEnum
from pathlib import Path
from typing import Any

from pytest_fsdp_turbo_contract.faults import FaultSpec
from pytest_fsdp_turbo_contract.vocab import (
    CaseKindName,
    DeviceKind,
    Dtype,
    GoldenTier,
    Rollout,
    SyncPolicy,
)

RUN = "run"  # a field a run fills in (rank_spec), never a case key
BOUNDS = "bounds"  # a case key's number: Bounds


def run_field(default: Any = "", **kwargs: Any) -> Any:
    return field(default=default, metadata={RUN: True}, **kwargs)


@dataclass(frozen=True)
class Bounds:
    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False
    expected: str = ""  # the words for what is allowed, where the numbers alone would not say

    def holds(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def words(self, integer: bool) -> str:
        if self.expected:
            return self.expected
        if integer:
            if self.high == math.inf:
                return "a positive integer" if self.low == 1 else f"an integer >= {self.low:g}"
            return f"an integer from {self.low:g} to {self.high:g}"
        if self.high == math.inf:
            return f"a finite number {'>' if self.low_open else '>='} {self.low:g}"
        left, right = "(["[not self.low_open], ")]"[not self.high_open]
        return f"a number in {left}{self.low:g}, {self.high:g}{right}"


def case_key(
    default: Any,
    low: float = -math.inf,
    high: float = math.inf,
    *,
    low_open: bool = False,
    high_open: bool = False,
    expected: str = "",
) -> Any:
    """A case key with bounds, checked by the case reader: one line naming file, case and key."""
    bounds = Bounds(low, high, low_open, high_open, expected)
    return field(default=default, metadata={BOUNDS: bounds})


@dataclass(frozen=True)
class EngineSpec:
    """The engine's part of a rank's spec: what an engine's constructor is handed."""

    backend: str = "fsdp"
    world_size: int = case_key(2, 1)
    # ranks one parameter is sharded over; 0 in a case: world_size // sp_size (a rank's spec always
    # holds the number, see `shard_size`)
    fsdp_size: int = case_key(0, 0, expected="a positive integer (or 0 for world_size / sp_size)")
    sp_size: int = case_key(1, 1)
    # bf16: bf16 params, fp32 gradient reduction; auto in a case: fp32 on CPU, bf16 elsewhere (a
    # rank's spec always holds the dtype, see `dtype_on`)
    dtype: Dtype = Dtype.AUTO
    gradient_sync: SyncPolicy = SyncPolicy.DEFERRED
    lr: float = case_key(1e-4, 0, low_open=True)
    grad_clip: float = case_key(1.0, 0, low_open=True)  # max_norm of the clip by the global norm
    # AdamW; the reference step and the closed form alike. Above 1, a step of lr 1 would turn
    # every parameter's sign: no training run decays like that
    weight_decay: float = case_key(0.0, 0, 1)
    adam_beta1: float = case_key(0.9, 0, 1, high_open=True)
    adam_beta2: float = case_key(0.999, 0, 1, high_open=True)
    adam_eps: float = case_key(1e-8, 0, low_open=True)
    turbo_config: dict = field(default_factory=dict)
    # fsdp_turbo with SP: each micro-batch fed as one packed row with position_ids and cu_seqlens,
    # the convention verl's FSDP-Turbo engine feeds the library (False: padded rows, no positions)
    packed: bool = False
    turbo_checkout: str = run_field()  # where the fsdp_turbo library was found (for messages)
    # what the engine's catalog entry declares (pytest_fsdp_turbo_contract.vocab.Capability)
    capabilities: tuple[str, ...] = run_field(())

    @property
    def shard_size(self) -> int:
        return self.fsdp_size or self.world_size // self.sp_size

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // self.sp_size

    def dtype_on(self, kind: str) -> Dtype:
        if self.dtype != Dtype.AUTO:
            return self.dtype
        return Dtype.FP32 if kind == DeviceKind.CPU else Dtype.BF16


@dataclass(frozen=True)
class PPOSpec:
    prompts: str = run_field("nearest_char")
    num_prompts: int = case_key(4, 1)  # global, split across data-parallel ranks
    n: int = case_key(4, 1)  # responses per prompt (a GRPO group)
    max_new_tokens: int = case_key(12, 1)
    micro_batches: int = case_key(2, 1)
    clip_ratio: float = case_key(0.2, 0, 1, low_open=True, high_open=True)  # the dual clip: 3
    clip_ratio_c: float = run_field(3.0)
    kl_coef: float = run_field(0.001)
    # the KL reference a known step from the rollout policy: the initial policy's log-probs, each
    # response token's lowered by a seeded |N(0, 1)| x this (0: the initial policy itself), the
    # same tokens on every layout, so the KL term pulls from the first update
    kl_reference_shift: float = case_key(0.0, 0, 1.0)  # nats per token: a step, not a model
    # Aspect -> why the case leaves it unexercised (`[case.not_exercised]`): check_exercised holds
    # every run to every other aspect, measured
    not_exercised: dict[str, str] = field(default_factory=dict)
    # the older spelling of not_exercised.ratio_clip, still read (case files, ppo_run overrides)
    clip_not_exercised: str = ""
    entropy_coef: float = run_field(0.0)
    # a causal-LM (NLL) term on the response tokens, token mean over the global batch; our engines
    # compute it through the model's own loss path with labels (the library's SP loss patch)
    lm_loss_coef: float = case_key(0.0, 0)
    # optimizer updates on the one rollout's batch: from the second on, the policy has moved away
    # from the one that sampled it, so PPO's clip, the KL term and the response mask shape the loss
    # (a few prove the point: each is another forward, backward and step)
    updates: int = case_key(1, 1, 4)
    rollout: Rollout = Rollout.HF
    vllm_memory_share: float = run_field(0.3)  # of the device's memory, for a vLLM rollout
    seed: int = case_key(7, 0)  # the rollout's sampling and the KL reference's shift
    # single-process reference gradients and fingerprint; None in a case: on for tiny models (a
    # rank's spec always holds the answer)
    reference_checks: bool | None = None
    replay: str = run_field()  # twin runs: the main run's artifact folder, whose batch is replayed
    # rollout replicas that receive the trainer's weights (a verl trainer run's resolved config)
    rollout_replicas: int | None = run_field(None)
    rollout_dtype: str | None = run_field(None)  # what the rollout serves the weights in (torch's)
    # a verl trainer run's: each mini-batch's gradients in its k micro-batches against one pass of
    # it through the same engine (check h)
    micro_batch_pair: bool | None = run_field(None)

    def unexercised(self) -> dict[Aspect, str]:
        """Each aspect the case leaves unexercised, with its reason (the older
        `clip_not_exercised` read as `ratio_clip`'s); names outside Aspect are left to validation."""
        reasons = {Aspect(k): v for k, v in self.not_exercised.items() if k in ASPECTS}
        if self.clip_not_exercised:
            reasons.setdefault(Aspect.RATIO_CLIP, self.clip_not_exercised)
        return reasons


class Aspect(StrEnum):
    """What a case gives its checks to see (the names of case key `not_exercised`). A case that
    leaves one out says why; check_exercised holds every run to the others, as measured."""

    SECOND_UPDATE = "second_update"  # updates > 1: an off-policy update (checks l and i)
    RATIO_CLIP = "ratio_clip"  # PPO's clip on the last update (actor/pg_clipfrac_last_update > 0)
    GRAD_CLIP = "grad_clip"  # the clip by the global norm engaged (sync/clip_coef < 1, check k)
    KL_REFERENCE = "kl_reference"  # the KL reference a step away (ppo/kl_reference_gap_mean > 0)
    ADAM_BETAS = "adam_betas"  # betas that are not torch's, over a second update (check i)
    SP_BOUNDARY = "sp_boundary"  # SP: a chunk boundary on a response token (sp_boundaries > 0)


ASPECTS = tuple(Aspect)
TORCH_ADAM_BETAS = (0.9, 0.999)  # torch's AdamW defaults: an engine that drops the case's has them


def covered(aspect: Aspect, engine: EngineSpec, ppo: PPOSpec) -> str | None:
    """Why the case's settings give `aspect` no room (another aspect's reason covers it), or
    None."""
    if aspect in (Aspect.RATIO_CLIP, Aspect.ADAM_BETAS) and ppo.updates < 2:
        return "one on-policy update cannot show it: second_update's reason covers it"
    if aspect == Aspect.SP_BOUNDARY and engine.sp_size < 2:
        return "without SP there is no chunk boundary"
    return None


def exercised_as_declared(aspect: Aspect, engine: EngineSpec, ppo: PPOSpec) -> str | None:
    """What of the case's settings exercises `aspect` by itself being declared, or None (the
    run's readings say whether it engaged)."""
    betas = (engine.adam_beta1, engine.adam_beta2)
    if aspect == Aspect.SECOND_UPDATE and ppo.updates > 1:
        return f"updates = {ppo.updates}"
    if aspect == Aspect.ADAM_BETAS and ppo.updates > 1 and betas != TORCH_ADAM_BETAS:
        return f"betas {betas[0]:g}, {betas[1]:g} over {ppo.updates} updates"
    if aspect == Aspect.KL_REFERENCE and ppo.kl_reference_shift > 0:
        return f"kl_reference_shift = {ppo.kl_reference_shift:g}"  # the gap is measured too
    return None


def reason_refused(aspect: Aspect, engine: EngineSpec, ppo: PPOSpec) -> str | None:
    """What a reason to leave `aspect` unexercised is refused for (the words a one-line error
    expects), or None where a reason is welcome: the case's settings exercise the aspect, or
    give it no room."""
    if room := covered(aspect, engine, ppo):
        return f"no reason ({room})"
    if settings := exercised_as_declared(aspect, engine, ppo):
        return f"no reason: the case exercises it ({settings})"
    return None


@dataclass(frozen=True)
class RankSpec:
    """spec.json: everything a rank needs, built by the case for one device kind; with the case's
    id, timeout and golden tier, it is also all a reader of the run folder needs of the case."""

    case_id: str
    model_path: str
    model_type: str
    device_kind: DeviceKind
    engine: EngineSpec
    ppo: PPOSpec
    memory_budget_mb: float | None = None
    engine_modules: tuple[str, ...] = ()
    # seconds a collective may wait before it fails and names its rank (below the case timeout)
    collective_timeout_s: float = 120.0
    timeout_s: float = 300.0  # the whole run's (the progress line counts against it)
    golden_tier: GoldenTier = GoldenTier.RELATIVE  # how compare holds two runs' metrics
    # the dtype a golden is keyed by and held to, where it is not engine.dtype: a verl trainer
    # run's compute dtype (its engine.dtype is the parameters', which its checks hold gradients to)
    golden_dtype: Dtype | None = None
    fault: FaultSpec | None = None  # the harness's own reliability tests inject one
    # the case kind that launched the run and whose checks judge it (CaseKindName, or a
    # downstream kind's own name)
    kind: str = CaseKindName.PPO_STEP

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RankSpec:
        """A spec holds what its kind declared; a key it leaves out reads as the field's default
        (a trainer run's spec.json holds only what verl's resolved config declares)."""
        engine, ppo = dict(data.get("engine", {})), dict(data.get("ppo", {}))
        for key, enum in (("dtype", Dtype), ("gradient_sync", SyncPolicy)):
            if key in engine:
                engine[key] = enum(engine[key])
        if "rollout" in ppo:
            ppo["rollout"] = Rollout(ppo["rollout"])
        if "capabilities" in engine:
            engine["capabilities"] = tuple(engine["capabilities"])
        _typed("engine", EngineSpec, engine)
        _typed("ppo", PPOSpec, ppo)
        _typed("spec", cls, data)
        return cls(
            **{
                **data,
                "model_path": data.get("model_path", ""),
                "model_type": data.get("model_type", ""),
                "device_kind": DeviceKind(data["device_kind"]),
                "engine": EngineSpec(**engine),
                "ppo": PPOSpec(**ppo),
                "golden_tier": GoldenTier(data.get("golden_tier", GoldenTier.RELATIVE)),
                "golden_dtype": Dtype(data["golden_dtype"]) if data.get("golden_dtype") else None,
                "engine_modules": tuple(data.get("engine_modules", ())),
                "fault": FaultSpec(**data["fault"]) if data.get("fault") else None,
            }
        )

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=1))

    @classmethod
    def read(cls, path: Path) -> RankSpec:
        return cls.from_json(json.loads(path.read_text()))


_PLAIN = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,)}


def _typed(where: str, record: type, values: dict[str, Any]) -> None:
    """spec.json as a rank may leave it (a rank can rewrite its own): each plain field (int,
    float, str, bool, or None where its type allows) holds a value of its type, or ValueError
    naming it, which a reader takes as an unreadable spec, never a crash in a check."""
    for each in fields(record):
        if each.name not in values or not isinstance(each.type, str):
            continue
        kinds = [k.strip() for k in each.type.split("|")]
        allowed = tuple(t for k in kinds for t in _PLAIN.get(k, ()))
        if len(allowed) == 0 or any(k not in _PLAIN and k != "None" for k in kinds):
            continue  # enums, tuples, nested records: their own constructors judge them
        value = values[each.name]
        if value is None and "None" in kinds:
            continue
        wrong_bool = isinstance(value, bool) and bool not in allowed
        if wrong_bool or not isinstance(value, allowed):
            raise ValueError(f"spec.json: {where}.{each.name}: expected {each.type}, got {value!r}")
