"""The replay twin: the layout that replays a case's saved batch without a single-process
reference, and a run followed by its twin."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from pytest_fsdp_turbo.cases import Case
from pytest_fsdp_turbo.launching.request import RunRequest, run_env
from pytest_fsdp_turbo_contract.artifacts import RunFolder
from pytest_fsdp_turbo_contract.engines import EngineCatalog
from pytest_fsdp_turbo_contract.results import RunResult
from pytest_fsdp_turbo_contract.vocab import Rollout, SyncPolicy, TwinKind


def twin_case(case: Case) -> Case | None:
    """The reference layout that replays a case's batch. single: our own FSDP2 engine on one
    unsharded rank, the whole global batch in one micro-batch, no sequence parallelism, HF rollout;
    so a twin differs from the main run in engine, world size, sharding, micro-batch split and SP
    all at once, and a bug tied to any of them cannot repeat in it. every_micro_batch: the same
    engine and layout, syncing every micro-batch (a policy comparison, not an independent one)."""
    kind = case.twin_kind()
    if kind == TwinKind.NONE:
        return None
    common = {"id": f"{case.id}-twin", "twin": TwinKind.NONE}
    ppo = replace(case.ppo, reference_checks=False)
    if kind == TwinKind.EVERY_MICRO_BATCH:
        engine = replace(case.engine, gradient_sync=SyncPolicy.EVERY_MICRO_BATCH)
        return replace(case, engine=engine, ppo=ppo, **common)
    engine = replace(
        case.engine,
        backend="fsdp",
        world_size=1,
        fsdp_size=0,
        sp_size=1,
        turbo_config={},
        packed=False,
    )
    ppo = replace(ppo, micro_batches=1, rollout=Rollout.HF)
    return replace(
        case,
        engine=engine,
        ppo=ppo,
        capabilities=EngineCatalog().capabilities("fsdp"),
        **common,
    )


def with_turbo_config(request: RunRequest) -> RunRequest:
    """fsdp_turbo cases: the exact turbo_config for the checkout's layout and the model's module
    tree, validated against the checkout's schema before any rank starts."""
    if not request.case.is_turbo or request.turbo_config is not None:
        return request
    from pytest_fsdp_turbo.turbo.library import turbo_config_for  # only turbo cases load packaging

    checkout = request.checkout.path if request.checkout is not None else None
    config = turbo_config_for(request.case, request.accelerator.kind, request.model_path, checkout)
    return replace(request, turbo_config=config)


def run_with_twin(request: RunRequest, launch: Callable[[RunRequest], RunResult]) -> RunResult:
    """The case, then (if it declares one and completed) its twin replaying the saved batch."""
    run_env(request)  # a fault the ranks could not act on is refused before anything
    request = with_turbo_config(request)
    result = launch(request)
    twin = twin_case(request.case)
    if twin is not None:  # declared, whether or not it gets to run: check c applies by it
        result.twin_kind = request.case.twin_kind()
    if twin is None or not result.ok:
        return result
    twin_request = replace(
        request,
        case=twin,
        artifacts_dir=RunFolder(request.artifacts_dir).twin.path,
        checkout=request.checkout if twin.is_turbo else None,
        turbo_config=None,
        replay=request.artifacts_dir,
    )
    twin_request = with_turbo_config(twin_request)
    result.twin, result.twin_kind = launch(twin_request), request.case.twin_kind()
    return result
