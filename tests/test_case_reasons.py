"""What a case leaves out and why: `not_exercised` (aspect -> reason) and `golden_reason`, validated
at collection in one line per bad value, dropped by ppo_run's overrides where they engage the
aspect, handed to the ranks in spec.json, and held by check_exercised on hand-made runs; every
shipped case exercises each aspect or says why."""

from __future__ import annotations

import dataclasses
import re
import textwrap
from pathlib import Path

import pytest

from pytest_fsdp_turbo import checks
from pytest_fsdp_turbo.cases import load_cases, with_overrides
from pytest_fsdp_turbo.kinds.registry import load_book
from pytest_fsdp_turbo_contract.errors import ConfigError
from pytest_fsdp_turbo_contract.records import (
    LossRecord,
    OptimizerRecord,
    RankRecord,
    RolloutRecord,
)
from pytest_fsdp_turbo_contract.results import RankResult, RunResult
from pytest_fsdp_turbo_contract.spec import (
    TORCH_ADAM_BETAS,
    Aspect,
    EngineSpec,
    PPOSpec,
    RankSpec,
)
from pytest_fsdp_turbo_contract.vocab import DeviceKind

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "e2e" / "cases.toml"
CASE = """
[[case]]
id = "c"
model = "tiny-qwen3"
world_size = 2
"""


def write(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "cases.toml"
    path.write_text(textwrap.dedent(body))
    return path


def test_every_shipped_case_exercises_each_aspect_or_says_why():
    """A tiny case leaves an aspect out only with a reason in the case file, naming the shipped
    case that exercises it (of the same engine, where the reason is the suite's). What the settings alone decide (a second
    update, betas other than torch's, a KL reference a step away) is declared on every tiny case
    that gives no reason, and so is a gradient clip below the tiny models' norms (0.8 to 1.0;
    the vLLM cases' 2.0 and the SP lm-loss case's 1.18 engage 1.0). What a run measured (both
    clips, the KL gap, SP boundaries) check_exercised holds, in test_ppo_one_step."""
    cases = load_cases(SHIPPED)
    by_id = {c.id: c for c in cases}
    clip_engaged_at_1 = {
        "tiny-qwen3-hd64-vllm-single-rank",
        "tiny-qwen3-hd64-vllm-fsdp2-deferred",
        "tiny-qwen3_5-fsdp_turbo-fsdp2-sp2-deferred",
    }
    for case in (c for c in cases if c.is_tiny):
        excused = case.ppo.unexercised()
        for aspect, reason in excused.items():
            named = [
                i for i in by_id if i != case.id and re.search(rf"(?<![\w.-]){i}(?![\w-])", reason)
            ]
            assert named, (case.id, aspect, "names no shipped case that exercises it")
            for other in named:
                assert aspect not in by_id[other].ppo.unexercised(), (case.id, aspect, other)
            if "suite" in reason:  # kept plain for the suite: the same engine exercises it
                assert any(by_id[o].engine.backend == case.engine.backend for o in named), case.id
        if Aspect.SECOND_UPDATE not in excused:
            assert case.ppo.updates >= 2, case.id
            betas = (case.engine.adam_beta1, case.engine.adam_beta2)
            assert betas != TORCH_ADAM_BETAS, case.id
        if Aspect.KL_REFERENCE not in excused:
            assert case.ppo.kl_reference_shift > 0, case.id
        if Aspect.GRAD_CLIP not in excused and case.id not in clip_engaged_at_1:
            assert case.engine.grad_clip < 0.8, case.id
    assert not any(c.ppo.clip_not_exercised for c in cases)  # the table spells it now
    without_goldens = [c for c in cases if c.golden_tier == "none"]
    assert len(without_goldens) == 3
    assert all(c.golden_reason and not c.is_tiny for c in without_goldens)


@pytest.mark.parametrize(
    ("fields", "said"),
    [
        (
            '[case.not_exercised]\ngrad_clpi = "why"\n',
            "field 'not_exercised': expected aspects among second_update, ratio_clip, grad_clip, "
            "kl_reference, adam_betas, sp_boundary; got 'grad_clpi'",
        ),
        (
            '[case.not_exercised]\ngrad_clip = "  "\n',
            "field 'not_exercised.grad_clip': expected a reason in words; got '  '",
        ),
        (
            "[case.not_exercised]\ngrad_clip = 1\n",
            "field 'not_exercised.grad_clip': expected a reason in words; got 1",
        ),
        ('not_exercised = "why"\n', "field 'not_exercised': expected a table; got 'why'"),
        (
            'updates = 2\n[case.not_exercised]\nsecond_update = "why"\n',
            "field 'not_exercised.second_update': expected no reason: the case exercises it "
            "(updates = 2); got 'why'",
        ),
        (
            'kl_reference_shift = 0.1\n[case.not_exercised]\nkl_reference = "why"\n',
            "field 'not_exercised.kl_reference': expected no reason: the case exercises it "
            "(kl_reference_shift = 0.1); got 'why'",
        ),
        (
            'updates = 2\nadam_beta2 = 0.95\n[case.not_exercised]\nadam_betas = "why"\n',
            "field 'not_exercised.adam_betas': expected no reason: the case exercises it "
            "(betas 0.9, 0.95 over 2 updates); got 'why'",
        ),
        (
            '[case.not_exercised]\nratio_clip = "why"\n',
            "field 'not_exercised.ratio_clip': expected no reason (one on-policy update cannot "
            "show it: second_update's reason covers it); got 'why'",
        ),
        (
            '[case.not_exercised]\nsp_boundary = "why"\n',
            "field 'not_exercised.sp_boundary': expected no reason (without SP there is no chunk "
            "boundary); got 'why'",
        ),
        (
            'updates = 2\nclip_not_exercised = "a"\n[case.not_exercised]\nratio_clip = "b"\n',
            "field 'clip_not_exercised': expected no key beside not_exercised.ratio_clip (its "
            "older spelling); got 'a'",
        ),
        (
            'golden_tier = "none"\n',
            "field 'golden_reason': expected why the case records no golden (golden_tier none), "
            "in words; got ''",
        ),
        (
            'golden_reason = "why"\n',
            "field 'golden_reason': expected no reason unless golden_tier is none (it is "
            "relative); got 'why'",
        ),
    ],
)
def test_a_reason_is_refused_in_one_line_where_it_is_wrong(tmp_path, fields, said):
    with pytest.raises(ConfigError) as refused:
        load_cases(write(tmp_path, CASE + fields))
    message = str(refused.value)
    assert message == f"{tmp_path / 'cases.toml'}: case 'c': {said}", message


def test_the_reasons_are_read_and_reach_the_ranks(tmp_path):
    path = write(
        tmp_path,
        CASE
        + 'updates = 2\ngolden_tier = "none"\ngolden_reason = "no hardware here"\n'
        + '[case.not_exercised]\nratio_clip = "bf16 log-probs"\ngrad_clip = "a reason"\n',
    )
    (case,) = load_cases(path)
    reasons = {Aspect.RATIO_CLIP: "bf16 log-probs", Aspect.GRAD_CLIP: "a reason"}
    assert case.ppo.unexercised() == reasons and case.golden_reason == "no hardware here"
    spec = case.rank_spec("cpu", model_path="m", model_type="qwen3")
    assert RankSpec.from_json(spec.to_json()).ppo.unexercised() == reasons
    path.write_text(CASE + 'updates = 2\nclip_not_exercised = "bf16"\n')  # the older key
    (older,) = load_cases(path)
    assert older.ppo.unexercised() == {Aspect.RATIO_CLIP: "bf16"}


def test_overrides_drop_the_reasons_they_make_moot_and_hold_their_own(tmp_path):
    """ppo_run(case, updates=2) on a case that says why it runs one update: the overrides engage
    the aspect, so the case's reason goes (golden_reason goes with a golden tier alike); a
    reason the overrides give is held to every rule."""
    path = write(
        tmp_path,
        CASE
        + 'golden_tier = "none"\ngolden_reason = "no hardware"\n'
        + '[case.not_exercised]\nsecond_update = "time"\nkl_reference = "k"\ngrad_clip = "g"\n',
    )
    (case,) = load_cases(path)
    moved = with_overrides(case, {"updates": 2, "golden_tier": "relative"})
    assert moved.ppo.unexercised() == {Aspect.KL_REFERENCE: "k", Aspect.GRAD_CLIP: "g"}
    assert moved.golden_reason == ""
    shifted = with_overrides(case, {"kl_reference_shift": 0.1})
    assert set(shifted.ppo.unexercised()) == {Aspect.SECOND_UPDATE, Aspect.GRAD_CLIP}
    with pytest.raises(ConfigError) as refused:
        with_overrides(case, {"updates": 2, "not_exercised": {"second_update": "time"}})
    assert str(refused.value) == (
        "ppo_run overrides: case 'c': field 'not_exercised.second_update': expected no reason: "
        "the case exercises it (updates = 2); got 'time'"
    )
    # verl's bf16 SP case for one update: its ratio_clip reason goes with its second update
    verl = next(
        c for c in load_cases(SHIPPED) if c.id == "tiny-qwen3_5-verl-fsdp_turbo-fsdp2-sp2-twin"
    )
    assert with_overrides(verl, {"updates": 1, "clip_not_exercised": None}).ppo.unexercised() == {}


def test_a_trainer_case_without_goldens_says_why(tmp_path):
    body = """
    [[trainer_case]]
    id = "t"
    model = "tiny-qwen3-chat"
    world_size = 2
    golden_tier = "none"
    overrides = ["trainer.n_gpus_per_node=2"]
    """
    with pytest.raises(ConfigError) as refused:
        load_book(write(tmp_path, body))
    assert str(refused.value) == (
        f"{tmp_path / 'cases.toml'}: trainer case 't': field 'golden_reason': expected why the "
        "case records no golden (golden_tier none), in words; got ''"
    )
    book = load_book(write(tmp_path, body + '    golden_reason = "no golden on this stack"\n'))
    assert book.trainer_cases[0].golden_reason == "no golden on this stack"


def run_of(spec: RankSpec, **measured: float | None) -> RunResult:
    """A completed one-rank run whose rank measured what check_exercised reads."""
    metrics = {
        RankRecord.key("rank"): 0,
        OptimizerRecord.key("grad_norm"): 0.85,
        OptimizerRecord.key("clip_coef"): measured.get("clip_coef", 0.24),
        LossRecord.key("pg_clipfrac_last_update"): measured.get("clipfrac", 0.6),
        RolloutRecord.key("kl_reference_gap_mean"): measured.get("kl_gap", 0.08),
        RolloutRecord.key("sp_boundaries_in_responses"): measured.get("boundaries", 4),
    }
    return RunResult(
        case_id="c",
        world_size=1,
        ranks=[RankResult(0, 0, 1.0, Path("rank0.log"), metrics)],
        artifacts_dir=Path("."),
        duration_s=1.0,
        launched=spec,
    )


ENGAGED = RankSpec(
    "c",
    "model",
    "qwen3",
    DeviceKind.CPU,
    EngineSpec(world_size=1, grad_clip=0.2, adam_beta2=0.95),
    PPOSpec(updates=2, clip_ratio=0.01, kl_reference_shift=0.1),
)


def test_check_exercised_holds_every_aspect_unless_the_case_says_why():
    """A run that engaged everything passes; each aspect missed is one line naming the aspect,
    the reading (or the declaration) and the setting to change; a reason excuses its aspect
    alone, and an aspect with no room (one update: the clip and the betas) is left to the one
    that covers it."""
    checks.check_exercised(run_of(ENGAGED))
    plain = dataclasses.replace(ENGAGED, engine=EngineSpec(world_size=1), ppo=PPOSpec(updates=2))
    idle = run_of(plain, clip_coef=1.0, clipfrac=0.0, kl_gap=0.0)
    with pytest.raises(checks.CheckFailure) as failure:
        checks.check_exercised(idle)
    text = str(failure.value)
    assert text.startswith("case c exercises less than it declares: ratio_clip: "), text
    for said in (
        "ratio_clip: its last of 2 updates clipped no token (actor/pg_clipfrac_last_update = 0): "
        "lower clip_ratio (0.2)",
        "grad_clip: its gradients were not clipped (sync/clip_coef = 1): lower grad_clip (1) "
        "below the measured norm (actor/grad_norm = 0.85)",
        "kl_reference: its KL reference equals the rollout policy (ppo/kl_reference_gap_mean = 0)",
        "adam_betas: Adam's betas are torch's defaults (0.9, 0.999)",
    ):
        assert said in text, text
    assert "second_update" not in text and "sp_boundary" not in text and "\n" not in text
    once = dataclasses.replace(plain, ppo=PPOSpec(updates=1))
    with pytest.raises(checks.CheckFailure) as failure:
        checks.check_exercised(run_of(once, clip_coef=1.0, kl_gap=0.0, clipfrac=None))
    text = str(failure.value)
    assert "second_update: one on-policy update" in text and "updates = 2 (now 1)" in text
    assert "ratio_clip" not in text and "adam_betas" not in text  # second_update covers them
    reasons = {"second_update": "time", "grad_clip": "g", "kl_reference": "k"}
    excused = dataclasses.replace(once, ppo=PPOSpec(updates=1, not_exercised=reasons))
    checks.check_exercised(run_of(excused, clip_coef=1.0, kl_gap=0.0, clipfrac=None))
    older = dataclasses.replace(plain, ppo=PPOSpec(updates=2, clip_not_exercised="bf16"))
    with pytest.raises(checks.CheckFailure) as failure:
        checks.check_exercised(run_of(older, clipfrac=0.0))
    assert "ratio_clip" not in str(failure.value) and "adam_betas" in str(failure.value)
    sp = dataclasses.replace(ENGAGED, engine=dataclasses.replace(ENGAGED.engine, sp_size=2))
    with pytest.raises(checks.CheckFailure, match=r"sp_boundary: no SP chunk boundary fell on a"):
        checks.check_exercised(run_of(sp, boundaries=0))
