"""What the harness's observer writes from inside a verl trainer run (observe/ in the run folder),
as typed records both sides share: the observer writes them, the plugin reads them. Torch-free.
One spelling per field: a reader that names a field the observer does not write fails mypy."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

VERL_GRAD_NORM = "actor/grad_norm"  # verl's own step metric of the clipped gradient's norm
# a weight push: tensor name -> {RECEIVED: the dtype it came in, as torch names it without
# "torch."; and for each dtype a rollout may serve it in, the digest of its bytes cast to it}
Push = dict[str, dict[str, str]]
RECEIVED = "received"
# a parameter after the step: dtype -> digest of its bytes in that dtype
Digests = dict[str, str]


@dataclass
class ObservedStep:
    """One optimizer step on one trainer rank."""

    reduce_scatters_by_micro_batch: list[int] = field(default_factory=list)
    # per training micro-batch, collective kind -> the collectives that carried parameter
    # gradients (fsdp_probe.CollectiveCounter says which do)
    gradient_collectives_by_micro_batch: list[dict[str, int]] = field(default_factory=list)
    # unsharded gradient bytes held when each micro-batch after the first started
    retained_grad_bytes: list[int] = field(default_factory=list)
    shard_group_size: int | None = None  # ranks one parameter is sharded over
    fsdp_units: int | None = None  # the FSDP units whose forward ran
    shard_grad_sq: float | None = None  # the raw gradient shard's sum of squares, last backward
    reported_grad_norm: float | None = None  # what the engine's clip returned
    # the mini-batch the actor handed the engine (train_batch): a digest of each row's tokens,
    # and the largest advantage's magnitude
    rows: list[str] = field(default_factory=list)
    advantages_abs_max: float | None = None
    # the gradients the optimizer stepped on (read as its step began) against the raw ones after
    # the last backward: the scale that fits them best, and what that scale leaves unexplained
    # (largest entry, relative to the largest scaled raw entry)
    stepped_scale: float | None = None
    stepped_residual: float | None = None
    # what the reference's capture cost this step on this rank, in seconds (None: no capture)
    capture_seconds: float | None = None
    # the micro-batch pair: the same engine's gradients of the same mini-batch in one pass against
    # the k micro-batches it trained on, this rank's shard of each parameter as [sum of squared
    # differences, the k-pass gradient's sum of squares] (None: not paired), and what it cost
    micro_batch_pair: dict[str, list[float]] | None = None
    pair_seconds: float | None = None

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ObservedStep:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass
class ObservedRank:
    """A trainer rank: its steps, and (rank 0) each parameter after the last step, gathered whole."""

    rank: int
    pid: int
    steps: list[ObservedStep] = field(default_factory=list)
    post_step_parameters: dict[str, Digests] = field(default_factory=dict)
    batches: int = 0  # mini-batches the actor handed the engine (train_batch), stepped or not
    engine_class: str = ""  # the class of the engine train_batch ran on (module.Class)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ObservedRank:
        return cls(
            rank=int(data["rank"]),
            pid=int(data["pid"]),
            steps=[ObservedStep.from_json(s) for s in data.get("steps", [])],
            post_step_parameters=dict(data.get("post_step_parameters", {})),
            batches=int(data.get("batches", 0)),
            engine_class=str(data.get("engine_class", "")),
        )


@dataclass
class ObservedReplica:
    """A rollout replica (a vLLM worker): what each weight push handed it."""

    pid: int
    pushes: list[Push] = field(default_factory=list)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ObservedReplica:
        return cls(pid=int(data.get("pid", 0)), pushes=list(data.get("pushes", [])))


@dataclass
class ReplayedStep:
    """One optimizer step replayed by the single-process reference (trainer/replay.py): from the
    step's own parameters before it, on the union of the data-parallel ranks' mini-batches."""

    step: int
    rows: int = 0  # in the union of the data-parallel ranks' mini-batches
    tokens: int = 0  # response tokens in it
    # c: the engine's raw gradients (after the last backward) against the reference's
    grad_max_rel_err: float | None = None
    grad_max_rel_err_param: str = ""
    grad_rel_l2_err: float | None = None
    reference_grad_norm: float | None = None
    # b: the old log-probs verl trained with, against the reference's forward of the same tokens
    old_logprob_max_abs_diff: float | None = None  # None: not the update's first mini-batch
    # and the reference policy's log-probs (the KL loss's) against the reference's forward at the
    # initial parameters (None: the mini-batch holds none)
    ref_logprob_max_abs_diff: float | None = None
    # l: the gradient verl's loss sent into each row's log-probs (times 1 / data-parallel size,
    # FSDP's average), against the reference loss's, relative to its largest entry
    loss_grad_max_rel_err: float | None = None
    loss_grad_rows: int = 0  # rows whose loss gradient the observer caught
    # i: the engine's parameters after the step against AdamW in closed form on its own clipped
    # gradients from the same parameters (largest entry, in units of the learning rate), and its
    # update against the reference's (relative L2)
    update_max_err_lr: float | None = None
    update_max_err_param: str = ""
    update_rel_l2_err: float | None = None
    # the parameters before this step against those after the previous one, or for the first
    # step the checkpoint as the engine loads it (largest |difference|; None where the run
    # resumes another): nothing may change the weights between them
    continuity_max_abs: float | None = None
    continuity_param: str = ""
    # in a run that computes in bf16: the same distances for the reference itself computed in
    # bf16 from the same parameters (what the dtype alone costs on this very computation)
    grad_rel_l2_noise: float | None = None
    # and per parameter [the engine's gradient's relative L2 distance from the reference's in
    # bf16, that one's from fp32]: c holds each parameter to its own rounding
    grad_param_rel_l2: dict[str, list[float]] | None = None
    old_logprob_noise: float | None = None
    ref_logprob_noise: float | None = None  # in the reference policy's own dtype
    update_rel_l2_noise: float | None = None
    clip_coef: float | None = None  # the reference's
    seconds: float = 0.0  # the replay of this step
    problem: str = ""  # what kept a reading from being taken (a missing capture, a name set)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ReplayedStep:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass
class Replay:
    """The reference's replay of a trainer run: each step, or what it refused to model."""

    refused: str = ""  # one line: the resolved config's setting the reference does not model
    error: str = ""  # the replay itself failed (a harness fault, said as such)
    steps: list[ReplayedStep] = field(default_factory=list)
    complete: bool = False  # every captured step was replayed (else the replay stopped short)
    kl_loss: bool = False  # the resolved config declares a KL loss: its steps hold ref log-probs

    def summary(self) -> str:
        """One line for the trainer's log."""
        if self.refused or self.error:
            return f"reference: {'refused: ' + self.refused if self.refused else self.error}"
        said = [
            f"step {s.step}: {s.problem}"
            if s.problem
            else (
                f"step {s.step}: c {s.grad_max_rel_err:.3g} ({s.grad_max_rel_err_param}), "
                f"i {s.update_max_err_lr:.3g} lr, {s.seconds:.1f} s"
            )
            for s in self.steps
        ]
        return "reference: " + ("; ".join(said) or "no step was captured")

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Replay:
        steps = [ReplayedStep.from_json(s) for s in data.get("steps", [])]
        return cls(
            refused=str(data.get("refused", "")),
            error=str(data.get("error", "")),
            steps=steps,
            complete=bool(data.get("complete", False)),
            kl_loss=bool(data.get("kl_loss", False)),
        )


def read_replay(path: Path) -> Replay | None:
    return _read(path, Replay)


def write_record(path: Path, record: Any) -> None:
    """Rewritten whole after each event, atomically: what was measured survives a failure."""
    write_json(path, asdict(record))


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_suffix(f".{os.getpid()}.tmp")
    scratch.write_text(json.dumps(data))
    os.replace(scratch, path)


def read_ranks(paths: list[Path]) -> dict[int, ObservedRank]:
    """rank -> its record, for each file that holds a readable one."""
    found = {}
    for path in paths:
        record = _read(path, ObservedRank)
        if record is not None:
            found[record.rank] = record
    return found


def read_replicas(paths: list[Path]) -> list[tuple[Path, ObservedReplica | None]]:
    """Each replica's file and its record (None: unreadable)."""
    return [(path, _read(path, ObservedReplica)) for path in paths]


def first_step_metrics(path: Path) -> dict[str, Any]:
    """verl's own metrics of the run's first step, as its tracking logger got them ({step:
    {name: value}}, written by the observer in the trainer's process)."""
    try:
        logged = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(logged, dict) or not logged:
        return {}
    first = min(logged, key=lambda step: float(step) if step.replace(".", "").isdigit() else 0)
    return logged[first] if isinstance(logged[first], dict) else {}


def _read(path: Path, kind: Any) -> Any:
    try:
        return kind.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None
