"""Each fault injected into real rank processes on this machine, and what the harness must do."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from pytest_fsdp_turbo import checks, report
from pytest_fsdp_turbo.cases import Case
from pytest_fsdp_turbo.devices import detect
from pytest_fsdp_turbo.launching.request import RunRequest, run_case
from pytest_fsdp_turbo.leases import LeaseBook
from pytest_fsdp_turbo_contract.faults import FaultSpec
from pytest_fsdp_turbo_contract.records import OptimizerRecord, PostStepRecord, ReferenceRecord

REPO = Path(__file__).resolve().parent.parent
FAULT = "PYTEST_FSDP_TURBO_FAULT"


def test_hang_in_a_collective_is_reported_with_every_rank_stack(ppo_run, no_leaked_processes):
    result = ppo_run(
        "tiny-qwen3-single-rank",
        world_size=2,
        timeout=60.0,
        collective_timeout=6.0,
        extra_env={FAULT: "hang:1:rollout"},
    )
    assert not result.ok and not result.timed_out  # the collective timeout ends it, not the case's
    text = result.failure_text()
    assert "Timed out waiting 6000ms" in text  # rank 0: where it waited, and for how long
    assert "in at_phase" in text and "phase rollout" in text  # rank 1: its dumped Python stack
    assert "--- rank 0" in text and "--- rank 1" in text
    from pytest_fsdp_turbo.report import run_cause

    assert run_cause(result).endswith("timed out in a collective"), run_cause(result)


def test_nan_in_one_rank_skips_the_update_everywhere(ppo_run):
    result = ppo_run("tiny-qwen3_5-fsdp2-deferred", extra_env={FAULT: "nan:1"})
    checks.check_completed(result)  # the run itself completes and reports
    for rank in result.ranks:
        assert rank.metrics[OptimizerRecord.key("grad_norm_finite")] is False
        assert (
            rank.metrics[OptimizerRecord.key("param_update_max_abs")] == 0.0
        )  # bit-identical to before the step
    with pytest.raises(
        checks.CheckFailure,
        match=r"^check a: rank 0: actor/grad_norm = nan, expected a finite value",
    ):
        checks.check_grad_norm(result)
    checks.check_optimizer_step(result)  # skipped everywhere alike is what check i expects


class FirstPortTaken(LeaseBook):
    """Hands out, once, a port that another process grabbed after the lease."""

    def __init__(self, state_dir, squatted: int):
        super().__init__(state_dir)
        self.squatted = [squatted]

    def port(self, attempts: int = 64) -> int:
        return self.squatted.pop() if self.squatted else super().port(attempts)

    def release_port(self, port: int) -> None:
        super().release_port(port)


def test_port_taken_between_lease_and_bind_is_retried(tiny_model, tmp_path, no_leaked_processes):
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    taken = squatter.getsockname()[1]
    case = Case(id="port-clash", model="tiny-qwen3")  # two ranks
    request = RunRequest(case, tiny_model("tiny-qwen3"), tmp_path / "art", detect("cpu:4"))
    try:
        result = run_case(request, FirstPortTaken(tmp_path / "state", taken))
    finally:
        squatter.close()
    checks.check_completed(result)
    assert len(result.notes) == 1 and f"port {taken} was taken" in result.notes[0]
    assert f"port {taken} was taken" in (tmp_path / "art" / "launcher.log").read_text()
    kept = tmp_path / "art" / f"attempt1-port{taken}"
    assert "EADDRINUSE" in (kept / "rank0.error.json").read_text()


def _forked_ranks(parent: psutil.Process, before: set[int], cwd: Path) -> list[psutil.Process]:
    """The parent's new children that run in `cwd`: a shared parent forks other tests' too."""
    ranks = []
    for child in parent.children():
        with contextlib.suppress(psutil.Error):
            if child.pid not in before and Path(child.cwd()) == cwd:
                ranks.append(child)
    return ranks


def _command_line(process: psutil.Process) -> str:
    """'' for a process that is gone or a zombie by now (short-lived helpers come and go)."""
    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return ""


@pytest.mark.parametrize("warm", ["own", "shared"])
def test_killed_xdist_worker_leaves_no_ranks_and_its_leases_are_reclaimed(tmp_path, warm):
    """own: the worker starts its warm parent, which dies with it; shared: the worker forks from
    this (outer) process's warm parent, which outlives it, and the worker's ranks still die."""
    from pytest_fsdp_turbo.processes.warm import warm_parent
    from pytest_fsdp_turbo_contract.vocab import Env

    state = tmp_path / "state"
    (tmp_path / "test_inner.py").write_text(
        textwrap.dedent(
            """
        def test_hangs(ppo_run):
            ppo_run("tiny-qwen3-single-rank", world_size=2, timeout=300.0, collective_timeout=200.0,
                    extra_env={"PYTEST_FSDP_TURBO_FAULT": "hang:1:init"})
        """
        )
    )
    shared = None
    env = {**os.environ, "PYTEST_FSDP_TURBO_STATE_DIR": str(state)}
    env.pop(Env.WARM_SOCKET, None)
    if warm == "shared":  # this process's warm parent (the suite's, under xdist)
        outer, why = warm_parent(tmp_path / "outer")
        assert outer is not None and outer.socket, why
        env[Env.WARM_SOCKET] = outer.socket
        shared = psutil.Process(outer.pid)
    before = {p.pid for p in shared.children()} if shared else set()
    inner = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-n",
            "1",
            "-q",
            f"--fsdp-turbo-cases={REPO / 'e2e' / 'cases.toml'}",
            "--fsdp-turbo-device=cpu:2",
            f"--fsdp-turbo-artifacts={tmp_path / 'art'}",
            str(tmp_path / "test_inner.py"),
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        ranks: list[psutil.Process] = []
        parent = shared
        while time.monotonic() < deadline and len(ranks) < 2:
            if shared is None:
                parent = next(
                    (
                        p
                        for p in psutil.Process(inner.pid).children(recursive=True)
                        if "pytest_fsdp_turbo_engine.warm_parent" in _command_line(p)
                    ),
                    None,
                )
            ranks = _forked_ranks(parent, before, tmp_path) if parent else []
            time.sleep(0.2)
        assert len(ranks) == 2, "the ranks were never forked from the warm parent"
        worker = next(  # the xdist worker: the inner pytest process's child
            p for p in psutil.Process(inner.pid).children() if "python" in p.name()
        )
        if shared is None:
            assert parent.parent().pid == worker.pid  # the worker started its own
            ranks.append(parent)
        book = LeaseBook(state)
        assert book.holders()["devices"], "the worker should hold its devices now"
        worker.send_signal(signal.SIGKILL)  # the xdist worker dies mid-case
        gone, alive = psutil.wait_procs(ranks, timeout=10)
        assert not alive, f"warm parent or ranks outlived their worker: {[p.pid for p in alive]}"
        if shared is not None:
            assert shared.is_running(), "the outer session's warm parent must outlive the worker"
        lease = book.devices("cpu", [0, 1], 2, timeout_s=5)  # reclaimed, not stuck behind the dead
        assert lease.ids == (0, 1)
    finally:
        inner.kill()
        inner.wait(30)


def test_git_never_prompts_and_never_runs_through_a_shell(tmp_path, monkeypatch):
    from pytest_fsdp_turbo.turbo.checkout import CheckoutRequest, clone_cached
    from pytest_fsdp_turbo_contract.errors import CheckoutUnavailable

    record = tmp_path / "calls.jsonl"
    fake = tmp_path / "bin" / "git"
    fake.parent.mkdir()
    fake.write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        f"open({str(record)!r}, 'a').write(json.dumps({{'argv': sys.argv[1:], "
        "'prompt': os.environ.get('GIT_TERMINAL_PROMPT'), 'tty': sys.stdin.isatty()}) + '\\n')\n"
        "sys.stderr.write('fatal: could not read Username: terminal prompts disabled\\n'); sys.exit(128)\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    with pytest.raises(CheckoutUnavailable, match="terminal prompts disabled.*after 2 attempt"):
        clone_cached(
            CheckoutRequest(
                repo="https://example.invalid/FSDPTurbo.git; rm -rf /",
                ref="main",
                cache_dir=tmp_path / "cache",
                attempts=2,
                backoff_s=0.01,
            )
        )
    calls = [json.loads(line) for line in record.read_text().splitlines()]
    assert len(calls) == 2
    for call in calls:
        assert call["prompt"] == "0" and call["tty"] is False
        assert (
            call["argv"][-2] == "https://example.invalid/FSDPTurbo.git; rm -rf /"
        )  # one argv entry
        assert "--" in call["argv"]


def test_missing_or_incomplete_local_model_skips_with_the_path(pytester, tmp_path):
    models = tmp_path / "models"
    (models / "Half-Model").mkdir(parents=True)
    (models / "Half-Model" / "config.json").write_text("{}")
    pytester.makefile(
        ".toml",
        cases=textwrap.dedent(
            """
        [[case]]
        id = "real-absent"
        model = "Qwen3.5-2B"
        world_size = 1
        [[case]]
        id = "real-half"
        model = "Half-Model"
        world_size = 1
        """
        ),
    )
    pytester.makepyfile("def test_run(fsdp_turbo_case, ppo_run):\n    ppo_run(fsdp_turbo_case)\n")
    result = pytester.runpytest(
        "-rs",
        "--fsdp-turbo-cases=cases.toml",
        f"--fsdp-turbo-models={models}",
        "--fsdp-turbo-device=cpu",
    )
    result.assert_outcomes(skipped=2)
    result.stdout.fnmatch_lines(
        [
            f"*case real-absent: model directory {models / 'Qwen3.5-2B'} does not exist*",
            f"*case real-half: model directory {models / 'Half-Model'} is incomplete: missing weights*",
        ]
    )
    strict = pytester.runpytest(
        "--fsdp-turbo-cases=cases.toml",
        f"--fsdp-turbo-models={models}",
        "--fsdp-turbo-device=cpu",
        "--fsdp-turbo-strict",
    )
    # under strict the pre-flight refuses the session at collection, naming both folders
    assert strict.ret == pytest.ExitCode.USAGE_ERROR
    strict.stderr.fnmatch_lines(
        [
            "*pre-flight: 2 selected case(s) would skip here:",
            f"*real-absent-cpu: model directory {models / 'Qwen3.5-2B'} does not exist",
            f"*real-half-cpu: model directory {models / 'Half-Model'} is incomplete*",
        ]
    )


def test_env_guard_names_the_leaked_variable_and_can_be_turned_off(pytester):
    pytester.makepyfile(
        "import os\n"
        "def test_leaks(device_lease):\n    os.environ['LEAKY_SETTING'] = '1'\n"
        "def test_moves(tmp_path, device_lease):\n    os.chdir(tmp_path)\n"
        "def test_not_using_the_harness():\n    os.environ['OTHER_SETTING'] = '1'\n"
    )
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(passed=3, errors=2)  # a test without harness fixtures is not guarded
    result.stdout.fnmatch_lines(
        [
            "*test changed environment variable LEAKY_SETTING and did not restore it*",
            "*test changed working directory and did not restore it*",
        ]
    )
    pytester.makeini("[pytest]\nfsdp_turbo_env_guard = false\n")
    pytester.runpytest_subprocess().assert_outcomes(passed=3)
    pytester.makeconftest(
        "import pytest\n@pytest.fixture(autouse=True)\ndef _all(fsdp_turbo_env_guard):\n    pass\n"
    )
    pytester.makeini("[pytest]\n")
    pytester.runpytest_subprocess().assert_outcomes(passed=3, errors=3)  # opted in: every test


def test_env_guard_lets_monkeypatch_restore_first_whatever_the_fixture_order(pytester):
    pytester.makepyfile(
        "import os\n"
        "def test_patch_first(monkeypatch, collective_env):\n"
        "    monkeypatch.setenv('GLOO_SOCKET_IFNAME', 'lo')\n"
        "    assert collective_env.child_env()['GLOO_SOCKET_IFNAME'] == collective_env.env.get("
        "'GLOO_SOCKET_IFNAME', 'lo')\n"
        "def test_patch_last(collective_env, monkeypatch):\n"
        "    monkeypatch.setenv('MY_SETTING', '1')\n"
        "def test_patch_and_leak(monkeypatch, collective_env):\n"
        "    monkeypatch.setenv('MY_SETTING', '1')\n"
        "    os.environ['LEAKY_SETTING'] = '1'\n"
    )
    result = pytester.runpytest_subprocess("--fsdp-turbo-device=cpu")
    result.assert_outcomes(passed=3, errors=1)  # only the direct write is the test's own change
    result.stdout.fnmatch_lines(["*environment variable LEAKY_SETTING and did not restore it*"])
    assert "MY_SETTING" not in result.stdout.str() and "GLOO_SOCKET_IFNAME and" not in (
        result.stdout.str()
    )


def test_secrets_are_masked_in_artifacts(ppo_run):
    result = ppo_run(
        "tiny-qwen3-single-rank", extra_env={"HF_TOKEN": "hf_topsecret", "MY_API_KEY": "k"}
    )
    checks.check_completed(result)
    saved = json.loads((result.artifacts_dir / "env.json").read_text())
    assert saved["HF_TOKEN"] == "***" and saved["MY_API_KEY"] == "***"
    for path in result.artifacts_dir.iterdir():
        assert "hf_topsecret" not in path.read_text(errors="replace"), path


def test_failed_case_keeps_every_log_traceback_and_metric(ppo_run):
    result = ppo_run("tiny-qwen3-single-rank", world_size=2, extra_env={FAULT: "crash:0:checks"})
    assert not result.ok
    names = {p.name for p in result.artifacts_dir.iterdir()}
    assert {
        "rank0.log",
        "rank1.log",
        "rank0.error.json",
        "spec.json",
        "env.json",
    } <= names
    assert json.loads((result.artifacts_dir / "rank0.error.json").read_text())["phase"] == "checks"
    assert "phase checks" in result.ranks[1].log_path.read_text()
    partial = json.loads((result.artifacts_dir / "rank0.partial-metrics.json").read_text())
    assert (
        partial[OptimizerRecord.key("grad_norm")] > 0
        and ReferenceRecord.key("grad_max_rel_err") in partial
    )
    # the ranks were told of the fault in their spec, as of every other input
    assert result.spec().fault == FaultSpec("crash", 0, "checks")


FLAKY_ENGINE = """
import torch.distributed as dist
from pytest_fsdp_turbo_engine.engines.fsdp2 import FSDPEngineWithLMHead
from pytest_fsdp_turbo_engine.engines.registry import register


@register(backend="flaky_step", device=["cpu"])
class FlakyStep(FSDPEngineWithLMHead):
    def optimizer_step(self):
        if dist.get_rank() == 1:
            raise RuntimeError("the downstream optimizer blew up on rank 1")
        return super().optimizer_step()
"""
FLAKY_TEST = """
from pathlib import Path
from pytest_fsdp_turbo import checks


def test_downstream(ppo_run):
    here = str(Path(__file__).parent)
    result = ppo_run("tiny-qwen3-single-rank", world_size=2, backend="flaky_step",
                     engine_modules=["flaky_engines"], pythonpath=[here])
    checks.check_completed(result)
"""


def test_a_downstream_engine_failing_on_one_rank_shows_its_cause_first(pytester):
    """The cause in the first lines of pytest's failure section; the rank that only waited for it
    in one line; where the test raised it last."""
    pytester.makepyfile(flaky_engines=FLAKY_ENGINE, test_ds=FLAKY_TEST)
    repo = Path(__file__).resolve().parent.parent
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--fsdp-turbo-device=cpu",
        f"--fsdp-turbo-cases={repo / 'e2e' / 'cases.toml'}",
    )  # fmt: skip
    result.assert_outcomes(failed=1)
    # the failure section only (with CI set, pytest's short summary repeats the whole message)
    section = result.stdout.str().split("_ test_downstream _")[1].split("short test summary")[0]
    lines = section.splitlines()[1:]
    assert any(
        "rank 1 failed first in phase optimizer: RuntimeError: the downstream optimizer blew up"
        in line
        for line in lines[:5]
    ), lines[:5]
    (waiting,) = [line for line in lines if line.startswith("--- rank 0:")]
    assert ": lost its peer rank 1 (" in waiting or waiting.endswith("failed"), waiting
    assert "(raised at " in "\n".join(lines)


E2E = REPO / "e2e"


def test_a_rank_whose_extra_collective_aborts_is_named_first_with_gloos_own_words(ppo_run):
    """Rank 1 issues one all_reduce its peer never issues: gloo aborts rank 1's process (no error
    report) with the collective mismatch in its log, and rank 0 then raises "Connection reset by
    peer". The first failure is rank 1's, told by its last log lines; rank 0 only lost its peer."""
    result = ppo_run(
        "tiny-llama-fsdp2-deferred",
        backend="fsdp_extra_all_reduce_on_rank1",
        engine_modules=["broken_engines"],
        pythonpath=[str(E2E)],
    )
    assert result.first_failure == 1 and result.ranks[1].error is None
    head = "\n".join(result.failure_text().splitlines()[:5])
    # SIGABRT, or SIGKILL where the supervisor stopped it mid-abort after rank 0's error
    assert "rank 1 failed first: killed by SIG" in head and "without an error report" in head, head
    assert "collective mismatch" in head, head
    (follower,) = [line for line in result.failure_text().splitlines() if "--- rank 0" in line]
    assert ": lost its peer rank 1 (phase optimizer: RuntimeError:" in follower, follower
    assert report.run_cause(result).startswith("rank 1 killed by SIG")


def test_a_rank_killed_by_a_signal_is_named_first_with_where_it_was(ppo_run):
    """SIGKILL (the kernel's OOM killer) leaves no error report and no last word: the rank is still
    named first, with the phase its log says it was in, ahead of the peer that lost it."""
    result = ppo_run(
        "tiny-qwen3-single-rank", world_size=2, extra_env={FAULT: "signal:1:optimizer"}
    )
    lines = result.failure_text().splitlines()
    assert result.first_failure == 1
    assert "rank 1 failed first: killed by SIGKILL without an error report" in lines[0], lines[0]
    assert "[rank 1] phase optimizer" in "\n".join(lines[1:4]), lines[:5]
    assert any(
        line.startswith("--- rank 0") and ": lost its peer rank 1 (" in line for line in lines
    ), lines


def test_a_full_disk_at_the_timeline_keeps_the_ranks_own_failure(ppo_run, monkeypatch):
    """ENOSPC when the timeline is written (after the ranks ended): the rank's failure stays the
    verdict, and the lost timeline is a note naming the folder."""
    import errno

    from pytest_fsdp_turbo.processes import progress

    def disk_full(*_args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(progress, "write_timeline", disk_full)
    result = ppo_run("tiny-qwen3-single-rank", extra_env={FAULT: "crash:0:train"})
    assert not result.ok
    assert result.failure_text().startswith(
        "case tiny-qwen3-single-rank: rank 0 failed first in phase train: InjectedFault"
    )
    assert any("timeline not written" in note and "No space left" in note for note in result.notes)


def test_an_artifacts_folder_that_cannot_be_made_is_one_line(pytester, tmp_path):
    """Below a regular file, or a symlink: one line naming the folder, before any rank starts."""
    repo = Path(__file__).resolve().parent.parent
    module = pytester.makepyfile("def test_run(ppo_run):\n    ppo_run('tiny-qwen3-single-rank')\n")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    from pytest_fsdp_turbo.report import artifact_name

    linked = tmp_path / "runs"
    linked.mkdir()
    folder = artifact_name(f"{module.name}::test_run")
    (linked / folder).symlink_to(tmp_path)  # the test's run folder is a link
    for root, said in ((blocker / "below", "cannot write"), (linked, "is a symlink")):
        result = pytester.runpytest(
            "-p", "no:cacheprovider", "--fsdp-turbo-device=cpu",
            f"--fsdp-turbo-cases={repo / 'e2e' / 'cases.toml'}", f"--fsdp-turbo-artifacts={root}",
        )  # fmt: skip
        result.assert_outcomes(failed=1)
        text = result.stdout.str()
        assert "Traceback" not in text and f"artifacts folder {root}" in text, text[-2000:]
        assert said in text


def test_a_hand_off_that_raises_keeps_what_the_post_step_phase_had_measured(ppo_run, tmp_path):
    """The post-step phase fills the step's record as it measures: an engine whose hand-off
    raises leaves the post-step log-probabilities (taken before it) in the partial metrics."""
    (tmp_path / "handoff_engines.py").write_text(
        "from pytest_fsdp_turbo_engine.engines.fsdp2 import FSDPEngineWithLMHead\n"
        "from pytest_fsdp_turbo_engine.engines.registry import register\n"
        "@register(backend='handoff_raises', device=['cpu'])\n"
        "class HandOffRaises(FSDPEngineWithLMHead):\n"
        "    def full_state_dict(self):\n"
        "        raise RuntimeError('the hand-off blew up')\n"
    )
    result = ppo_run(
        "tiny-qwen3-single-rank",
        backend="handoff_raises",
        engine_modules=["handoff_raises = handoff_engines"],
        pythonpath=[str(tmp_path)],
    )
    assert not result.ok and result.ranks[0].error.phase == "checks"
    partial = json.loads(result.folder.partial_metrics(0).read_text())
    assert partial[PostStepRecord.key("post_step_logprob_mean")] < 0  # log-probabilities
    assert PostStepRecord.key("replica_max_abs_diff") in partial
