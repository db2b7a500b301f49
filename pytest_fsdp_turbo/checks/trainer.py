"""The verdicts on a verl trainer run (`main_ppo`), every optimizer step of it, over what the harness's observer read
from outside verl and what verl's resolved config declares (spec.json).

  a  the gradient norm each rank's engine reported: finite, the same on every rank, equal to the
     global L2 norm of the raw gradient shards the harness read after the last backward, and equal
     to verl's own `actor/grad_norm` step metric; never 0 when the mini-batch the actor handed
     the engine (`train_batch`) has non-zero advantages
  e  every rollout replica's last weight push equals the trainer's parameters after the step,
     tensor by tensor, in the dtype the rollout declares (exact bytes), and every replica got one
  h  the resolved sync policy (`use_no_sync_for_gradient_accumulation`) proven by reduce-scatters
     per micro-batch and by the unsharded gradients held between micro-batches; and, where the
     case declares the micro-batch pair, each parameter's gradient over the k micro-batches equal
     to its gradient in one pass of the same mini-batch through the same engine
  j  the data-parallel ranks' mini-batches (each row's tokens, as `train_batch` got them) are
     disjoint
  k  the optimizer stepped on the raw gradients after the last backward times the clip
     coefficient min(1, grad_clip / (the harness's global norm + 1e-6)): a clip skipped, or
     gradients changed between the backward and the step, is red
  g  goldens of verl's step metrics per hardware (pytest_fsdp_turbo.checks.goldens, as every case)
  b, c, i, l and a's reference norm: the single-process reference's replay of every step
     (trainer_reference.py)

What a trainer run cannot have, and why, is said from the case kind (TRAINER_CANNOT), never from a
missing measurement: a check that applies and finds its reading missing fails, naming the file.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from pytest_fsdp_turbo.checks.check_sets import CheckSet, register_check_set
from pytest_fsdp_turbo.checks.gradients import check_grad_norm
from pytest_fsdp_turbo.checks.optimizer import check_clip
from pytest_fsdp_turbo.checks.readings import (
    GRAD_NORM,
    MICRO_BATCH_PAIR_REL_L2,
    _dtype,
    _rel,
    _value,
    declared,
)
from pytest_fsdp_turbo.checks.sync import (
    check_data_rows,
    check_gradient_collectives,
    check_reduce_scatters,
    check_retained_gradients,
)
from pytest_fsdp_turbo.checks.tolerances import MICRO_BATCH_PAIR_TOL, NORM_AGREEMENT_REL
from pytest_fsdp_turbo.checks.trainer_reference import (
    check_old_logprobs,
    check_trainer_gradients,
    check_trainer_loss_gradient,
    check_trainer_update,
)
from pytest_fsdp_turbo.checks.verdicts import CheckFailure, judges
from pytest_fsdp_turbo_contract.results import RunResult, read_json
from pytest_fsdp_turbo_contract.trainer_files import TrainerFolder
from pytest_fsdp_turbo_contract.trainer_records import (
    RECEIVED,
    VERL_GRAD_NORM,
    first_step_metrics,
    read_ranks,
    read_replicas,
)
from pytest_fsdp_turbo_contract.trainer_spec import TrainerSpec
from pytest_fsdp_turbo_contract.vocab import CaseKindName

# What a trainer run cannot have, and why (docs/verl.md says more). Short: the summary table shows them.
TRAINER_CANNOT = {
    "d": "verl's FSDP engines shard over one group: no HSDP replicas (rollout replicas: e)",
    "f": "a trainer case declares no memory budget",
}


def each_step(result: RunResult) -> list[tuple[int, RunResult]]:
    """The run as each optimizer step's readings: step 0's are the run's own (rankN.metrics.json,
    as every case's), a later step's are written beside them (TrainerFolder.step_metrics_of)."""
    folder = TrainerFolder(result.artifacts_dir)
    views = [(0, result)]
    for index in range(1, folder.stepped_count()):
        ranks = [
            dataclasses.replace(rank, metrics=read_json(folder.step_metrics_of(index, rank.rank)))
            for rank in result.ranks
        ]
        views.append((index, dataclasses.replace(result, ranks=ranks)))
    return views


def every_step(
    check: Callable[[RunResult], None], letter: str, views: list[tuple[int, RunResult]]
) -> None:
    """A check every case has, on each optimizer step's readings in turn (each_step). Every step
    is judged, so bugs on different steps of one run are each seen: the failure says each failed
    step's cause, the first step's first, a later one's naming its step."""
    failures = []
    for index, view in views:
        try:
            check(view)
        except CheckFailure as exc:
            said = str(exc).removeprefix(f"check {letter}: ")
            failures.append(f"check {letter}: {f'step {index}: ' if index else ''}{said}")
    if failures:
        raise CheckFailure("\n".join(failures))


@judges("a")
def check_trainer_grad_norm(result: RunResult) -> None:
    """a, as every case's on every step, then against verl's own step metric: the mean of the
    norms of the first training step's optimizer steps (verl averages its mini-batches')."""
    views = each_step(result)
    every_step(check_grad_norm, "a", views)
    folder = TrainerFolder(result.artifacts_dir)
    verl = first_step_metrics(folder.step_metrics).get(VERL_GRAD_NORM)
    if not isinstance(verl, int | float):
        raise CheckFailure(
            f"check a: verl's step metrics have no {VERL_GRAD_NORM} ({folder.step_metrics})"
        )
    updates = declared(result).ppo.updates
    asked = TrainerSpec.read(folder.spec).total_training_steps  # what the harness asked verl for
    if len(views) != asked * updates:
        raise CheckFailure(
            f"check a: the case asks for {asked} training step(s) of {updates} optimizer step(s) "
            f"(verl's resolved config); the engine stepped {len(views)} time(s)"
        )
    norms = [view.ranks[0].step.optimizer.grad_norm for _, view in views[:updates]]
    if len(norms) < updates or any(norm is None for norm in norms):
        raise CheckFailure(
            f"check a: verl's resolved config declares {updates} optimizer step(s) per training "
            f"step; rank 0's engine reported norms {norms} ({GRAD_NORM.key})"
        )
    mean = sum(n for n in norms if n is not None) / updates
    if not _rel(verl, mean) <= NORM_AGREEMENT_REL:
        said = f"{mean!r}" if updates == 1 else f"a mean of {mean!r} over {updates} steps"
        raise CheckFailure(
            f"check a: verl's step metric {VERL_GRAD_NORM} = {verl!r}, but rank 0's engine "
            f"reported {said} ({GRAD_NORM.key})"
        )


@judges("h")
def check_trainer_sync(result: RunResult) -> None:
    """h: the counts and the held gradients the resolved sync policy promises, every step."""
    every_step(_trainer_sync, "h", each_step(result))


def _trainer_sync(result: RunResult) -> None:  # one step's readings
    spec = declared(result)
    if spec.golden_dtype is None:  # written with what verl's config declares, and only then
        raise CheckFailure(
            f"check h: trainer case {result.case_id}: verl's resolved config was not read, so "
            "no sync policy is declared to hold the run to (the run's failure says why)"
        )
    measured = len(result.ranks[0].step.train.reduce_scatter_calls_by_micro_batch or [])
    micro_batches = spec.ppo.micro_batches or measured  # 0: dynamic batch sizes in verl's config
    head = (
        f"check h: trainer case {result.case_id}: verl's resolved config declares gradient_sync "
        f"{str(spec.engine.gradient_sync)!r} (use_no_sync_for_gradient_accumulation) with "
        f"{micro_batches} micro-batches"
    )
    if spec.ppo.micro_batches and measured != spec.ppo.micro_batches:
        raise CheckFailure(f"{head}: the harness saw {measured} training micro-batches on rank 0")
    check_reduce_scatters(result, str(spec.engine.gradient_sync), micro_batches, head)
    check_gradient_collectives(result, str(spec.engine.gradient_sync), micro_batches, head)
    check_retained_gradients(result, str(spec.engine.gradient_sync), micro_batches, head)
    if spec.ppo.micro_batch_pair and micro_batches > 1:  # one micro-batch is its own pair
        _micro_batch_pair(result, micro_batches, head)


def _micro_batch_pair(result: RunResult, micro_batches: int, head: str) -> None:
    tolerance = MICRO_BATCH_PAIR_TOL[_dtype(result)]
    distance = _value(result, 0, MICRO_BATCH_PAIR_REL_L2)
    if not distance <= tolerance:
        param = result.ranks[0].step.train.micro_batch_pair_param
        raise CheckFailure(
            f"{head}: the micro-batch pair: parameter {param}'s gradient over the "
            f"{micro_batches} micro-batches differs from one pass of the same mini-batch through "
            f"the same engine by {distance:.3g} (relative L2), tolerance {tolerance:g}"
        )


@judges("e")
def check_rollout_weights(result: RunResult) -> None:
    """e: each replica's last push, tensor by tensor, against the trainer after the step."""
    folder = TrainerFolder(result.artifacts_dir)
    first = read_ranks(folder.ranks()).get(0)
    trainer = first.post_step_parameters if first is not None else {}
    if not trainer:
        raise CheckFailure(f"check e: rank 0 read no parameters after the step ({folder.rank(0)})")
    expected = declared(result).ppo.rollout_replicas
    if expected is None:
        raise CheckFailure(
            f"check e: the run's spec.json declares no rollout replicas ({folder.path}): verl "
            f"saved no resolved config ({folder.resolved_config}), or it names none"
        )
    replicas = read_replicas(folder.replicas())
    if len(replicas) != expected:
        raise CheckFailure(
            f"check e: {len(replicas)} rollout replica(s) received weights, verl's resolved "
            f"config declares {expected} ({folder.observe})"
        )
    for number, (path, replica) in enumerate(replicas):
        pushes = replica.pushes if replica is not None else []
        name = f"rollout replica {number} ({path.name})"
        if not pushes:
            raise CheckFailure(f"check e: {name} received no weight push")
        last = pushes[-1]
        missing = sorted(set(trainer) - set(last))
        if missing:
            raise CheckFailure(
                f"check e: {name}: its last push lacks {len(missing)} of the trainer's "
                f"{len(trainer)} parameters (first: {missing[0]}): a partial push"
            )
        served = declared(result).ppo.rollout_dtype  # None: as each tensor came in
        wrong = []
        for tensor, got in sorted(last.items()):
            dtype = served if served in got else got.get(RECEIVED, "")
            if trainer.get(tensor, {}).get(dtype) != got.get(dtype):
                wrong.append((tensor, dtype, got.get(RECEIVED, "")))
        if wrong:
            tensor, dtype, came = wrong[0]
            exact = trainer.get(tensor, {}).get(came) == last[tensor].get(came)
            how = (
                f"it came in {came}, the trainer's own weights in that dtype, which the rollout "
                f"serves in {dtype} (actor_rollout_ref.rollout.dtype): a push cast on the way"
                if exact and came != dtype
                else "a stale or wrong push"
            )
            raise CheckFailure(
                f"check e: {name}: {len(wrong)} of the {len(last)} tensors of its last push "
                f"differ from the trainer's parameters after the step in {dtype} (first: "
                f"{tensor}): {how}"
            )


@judges("j")
def check_trainer_rows(result: RunResult) -> None:
    """j, as every case's, on every step (its note on the run: every failed step's line)."""
    every_step(check_data_rows, "j", each_step(result))


@judges("k")
def check_trainer_clip(result: RunResult) -> None:
    """k, as every case's, on every step (its note on the run: every failed step's line)."""
    every_step(check_clip, "k", each_step(result))


TRAINER_CHECKS = CheckSet(
    CaseKindName.VERL_TRAINER,
    (
        ("a", lambda r, _: check_trainer_grad_norm(r)),
        ("b", lambda r, _: check_old_logprobs(r)),
        ("c", lambda r, _: check_trainer_gradients(r)),
        ("e", lambda r, _: check_rollout_weights(r)),
        ("h", lambda r, _: check_trainer_sync(r)),
        ("i", lambda r, _: check_trainer_update(r)),
        ("j", lambda r, _: check_trainer_rows(r)),
        ("k", lambda r, _: check_trainer_clip(r)),
        ("l", lambda r, _: check_trainer_loss_gradient(r)),
    ),
    TRAINER_CANNOT,
)
register_check_set(TRAINER_CHECKS)
