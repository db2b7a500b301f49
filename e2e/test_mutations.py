"""The mutation suite: every check is proven by a deliberately broken engine it turns red, in both
modes a case can run in (an in-rank single-process reference, or no reference and a replay twin).
The healthy engine passes both. Engines: e2e/broken_engines.py, each named after its bug.

Not in cpu_e2e (it is the harness's own proof, not a hardware case): select it with -m mutation.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from pytest_fsdp_turbo import checks, goldens

HERE = Path(__file__).parent
CASE = "tiny-qwen3_5-fsdp2-deferred"
HSDP_CASE = "tiny-qwen3-hsdp-2x2-deferred"
MODES = {
    "reference": {"reference_checks": True, "twin": "none"},
    "twin": {"reference_checks": False, "twin": "single"},
}
ALL_CHECKS = "abcdefhi"  # g (goldens) is proven below, outside check_all


@dataclass(frozen=True)
class Mutant:
    backend: str
    caught: dict[str, tuple[tuple[str, str], ...]]  # mode -> (check letter, text in its message)
    case: str = CASE

    def __str__(self) -> str:
        return self.backend


def both(*expected: tuple[str, str]) -> dict:
    return {"reference": expected, "twin": expected}


MUTANTS = (
    Mutant(
        "fsdp_off_by_one_sync",
        {
            "reference": (("c", "gradient differs from the single-process reference"),),
            "twin": (
                ("h", "expected reduce-scatters per micro-batch [0, 5], measured [5, 0]"),
                ("c", "twin (single): actor/grad_norm"),
            ),
        },
    ),
    Mutant(
        "fsdp_noop_sync_context",
        both(
            ("h", "declared gradient_sync 'deferred' with 2 micro-batches"),
            ("h", "measured [5, 5]"),
        ),
    ),
    Mutant(
        "fsdp_never_sync",
        both(("a", "actor/grad_norm = 0 on a step whose advantages"), ("h", "measured [0, 0]")),
    ),
    Mutant(
        "fsdp_gradients_divided_twice",
        {
            "reference": (
                ("c", "gradient differs from the single-process reference"),
                ("a", "the single-process reference gradients' norm"),
            ),
            "twin": (("c", "twin (single): actor/grad_norm"),),
        },
    ),
    Mutant("fsdp_norm_max_over_ranks", both(("a", "global L2 norm of the sharded gradients"))),
    Mutant("fsdp_skip_step_on_rank1", both(("i", "rank 1: actor/param_update_max_abs = 0"))),
    Mutant(
        "fsdp_double_step",
        {
            "reference": (("i", "the single-process reference step's"),),
            "twin": (("c", "post-step logprobs on the batch differ from the twin's"),),
        },
    ),
    Mutant(
        "fsdp_dropout_in_training_forward",
        both(("b", "actor/ppo_kl on the first micro-batch")),
    ),
    Mutant("fsdp_drifting_replica", both(("d", "sync/replica_max_abs_diff")), case=HSDP_CASE),
    Mutant("fsdp_stale_rollout_weights", both(("e", "sync/rollout_logprob_max_abs_diff"))),
    Mutant("fsdp_hoarding_memory", both(("f", "perf/peak_memory_bytes"))),
)
VERL_CASE = "tiny-qwen3-verl-fsdp2-deferred"
GOLDEN_MUTANT = "fsdp_gradients_divided_twice"
assert any(m.backend == GOLDEN_MUTANT and m.case == CASE for m in MUTANTS)


def run_broken(ppo_run, backend: str, case: str, mode: str, module: str = "broken_engines"):
    return ppo_run(
        case,
        backend=backend,
        engine_modules=[module],
        pythonpath=[str(HERE)],
        **MODES[mode],
    )


def test_every_check_has_a_mutant_in_every_mode():
    for mode in MODES:
        letters = {letter for m in MUTANTS for letter, _ in m.caught[mode]}
        assert letters == set(ALL_CHECKS), f"{mode}: no mutant for {set(ALL_CHECKS) - letters}"


pytestmark = [pytest.mark.mutation, pytest.mark.devices(2)]


@pytest.mark.parametrize("mode", list(MODES))
def test_healthy_engine_passes(ppo_run, mode):
    result = ppo_run(CASE, **MODES[mode])
    verdict = checks.check_all(result)
    assert verdict.not_applicable() == ["d: no replicas"]
    assert (result.twin is not None) == (mode == "twin")


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("mutant", MUTANTS, ids=str)
def test_check_catches_broken_engine(ppo_run, pytestconfig, mutant, mode):
    result = run_broken(ppo_run, mutant.backend, mutant.case, mode)
    checks.check_completed(result)  # every bug here runs to the end: only the checks can tell
    failed = {o.check: o.detail for o in checks.evaluate(result).with_status(checks.FAILED)}
    for letter, text in mutant.caught[mode]:
        assert letter in failed, f"check {letter} missed {mutant}; failed: {failed}"
        assert f"check {letter}" in failed[letter] and text in failed[letter], failed[letter]
    with pytest.raises(checks.CheckFailure):
        checks.check_all(result)
    if mutant.backend == GOLDEN_MUTANT:  # the same run proves g (goldens live outside check_all)
        assert_golden_is_red(result, pytestconfig)


def assert_golden_is_red(result, pytestconfig) -> None:
    """g: the case's recorded golden turns red when the gradients are silently halved."""
    from pytest_fsdp_turbo.session import cases_of

    case = cases_of(pytestconfig).get(CASE)
    with pytest.raises(checks.CheckFailure, match=r"check g: metric actor/grad_norm = "):
        goldens.check_or_record(result, case, "cpu", None, record=False)


@pytest.mark.parametrize("mode", list(MODES))
def test_verl_engine_with_noop_sync_context_is_caught(ppo_run, mode):
    """A subclass of verl's own FSDP2 engine, registered in verl's registry, tested as it is."""
    result = run_broken(
        ppo_run, "verl:fsdp2_noop_sync_context", VERL_CASE, mode, module="broken_verl_engines"
    )
    checks.check_completed(result)
    failed = {o.check: o.detail for o in checks.evaluate(result).with_status(checks.FAILED)}
    assert set(failed) == {"h"}, failed  # same gradients; only the contract can tell
    units = result.metrics["comm/fsdp_units"]
    assert (
        f"expected reduce-scatters per micro-batch [0, {units}], measured [{units}, {units}]"
        in (failed["h"])
    )


@pytest.mark.parametrize("mode", list(MODES))
def test_verl_engine_as_shipped_passes(ppo_run, mode):
    result = ppo_run(VERL_CASE, **MODES[mode])
    assert checks.check_all(result).not_applicable() == ["d: no replicas"]
