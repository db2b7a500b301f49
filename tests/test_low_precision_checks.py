"""c in low precision, per parameter, on hand-made results: each parameter's gradient is held to a
multiple of the rounding the same computation shows in the same run, with the reference and with
a single twin, so a wrong gradient is red at any scale of parameter. The same rule on real runs,
against broken engines: e2e/test_mutations.py (small-gradient mutants) and
benchmarks/bf16_parameters.py (healthy engines over seeds)."""

import pytest

from pytest_fsdp_turbo import checks
from pytest_fsdp_turbo_contract.records import (
    LossRecord,
    PostStepRecord,
    ReferenceRecord,
    ReplayRecord,
    TrainRecord,
)
from pytest_fsdp_turbo_contract.results import RankResult, RunResult
from tests.test_checks import DECLARED, declared_by, healthy, reference_metrics, result_of

BF16 = {DECLARED + "dtype": "bf16"}
# what check_twin reads before and after the sketches, alike in the run and its twin
TWIN_READINGS = {
    LossRecord.key("loss"): 0.1,
    ReplayRecord.key("old_logprob_max_abs_diff"): 0.0,
    ReplayRecord.key("old_logprob_worst_row"): 0,
    PostStepRecord.key("post_step_logprob_max_abs_diff"): 0.0,
}
SMALL = "model.layers.0.linear_attn.dt_bias"  # 1e-5 of the largest gradient, in real runs
# (engine's distance from the reference computed in bf16, the latter's own from fp32), per
# parameter, as measured on healthy runs of the NPU target's mode (benchmarks/bf16_parameters.py)
HEALTHY = {
    "model.embed_tokens.weight": [0.007, 0.008],
    "model.layers.0.mlp.up_proj.weight": [0.011, 0.012],
    "model.layers.0.linear_attn.A_log": [0.029, 0.028],
    SMALL: [0.021, 0.024],
    "model.layers.1.linear_attn.A_log": [0.0096, 0.00037],  # the reference's lucky draw
}


def with_reference(readings: dict) -> dict:
    return healthy(
        0,
        **reference_metrics("bf16", per_param=0.06, l2=8e-3),
        **{ReferenceRecord.key("grad_param_rel_l2"): readings},
    )


def test_each_parameter_is_held_to_the_rounding_the_reference_shows_in_its_dtype():
    checks.check_gradient_parity(result_of(with_reference(HEALTHY)))
    zeroed = {**HEALTHY, SMALL: [1.0, 0.024]}  # the whole gradient's L2 barely moves
    with pytest.raises(checks.CheckFailure) as failure:
        checks.check_gradient_parity(result_of(with_reference(zeroed)))
    said = str(failure.value)
    assert said.startswith(f"check c: parameter {SMALL}: its gradient differs from the single")
    assert "(sync/grad_param_rel_l2) by relative L2 error 1, 41.7 times" in said
    assert "tolerance 0.072 = 3 x that" in said
    # a later update's parameters were set apart by rounding already: not judged per parameter
    later = {**HEALTHY, f"{SMALL} (update 2)": [0.5, 0.02]}
    checks.check_gradient_parity(result_of(with_reference(later)))


def test_a_lucky_draw_of_the_references_rounding_is_floored_at_the_median_parameters():
    """One parameter's noise is one draw; the run's median parameter's noise is the floor."""
    margins = checks.rounding_margins(result_of(with_reference(HEALTHY)))
    worst = margins["reference"]
    assert worst.name == "model.layers.0.linear_attn.A_log"
    assert worst.noise == 0.028 and worst.ratio == pytest.approx(0.029 / 0.084)
    lucky = margins_of({"a": [0.0096, 0.00037], "b": [0.01, 0.012], "c": [0.01, 0.013]})
    assert lucky.noise == 0.012 and lucky.tolerance == pytest.approx(0.036)


def margins_of(readings: dict):
    return checks.rounding_margins(result_of(with_reference(readings)))["reference"]


def test_a_low_precision_run_with_the_reference_must_have_its_per_parameter_reading():
    bare = with_reference(HEALTHY)
    del bare[ReferenceRecord.key("grad_param_rel_l2")]
    with pytest.raises(checks.CheckFailure, match=r"metric 'sync/grad_param_rel_l2' missing"):
        checks.check_gradient_parity(result_of(bare))
    fp32 = healthy(0, **reference_metrics("fp32", per_param=2e-6, l2=1e-7))
    checks.check_gradient_parity(result_of(fp32))  # fp32: per parameter by its largest entry


def sketch_run(sketch: dict | None, dtype: str = "bf16") -> dict:
    run = healthy(0, **{DECLARED + "dtype": dtype}, **TWIN_READINGS)
    if sketch is not None:
        run[TrainRecord.key("grad_sketch")] = sketch
    return run


def twin_of(low: dict | None, sketch: dict) -> RunResult:
    metrics = healthy(0, **BF16, **TWIN_READINGS, **{TrainRecord.key("grad_sketch"): sketch})
    if low is not None:
        metrics[TrainRecord.key("grad_sketch_low")] = low
    twin = RunResult(
        "case-twin",
        1,
        [RankResult(0, 0, 1.0, None, metrics)],
        None,
        1.0,  # type: ignore[arg-type]
    )
    twin.launched = declared_by(metrics, 1, reference=False)
    return twin


# the twin's reference in bf16: [norm, projection, its relative L2 distance from fp32]
LOW = {
    "model.layers.0.mlp.up_proj.weight": [2.0, 0.5, 0.012],
    SMALL: [2e-5, 1e-5, 0.024],
    "model.layers.0.linear_attn.A_log": [1e-5, 4e-6, 0.028],
}
RUN = {
    "model.layers.0.mlp.up_proj.weight": [2.01, 0.501],
    SMALL: [2.02e-5, 1.01e-5],
    "model.layers.0.linear_attn.A_log": [1.01e-5, 4.05e-6],
}


def twin_checked(run: dict, low: dict | None = LOW) -> None:
    checks.check_twin(result_of(sketch_run(run), twin=twin_of(low, RUN)))


def test_a_single_twin_holds_each_gradient_norm_to_the_rounding_of_its_reference():
    twin_checked(RUN)
    for factor, times in ((0.0, "41.7 times"), (0.5, "20.8 times")):
        wrong = {**RUN, SMALL: [2e-5 * factor, 1e-5 * factor]}
        with pytest.raises(checks.CheckFailure) as failure:
            twin_checked(wrong)
        said = str(failure.value)
        assert f"check c: twin (single): parameter {SMALL}: its gradient's norm differs" in said
        assert times in said, said
    # gradients that trade places keep the norm: the projection still sees them
    swapped = {**RUN, "model.layers.0.mlp.up_proj.weight": [2.0, -0.5]}
    with pytest.raises(checks.CheckFailure, match=r"gradient sketch differs from the twin's by"):
        twin_checked(swapped)


def test_the_sketches_a_twin_judges_are_required_not_skipped():
    """A run that drops its sketch, or a low-precision twin without its reference, is red."""
    with pytest.raises(checks.CheckFailure, match=r"metric 'sync/grad_sketch' missing"):
        checks.check_twin(result_of(sketch_run(None), twin=twin_of(LOW, RUN)))
    with pytest.raises(checks.CheckFailure, match=r"metric 'sync/grad_sketch_low' missing"):
        twin_checked(RUN, low=None)
