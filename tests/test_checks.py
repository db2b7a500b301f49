"""Check logic on hand-made results: tolerance selection by dtype, what applies, every failure listed.
The same checks on real runs, against broken engines, are in e2e/test_mutations.py."""

from pathlib import Path

import pytest

from pytest_fsdp_turbo import checks
from pytest_fsdp_turbo_contract.records import Metric
from pytest_fsdp_turbo_contract.results import RankResult, RunResult


def healthy(rank: int, **changes) -> dict:
    metrics = {
        Metric.CASE_DTYPE: "fp32",
        Metric.CASE_SYNC_POLICY: "deferred",
        Metric.CASE_MICRO_BATCHES: 2,
        Metric.CASE_MEMORY_BUDGET_MB: None,
        Metric.ACTOR_GRAD_NORM: 0.8,
        Metric.ACTOR_GRAD_NORM_FINITE: True,
        Metric.SYNC_GRAD_NORM_MEASURED: 0.8,
        Metric.PPO_ADVANTAGES_ABS_MAX: 1.5,
        Metric.ACTOR_PPO_KL_FIRST_MICRO_BATCH: 0.0,
        Metric.ACTOR_PPO_LOG_RATIO_ABS_MAX_FIRST_MICRO_BATCH: 0.0,
        Metric.ACTOR_PG_CLIPFRAC_FIRST_MICRO_BATCH: 0.0,
        Metric.SYNC_REPLICA_MAX_ABS_DIFF: None,
        Metric.SYNC_ROLLOUT_LOGPROB_MAX_ABS_DIFF: 0.0,
        Metric.SYNC_ROLLOUT_WEIGHT_MAX_ABS_DIFF: 0.0,
        Metric.SYNC_ROLLOUT_WEIGHT_WORST: "lm_head.weight",
        Metric.SYNC_ROLLOUT_WEIGHTS_COMPARED: 7,
        Metric.SYNC_HANDOFF_WEIGHT_MAX_ABS_DIFF: 0.0,
        Metric.SYNC_HANDOFF_WEIGHT_WORST: "lm_head.weight",
        Metric.SYNC_ADAMW_STEP_MAX_ERR_LR: 1e-5,
        Metric.COMM_REDUCE_SCATTER_CALLS_BY_MICRO_BATCH: [0, 5],
        Metric.COMM_FSDP_UNITS: 5,
        Metric.COMM_SHARD_GROUP_SIZE: 2,
        Metric.SYNC_RETAINED_GRAD_BYTES: 1024,
        Metric.ACTOR_PARAM_UPDATE_MAX_ABS: 1e-4,
        Metric.ACTOR_LOCAL_PARAM_NUMEL: 100,
        Metric.PERF_PEAK_MEMORY_BYTES: 2**28,
        Metric.SYNC_DATA_ROWS: [4 * rank + i for i in range(4)],
        Metric.SYNC_CLIP_MAX_REL_ERR: None,
        "rank": rank,
    }
    return {**metrics, **changes}


def result_of(*ranks: dict, twin: RunResult | None = None) -> RunResult:
    return RunResult(
        case_id="case",
        world_size=len(ranks),
        ranks=[RankResult(r["rank"], 0, 1.0, Path(f"rank{r['rank']}.log"), r) for r in ranks],
        artifacts_dir=Path("."),
        duration_s=1.0,
        twin=twin,
        twin_kind="single" if twin else "",
    )


def test_healthy_run_without_reference_or_twin_says_what_did_not_apply():
    verdict = checks.check_all(result_of(healthy(0), healthy(1)))
    assert verdict.not_applicable() == [
        "c: no reference, no twin",
        "d: no replicas",
        "f: no memory budget",
        "k: no optimizer step observed",
        "l: no loss gradient measured",
    ]


def test_every_failed_check_is_listed():
    broken = [
        healthy(r, **{Metric.SYNC_GRAD_NORM_MEASURED: 1.6, Metric.SYNC_RETAINED_GRAD_BYTES: 0})
        for r in (0, 1)
    ]
    with pytest.raises(checks.CheckFailure) as failure:
        checks.check_all(result_of(*broken))
    lines = str(failure.value).splitlines()
    assert [line[:8] for line in lines] == ["check a:", "check h:"]


def reference_metrics(dtype: str, per_param: float, l2: float) -> dict:
    return {
        Metric.CASE_DTYPE: dtype,
        Metric.SYNC_GRAD_MAX_REL_ERR: per_param,
        Metric.SYNC_GRAD_MAX_REL_ERR_PARAM: "model.layers.0.linear_attn.A_log",
        Metric.SYNC_GRAD_REL_L2_ERR: l2,
        Metric.SYNC_REFERENCE_GRAD_NORM: 0.8,
    }


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        (
            {
                Metric.SYNC_ROLLOUT_WEIGHT_MAX_ABS_DIFF: 1e-3,
                Metric.SYNC_ROLLOUT_WEIGHT_WORST: "norm.weight",
            },
            "check e: rank 1: the rollout serves 'norm.weight' 0.001 away from the trainer's "
            "parameter after the push (7 tensors compared exactly",
        ),
        ({Metric.SYNC_ROLLOUT_WEIGHTS_COMPARED: 0}, "(0 tensors compared exactly"),
        (
            {
                Metric.SYNC_ROLLOUT_LOGPROB_MAX_ABS_DIFF: 0.5,
                Metric.SYNC_ROLLOUT_WEIGHT_MAX_ABS_DIFF: 2.0,
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


def test_bf16_parity_is_held_to_relative_l2_not_per_parameter():
    tiny_grads_flip = healthy(0, **reference_metrics("bf16", per_param=0.85, l2=8e-3))
    checks.check_gradient_parity(result_of(tiny_grads_flip))
    off = healthy(0, **reference_metrics("bf16", per_param=0.85, l2=0.2))
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


def test_single_micro_batch_deferred_must_not_retain_gradients():
    run = healthy(
        0,
        **{
            Metric.CASE_MICRO_BATCHES: 1,
            Metric.COMM_REDUCE_SCATTER_CALLS_BY_MICRO_BATCH: [5],
            Metric.SYNC_RETAINED_GRAD_BYTES: 64,
        },
    )
    with pytest.raises(checks.CheckFailure, match="expected no unsharded gradients held"):
        checks.check_sync_contract(result_of(run))


def test_optimizer_step_after_non_finite_norm_must_leave_parameters_alone():
    skipped = {Metric.ACTOR_GRAD_NORM_FINITE: False}
    checks.check_optimizer_step(
        result_of(healthy(0, **skipped, **{Metric.ACTOR_PARAM_UPDATE_MAX_ABS: 0.0}))
    )
    with pytest.raises(checks.CheckFailure, match="expected the step to be skipped"):
        checks.check_optimizer_step(result_of(healthy(0, **skipped)))
    empty_shard = healthy(
        1, **{Metric.ACTOR_PARAM_UPDATE_MAX_ABS: 0.0, Metric.ACTOR_LOCAL_PARAM_NUMEL: 0}
    )
    checks.check_optimizer_step(result_of(healthy(0), empty_shard))  # holds nothing, moves nothing


def test_a_failed_twin_fails_check_c_with_its_failure_text():
    twin = RunResult("case-twin", 1, [RankResult(0, 1, 1.0, Path("t.log"))], Path("twin"), 1.0)
    with pytest.raises(checks.CheckFailure, match=r"check c: twin \(single\): the twin run failed"):
        checks.check_twin(result_of(healthy(0), twin=twin))


def test_on_policy_holds_each_token_in_fp32_where_a_mean_can_cancel():
    """Errors of both signs cancel in ppo_kl; the per-token log-ratio does not (fp32 only)."""
    cancelled = {Metric.ACTOR_PPO_KL_FIRST_MICRO_BATCH: 0.0}
    off = {**cancelled, Metric.ACTOR_PPO_LOG_RATIO_ABS_MAX_FIRST_MICRO_BATCH: 2e-3}
    with pytest.raises(checks.CheckFailure, match=r"check b: rank 1: a token's .* is 0.002 "):
        checks.check_on_policy(result_of(healthy(0), healthy(1, **off)))
    bf16 = {**off, Metric.CASE_DTYPE: "bf16"}
    checks.check_on_policy(result_of(healthy(0, **bf16), healthy(1, **bf16)))


def test_data_ranks_must_train_on_disjoint_rows():
    same = [healthy(r, **{Metric.SYNC_DATA_ROWS: [0, 1, 2, 3]}) for r in (0, 1)]
    with pytest.raises(checks.CheckFailure, match=r"^check j: ranks \[0, 1\] trained on the same"):
        checks.check_data_rows(result_of(*same))
    # an SP group of 2 shares its rows, and that is right
    sp = [healthy(r, **{Metric.SYNC_DATA_ROWS: [r // 2], Metric.CASE_SP_SIZE: 2}) for r in range(4)]
    checks.check_data_rows(result_of(*sp))
    overlap = [healthy(0), healthy(1, **{Metric.SYNC_DATA_ROWS: [3, 4, 5, 6]})]
    with pytest.raises(checks.CheckFailure, match=r"^check j: row 3 was trained by ranks \[0\]"):
        checks.check_data_rows(result_of(*overlap))
    with pytest.raises(checks.NotApplicable, match="one rank"):
        checks.check_data_rows(result_of(healthy(0)))


def test_the_clip_is_judged_against_the_measured_global_norm():
    ok = [
        healthy(r, **{Metric.SYNC_CLIP_MAX_REL_ERR: 1e-7, Metric.SYNC_CLIP_COEF: 0.25})
        for r in (0, 1)
    ]
    checks.check_clip(result_of(*ok))
    off = [healthy(0, **{Metric.SYNC_CLIP_MAX_REL_ERR: 2e-3, Metric.SYNC_CLIP_COEF: 0.25}), ok[1]]
    with pytest.raises(
        checks.CheckFailure,
        match=r"^check k: rank 0: the optimizer stepped on gradients 0.002 away",
    ):
        checks.check_clip(result_of(*off))
