"""Check logic on hand-made results: tolerance selection by dtype, what applies, every failure listed.
The same checks on real runs, against broken engines, are in e2e/test_mutations.py."""

import dataclasses
from pathlib import Path

import pytest

from pytest_fsdp_turbo import checks
from pytest_fsdp_turbo.checks.sync import expected_gradient_collectives
from pytest_fsdp_turbo_contract.records import (
    LossRecord,
    OptimizerRecord,
    PerfRecord,
    PostStepRecord,
    RankRecord,
    ReferenceRecord,
    RolloutRecord,
    StepMetrics,
    TrainRecord,
)
from pytest_fsdp_turbo_contract.results import RankResult, RunResult
from pytest_fsdp_turbo_contract.spec import EngineSpec, PPOSpec, RankSpec
from pytest_fsdp_turbo_contract.vocab import DeviceKind, Dtype, SyncPolicy

# What the run declared rides in the hand-made metrics under this prefix, no record's: declared_by
# turns it into the run's spec, which is where the checks read it.
DECLARED = "declared/"


def healthy(rank: int, **changes) -> dict:
    metrics = {
        DECLARED + "dtype": "fp32",
        DECLARED + "gradient_sync": "deferred",
        DECLARED + "micro_batches": 2,
        DECLARED + "memory_budget_mb": None,
        OptimizerRecord.key("grad_norm"): 0.8,
        OptimizerRecord.key("grad_norm_finite"): True,
        OptimizerRecord.key("grad_norm_measured"): 0.8,
        RolloutRecord.key("advantages_abs_max"): 1.5,
        LossRecord.key("ppo_kl_first_micro_batch"): 0.0,
        LossRecord.key("ppo_log_ratio_abs_max_first_micro_batch"): 0.0,
        LossRecord.key("pg_clipfrac_first_micro_batch"): 0.0,
        PostStepRecord.key("replica_max_abs_diff"): None,
        PostStepRecord.key("rollout_logprob_max_abs_diff"): 0.0,
        PostStepRecord.key("rollout_weight_max_abs_diff"): 0.0,
        PostStepRecord.key("rollout_weight_worst"): "lm_head.weight",
        PostStepRecord.key("rollout_weights_compared"): 7,
        PostStepRecord.key("handoff_weight_max_abs_diff"): 0.0,
        PostStepRecord.key("handoff_weight_worst"): "lm_head.weight",
        OptimizerRecord.key("adamw_step_max_err_lr"): 1e-5,
        TrainRecord.key("reduce_scatter_calls_by_micro_batch"): [0, 5],
        TrainRecord.key("gradient_collectives_by_micro_batch"): [{}, {"reduce_scatter": 5}],
        TrainRecord.key("fsdp_units"): 5,
        TrainRecord.key("shard_group_size"): 2,
        TrainRecord.key("replicate_group_size"): 1,
        TrainRecord.key("retained_grad_bytes"): 1024,
        OptimizerRecord.key("param_update_max_abs"): 1e-4,
        OptimizerRecord.key("local_param_numel"): 100,
        PerfRecord.key("peak_memory_bytes"): 2**28,
        TrainRecord.key("data_rows"): [4 * rank + i for i in range(4)],
        OptimizerRecord.key("clip_max_rel_err"): 0.0,
        OptimizerRecord.key("clip_coef"): 1.0,
        TrainRecord.key("loss_grad_max_rel_err"): 0.0,
        **reported_layout(rank),
        "rank": rank,
    }
    return {**metrics, **changes}


def reported_layout(rank: int, world: int = 2, sp: int = 1, shard: int = 2) -> dict:
    """What an engine that follows the declared layout reports of its place (checks d and j)."""
    return {
        RankRecord.key("engine_data_rank"): rank // sp,
        RankRecord.key("engine_data_size"): world // sp,
        RankRecord.key("engine_data_group"): list(range(rank % sp, world, sp)),
        RankRecord.key("engine_replica_group"): list(range(rank % shard, world, shard)),
    }


def declared_by(metrics: dict, world_size: int = 2, reference: bool | None = None) -> RankSpec:
    """The spec a run was launched with, from what the hand-made metrics declare (DECLARED): the
    checks read what was declared from the spec, never from the ranks' metrics. The reference is
    declared where the hand-made metrics hold its readings, unless `reference` says otherwise."""
    step = StepMetrics.from_json(metrics)
    if reference is None:
        reference = step.reference.measured()
    sp = step.train.sp_size or 1
    engine = EngineSpec(
        world_size=world_size,
        fsdp_size=world_size // sp,
        sp_size=sp,
        dtype=Dtype(metrics.get(DECLARED + "dtype") or "fp32"),
        gradient_sync=SyncPolicy(metrics.get(DECLARED + "gradient_sync") or "deferred"),
    )
    ppo = PPOSpec(
        micro_batches=metrics.get(DECLARED + "micro_batches") or 2,
        updates=metrics.get(DECLARED + "updates") or 1,
        reference_checks=reference,
    )
    budget = metrics.get(DECLARED + "memory_budget_mb")
    return RankSpec("case", "model", "qwen3", DeviceKind.CPU, engine, ppo, budget)


def result_of(*ranks: dict, twin: RunResult | None = None) -> RunResult:
    return RunResult(
        case_id="case",
        world_size=len(ranks),
        ranks=[RankResult(r["rank"], 0, 1.0, Path(f"rank{r['rank']}.log"), r) for r in ranks],
        artifacts_dir=Path("."),
        duration_s=1.0,
        twin=twin,
        twin_kind="single" if twin else "",
        launched=declared_by(ranks[0], len(ranks)),
    )


def test_healthy_run_without_reference_or_twin_says_what_did_not_apply():
    verdict = checks.check_all(result_of(healthy(0), healthy(1)))
    assert verdict.not_applicable() == [
        "c: no reference, no twin declared",
        "d: no replicas",
        "f: no memory budget",
    ]


def test_a_check_that_applies_fails_when_its_measurement_is_missing():
    """An engine that runs its own loop and never reaches the harness's probe, or a reference
    that never ran: declared, so red, naming the metric and the phase that should have written
    it; never "not applicable" (which only the declaration decides)."""
    lacking = (
        TrainRecord.key("loss_grad_max_rel_err"),
        TrainRecord.key("data_rows"),
        OptimizerRecord.key("clip_max_rel_err"),
        PostStepRecord.key("rollout_logprob_max_abs_diff"),
    )
    ranks = [{k: v for k, v in healthy(r).items() if k not in lacking} for r in (0, 1)]
    result = result_of(*ranks)
    result.launched = declared_by(ranks[0], 2, reference=True)
    verdict = checks.evaluate(result)
    failed = {o.check: o.detail for o in verdict.with_status(checks.FAILED)}
    # a and i compare with the reference by declaration too: its readings missing is red
    assert set(failed) == {"a", "c", "e", "i", "j", "k", "l"}, failed
    assert "no reading of the reference gradients' norm (sync/reference_grad_norm)" in failed["a"]
    assert "no reading of the reference's step (sync/step_max_err_lr)" in failed["i"]
    assert (
        "check k: rank 0: no reading of the gradients the optimizer stepped on "
        "(sync/clip_max_rel_err)" in failed["k"]
    )
    assert "metric 'sync/grad_rel_l2_err' missing" in failed["c"]
    assert "phase 'reference' should have written it" in failed["c"]
    assert "phase 'train' should have written it" in failed["l"]
    assert "phase 'checks' should have written it" in failed["e"]
    declared_twin = result_of(healthy(0), healthy(1))
    declared_twin.twin_kind = "single"
    with pytest.raises(checks.CheckFailure, match="declares a twin; no twin run is attached"):
        checks.check_twin(declared_twin)


def test_every_failed_check_is_listed():
    broken = [
        healthy(
            r,
            **{
                OptimizerRecord.key("grad_norm_measured"): 1.6,
                TrainRecord.key("retained_grad_bytes"): 0,
            },
        )
        for r in (0, 1)
    ]
    with pytest.raises(checks.CheckFailure) as failure:
        checks.check_all(result_of(*broken))
    lines = str(failure.value).splitlines()
    assert [line[:8] for line in lines] == ["check a:", "check h:"]


def reference_metrics(dtype: str, per_param: float, l2: float) -> dict:
    return {
        DECLARED + "dtype": dtype,
        ReferenceRecord.key("grad_max_rel_err"): per_param,
        ReferenceRecord.key("grad_max_rel_err_param"): "model.layers.0.linear_attn.A_log",
        ReferenceRecord.key("grad_rel_l2_err"): l2,
        ReferenceRecord.key("reference_grad_norm"): 0.8,
    }


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        (
            {
                PostStepRecord.key("rollout_weight_max_abs_diff"): 1e-3,
                PostStepRecord.key("rollout_weight_worst"): "norm.weight",
            },
            "check e: rank 1: the rollout serves 'norm.weight' 0.001 away from the trainer's "
            "parameter after the push (7 tensors compared exactly",
        ),
        ({PostStepRecord.key("rollout_weights_compared"): 0}, "(0 tensors compared exactly"),
        (
            {
                PostStepRecord.key("rollout_logprob_max_abs_diff"): 0.5,
                PostStepRecord.key("rollout_weight_max_abs_diff"): 2.0,
            },
            "check e: rank 1: sync/rollout_logprob_max_abs_diff = 0.5, tolerance 0.0001; "
            "rank 1: the rollout serves",
        ),
    ],
)
def test_weight_handoff_must_be_exact_and_compare_something(changes, expected):
    result = result_of(healthy(0), healthy(1, **changes))
    with pytest.raises(checks.CheckFailure) as info:
        checks.check_all(result)
    assert expected in str(info.value)


def test_bf16_parity_is_held_to_relative_l2_and_to_rounding_not_to_the_largest_entry():
    """bf16: a parameter's error relative to its largest entry (0.85 where a tiny gradient's
    entries flip sign) is not judged; each parameter's relative L2 against the rounding the
    reference shows in bf16 is (tests/test_low_precision_checks.py), and the whole gradient's."""
    within = {
        ReferenceRecord.key("grad_param_rel_l2"): {"model.layers.0.linear_attn.A_log": [0.02, 0.03]}
    }
    tiny_grads_flip = healthy(0, **reference_metrics("bf16", per_param=0.85, l2=8e-3), **within)
    checks.check_gradient_parity(result_of(tiny_grads_flip))
    off = healthy(0, **reference_metrics("bf16", per_param=0.85, l2=0.2), **within)
    with pytest.raises(
        checks.CheckFailure, match=r"relative L2 error 0.2 \(sync/grad_rel_l2_err\)"
    ):
        checks.check_gradient_parity(result_of(off))
    fp32 = healthy(0, **reference_metrics("fp32", per_param=2e-4, l2=1e-7))
    with pytest.raises(checks.CheckFailure, match="parameter model.layers.0.linear_attn.A_log"):
        checks.check_gradient_parity(result_of(fp32))


@pytest.mark.parametrize(
    ("policy", "micro_batches", "shards", "want"),
    [
        ("deferred", 3, 2, [0, 0, 5]),
        ("every_micro_batch", 3, 2, [5, 5, 5]),
        ("deferred", 1, 2, [5]),
        ("deferred", 2, 1, [0, 0]),  # sharded one way: FSDP2 reduces nothing
    ],
)
def test_sync_contract_expectation(policy, micro_batches, shards, want):
    assert checks.expected_reduce_scatters(policy, micro_batches, 5, shards) == want


@pytest.mark.parametrize(
    ("policy", "micro_batches", "shards", "replicas", "want"),
    [
        ("deferred", 3, 2, 1, [{}, {}, {"reduce_scatter": 5}]),
        ("every_micro_batch", 2, 2, 1, [{"reduce_scatter": 5}] * 2),
        ("deferred", 2, 2, 2, [{}, {"reduce_scatter": 5, "all_reduce": 5}]),  # HSDP
        ("deferred", 2, 1, 2, [{}, {"all_reduce": 5}]),  # replicated, not sharded
        ("deferred", 2, 1, 1, [{}, {}]),  # one rank: nothing to reduce
    ],
)
def test_gradient_collective_expectation(policy, micro_batches, shards, replicas, want):
    got = expected_gradient_collectives(policy, micro_batches, 5, shards, replicas)
    assert got == want


def test_h_counts_every_gradient_collective_not_only_reduce_scatters():
    """Declared deferred, FSDP2's reduce-scatters right, but each gradient all-reduced by hand
    on the first micro-batch: the reduce-scatter counts alone read right; h is red."""
    by_hand = {
        TrainRecord.key("gradient_collectives_by_micro_batch"): [
            {"all_reduce": 27},
            {"reduce_scatter": 5},
        ]
    }
    with pytest.raises(
        checks.CheckFailure,
        match=r"^check h: case case: declared gradient_sync 'deferred' with 2 micro-batches "
        r"over 5 FSDP units that ran, sharded 2 ways, 1 replica\(s\): expected gradient "
        r"collectives per micro-batch \[none, 5 reduce_scatter\], measured \[27 all_reduce, 5 "
        r"reduce_scatter\] on rank 1 \(comm/gradient_collectives_by_micro_batch",
    ):
        checks.check_sync_contract(result_of(healthy(0), healthy(1, **by_hand)))
    # HSDP: FSDP2 all-reduces each unit's reduced gradients over the replicas too
    hsdp_counts = {
        TrainRecord.key("gradient_collectives_by_micro_batch"): [
            {},
            {"reduce_scatter": 5, "all_reduce": 5},
        ],
        TrainRecord.key("replicate_group_size"): 2,
    }
    checks.check_sync_contract(result_of(healthy(0, **hsdp_counts), healthy(1, **hsdp_counts)))
    lacking = healthy(1)
    del lacking[TrainRecord.key("gradient_collectives_by_micro_batch")]
    with pytest.raises(
        checks.CheckFailure, match="metric 'comm/gradient_collectives_by_micro_batch' missing"
    ):
        checks.check_sync_contract(result_of(healthy(0), lacking))


def test_single_micro_batch_deferred_must_not_retain_gradients():
    run = healthy(
        0,
        **{
            DECLARED + "micro_batches": 1,
            TrainRecord.key("reduce_scatter_calls_by_micro_batch"): [5],
            TrainRecord.key("gradient_collectives_by_micro_batch"): [{"reduce_scatter": 5}],
            TrainRecord.key("retained_grad_bytes"): 64,
        },
    )
    with pytest.raises(checks.CheckFailure, match="expected no unsharded gradients held"):
        checks.check_sync_contract(result_of(run))


def test_optimizer_step_after_non_finite_norm_must_leave_parameters_alone():
    skipped = {OptimizerRecord.key("grad_norm_finite"): False}
    checks.check_optimizer_step(
        result_of(healthy(0, **skipped, **{OptimizerRecord.key("param_update_max_abs"): 0.0}))
    )
    with pytest.raises(checks.CheckFailure, match="expected the step to be skipped"):
        checks.check_optimizer_step(result_of(healthy(0, **skipped)))
    empty_shard = healthy(
        1,
        **{
            OptimizerRecord.key("param_update_max_abs"): 0.0,
            OptimizerRecord.key("local_param_numel"): 0,
        },
    )
    checks.check_optimizer_step(result_of(healthy(0), empty_shard))  # holds nothing, moves nothing


def test_a_failed_twin_fails_check_c_with_its_failure_text():
    twin = RunResult("case-twin", 1, [RankResult(0, 1, 1.0, Path("t.log"))], Path("twin"), 1.0)
    with pytest.raises(checks.CheckFailure, match=r"check c: twin \(single\): the twin run failed"):
        checks.check_twin(result_of(healthy(0), twin=twin))


def test_on_policy_holds_each_token_in_fp32_where_a_mean_can_cancel():
    """Errors of both signs cancel in ppo_kl; the per-token log-ratio does not (fp32 only)."""
    cancelled = {LossRecord.key("ppo_kl_first_micro_batch"): 0.0}
    off = {**cancelled, LossRecord.key("ppo_log_ratio_abs_max_first_micro_batch"): 2e-3}
    with pytest.raises(checks.CheckFailure, match=r"check b: rank 1: a token's .* is 0.002 "):
        checks.check_on_policy(result_of(healthy(0), healthy(1, **off)))
    bf16 = {**off, DECLARED + "dtype": "bf16"}
    checks.check_on_policy(result_of(healthy(0, **bf16), healthy(1, **bf16)))


def test_data_ranks_must_train_on_disjoint_rows():
    same = [healthy(r, **{TrainRecord.key("data_rows"): [0, 1, 2, 3]}) for r in (0, 1)]
    with pytest.raises(checks.CheckFailure, match=r"^check j: ranks \[0, 1\] trained on the same"):
        checks.check_data_rows(result_of(*same))
    # an SP group of 2 shares its rows, and that is right
    sp = [
        healthy(
            r,
            **{TrainRecord.key("data_rows"): [r // 2], TrainRecord.key("sp_size"): 2},
            **reported_layout(r, world=4, sp=2),
        )
        for r in range(4)
    ]
    checks.check_data_rows(result_of(*sp))
    # the SP groups are consecutive ranks: ranks 0 and 2 sharing rows is another layout
    strided = [{**sp[r], TrainRecord.key("data_rows"): [r % 2]} for r in range(4)]
    with pytest.raises(
        checks.CheckFailure,
        match=r"^check j: ranks \[0, 2\] trained on the same rows \[0\] \(sync/data_rows\); "
        r"the declared layout \(world_size 4, sp_size 2\) has ranks \[0, 1\] share them",
    ):
        checks.check_data_rows(result_of(*strided))
    overlap = [healthy(0), healthy(1, **{TrainRecord.key("data_rows"): [3, 4, 5, 6]})]
    with pytest.raises(checks.CheckFailure, match=r"^check j: row 3 was trained by ranks \[0\]"):
        checks.check_data_rows(result_of(*overlap))
    with pytest.raises(checks.NotApplicable, match="one rank"):
        checks.check_data_rows(result_of(healthy(0)))


def test_j_holds_the_engines_reported_data_rank_to_the_declared_layout():
    """The rows are handed out by the declared layout, so an engine whose own data rank is wrong
    trains the right rows here; what it reports is held to the layout, naming both."""
    wrong = healthy(1, **{RankRecord.key("engine_data_rank"): 0})
    with pytest.raises(
        checks.CheckFailure,
        match=r"^check j: rank 1: the engine reports data-parallel rank 0 of 2, over ranks "
        r"\[0, 1\] \(rank/engine_data_rank, rank/engine_data_size, rank/engine_data_group\); "
        r"the declared layout \(world_size 2, sp_size 1\) makes it data-parallel rank 1 of 2",
    ):
        checks.check_data_rows(result_of(healthy(0), wrong))
    lacking = healthy(1)
    del lacking[RankRecord.key("engine_data_rank")]
    with pytest.raises(checks.CheckFailure, match="metric 'rank/engine_data_rank' missing"):
        checks.check_data_rows(result_of(healthy(0), lacking))
    # a run of another kind (a trainer, observed from outside) need not record it
    other = result_of(healthy(0), lacking)
    other.launched = dataclasses.replace(other.launched, kind="verl_trainer")
    checks.check_data_rows(other)


def hsdp(rank: int, **changes) -> dict:
    """A rank of a 2 x 2 HSDP run: shard groups [0, 1] and [2, 3], replicas [0, 2] and [1, 3]."""
    layout = {
        PostStepRecord.key("replica_max_abs_diff"): 0.0,
        **reported_layout(rank, world=4, shard=2),
        TrainRecord.key("data_rows"): [rank],
    }
    return healthy(rank, **{**layout, **changes})


def hsdp_run(*ranks: dict) -> RunResult:
    result = result_of(*ranks)
    engine = dataclasses.replace(result.launched.engine, fsdp_size=2)
    result.launched = dataclasses.replace(result.launched, engine=engine)
    return result


def test_d_compares_the_declared_replicas_and_holds_the_engines_group_to_them():
    checks.check_replicas(hsdp_run(*(hsdp(r) for r in range(4))))
    alone = {RankRecord.key("engine_replica_group"): [1]}
    with pytest.raises(
        checks.CheckFailure,
        match=r"^check d: rank 1: the engine reports replica group \[1\] "
        r"\(rank/engine_replica_group\); the declared layout \(world_size 4, fsdp_size 2\) "
        r"makes its replicas \[1, 3\], the ranks holding the same shard$",
    ):
        checks.check_replicas(hsdp_run(hsdp(0), hsdp(1, **alone), hsdp(2), hsdp(3)))
    # drift across the declared replicas, which the engine's one-rank group would have hidden
    drifted = {PostStepRecord.key("replica_max_abs_diff"): 3e-8, **alone}
    with pytest.raises(
        checks.CheckFailure,
        match=r"^check d: rank 1: sync/replica_max_abs_diff = 3e-08 across the replicas the "
        r"declared layout \(world_size 4, fsdp_size 2\) names, \[1, 3\]; tolerance 0; the "
        r"engine reports replica group \[1\] \(rank/engine_replica_group\)$",
    ):
        checks.check_replicas(hsdp_run(hsdp(0), hsdp(1, **drifted), hsdp(2), hsdp(3)))
    with pytest.raises(checks.NotApplicable, match="no replicas"):
        checks.check_replicas(result_of(healthy(0), healthy(1)))


def test_the_clip_is_judged_against_the_measured_global_norm():
    ok = [
        healthy(
            r,
            **{
                OptimizerRecord.key("clip_max_rel_err"): 1e-7,
                OptimizerRecord.key("clip_coef"): 0.25,
            },
        )
        for r in (0, 1)
    ]
    checks.check_clip(result_of(*ok))
    off = [
        healthy(
            0,
            **{
                OptimizerRecord.key("clip_max_rel_err"): 2e-3,
                OptimizerRecord.key("clip_coef"): 0.25,
            },
        ),
        ok[1],
    ]
    with pytest.raises(
        checks.CheckFailure,
        match=r"^check k: rank 0: the optimizer stepped on gradients 0.002 away",
    ):
        checks.check_clip(result_of(*off))


def test_k_applies_to_every_finite_step_whatever_the_optimizer_and_names_a_missing_reading():
    """The harness reads the gradients the step used whatever the optimizer's class: a finite
    step without that reading on any rank is red, naming it; a skipped step (non-finite norm)
    has nothing to judge."""
    lacking = healthy(1)
    del lacking[OptimizerRecord.key("clip_max_rel_err")]
    with pytest.raises(
        checks.CheckFailure,
        match=r"^check k: rank 1: no reading of the gradients the optimizer stepped on "
        r"\(sync/clip_max_rel_err\)",
    ):
        checks.check_clip(result_of(healthy(0), lacking))
    skipped = {
        OptimizerRecord.key("grad_norm_finite"): False,
        OptimizerRecord.key("clip_max_rel_err"): None,
        OptimizerRecord.key("clip_coef"): None,
    }
    checks.check_clip(result_of(healthy(0, **skipped), healthy(1, **skipped)))


def step_against_reference(dtype: str, **changes) -> dict:
    return {
        **reference_metrics(dtype, per_param=1e-6, l2=1e-7),
        PostStepRecord.key("step_max_err_lr"): 1e-3,
        PostStepRecord.key("step_rel_l2_err"): 1e-6,
        **changes,
    }


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("lacking", ["step_max_err_lr", "step_rel_l2_err"])
def test_i_compares_with_a_declared_reference_on_every_rank_by_declaration(dtype, lacking):
    """A declared reference whose post-step readings are missing on any rank is red, naming the
    reading, in every dtype (bf16 judges no per-entry error, yet its reading must be there)."""
    whole = [healthy(r, **step_against_reference(dtype)) for r in (0, 1)]
    checks.check_optimizer_step(result_of(*whole))
    rank1 = step_against_reference(dtype, **{PostStepRecord.key(lacking): None})
    with pytest.raises(
        checks.CheckFailure,
        match=rf"^check i: the case declares the single-process reference \(reference_checks\) "
        rf"but rank 1 has no reading of the reference's step \(sync/{lacking}\)",
    ):
        checks.check_optimizer_step(result_of(whole[0], healthy(1, **rank1)))


def test_comparing_policies_shows_a_crashed_run_first_not_a_missing_fingerprint():
    crashed = result_of(healthy(0), healthy(1))
    crashed.ranks[1] = dataclasses.replace(crashed.ranks[1], exit_code=1, metrics=None)
    crashed.first_failure = 1
    with pytest.raises(checks.CheckFailure) as failure:
        checks.check_policies_agree(crashed, result_of(healthy(0), healthy(1)))
    assert str(failure.value).startswith("case case: rank 1 failed first")
    assert "fingerprint" not in str(failure.value)


def test_a_failed_check_reads_in_the_summary_as_its_letter_and_numbers():
    """The summary's verdict column: each failed check, noted on the run as the check judged it,
    cut to its letter, rank and numbers (what the full message says at length)."""
    from pytest_fsdp_turbo.report import CHECK_CHARS, check_in_numbers

    broken = healthy(1)
    broken[OptimizerRecord.key("grad_norm")] *= 1.5  # rank 1 logs another norm than rank 0
    result = result_of(healthy(0), broken)
    with pytest.raises(checks.CheckFailure) as failure:
        checks.check_grad_norm(result)
    status, detail = result.judged["a"]
    assert status == checks.FAILED and detail == str(failure.value)
    short = check_in_numbers(detail)
    assert short.startswith("a: rank 1: ") and len(short) <= CHECK_CHARS, short
    assert f"{broken[OptimizerRecord.key('grad_norm')]!r}" in short and "1e-06" in short, short
    checks.check_data_rows(result)  # a passed check is noted too; failed outranks passed
    assert result.judged["j"] == (checks.PASSED, "") and result.judged["a"][0] == checks.FAILED


def test_a_case_that_declares_what_exercises_the_checks_must_show_it_happened():
    """check_exercised: a second update that clipped no token, gradients the optimizer did not
    clip, a KL reference equal to the rollout policy, SP boundaries all inside prompts: each is a
    line naming the reading and the setting to change; a case that says why its clip cannot be
    judged is not held to it."""
    exercised = {
        LossRecord.key("pg_clipfrac_last_update"): 0.12,
        OptimizerRecord.key("clip_coef"): 0.21,
        RolloutRecord.key("kl_reference_gap_mean"): 0.08,
        RolloutRecord.key("sp_boundaries_in_responses"): 8,
    }
    ranks = [healthy(r, **exercised) for r in (0, 1)]
    result = result_of(*ranks)
    spec = declared_by(ranks[0], 2)
    engine = dataclasses.replace(spec.engine, sp_size=2, fsdp_size=1, adam_beta2=0.95)
    ppo = dataclasses.replace(spec.ppo, updates=2, kl_reference_shift=0.1)
    result.launched = dataclasses.replace(spec, engine=engine, ppo=ppo)
    checks.check_exercised(result)
    idle = {
        LossRecord.key("pg_clipfrac_last_update"): 0.0,
        OptimizerRecord.key("clip_coef"): 1.0,
        RolloutRecord.key("kl_reference_gap_mean"): 0.0,
        RolloutRecord.key("sp_boundaries_in_responses"): 0,
    }
    lazy = dataclasses.replace(
        result, ranks=[RankResult(r, 0, 1.0, Path("x"), healthy(r, **idle)) for r in (0, 1)]
    )
    with pytest.raises(checks.CheckFailure) as failure:
        checks.check_exercised(lazy)
    text = str(failure.value)
    assert text.startswith("case case exercises less than it declares: ")
    for said in (
        "actor/pg_clipfrac_last_update = 0): lower clip_ratio (0.2)",
        "sync/clip_coef = 1): lower grad_clip (1)",
        "ppo/kl_reference_gap_mean = 0)",
        "ppo/sp_boundaries_in_responses = 0): raise max_new_tokens (12)",
    ):
        assert said in text, text
    why = dataclasses.replace(ppo, clip_not_exercised="bf16 log-probs")
    lazy.launched = dataclasses.replace(result.launched, ppo=why)
    with pytest.raises(checks.CheckFailure) as failure:
        checks.check_exercised(lazy)
    assert "clipped no token" not in str(failure.value) and "clip_coef" in str(failure.value)


def test_the_plugin_names_the_class_whose_failures_it_shows_as_their_message():
    """The plugin names CheckFailure without importing the checks; the name must stay the class's,
    or a failed check shows its traceback before its cause."""
    from pytest_fsdp_turbo.plugin import CHECK_FAILURE

    assert f"{checks.CheckFailure.__module__}.{checks.CheckFailure.__name__}" == CHECK_FAILURE
