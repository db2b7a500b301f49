"""Warm ranks: forked from a warm parent per pytest process, fresh for every case."""

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import psutil
import pytest

from pytest_fsdp_turbo import checks
from pytest_fsdp_turbo_contract.records import (
    LossRecord,
    OptimizerRecord,
    RolloutRecord,
    TrainRecord,
)

FAULT = "PYTEST_FSDP_TURBO_FAULT"
PROBES = str(Path(__file__).parent / "warm_probes")
CASE = "tiny-llama-fsdp2-deferred"  # the quickest two-rank case: the launcher is under test
REPO_CASES = Path(__file__).parents[1] / "e2e" / "cases.toml"

pytestmark = pytest.mark.devices(2)


def test_forked_and_spawned_ranks_give_identical_results(ppo_run):
    # one rank: a spawned rank imports torch and transformers itself, the cost under comparison
    warm = ppo_run(CASE, launcher="local", world_size=1)
    cold = ppo_run(CASE, launcher="spawn", world_size=1)
    for result in (warm, cold):
        checks.check_all(result)
    assert warm.notes == []  # forked: no fallback note
    for key in (
        OptimizerRecord.key("grad_norm"),
        LossRecord.key("pg_loss"),
        TrainRecord.key("reduce_scatter_calls_by_micro_batch"),
    ):
        assert warm.metrics[key] == cold.metrics[key], key
    # how much start-up forking saves is benchmarks/warm_ranks.py's figure, not a test's
    phases = {k for k in warm.metrics if k.startswith("timing_s/")}
    assert {
        f"timing_s/{p}"
        for p in (
            "startup",
            "load",
            "rollout",
            "reward",
            "logprobs",
            "train",
            "reference",
            "optimizer",
            "checks",
        )
    } <= phases


def test_a_case_after_a_failed_polluting_case_is_unaffected(ppo_run):
    before = ppo_run(CASE)
    failed = ppo_run(
        CASE,
        engine_modules=["polluter"],
        pythonpath=[PROBES],
        extra_env={FAULT: "crash:0:rollout"},
    )
    assert not failed.ok and "injected crash" in failed.failure_text()
    after = ppo_run(CASE, engine_modules=["leak_probe"], pythonpath=[PROBES])
    checks.check_all(after)  # leak_probe raises in the rank if env, modules or registry leaked
    for key in (
        OptimizerRecord.key("grad_norm"),
        LossRecord.key("pg_loss"),
        RolloutRecord.key("score_mean"),
    ):
        assert after.metrics[key] == before.metrics[key], key  # RNG and weights untouched
    # the name passes as a plain backend (engine modules are given), but nothing registers it now
    orphan = ppo_run(
        CASE, backend="fsdp_polluted", engine_modules=["leak_probe"], pythonpath=[PROBES]
    )
    assert not orphan.ok
    assert "no engine for model_type='llama', backend='fsdp_polluted'" in orphan.failure_text()


def test_an_inner_session_forks_from_the_outer_sessions_warm_parent(pytester, tmp_path):
    """Imports are paid once per process tree: a pytest started inside this one (here, or a
    `pytest-fsdp-turbo run`) forks its ranks from this process's warm parent, in its own folder."""
    from pytest_fsdp_turbo.processes.warm import warm_parent

    outer, why = warm_parent(tmp_path / "state")
    assert outer is not None, why
    pytester.makeini(f"[pytest]\nfsdp_turbo_cases = {REPO_CASES}\n")
    pytester.makepyfile(
        "import os\n"
        "from pathlib import Path\n"
        "from pytest_fsdp_turbo import checks\n"
        "from pytest_fsdp_turbo.processes.warm import warm_parent\n"
        "def test_inner(ppo_run):\n"
        f"    checks.check_all(ppo_run({CASE!r}, launcher='local'))\n"
        "    parent, _ = warm_parent(Path('unused'))\n"
        "    print('forked-by', parent.pid, 'in', os.getcwd())\n"
    )
    result = pytester.runpytest_subprocess("-s")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([f"*forked-by {outer.pid} in {pytester.path}"])


def test_a_stale_or_unfit_advertised_parent_is_not_used(tmp_path, monkeypatch):
    from pytest_fsdp_turbo.processes import warm

    monkeypatch.setenv(warm.SOCKET_VAR, str(tmp_path / "gone.sock"))
    assert warm._shared_parent() is None  # nothing listens: this process starts its own
    outer, why = warm.warm_parent(tmp_path / "state")
    assert outer is not None, why
    monkeypatch.setenv(warm.SOCKET_VAR, outer.socket or str(tmp_path / "no-socket"))
    shared = warm._shared_parent()
    assert shared is not None and shared.pid == outer.pid
    shared.close()
    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "debug")  # the parent imported under "error"
    assert warm._shared_parent() is None


@pytest.mark.skipif(importlib.util.find_spec("verl") is None, reason="needs verl")
def test_verl_ranks_fork_from_a_zygote_that_imported_verl_once(ppo_run):
    """verl resolves its platform while importing, so the parent cannot import it for every kind;
    a zygote per (verl, kind) does, and the ranks of every later verl case skip the import."""
    from pytest_fsdp_turbo.processes.session_processes import session_processes

    first = ppo_run("tiny-qwen3-verl-fsdp2-deferred")
    checks.check_all(first)
    parent = session_processes().warm  # this process's own warm parent, or the one it shares
    # the parent's children: ranks (each leads a session of its own) and zygotes (which do not)
    children = psutil.Process(parent.pid).children()
    zygotes = [child for child in children if os.getsid(child.pid) != child.pid]
    assert len(zygotes) == 1, zygotes  # one for verl:cpu, however many verl cases ran
    assert first.notes == []
    # verl's own import is paid in the zygote: every rank starts with verl already imported
    for rank in first.ranks:
        assert "stacks already imported: verl" in rank.log_path.read_text(), rank.log_tail()


def test_a_stack_that_fails_to_preload_leaves_forking_to_the_parent():
    from pytest_fsdp_turbo_contract.warm_protocol import Fork, Ready, ZygoteStarting, encode
    from pytest_fsdp_turbo_engine.warm.server import Channel, Server, Zygote

    broken = Zygote("no-such-stack:cpu", [])
    assert broken.reason.startswith("KeyError"), broken.reason
    said: list[bytes] = []
    server = Server(Ready(fork_safe=True), Channel(-1, said.append))
    request = Fork({}, "log", rank=0, preload="no-such-stack:cpu")
    assert server.fork_in_zygote(request) is None
    # said before its imports begin: whoever waits on the parent then waits for start-up
    assert said == [encode(ZygoteStarting("no-such-stack:cpu"))]
    assert server.zygotes == {"no-such-stack:cpu": None}  # not tried again
    assert server.fork_in_zygote(replace(request, preload="verl:cuda")) is None  # cpu only
    assert "verl:cuda" not in server.zygotes


def test_every_warm_message_round_trips_through_its_one_encoding():
    from pytest_fsdp_turbo_contract import warm_protocol as wp

    messages = [
        wp.Ready(fork_safe=False, reason="a CUDA context exists", socket="/s"),
        wp.Fork({"RANK": "0"}, "/l", "/cwd", rank=0, spec="/spec.json", preload="verl:cpu"),
        wp.Fork({}, "/err", module="helper", argv=["a"], stdout="/out"),
        wp.Forked(123, rank=1),
        wp.Exited(123, -9),
        wp.ZygoteStarted(77, "verl:cpu"),
        wp.ZygoteStarting("verl:cpu"),
    ]
    wire = b"".join(wp.encode(m) for m in messages)
    buffer = wp.MessageBuffer()
    heard = buffer.feed(wire[:50]) + buffer.feed(wire[50:])  # split mid-line, as sockets do
    assert heard == messages and buffer.pending == b""


def test_helpers_run_as_forks_of_the_warm_parent_with_their_output_and_exit_code(tmp_path):
    """Tiny-model builds and inspections (`python -m` helpers that import torch) fork from the
    warm parent this process tree already has; without one they get a fresh interpreter."""
    from pytest_fsdp_turbo.processes import warm

    outer, why = warm.warm_parent(tmp_path / "state")
    assert outer is not None, why
    argv = ["a", "b"]
    env = {"PYTHONPATH": PROBES}
    forked = warm.run_module("helper_probe", argv, timeout_s=60, env=env)
    assert (forked.returncode, forked.stderr.strip()) == (3, "to stderr"), forked
    report = json.loads(forked.stdout)
    assert report == {"argv": argv, "parent": outer.pid, "torch_loaded": True}
    code = f"from pytest_fsdp_turbo.processes import warm; print(warm.run_module('helper_probe', {argv!r}, timeout_s=60, env={env!r}).stdout)"
    inner = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(inner.stdout)["parent"] == outer.pid  # a descendant uses the same parent
    sibling = Path(sys.executable).with_name("python3")  # console scripts' shebang says python3
    if sibling.exists() and sibling.name != Path(sys.executable).name:
        other = subprocess.run([sibling, "-c", code], capture_output=True, text=True, check=True)
        assert json.loads(other.stdout)["parent"] == outer.pid
    alone = {k: v for k, v in os.environ.items() if k != warm.SOCKET_VAR}
    fresh = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=alone
    )
    assert json.loads(fresh.stdout)["torch_loaded"] is False  # no parent: a fresh interpreter


@pytest.mark.skipif(not os.environ.get("PYTEST_XDIST_WORKER"), reason="a worker of an xdist run")
def test_every_xdist_worker_forks_from_the_controllers_one_warm_parent(fsdp_turbo_lease_book):
    """conftest.py: the controller starts one parent before the workers; a parent it started
    from a helper thread died with that thread, and every worker quietly started its own."""
    from pytest_fsdp_turbo.processes.session_processes import session_processes
    from pytest_fsdp_turbo.processes.warm import SharedWarmParent, warm_parent

    parent, why = warm_parent(fsdp_turbo_lease_book.state_dir)
    assert parent is session_processes().warm and isinstance(parent, SharedWarmParent), why
    assert psutil.Process(parent.pid).ppid() == os.getppid()  # the controller's child


def test_a_fork_that_fails_setting_itself_up_ends_alone_and_the_parent_serves_on(tmp_path):
    """A forked rank that fails before its own error handling (here a thread count that is not a
    number) exits 1 with the cause in its output; it never unwinds into the parent's server code,
    so the parent lives on, keeps its socket and serves the next fork."""
    from pytest_fsdp_turbo.processes import warm

    outer, why = warm.warm_parent(tmp_path / "state")
    assert outer is not None, why
    env = {"PYTHONPATH": PROBES, "OMP_NUM_THREADS": "abc"}
    failed = warm.run_module("helper_probe", ["a"], timeout_s=60, env=env)
    assert failed.returncode == 1
    assert (
        "warm fork: setting up the rank failed: ValueError: OMP_NUM_THREADS: expected a "
        "positive integer; got 'abc'"
    ) in failed.stderr
    assert outer.alive and Path(outer.socket).exists()
    again = warm.run_module("helper_probe", ["a"], timeout_s=60, env={"PYTHONPATH": PROBES})
    assert again.returncode == 3 and json.loads(again.stdout)["parent"] == outer.pid


def test_a_thread_count_that_is_not_a_number_is_one_line_before_any_rank(ppo_run):
    with pytest.raises(pytest.fail.Exception) as refused:
        ppo_run("tiny-qwen3-single-rank", extra_env={"OMP_NUM_THREADS": "abc"})
    assert str(refused.value.msg) == (
        "ppo_run extra_env OMP_NUM_THREADS: expected a positive integer (threads per rank); got "
        "'abc'"
    )


def test_a_stopped_warm_parent_costs_seconds_and_the_case_runs_on_spawned_ranks(
    pytester, monkeypatch
):
    """A warm parent that no longer answers (stopped with SIGSTOP here) is given up after the
    fork timeout: the case's ranks are spawned as fresh interpreters and it runs, saying why;
    the silent parent is never asked again."""
    from pytest_fsdp_turbo.processes import warm

    monkeypatch.delenv(warm.SOCKET_VAR, raising=False)  # its own parent, not this session's
    pytester.makeini(f"[pytest]\nfsdp_turbo_cases = {REPO_CASES}\n")
    pytester.makepyfile(
        "import os, signal\n"
        "from pathlib import Path\n"
        "from pytest_fsdp_turbo.processes import warm\n"
        "def test_stopped(ppo_run, fsdp_turbo_lease_book):\n"
        "    parent, why = warm.warm_parent(fsdp_turbo_lease_book.state_dir)\n"
        "    assert parent is not None and parent.fork_safe, why\n"
        "    assert ppo_run('tiny-qwen3-single-rank').ok  # its model and inspection: ready\n"
        "    warm.FORK_TIMEOUT_S = 2.0\n"
        "    os.kill(parent.pid, signal.SIGSTOP)\n"
        "    result = ppo_run('tiny-qwen3-single-rank')\n"
        "    assert result.ok, result.failure_text()\n"
        "    (note,) = [n for n in result.notes if 'did not answer within 2s' in n]\n"
        "    assert note.startswith('ranks spawned as fresh interpreters: the warm parent')\n"
        "    assert not parent.alive\n"
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


def test_a_fork_may_wait_for_a_zygotes_imports_when_the_parent_says_one_is_starting(
    tmp_path, monkeypatch
):
    """A parent that builds a zygote first (verl's imports) says so, and the wait becomes
    start-up, held to READY_TIMEOUT_S; without that word, silence past FORK_TIMEOUT_S is a
    stopped parent. The conversation's client side, with a parent that answers each request
    after 0.5 s and announces a zygote for the first stack it sees."""
    import threading
    import time

    from pytest_fsdp_turbo.processes import warm
    from pytest_fsdp_turbo_contract.warm_protocol import (
        Forked,
        ZygoteStarting,
        decode_line,
        encode,
    )

    class SlowParent(warm._Conversation):
        pid, log_path, alive = 1, tmp_path / "parent.log", True

        def __init__(self) -> None:
            self.lines: list[bytes] = []
            self.arrived = threading.Condition()
            self._start_reading(self._answers())

        def _answers(self):
            zygotes: set[str] = set()
            while True:
                with self.arrived:
                    self.arrived.wait_for(lambda: self.lines)
                    request = decode_line(self.lines.pop(0))
                if request.preload not in zygotes:
                    zygotes.add(request.preload)
                    yield encode(ZygoteStarting(request.preload))
                time.sleep(0.5)
                yield encode(Forked(100 + request.rank, rank=request.rank))

        def _write(self, data: bytes) -> None:
            with self.arrived:
                self.lines.append(data)
                self.arrived.notify()

        def close(self) -> None:
            pass

    monkeypatch.setattr(warm, "FORK_TIMEOUT_S", 0.2)
    parent = SlowParent()
    spec, log = tmp_path / "spec.json", tmp_path / "rank.log"
    assert parent.fork(0, {}, spec, log, preload="verl:cpu") == 100  # its zygote's imports
    with pytest.raises(warm.WarmParentSilent, match=r"did not answer within 0\.2s \(fork rank 1"):
        parent.fork(1, {}, spec, log, preload="verl:cpu")  # no zygote to start: silent
    assert parent.silent
