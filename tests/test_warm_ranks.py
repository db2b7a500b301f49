"""Warm ranks: forked from a warm parent per pytest process, fresh for every case."""

from pathlib import Path

import pytest

from pytest_fsdp_turbo import checks

FAULT = "PYTEST_FSDP_TURBO_FAULT"
PROBES = str(Path(__file__).parent / "warm_probes")
CASE = "tiny-qwen3_5-fsdp2-deferred"

pytestmark = pytest.mark.devices(2)


def test_forked_and_spawned_ranks_give_identical_results(ppo_run):
    warm = ppo_run(CASE, launcher="local")
    cold = ppo_run(CASE, launcher="spawn")
    for result in (warm, cold):
        checks.check_all(result)
    assert warm.notes == []  # forked: no fallback note
    for key in ("actor/grad_norm", "actor/pg_loss", "comm/reduce_scatter_calls_by_micro_batch"):
        assert warm.metrics[key] == cold.metrics[key], key
    # start-up is imports and the process group; forked ranks skip the imports
    assert warm.metrics["timing_s/startup"] < cold.metrics["timing_s/startup"] / 3
    phases = {k for k in warm.metrics if k.startswith("timing_s/")}
    assert {
        f"timing_s/{p}"
        for p in (
            "startup",
            "load",
            "rollout",
            "reward",
            "logprobs",
            "train",
            "reference",
            "optimizer",
            "checks",
        )
    } <= phases


def test_a_case_after_a_failed_polluting_case_is_unaffected(ppo_run):
    before = ppo_run(CASE)
    failed = ppo_run(
        CASE,
        engine_modules=["polluter"],
        pythonpath=[PROBES],
        extra_env={FAULT: "crash:0:rollout"},
    )
    assert not failed.ok and "injected crash" in failed.failure_text()
    after = ppo_run(CASE, engine_modules=["leak_probe"], pythonpath=[PROBES])
    checks.check_all(after)  # leak_probe raises in the rank if env, modules or registry leaked
    for key in ("actor/grad_norm", "actor/pg_loss", "critic/score/mean"):
        assert after.metrics[key] == before.metrics[key], key  # RNG and weights untouched
    # the name passes as a plain backend (engine modules are given), but nothing registers it now
    orphan = ppo_run(
        CASE, backend="fsdp_polluted", engine_modules=["leak_probe"], pythonpath=[PROBES]
    )
    assert not orphan.ok
    assert (
        "no engine for model_type='qwen3_5_text', backend='fsdp_polluted'" in orphan.failure_text()
    )
