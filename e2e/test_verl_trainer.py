"""verl's own trainer, one step of `python -m verl.trainer.main_ppo` per trainer case x device
kind, judged by the harness's checks (with the single-process reference where the case has one)
and goldens, the same table and junit properties
as every case."""

from __future__ import annotations

from pytest_fsdp_turbo import checks


def test_verl_trainer_one_step(
    fsdp_turbo_trainer_case,
    verl_trainer_run,
    fsdp_turbo_golden,
    record_property,
    no_leaked_processes,
):
    result = verl_trainer_run(fsdp_turbo_trainer_case)
    verdict = checks.check_all(result)
    expected = {"a", "e", "h", "j", "k"}
    if fsdp_turbo_trainer_case.case.with_reference:
        expected |= {"b", "c", "i", "l"}
    assert {o.check for o in verdict.with_status(checks.PASSED)} == expected
    golden = fsdp_turbo_golden(result, fsdp_turbo_trainer_case)
    record_property("fsdp_turbo/golden", str(golden))
