"""The launcher on real rank processes: fast failure, timeouts with stacks, no leaked processes."""

import os
import sys
import textwrap
from pathlib import Path

import pytest

from pytest_fsdp_turbo.processes import supervisor
from pytest_fsdp_turbo.processes.supervisor import LocalRank, launch_local
from pytest_fsdp_turbo_contract.artifacts import RunFolder

HANG = textwrap.dedent(
    """
    import faulthandler, os, signal, subprocess, sys, time
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    def wait_for_peer():
        time.sleep(300)
    wait_for_peer()
    """
)


def test_timeout_dumps_every_rank_stack_and_kills_the_tree(tmp_path, no_leaked_processes):
    """How soon it stops is a benchmark (benchmarks/failure_latency.py); here: that it does."""
    result = launch_local(
        case_id="hang",
        world_size=2,
        env={"PATH": "/usr/bin:/bin"},
        artifacts_dir=tmp_path,
        timeout_s=3,
        command=[sys.executable, "-c", HANG],
    )
    assert result.timed_out and not result.ok
    assert all(rank.exit_code is not None and rank.exit_code < 0 for rank in result.ranks)
    for rank in result.ranks:
        assert "in wait_for_peer" in rank.log_path.read_text()
    assert "timed out after 3s" in result.failure_text()
    assert "in wait_for_peer" in result.failure_text()


# a rank whose start-up (its imports, on a busy box) takes argv[1] seconds, then records its first
# phase, as the engine worker does, and runs its case for argv[3] seconds
SLOW_START = textwrap.dedent(
    """
    import json, sys, time
    time.sleep(float(sys.argv[1]))
    with open(sys.argv[2], "a") as record:
        record.write(json.dumps({"phase": "init", "t": time.time()}) + "\\n")
    time.sleep(float(sys.argv[3]))
    """
)


def _slow_starters(folder: RunFolder, start_s: float, run_s: float) -> list[LocalRank]:
    env = {"PATH": "/usr/bin:/bin"}
    return [
        LocalRank(
            rank,
            [sys.executable, "-c", SLOW_START, str(start_s), str(folder.phases(rank)), str(run_s)],
            env,
            folder.log(rank),
        )
        for rank in range(2)
    ]


def test_the_case_timeout_counts_from_when_every_rank_has_started(tmp_path, no_leaked_processes):
    """A slow start-up (a fresh interpreter's imports on a busy box) is not the case's time: 2.5 s
    of start-up and 0.5 s of case pass a 1.5 s timeout; counted from launch, they would not."""
    folder = RunFolder(tmp_path)
    started = supervisor.began_phases(tmp_path)
    outcome = supervisor.supervise(_slow_starters(folder, 2.5, 0.5), 1.5, started=started)
    assert not outcome.timed_out and set(outcome.ends) == {0, 1}
    assert outcome.start_up_s is not None and outcome.start_up_s >= 2.5
    control = RunFolder(tmp_path / "control")
    control.path.mkdir()
    assert supervisor.supervise(_slow_starters(control, 2.5, 0.5), 1.5).timed_out


def test_a_start_up_that_never_ends_is_its_own_timeout_and_says_so(
    tmp_path, monkeypatch, no_leaked_processes
):
    monkeypatch.setattr(supervisor, "START_UP_TIMEOUT_S", 1.0)
    folder = RunFolder(tmp_path)
    handles = _slow_starters(folder, 300, 0)
    outcome = supervisor.supervise(handles, 60, started=supervisor.began_phases(tmp_path))
    assert outcome.timed_out and outcome.start_up_s is None
    result = supervisor.collect_result("slow", handles, tmp_path, 60, 0.0, outcome)
    assert result.failure_text().startswith(
        "case slow: its ranks did not finish starting (interpreter and imports, before their "
        "first phase) within 1s"
    )


def test_first_failure_stops_the_rest_at_once(tmp_path, no_leaked_processes):
    script = "import os, sys, time\nif os.environ['RANK'] == '1':\n    sys.exit('rank one fell over')\ntime.sleep(300)\n"
    result = launch_local(
        case_id="crash",
        world_size=3,
        env={"PATH": "/usr/bin:/bin"},
        artifacts_dir=tmp_path,
        timeout_s=120,
        command=[sys.executable, "-c", script],
    )
    assert result.first_failure == 1 and not result.timed_out
    # the others were stopped by a signal, not left to finish their sleep
    assert [r.exit_code < 0 for r in result.ranks] == [True, False, True]
    text = result.failure_text()
    assert "rank 1 failed first" in text and "rank one fell over" in text


def test_crashing_rank_fails_fast_with_traceback_and_phase(ppo_run, no_leaked_processes):
    result = ppo_run(
        "tiny-qwen3-single-rank",
        world_size=2,
        extra_env={"PYTEST_FSDP_TURBO_FAULT": "crash:1:rollout"},
    )
    assert not result.ok and result.first_failure == 1
    crashed = result.ranks[1]
    assert crashed.error.phase == "rollout"
    assert crashed.error.type == "InjectedFault"
    # stopped at once (the supervisor's signal, or gloo seeing its peer gone), never at a timeout
    peer = result.ranks[0]
    assert not result.timed_out and peer.exit_code != 0, peer
    assert peer.exit_code < 0 or "timeout" not in peer.error.message.lower(), peer.error
    text = result.failure_text()
    assert "phase rollout: InjectedFault: injected crash in rank 1 at phase rollout" in text
    assert "Traceback (most recent call last)" in text
    assert crashed.log_path.is_file() and result.folder.spec.is_file()


def test_leak_check_tolerates_a_child_that_exits_during_its_scan():
    """Issue: the leak check raised NameError (psutil imported for type checking only)."""
    import subprocess
    import sys

    import psutil

    from pytest_fsdp_turbo.fixtures import _alive, _cmd

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    proc = psutil.Process(child.pid)
    child.wait()
    assert _alive(proc) is False  # gone (reaped): no NameError, no exception
    assert _cmd(proc) == "?"


def test_the_launcher_is_chosen_in_one_place_and_a_wrong_name_is_one_line(ppo_run, tmp_path):
    from pytest_fsdp_turbo.launching.request import launcher_for
    from pytest_fsdp_turbo.leases import LeaseBook
    from pytest_fsdp_turbo_contract.vocab import Launcher

    started = []
    book = LeaseBook(tmp_path / "state")
    launcher_for(Launcher.LOCAL, book, lambda: started.append("ray"))
    launcher_for(Launcher.SPAWN, book, lambda: started.append("ray"))
    assert started == []  # only the Ray launcher starts (or joins) Ray
    with pytest.raises(pytest.fail.Exception) as failed:
        ppo_run("tiny-qwen3-single-rank", launcher="slurm")
    message = str(failed.value)
    assert message == "launcher: expected one of local, spawn, ray; got 'slurm'", message


def test_a_log_without_newlines_gives_a_tail_bounded_in_bytes(tmp_path):
    """A rank that wrote 50 MB without a newline: its tail in the failure text stays short."""
    from pytest_fsdp_turbo_contract.results import LOG_TAIL_BYTES, RankResult

    log = tmp_path / "rank0.log"
    with open(log, "w") as out:
        for _ in range(50):
            out.write("x" * 1_000_000)
        out.write("\nthe last line\n")
    tail = RankResult(rank=0, exit_code=1, duration_s=1.0, log_path=log).log_tail()
    assert tail.endswith("the last line")
    assert len(tail) <= LOG_TAIL_BYTES + 60


def test_a_pytest_inside_a_torchrun_job_keeps_the_agents_variables_from_its_ranks(monkeypatch):
    """Started under torchrun, the session inherits TORCHELASTIC_USE_AGENT_STORE (and the agent's
    group variables): handed on, every rank would wait on an agent store nobody serves until the
    collective timeout. Every launcher builds a rank's environment here, without them."""
    from pytest_fsdp_turbo.processes.supervisor import rank_env

    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "outer-job")
    monkeypatch.setenv("GROUP_RANK", "3")
    env = rank_env(dict(os.environ), 1, 2)
    assert not [n for n in env if n.startswith("TORCHELASTIC_") or n == "GROUP_RANK"]
    assert (env["RANK"], env["WORLD_SIZE"], env["PATH"]) == ("1", "2", os.environ["PATH"])


@pytest.mark.parametrize("fails", [False, True])
def test_nothing_a_case_started_outlives_it(ppo_run, tmp_path, fails):
    """A helper an engine starts in a session of its own (out of the rank's process tree, re-
    parented once the rank exits) is gone when the case ends, whether the case passed or not."""
    import psutil

    pids = tmp_path / "helpers"
    result = ppo_run(
        "tiny-qwen3-single-rank",
        backend="fsdp_with_helper",
        engine_modules=["fsdp_with_helper = helper_starter"],
        pythonpath=[str(Path(__file__).parent / "warm_probes")],
        extra_env={"HELPER_PIDS": str(pids), "HELPER_THEN_FAIL": "1" if fails else "0"},
    )
    assert result.ok is not fails
    (helper,) = [int(line) for line in pids.read_text().split()]
    alive = psutil.pid_exists(helper) and psutil.Process(helper).status() != psutil.STATUS_ZOMBIE
    assert not alive, f"helper {helper} outlived its case"


def test_a_gloo_interface_this_host_lacks_is_one_line_naming_the_variable(ppo_run):
    with pytest.raises(pytest.fail.Exception) as refused:
        ppo_run("tiny-qwen3-single-rank", extra_env={"GLOO_SOCKET_IFNAME": "nosuch0"})
    message = str(refused.value.msg)
    assert message.startswith(
        "ppo_run extra_env GLOO_SOCKET_IFNAME: expected network interfaces of this host ("
    )
    assert message.endswith("; nosuch0 is not one") and "lo" in message


def test_reaping_never_touches_a_session_whose_leader_took_a_dead_ranks_pid():
    """Reaping matches sessions by the rank's pid; once a rank is gone its pid may name another
    process's session. A leader alive with another start time is not the rank: left alone."""
    import subprocess
    import sys

    import psutil

    from pytest_fsdp_turbo.processes.reaping import case_processes

    other = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True
    )
    try:
        started = psutil.Process(other.pid).create_time()
        assert [p.pid for p in case_processes("x", {other.pid: started})] == [other.pid]
        assert case_processes("x", {other.pid: started - 100}) == []  # a recycled pid
    finally:
        other.kill()
        other.wait()


def test_the_ranks_pythonpath_is_the_cases_then_the_checkouts_then_the_sessions(
    monkeypatch, tmp_path
):
    """What a rank imports first: ppo_run's pythonpath, the FSDPTurbo checkout, then the session's
    PYTHONPATH (HarnessEnv); ppo_run's extra_env, when it names PYTHONPATH, wins outright."""
    from types import SimpleNamespace

    from pytest_fsdp_turbo.cases import Case
    from pytest_fsdp_turbo.devices import Accelerator
    from pytest_fsdp_turbo.launching.request import RunRequest, _env_overrides

    monkeypatch.setenv("PYTHONPATH", "/session")
    request = RunRequest(
        Case("c", "tiny-qwen3"),
        tmp_path,
        tmp_path,
        Accelerator("cpu", (0, 1)),
        checkout=SimpleNamespace(pythonpath="/checkout"),
        pythonpath=["/mine"],
    )
    env = _env_overrides(request, (0, 1), 29500, None)
    assert env["PYTHONPATH"] == os.pathsep.join(["/mine", "/checkout", "/session"])
    request.extra_env = {"PYTHONPATH": "/only"}
    assert _env_overrides(request, (0, 1), 29500, None)["PYTHONPATH"] == "/only"


def test_the_profiles_own_loopback_is_checked_too_on_a_host_without_it(monkeypatch):
    """On CPU the collective profile tells gloo to use lo; a host without it is told before any
    rank starts, naming the profile as where the interface came from."""
    import psutil

    from pytest_fsdp_turbo.environ import build_collective_env
    from pytest_fsdp_turbo.launching.request import _refuse_missing_interfaces
    from pytest_fsdp_turbo.settings import RunEnv
    from pytest_fsdp_turbo_contract.errors import ConfigError

    group = build_collective_env("cpu", (0, 1), 29500, world_size=2, user_env={})
    monkeypatch.setattr(psutil, "net_if_addrs", lambda: {"eth0": []})
    with pytest.raises(ConfigError) as refused:
        _refuse_missing_interfaces(group, RunEnv.read({}, {}, 2))
    assert str(refused.value) == (
        "collective profile GLOO_SOCKET_IFNAME: expected network interfaces of this host (eth0); "
        "lo is not one"
    )
