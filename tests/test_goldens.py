import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from pytest_fsdp_turbo.checks import CheckFailure, goldens
from pytest_fsdp_turbo_contract.artifacts import RunFolder
from pytest_fsdp_turbo_contract.records import LossRecord, OptimizerRecord, RolloutRecord
from pytest_fsdp_turbo_contract.spec import EngineSpec, PPOSpec, RankSpec
from pytest_fsdp_turbo_contract.vocab import DeviceKind, Dtype, GoldenTier

METRICS = {
    OptimizerRecord.key("grad_norm"): 0.5,
    LossRecord.key("pg_loss"): -0.1,
    RolloutRecord.key("score_mean"): 0.7,
}


def test_record_then_check(tmp_path):
    path = goldens.golden_path("c", "cpu", "fp32", 2, tmp_path)
    goldens.record_golden(path, METRICS)
    assert path == tmp_path / "c" / "cpu-fp32-ws2.json"
    assert goldens.compare_golden(path, METRICS, "exact") == []
    nudged = {**METRICS, OptimizerRecord.key("grad_norm"): 0.5 * (1 + 1e-4)}
    assert goldens.compare_golden(path, nudged, "relative") == []
    problems = goldens.compare_golden(path, nudged, "exact")
    assert problems and problems[0].startswith("check g: metric actor/grad_norm = 0.50005")
    far = {**METRICS, LossRecord.key("pg_loss"): -0.2}
    assert LossRecord.key("pg_loss") in goldens.compare_golden(path, far, "relative")[0]


@pytest.mark.parametrize("bad", [math.nan, math.inf, None])
def test_nan_never_passes(tmp_path, bad):
    path = goldens.golden_path("c", "cpu", "fp32", 1, tmp_path)
    goldens.record_golden(path, METRICS)
    for tier in ("exact", "relative"):
        assert goldens.compare_golden(
            path, {**METRICS, OptimizerRecord.key("grad_norm"): bad}, tier
        )


def test_refuses_to_record_nan(tmp_path):
    with pytest.raises(CheckFailure, match="refusing to record"):
        goldens.record_golden(tmp_path / "g.json", {OptimizerRecord.key("grad_norm"): math.nan})


def launched(kind: str = "cpu", tier: str = "relative", dtype: str = "fp32") -> RankSpec:
    """The spec.json of a run of case c on two ranks: what its golden is keyed by."""
    return RankSpec(
        case_id="c",
        model_path="/m",
        model_type="qwen3",
        device_kind=DeviceKind(kind),
        engine=EngineSpec(world_size=2, dtype=Dtype(dtype)),
        ppo=PPOSpec(),
        golden_tier=GoldenTier(tier),
    )


@dataclass
class Result:
    metrics: dict = field(default_factory=lambda: dict(METRICS))
    ok: bool = True
    launched: RankSpec | None = field(default_factory=launched)
    case_id: str = "c"
    folder: RunFolder = RunFolder(Path("/run"))
    judged: dict = field(default_factory=dict)

    def failure_text(self) -> str:
        return "" if self.ok else "case c: rank 1 failed first in phase train: RuntimeError: boom"

    def spec(self) -> RankSpec | None:
        return self.launched


def test_a_golden_older_than_a_measured_metric_fails_until_re_recorded(tmp_path):
    path = goldens.golden_path("c", "cpu", "fp32", 2, tmp_path)
    goldens.record_golden(path, METRICS)
    later = {
        **METRICS,
        OptimizerRecord.key("update_l2"): 0.01,
    }  # a post-step metric the old golden lacks
    (problem,) = goldens.compare_golden(path, later, "relative")
    assert f"golden {path} has no actor/update_l2" in problem
    assert "--fsdp-turbo-record-golden" in problem
    goldens.record_golden(path, later)
    assert goldens.compare_golden(path, later, "relative") == []


def test_strict_turns_a_missing_golden_into_a_failure_naming_path_and_command(tmp_path):
    with pytest.raises(CheckFailure) as failure:
        goldens.check_or_record(Result(launched=launched("npu")), tmp_path, False, strict=True)
    message = str(failure.value)
    assert message.startswith("check g: case c: no golden for npu fp32 on 2 ranks at ")
    assert str(goldens.golden_path("c", "npu", "fp32", 2, tmp_path)) in message
    assert goldens.RECORD_COMMAND in message
    lenient = goldens.check_or_record(Result(launched=launched("npu")), tmp_path, False)
    assert lenient.status == "missing"


def test_check_or_record_says_what_happened_as_a_status(tmp_path):
    from pytest_fsdp_turbo_contract.vocab import GoldenStatus

    outcome = goldens.check_or_record(Result(), tmp_path, record=False)
    assert outcome.status == GoldenStatus.MISSING and outcome.path.parent.name == "c"
    assert goldens.check_or_record(Result(), tmp_path, True).status == GoldenStatus.RECORDED
    assert goldens.check_or_record(Result(), tmp_path, False).status == GoldenStatus.MATCHED
    none = goldens.check_or_record(Result(launched=launched(tier="none")), tmp_path, False)
    assert none.status == GoldenStatus.NOT_COMPARED and str(none) == "not compared (tier none)"


def test_bf16_goldens_allow_bf16_rounding_and_no_more(tmp_path):
    path = tmp_path / "g.json"
    goldens.record_golden(path, METRICS)
    nudged = {**METRICS, LossRecord.key("pg_loss"): METRICS[LossRecord.key("pg_loss")] * (1 + 5e-3)}
    bf16 = goldens.relative_tolerance("bf16")
    assert goldens.compare_golden(path, nudged, "relative") != []  # fp32's 1e-3
    assert goldens.compare_golden(path, nudged, "relative", bf16) == []
    far = {**METRICS, LossRecord.key("pg_loss"): METRICS[LossRecord.key("pg_loss")] * (1 + 2e-2)}
    (problem,) = goldens.compare_golden(path, far, "relative", bf16)
    assert "relative 0.01" in problem


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("[1, 2]", "expected a JSON object of metric to number; got list"),
        ('{"actor/grad_norm": "0.5"}', "metric actor/grad_norm should be a number; got '0.5'"),
        ("{not json", "cannot be read"),
    ],
)
def test_a_broken_golden_file_is_one_check_failure_naming_it(tmp_path, text, said):
    path = tmp_path / "g.json"
    path.write_text(text)
    with pytest.raises(CheckFailure) as failed:
        goldens.compare_golden(path, METRICS, "relative")
    assert str(failed.value).startswith(f"check g: golden {path}")
    assert said in str(failed.value) and "\n" not in str(failed.value)


def test_a_failed_run_raises_its_own_failure_before_any_golden(tmp_path):
    """A crash is never "metric missing" against a golden, and never recorded as one."""
    crashed = Result(metrics={}, ok=False)
    for record in (False, True):
        with pytest.raises(CheckFailure, match="^case c: rank 1 failed first in phase train"):
            goldens.check_or_record(crashed, tmp_path, record=record)
    assert not any(tmp_path.iterdir())


def test_recording_never_writes_through_a_link_or_outside_the_goldens_folder(tmp_path):
    """A committed golden that is a symbolic link (or a case folder that links elsewhere) is
    refused in one line and its target is left as it was; a folder that cannot be written is one
    line too, never a traceback."""
    root = tmp_path / "goldens"
    outside = tmp_path / "outside.txt"
    outside.write_text("precious\n")
    path = goldens.golden_path("c", "cpu", "fp32", 2, root)
    path.parent.mkdir(parents=True)
    path.symlink_to(outside)
    with pytest.raises(CheckFailure) as linked:
        goldens.record_golden(path, METRICS, root)
    assert str(linked.value) == (
        f"check g: refusing to record golden {path}: it is a symbolic link, in the goldens "
        f"folder {root}"
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (root / "d").symlink_to(elsewhere, target_is_directory=True)
    moved = goldens.golden_path("d", "cpu", "fp32", 2, root)
    with pytest.raises(CheckFailure, match="it resolves outside the goldens folder"):
        goldens.record_golden(moved, METRICS, root)
    assert outside.read_text() == "precious\n" and not any(elsewhere.iterdir())
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        target = goldens.golden_path("c", "cpu", "fp32", 2, locked / "goldens")
        if os.getuid() != 0:  # root writes anywhere: the refusal is for everyone else
            with pytest.raises(CheckFailure, match=r"refusing to record golden .*: Permission"):
                goldens.record_golden(target, METRICS, locked / "goldens")
    finally:
        locked.chmod(0o700)


def test_a_spec_json_a_rank_rewrote_never_reaches_a_golden_outside_the_folder(tmp_path):
    """The golden is keyed by the run's spec.json, which a rank can rewrite: a case id that is a
    path is one check failure naming it, even where a file waits at that path; a field of the
    wrong type makes the spec unreadable (one line), never a crash in a check."""
    root = tmp_path / "goldens"
    planted = goldens.golden_path("../outside", "cpu", "fp32", 2, root)
    goldens.record_golden(planted, METRICS)  # no root given: written where it points
    rewritten = Result(launched=dataclasses.replace(launched(), case_id="../outside"))
    with pytest.raises(CheckFailure) as refused:
        goldens.check_or_record(rewritten, root, record=False)
    assert str(refused.value).startswith(
        "check g: case c: its spec.json keys the golden at "
    ) and str(refused.value).endswith(
        f"which resolves outside the goldens folder {root}: a case id is a name, never a path"
    )
    data = launched().to_json()
    data["engine"]["world_size"] = "two"
    with pytest.raises(ValueError, match=r"spec.json: engine.world_size: expected int, got 'two'"):
        RankSpec.from_json(data)
    data["engine"]["world_size"] = True  # a bool is no count either
    with pytest.raises(ValueError, match="engine.world_size: expected int, got True"):
        RankSpec.from_json(data)


def test_compare_holds_two_runs_to_the_golden_tier_their_spec_declares(tmp_path):
    """compare reads the case's tier from spec.json (case.json is gone): a case declared exact
    differs at a change the relative tier lets through."""
    import json

    from pytest_fsdp_turbo.compare import compare_runs

    key = OptimizerRecord.key("grad_norm")
    verdicts = {}
    for tier in ("exact", "relative"):
        for side, value in (("a", 0.8), ("b", 0.8 * (1 + 1e-6))):
            folder = tmp_path / tier / side / "run"
            folder.mkdir(parents=True)
            spec = {"case_id": "c", "device_kind": "cpu", "golden_tier": tier}
            (folder / "spec.json").write_text(json.dumps(spec))
            (folder / "rank0.metrics.json").write_text(json.dumps({key: value}))
        rows, _, _ = compare_runs(tmp_path / tier / "a", tmp_path / tier / "b")
        verdicts[tier] = next(r.verdict for r in rows if r.metric == key)
    assert verdicts == {"exact": "differs (exact)", "relative": "match"}


def test_compare_holds_bf16_to_its_rounding_and_sync_counts_exactly_and_skips_the_unmeasured(
    tmp_path,
):
    """Two runs of one bf16 trainer case: a loss 0.5% apart is bf16's run-to-run rounding
    (goldens allow 1e-2 there), one reduce-scatter more under the same sync policy is a real
    difference, the same count under another policy is shown only, and a reading neither run
    has (a trainer run measures no peak memory) is no row."""
    import json

    from pytest_fsdp_turbo.compare import compare_runs, differing

    loss, calls = LossRecord.key("pg_loss"), "comm/reduce_scatter_calls"
    for side, value, count, sync in (
        ("a", 0.4, 10, "deferred"),
        ("b", 0.402, 11, "deferred"),
        ("c", 0.4, 11, "every_micro_batch"),
    ):
        folder = tmp_path / side / "run"
        folder.mkdir(parents=True)
        engine = {"dtype": "bf16", "gradient_sync": sync, "world_size": 2}
        spec = {"case_id": "t", "device_kind": "cpu", "golden_dtype": "bf16", "engine": engine}
        (folder / "spec.json").write_text(json.dumps(spec))
        (folder / "rank0.metrics.json").write_text(json.dumps({loss: value, calls: count}))
    rows, _, _ = compare_runs(tmp_path / "a", tmp_path / "b")
    verdicts = {r.metric: r.verdict for r in rows}
    assert verdicts == {loss: "match", calls: "differs (exact: the same sync policy)"}, verdicts
    assert [r.metric for r in differing(rows)] == [calls]
    rows, _, _ = compare_runs(tmp_path / "a", tmp_path / "c")
    assert {r.metric: r.verdict for r in rows} == {loss: "match", calls: "info"}


def test_the_golden_is_keyed_and_held_by_what_the_run_declared(tmp_path):
    """Device kind, dtype, ranks and tier come from the run's spec.json: a bf16 run on npu is
    recorded under npu-bf16 and held to bf16's tolerance, whatever case object a test holds."""
    bf16 = Result(launched=launched("npu", dtype="bf16"))
    recorded = goldens.check_or_record(bf16, tmp_path, record=True)
    assert recorded.path == tmp_path / "c" / "npu-bf16-ws2.json"
    pg_loss = LossRecord.key("pg_loss")
    nudged = {**METRICS, pg_loss: METRICS[pg_loss] * (1 + 5e-3)}  # inside bf16's 1e-2 only
    matched = Result(metrics=nudged, launched=launched("npu", dtype="bf16"))
    assert goldens.check_or_record(matched, tmp_path, False).status == "matched"
    exact = Result(metrics=nudged, launched=launched("npu", tier="exact", dtype="bf16"))
    with pytest.raises(CheckFailure, match="^check g: metric actor/pg_loss = .*exact"):
        goldens.check_or_record(exact, tmp_path, False)


def test_a_run_without_a_readable_spec_is_one_line_naming_its_folder(tmp_path):
    with pytest.raises(CheckFailure) as failed:
        goldens.check_or_record(Result(launched=None), tmp_path, False)
    assert str(failed.value).startswith("check g: case c: its run folder has no readable spec")
    assert "/run/spec.json" in str(failed.value) and "\n" not in str(failed.value)


FIXTURE_TEST = """
from dataclasses import dataclass, field
from pytest_fsdp_turbo.cases import Case, CaseParam
from pytest_fsdp_turbo_contract.spec import EngineSpec, PPOSpec, RankSpec

SPEC = RankSpec("c", "/m", "qwen3", "cpu", EngineSpec(world_size=2, dtype="fp32"), PPOSpec())


@dataclass
class Run:
    case_id: str = "c"
    ok: bool = True
    metrics: dict = field(default_factory=lambda: {"actor/grad_norm": 0.5})
    judged: dict = field(default_factory=dict)

    def failure_text(self):
        return ""

    def spec(self):
        return SPEC


def test_records_under_the_runs_key(fsdp_turbo_golden):
    param = CaseParam(Case("c", "tiny-qwen3"), "cpu")  # as the fsdp_turbo_case parameter
    outcome = fsdp_turbo_golden(Run(), param)
    assert outcome.path.parts[-2:] == ("c", "cpu-fp32-ws2.json"), outcome
    for same in (param.case, "c", None):
        assert fsdp_turbo_golden(Run(), same).status == "recorded"


def test_another_case_is_refused(fsdp_turbo_golden):
    fsdp_turbo_golden(Run(), CaseParam(Case("other", "tiny-qwen3"), "cpu"))


def test_another_case_id_is_refused(fsdp_turbo_golden):
    fsdp_turbo_golden(Run(), "other")
"""


def test_the_golden_fixture_keys_by_the_run_and_refuses_another_case(pytester, tmp_path):
    pytester.makepyfile(FIXTURE_TEST)
    goldens_root = tmp_path / "goldens"
    result = pytester.runpytest(
        f"--fsdp-turbo-goldens={goldens_root}",
        "--fsdp-turbo-record-golden",
        "-p",
        "no:cacheprovider",
    )
    result.assert_outcomes(passed=1, failed=2)
    result.stdout.fnmatch_lines(
        ["*fsdp_turbo_golden: the result is a run of case c, not of case other*"] * 2
    )
    assert (goldens_root / "c" / "cpu-fp32-ws2.json").is_file()
