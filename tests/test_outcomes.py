"""Outcomes that must not pass by accident: a job whose required extra cannot be imported, a strict
session in which every test skipped, and a known failure that hides another rank's new crash."""

import sys
from pathlib import Path

import pytest

from pytest_fsdp_turbo.checks import CheckFailure
from pytest_fsdp_turbo.outcomes import off_the_known_failure
from pytest_fsdp_turbo_contract.results import RankError, RankResult, RunResult

VERL_CASE = '[[case]]\nid = "v"\nmodel = "tiny-qwen3"\nbackend = "verl:fsdp2"\nworld_size = 1\n'


def test_a_required_extra_that_cannot_be_imported_fails_the_session_in_one_line(
    pytester, monkeypatch
):
    """Where verl cannot be imported its cases skip, and a job that installed it would pass:
    --fsdp-turbo-require=verl ends the session at start instead, in one line naming the extra,
    the module and the import error. Without it (or requiring another extra) they still skip."""
    monkeypatch.setitem(sys.modules, "verl", None)  # `import verl` fails here, as if not installed
    monkeypatch.delenv("PYTEST_FSDP_TURBO_REQUIRE", raising=False)
    pytester.makefile(".toml", cases=VERL_CASE)
    pytester.makepyfile("def test_run(fsdp_turbo_case, ppo_run):\n    ppo_run(fsdp_turbo_case)\n")
    args = ["--fsdp-turbo-cases=cases.toml", "--fsdp-turbo-device=cpu"]
    pytester.runpytest(*args).assert_outcomes(skipped=1)
    pytester.runpytest(*args, "--fsdp-turbo-require=engine").assert_outcomes(skipped=1)

    cause = (
        "verl: verl is not importable here (ModuleNotFoundError: No module named 'verl'); "
        "pip install 'pytest-fsdp-turbo[verl]' (verl 0.9.1 needs transformers"
    )
    required = pytester.runpytest(*args, "--fsdp-turbo-require=engine,verl")
    assert error_line(required).startswith(f"ERROR: --fsdp-turbo-require {cause}")
    monkeypatch.setenv("PYTEST_FSDP_TURBO_REQUIRE", "verl")
    assert error_line(pytester.runpytest(*args)).startswith(
        f"ERROR: PYTEST_FSDP_TURBO_REQUIRE {cause}"
    )
    unknown = error_line(pytester.runpytest(*args, "--fsdp-turbo-require=verl,verll"))
    assert unknown.startswith("ERROR: --fsdp-turbo-require: expected extras among engine, ")
    assert unknown.endswith("got 'verl,verll'")


def error_line(result: pytest.RunResult) -> str:
    """A session refused at start: exit 4 and one line, no traceback."""
    lines = [line for line in result.stderr.lines if line.strip()]
    assert result.ret == pytest.ExitCode.USAGE_ERROR and len(lines) == 1, lines
    return lines[0]


def test_a_strict_session_in_which_every_test_skipped_is_red(pytester):
    """CI's downstream-wheel stage is one test that skips unless its variable is set: under
    --fsdp-turbo-strict a session in which every selected test skipped fails, saying why."""
    pytester.makepyfile(
        test_trial="import pytest\n"
        "@pytest.mark.skipif(True, reason='the wheel trial runs in stage 3')\n"
        "def test_trial():\n    pass\n"
    )
    relaxed = pytester.runpytest()
    assert relaxed.ret == pytest.ExitCode.OK
    relaxed.assert_outcomes(skipped=1)
    strict = pytester.runpytest("--fsdp-turbo-strict")
    assert strict.ret == pytest.ExitCode.TESTS_FAILED
    strict.assert_outcomes(skipped=1)
    strict.stdout.fnmatch_lines(
        [
            "--fsdp-turbo-strict: every selected test skipped (1), the first because: the wheel "
            "trial runs in stage 3"
        ]
    )
    pytester.makepyfile(test_plain="def test_plain():\n    pass\n")
    some_ran = pytester.runpytest("--fsdp-turbo-strict")
    assert some_ran.ret == pytest.ExitCode.OK
    some_ran.assert_outcomes(passed=1, skipped=1)


# verl 0.9.1's FSDP-Turbo engine on FSDP units that never run forward (e2e/cases.toml)
KNOWN = {
    "reason": "verl PR #7475, open",
    "match": "'FSDPParam' object has no attribute '_unsharded_param'",
}
KNOWN_ERROR = RankError(0, "train", "AttributeError", KNOWN["match"], "Traceback ...", 1.0)
# what a rank's gloo says when its peer exits mid-collective (a real 2-rank run's rank1.error.json)
GLOO_LOST = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
    "[127.0.0.1]:50056: Connection reset by peer. This is typically caused by a remote worker "
    "hanging or bugs in the application"
)
GLOO_TIMEOUT = (
    "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 30000ms "
    "for recv operation to complete"
)
NCCL_OWN = (
    "NCCL error in: ProcessGroupNCCL.cpp:3376, invalid argument (run with NCCL_DEBUG=WARN for "
    "details), NCCL version 2.27.3"
)
NCCL_REMOTE = (
    "NCCL error in: NCCLUtils.hpp:268, remote process exited or there was a network error, NCCL "
    "version 2.27.3"
)
# rank 1's ending, each after rank 0 raised the known error: (error, exit code), and whether the
# test stays an expected failure
RANK1 = {
    "other": (RankError(1, "train", "RuntimeError", "CUDA error: an illegal memory access"), 1),
    # a rank's own NCCL bug says "NCCL error" too: it is no lost peer
    "own-nccl": (RankError(1, "train", "DistBackendError", NCCL_OWN, "", 1.1), 1),
    "nccl-lost-peer": (RankError(1, "train", "DistBackendError", NCCL_REMOTE, "", 1.2), 1),
    "known-too": (RankError(1, "train", "AttributeError", KNOWN["match"], "", 1.1), 1),
    "lost-peer": (RankError(1, "train", "RuntimeError", GLOO_LOST, "", 1.2), 1),
    "timed-out": (RankError(1, "train", "RuntimeError", GLOO_TIMEOUT, "", 31.0), 1),
    "stopped": (None, -15),  # the supervisor ended it after rank 0 failed: no error report
}


def two_rank_run(folder: Path, rank1: RankError | None, exit1: int) -> RunResult:
    """A 2-rank run whose rank 0 failed first with the known error, as the launcher reads it."""
    ranks = []
    for rank, error, code in ((0, KNOWN_ERROR, 1), (1, rank1, exit1)):
        log = folder / f"rank{rank}.log"
        log.write_text(f"[rank {rank}] phase train\n")
        ranks.append(RankResult(rank, code, 1.0, log, error=error))
    return RunResult("tiny-qwen3_5-verl-fsdp_turbo", 2, ranks, folder, 2.0, first_failure=0)


@pytest.mark.parametrize("rank1", RANK1)
def test_a_known_failure_is_judged_on_every_rank_that_failed_on_its_own(rank1, tmp_path):
    """Each failed rank's own error must be the known one, or the rank only lost its peer: a new
    crash on rank 1 no longer hides behind rank 0's known error in the one failure text."""
    run = two_rank_run(tmp_path, *RANK1[rank1])
    said = run.failure_text()  # what check_all raises: the known error is in it every time
    assert KNOWN["match"] in said
    otherwise = off_the_known_failure(KNOWN, CheckFailure(said), [run])
    if rank1 not in ("other", "own-nccl"):
        assert otherwise is None, otherwise
        return
    error = RANK1[rank1][0]
    first = error.message.splitlines()[0]
    assert otherwise == (
        f"known failure expected ({KNOWN['match']!r}: {KNOWN['reason']}), but rank 1 failed "
        f"otherwise (phase train: {error.type}: {first}):\n{said}"
    )


def test_a_known_failure_with_no_rank_failing_as_known_is_red(tmp_path):
    """The match found only in a rank's log, no rank having raised it, is not the failure."""
    run = two_rank_run(tmp_path, *RANK1["lost-peer"])
    run.ranks[0].error = RankError(0, "train", "ValueError", "a new bug", "", 1.0)
    said = run.failure_text() + f"\nlog tail: {KNOWN['match']}"
    otherwise = off_the_known_failure(KNOWN, CheckFailure(said), [run])
    assert otherwise is not None and otherwise.startswith(
        f"known failure expected ({KNOWN['match']!r}: {KNOWN['reason']}), but rank 0 failed "
        "otherwise (phase train: ValueError: a new bug):\n"
    )


KNOWN_CASES = "".join(
    f'[[case]]\nid = "{case}"\nmodel = "tiny-qwen3"\nworld_size = 2\n'
    f'[case.known_failure.cpu]\nreason = "{KNOWN["reason"]}"\nmatch = "{KNOWN["match"]}"\n'
    for case in ("other", "lost-peer")
)


def test_the_plugin_holds_a_case_to_its_known_failure_rank_by_rank(pytester):
    """Through the plugin: a test whose run ends as two_rank_run's, its checks raising the run's
    failure text, is red when rank 1 failed otherwise and an expected failure when it lost its
    peer."""
    pytester.makefile(".toml", cases=KNOWN_CASES)
    pytester.makepyfile(
        "from pytest_fsdp_turbo import checks\n"
        "from pytest_fsdp_turbo.report import note_run\n"
        "from tests.test_outcomes import RANK1, two_rank_run\n"
        "def test_run(fsdp_turbo_case, request, tmp_path):\n"
        "    run = two_rank_run(tmp_path, *RANK1[fsdp_turbo_case.case.id])\n"
        "    note_run(request.node, run)  # as ppo_run records each run\n"
        "    raise checks.CheckFailure(run.failure_text())\n"
    )
    result = pytester.runpytest("--fsdp-turbo-device=cpu", "--fsdp-turbo-cases=cases.toml", "-rxX")
    result.assert_outcomes(failed=1, xfailed=1)
    result.stdout.fnmatch_lines(
        [
            "*known failure expected (*), but rank 1 failed otherwise (phase train: RuntimeError: "
            "CUDA error: an illegal memory access):",
            "XFAIL test_the_plugin_holds_a_case_to_its_known_failure_rank_by_rank.py::"
            "test_run[[]lost-peer-cpu[]] - verl PR #7475, open",
        ]
    )
