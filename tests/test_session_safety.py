"""The harness never takes down its own session: real faults in one pytest session (Ray started
lazily inside a guarded test, a leaked actor, a killed warm parent, a rank that exits, a Ray cluster
that dies), and every test still reaches a verdict, the summary and the junit file."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from xml.etree import ElementTree

import pytest

from pytest_fsdp_turbo.leases import LeaseBook
from pytest_fsdp_turbo.private_dirs import private_dir, write_private
from pytest_fsdp_turbo_contract.errors import ConfigError
from pytest_fsdp_turbo_contract.faults import parse_fault

REPO = Path(__file__).resolve().parent.parent

SESSION = '''
import os, subprocess, sys

import psutil

from pytest_fsdp_turbo import checks

LEAK = """
import sys, ray
ray.init(address=sys.argv[1])
@ray.remote(num_cpus=0)
class Leaker:
    def ping(self):
        return os.getpid()
actor = Leaker.options(name="leaker", lifetime="detached").remote()
ray.get(actor.ping.remote())
""".replace("os.getpid()", "__import__('os').getpid()")
FAULT = "PYTEST_FSDP_TURBO_FAULT"


def test_a_first_ray_case_starts_ray_under_the_guard(ppo_run, no_leaked_processes):
    result = ppo_run(  # slowed, so live progress must follow the Ray ranks and warn of the stall
        "tiny-qwen3-single-rank", timeout=240.0, collective_timeout=20.0,
        extra_env={FAULT: "stall:0:rollout", "PYTEST_FSDP_TURBO_FAULT_STALL_S": "2.5"},
    )
    checks.check_completed(result)
    assert any("ranks ran as Ray actors" in note for note in result.notes), result.notes


def test_b_second_ray_case_uses_the_same_cluster(ppo_run, no_leaked_processes):
    checks.check_completed(ppo_run("tiny-qwen3-single-rank"))


def test_c_a_leaked_actor_is_red(ray_cluster, no_leaked_processes):
    env = {**os.environ, "RAY_AUTH_MODE": "token"}  # the token of the cluster ray.init() made
    subprocess.run([sys.executable, "-c", LEAK, ray_cluster.cluster_address], check=True, env=env)


def test_d_killed_warm_parent(ppo_run):
    killed = ppo_run(
        "tiny-qwen3-single-rank", launcher="local", extra_env={FAULT: "kill_parent:0:rollout"}
    )
    assert not killed.ok and "the warm parent (pid" in killed.failure_text()
    checks.check_completed(ppo_run("tiny-qwen3-single-rank", launcher="local"))  # a new parent
    from pytest_fsdp_turbo.processes.session_processes import owned

    parents = [p for p in owned().values() if p.what == "warm parent"]
    assert len(parents) == 1 and psutil.pid_exists(parents[0].pid), parents  # the dead one let go


def test_e_rank_that_exits(ppo_run):
    result = ppo_run(
        "tiny-qwen3-single-rank", world_size=2, launcher="local", extra_env={FAULT: "exit:1:rollout"}
    )
    assert not result.ok and not result.timed_out and result.first_failure == 1
    assert "exited with code 0 without writing its results" in result.failure_text()


def test_f_the_ray_cluster_dies(ray_cluster):
    daemons = psutil.Process(ray_cluster.proc.pid).children(recursive=True)
    for proc in daemons:
        if "gcs_server" in " ".join(proc.cmdline()) or "raylet/raylet" in " ".join(proc.cmdline()):
            proc.kill()


def test_g_ray_case_after_the_cluster_died(ppo_run):
    checks.check_completed(ppo_run("tiny-qwen3-single-rank"))
'''


def test_faults_end_tests_never_the_session(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    if (
        importlib.util.find_spec("ray") is None
    ):  # never imported here: the pytest process stays light
        pytest.skip("needs ray: pip install 'pytest-fsdp-turbo[ray]'")
    pytester.makepyfile(test_faults=SESSION)
    # 1.2 s of the first Ray case's 240 s timeout (which counts from the rank's first phase: a
    # fresh Ray rank's imports, over 30 s on a busy 2-core box, are not in it)
    pytester.makeini("[pytest]\nfsdp_turbo_stall_share = 0.005\n")
    junit = pytester.path / "junit.xml"
    monkeypatch.setenv("RAY_gcs_rpc_server_reconnect_timeout_s", "2")  # a dead GCS ends it soon
    # its own warm parent, not this session's: the kill_parent fault below is meant for that one
    monkeypatch.delenv("PYTEST_FSDP_TURBO_WARM_SOCKET", raising=False)
    result = pytester.runpytest_subprocess(
        "-p",
        "no:cacheprovider",
        "--fsdp-turbo-device=cpu",
        "--fsdp-turbo-launcher=ray",  # the option, as users give it; the local cases override it
        f"--fsdp-turbo-cases={REPO / 'e2e' / 'cases.toml'}",
        f"--junitxml={junit}",
        timeout=400,
    )
    text = result.stdout.str()
    result.assert_outcomes(passed=6, failed=1, errors=1)  # c passes, then errors at teardown
    # the leaked actor, by pid and title; the session's own Ray processes are not named
    leaks = [line for line in text.splitlines() if line.startswith("processes outlived the test")]
    assert len(leaks) == 1 and leaks[0].count("pid ") == 1 and "(ray::Leaker" in leaks[0], leaks
    result.stdout.fnmatch_lines(
        ["fsdp-turbo: stall: case tiny-qwen3-single-rank rank 0 has been in phase rollout for *"]
    )
    # the case after the cluster died says why
    result.stdout.re_match_lines([r"E?\s*.*(Ray launcher|the Ray driver \(pid \d+\) ended).*"])
    assert "fsdp-turbo e2e runs" in text  # the summary table
    cases = ElementTree.parse(junit).getroot().iter("testcase")
    assert len(list(cases)) == 7


def test_fault_spec_is_validated_before_launch() -> None:
    assert parse_fault("") is None
    assert parse_fault("crash:1", world_size=2).phase == "init"
    with pytest.raises(ConfigError, match=r"PYTEST_FSDP_TURBO_FAULT: expected KIND:RANK\[:PHASE\]"):
        parse_fault("explode:9")
    with pytest.raises(ConfigError, match="rank 9 is outside the case's 2 ranks"):
        parse_fault("crash:9:rollout", world_size=2)
    with pytest.raises(ConfigError, match="unknown phase 'nowhere'"):
        parse_fault("crash:1:nowhere")


def test_unknown_fault_fails_the_test_in_one_line(ppo_run, monkeypatch) -> None:
    monkeypatch.setenv("PYTEST_FSDP_TURBO_FAULT", "explode:9")
    with pytest.raises(pytest.fail.Exception, match="PYTEST_FSDP_TURBO_FAULT: expected") as info:
        ppo_run("tiny-qwen3-single-rank")
    assert info.value.__suppress_context__


def _foreign(folder: Path) -> Path:
    """A folder owned by another user (nobody), as on a shared CI box."""
    folder.mkdir()
    try:
        os.chown(folder, 65534, 65534)
    except PermissionError:
        pytest.skip("chown to another user needs root (CI runs as root)")
    return folder


def test_state_folder_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    foreign = _foreign(tmp_path / "state")
    with pytest.raises(ConfigError) as info:
        LeaseBook(foreign)
    message = str(info.value)
    assert f"lease state folder {foreign} is owned by uid 65534" in message
    assert "PYTEST_FSDP_TURBO_STATE_DIR" in message
    assert not (foreign / "leases.json").exists() and not (foreign / "leases.lock").exists()


def test_state_folder_others_may_write_is_refused_and_new_ones_are_private(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(ConfigError, match=r"is writable by other users \(mode 777\)"):
        LeaseBook(shared)
    book = LeaseBook(tmp_path / "fresh")
    assert (tmp_path / "fresh").stat().st_mode & 0o777 == 0o700
    book.release_port(book.port())
    assert (tmp_path / "fresh" / "leases.json").stat().st_mode & 0o777 == 0o600
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "fresh")
    with pytest.raises(ConfigError, match="is a symbolic link"):
        private_dir(link, "lease state folder", "PYTEST_FSDP_TURBO_STATE_DIR")


def test_state_file_is_never_written_through_a_planted_symlink(tmp_path: Path) -> None:
    target = tmp_path / "victim"
    target.write_text("keep")
    state = private_dir(tmp_path / "state", "lease state folder", "X")
    (state / f".leases.json.{os.getpid()}.tmp").symlink_to(target)  # planted temporary name
    write_private(state / "leases.json", "{}")
    assert target.read_text() == "keep"
    assert (state / "leases.json").read_text() == "{}"


def test_a_foreign_state_folder_fails_the_fixture_in_one_line(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    foreign = _foreign(pytester.path / "state")
    pytester.makepyfile("def test_port(free_port):\n    pass\n")
    monkeypatch.setenv("PYTEST_FSDP_TURBO_STATE_DIR", str(foreign))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines([f"*lease state folder {foreign} is owned by uid 65534*"])
    assert "Traceback" not in result.stdout.str()


def test_the_session_owned_registry_keeps_only_what_the_owner_says() -> None:
    """The warm parent is the session's; its forked ranks are not (no keeps rule)."""
    import psutil

    from pytest_fsdp_turbo.processes.session_processes import belongs_to_session, disown, own

    me = psutil.Process()
    child = psutil.Popen(["sleep", "30"])
    try:
        assert not belongs_to_session(child)
        own(me.pid, "test", keeps=None)
        assert belongs_to_session(me) and not belongs_to_session(child)
        own(me.pid, "test", keeps=lambda proc: proc.pid == child.pid)
        assert belongs_to_session(child)
    finally:
        disown(me.pid)
        child.kill()
        child.wait()


def test_one_owner_closes_the_ray_driver_then_the_warm_parent_and_a_fork_closes_neither() -> None:
    from pytest_fsdp_turbo.processes.session_processes import SessionProcesses

    closed: list[str] = []

    class Helper:
        def __init__(self, name: str) -> None:
            self.name = name

        def close(self) -> None:
            closed.append(self.name)

    processes = SessionProcesses(warm=Helper("warm parent"), ray=Helper("ray driver"))
    child = os.fork()
    if child == 0:  # a forked child holds a copy: the helpers are its parent's, not its own
        processes.close()
        os._exit(len(closed))
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    processes.close()
    assert closed == ["ray driver", "warm parent"]
    processes.close()  # at exit again: nothing left to close
    assert closed == ["ray driver", "warm parent"]


def test_a_ray_address_where_nothing_answers_is_one_line_within_the_bound(tmp_path: Path) -> None:
    if importlib.util.find_spec("ray") is None:
        pytest.skip("needs ray: pip install 'pytest-fsdp-turbo[ray]'")
    from pytest_fsdp_turbo.launching.ray_driver import RayDriver

    with pytest.raises(ConfigError) as info:
        RayDriver("127.0.0.1:9", connect_timeout_s=3, log_path=tmp_path / "driver.log")
    message = str(info.value)
    assert message.startswith("Ray cluster at 127.0.0.1:9 (--fsdp-turbo-ray-address / RAY_ADDRESS)")
    assert "did not answer within 3s" in message and "--fsdp-turbo-ray-connect-timeout" in message


def test_ray_connect_timeout_is_validated() -> None:
    from pytest_fsdp_turbo.settings import resolve

    assert resolve({"fsdp_turbo_ray_connect_timeout": "7.5"}, env={}).ray_connect_timeout_s == 7.5
    assert resolve({}, env={}).ray_connect_timeout_s == 30.0
    with pytest.raises(ConfigError, match="PYTEST_FSDP_TURBO_RAY_CONNECT_TIMEOUT_S: expected a"):
        resolve({}, env={"PYTEST_FSDP_TURBO_RAY_CONNECT_TIMEOUT_S": "soon"})


CTRL_C_SESSION = """
def test_a_case_interrupted(ppo_run):
    ppo_run("tiny-qwen3-single-rank")
"""


def test_ctrl_c_during_a_case_ends_with_pytests_own_summary_and_cleans_up(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGINT while the ranks run (one stalls in rollout): exit 2 with pytest's interrupted summary,
    no traceback of the harness's, no rank left running, no lease left held."""
    import signal
    import subprocess
    import sys
    import time

    import psutil

    from pytest_fsdp_turbo.leases import LeaseBook

    pytester.makepyfile(test_interrupted=CTRL_C_SESSION)
    state = pytester.path / "state"
    monkeypatch.setenv("PYTEST_FSDP_TURBO_STATE_DIR", str(state))
    monkeypatch.setenv("PYTEST_FSDP_TURBO_FAULT", "stall:0:rollout")
    monkeypatch.setenv("PYTEST_FSDP_TURBO_FAULT_STALL_S", "60")
    monkeypatch.delenv("PYTEST_FSDP_TURBO_WARM_SOCKET", raising=False)
    artifacts = pytester.path / "artifacts"
    session = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--fsdp-turbo-device=cpu",
         f"--fsdp-turbo-cases={REPO / 'e2e' / 'cases.toml'}", f"--fsdp-turbo-artifacts={artifacts}"],
        cwd=pytester.path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        # SIGINT as a terminal gives it, even when this suite runs from a background job (which
        # starts with SIGINT ignored, and a child inherits that)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while not list(artifacts.glob("*/rank0.phases.jsonl")) and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1.0)  # the rank is in its stall now
    ranks = [
        p for p in psutil.process_iter(["cmdline"])
        if str(artifacts) in " ".join(p.info["cmdline"] or [])
    ]  # fmt: skip
    assert ranks, "the case never started its ranks"
    session.send_signal(signal.SIGINT)
    out, _ = session.communicate(timeout=60)
    assert session.returncode == pytest.ExitCode.INTERRUPTED, out[-3000:]
    assert "KeyboardInterrupt" in out and "AttributeError" not in out, out[-3000:]
    (said,) = [line for line in out.splitlines() if "fsdp-turbo: interrupted during case" in line]
    assert said.endswith(
        f"; its logs so far: {artifacts}/test_interrupted.test_a_case_interrupted"
    ), said
    gone, alive = psutil.wait_procs(ranks, timeout=10)
    assert not alive, [p.pid for p in alive]
    assert all(not rows for rows in LeaseBook(state).holders().values())


def test_a_full_or_read_only_state_disk_is_one_line_naming_the_path(
    tmp_path: Path, monkeypatch
) -> None:
    """Writing the lease state on a full disk, or making a cache under a read-only folder, is a
    ConfigError naming the path and the system's reason, never a traceback."""
    import errno

    from pytest_fsdp_turbo.private_dirs import private_dir, write_private
    from pytest_fsdp_turbo_contract.errors import ConfigError

    state = private_dir(tmp_path / "state", "lease state folder", "PYTEST_FSDP_TURBO_STATE_DIR")
    real_fdopen = os.fdopen

    class Full:
        def __init__(self, fd):
            self.handle = real_fdopen(fd, "w")

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.handle.close()

        def write(self, text):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fdopen", lambda fd, mode: Full(fd))
    with pytest.raises(ConfigError) as full:
        write_private(state / "leases.json", "{}")
    monkeypatch.undo()
    assert str(full.value) == f"{state / 'leases.json'}: cannot write it (No space left on device)"
    assert not list(state.glob(".leases.json.*"))  # the half-written file is gone
    monkeypatch.setattr(
        os,
        "mkdir",
        lambda *a, **k: (_ for _ in ()).throw(OSError(errno.EROFS, "Read-only file system")),
    )
    with pytest.raises(ConfigError) as read_only:
        private_dir(tmp_path / "cache" / "models", "tiny model cache", "XDG_CACHE_HOME")
    assert "tiny model cache" in str(read_only.value) and "Read-only file system" in str(
        read_only.value
    )
