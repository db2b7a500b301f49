"""One real 1-step PPO run per case x device kind, and every check that a run can prove."""

from __future__ import annotations

import warnings

import pytest

from pytest_fsdp_turbo import checks, goldens
from pytest_fsdp_turbo.session import settings_of
from pytest_fsdp_turbo.vocab import GoldenStatus


def test_ppo_one_step(fsdp_turbo_case, ppo_run, pytestconfig, record_property, no_leaked_processes):
    case = fsdp_turbo_case.case
    result = ppo_run(fsdp_turbo_case)
    checks.check_all(result)  # every check that applies; the case's memory budget rides along
    settings = settings_of(pytestconfig)
    golden = goldens.check_or_record(
        result,
        case,
        fsdp_turbo_case.kind,
        settings.goldens,
        settings.record_golden,
        strict=settings.strict,
    )
    record_property("fsdp_turbo/golden", str(golden))
    if golden.status == GoldenStatus.MISSING:
        warnings.warn(f"golden {golden}; record it: {goldens.RECORD_COMMAND}", stacklevel=1)


@pytest.mark.e2e
@pytest.mark.cpu_e2e
@pytest.mark.devices(2)
def test_sync_policies_agree_and_differ_in_cost(ppo_run):
    """Deferred and every-micro-batch sync: same gradients, different memory and communication."""
    deferred = ppo_run("tiny-qwen3_5-fsdp2-deferred")
    every = ppo_run("tiny-qwen3_5-fsdp2-every_micro_batch")
    for result in (deferred, every):
        checks.check_completed(result)
    checks.check_policies_agree(deferred, every)  # raises beyond POLICY_AGREEMENT_TOL
    assert (
        deferred.metrics["comm/reduce_scatter_calls"] < every.metrics["comm/reduce_scatter_calls"]
    )
    assert deferred.metrics["sync/retained_grad_bytes"] > 0
    assert every.metrics["sync/retained_grad_bytes"] == 0
    units = deferred.metrics["comm/fsdp_units"]
    assert deferred.metrics["comm/reduce_scatter_calls_by_micro_batch"] == [0, units]
    assert every.metrics["comm/reduce_scatter_calls_by_micro_batch"] == [units, units]
