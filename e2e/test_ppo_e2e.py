"""One real 1-step PPO run per case x device kind, and every check that a run can prove."""

from __future__ import annotations

import pytest

from pytest_fsdp_turbo import checks
from pytest_fsdp_turbo_contract.records import TrainRecord


def test_ppo_one_step(
    fsdp_turbo_case, ppo_run, fsdp_turbo_golden, record_property, no_leaked_processes
):
    result = ppo_run(fsdp_turbo_case)
    checks.check_all(result)  # every check that applies; the case's memory budget rides along
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
