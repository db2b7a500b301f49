"""The class of bug this harness exists for must turn a run red."""

from pathlib import Path

import pytest

from pytest_fsdp_turbo import checks


@pytest.mark.e2e
@pytest.mark.cpu_e2e
@pytest.mark.devices(2)
def test_broken_gradient_sync_fails_check_c(ppo_run):
    result = ppo_run(
        "tiny-qwen3_5-fsdp2-deferred",
        backend="fsdp_off_by_one_sync",
        engine_modules=["broken_engines"],
        pythonpath=[str(Path(__file__).parent)],
    )
    checks.check_completed(result)  # it runs to the end: only the gradient check can tell
    checks.check_grad_norm(result)
    with pytest.raises(checks.CheckFailure) as failure:
        checks.check_gradient_parity(result)
    message = str(failure.value)
    assert message.startswith("check c: rank 0: parameter model.")
    assert "gradient differs from the single-process reference by" in message
    assert "tolerance 0.0001" in message
    assert result.metrics["sync/grad_max_rel_err"] > 0.01
