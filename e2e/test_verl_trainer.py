"""verl's own trainer, one step of `python -m verl.trainer.main_ppo` per trainer case x device
kind, judged by the harness's checks (a, e, h) and goldens, the same table and junit properties
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
    assert {o.check for o in verdict.with_status(checks.PASSED)} == {"a", "e", "h", "j", "k"}
    golden = fsdp_turbo_golden(result, fsdp_turbo_trainer_case)
    record_property("fsdp_turbo/golden", str(golden))
