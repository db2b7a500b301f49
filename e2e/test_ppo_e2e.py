"""One real 1-step PPO run per case x device kind, and every check that a run can prove."""

from __future__ import annotations

import pytest

from pytest_fsdp_turbo import checks
from pytest_fsdp_turbo_contract.records import TrainRecord
from pytest_fsdp_turbo_contract.vocab import TwinKind


def declared_not_applicable(case) -> set[str]:
    """The checks a case's declaration leaves out, and only those: no reference and no twin (c),
    no HSDP replicas (d), no memory budget (f), one rank (j). Every other check applies, and a
    reading it lacks fails it."""
    out = set()
    if not case.with_reference_checks() and case.twin_kind() == TwinKind.NONE:
        out.add("c")
    if case.engine.shard_size * case.engine.sp_size == case.engine.world_size:
        out.add("d")
    if case.memory_budget_mb is None:
        out.add("f")
    if case.engine.world_size < 2:
        out.add("j")
    return out


def test_ppo_one_step(
    fsdp_turbo_case, ppo_run, fsdp_turbo_golden, record_property, no_leaked_processes
):
    result = ppo_run(fsdp_turbo_case)
    verdict = checks.check_all(result)  # every check that applies; the memory budget rides along
    left_out = {o.check for o in verdict.with_status(checks.NOT_APPLICABLE)}
    assert left_out == declared_not_applicable(fsdp_turbo_case.case), verdict.not_applicable()
    checks.check_exercised(result)  # the case's second update clipped, its KL pulled, its SP split
    golden = fsdp_turbo_golden(result, fsdp_turbo_case)  # g: checked, or recorded, or missing
    record_property("fsdp_turbo/golden", str(golden))


@pytest.mark.e2e
@pytest.mark.cpu_e2e
@pytest.mark.devices(2)
def test_sync_policies_agree_and_differ_in_cost(ppo_run):
    """Deferred and every-micro-batch sync: same gradients, different memory and communication.
    (The matrix runs both policies on tiny Qwen3.5 too; here the cheapest model compares them.)"""
    deferred = ppo_run("tiny-llama-fsdp2-deferred")
    every = ppo_run("tiny-llama-fsdp2-deferred", gradient_sync="every_micro_batch")
    for result in (deferred, every):
        checks.check_completed(result)
    checks.check_policies_agree(deferred, every)  # raises beyond POLICY_AGREEMENT_TOL
    assert (
        deferred.metrics[TrainRecord.key("reduce_scatter_calls")]
        < every.metrics[TrainRecord.key("reduce_scatter_calls")]
    )
    assert deferred.metrics[TrainRecord.key("retained_grad_bytes")] > 0
    assert every.metrics[TrainRecord.key("retained_grad_bytes")] == 0
    units = deferred.metrics[TrainRecord.key("fsdp_units")]
    assert deferred.metrics[TrainRecord.key("reduce_scatter_calls_by_micro_batch")] == [0, units]
    assert every.metrics[TrainRecord.key("reduce_scatter_calls_by_micro_batch")] == [units, units]
