"""The launcher on real rank processes: fast failure, timeouts with stacks, no leaked processes."""

import sys
import textwrap
import time

from pytest_fsdp_turbo.launch import launch_local

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
    start = time.monotonic()
    result = launch_local(
        case_id="hang",
        world_size=2,
        env={"PATH": "/usr/bin:/bin"},
        artifacts_dir=tmp_path,
        timeout_s=3,
        command=[sys.executable, "-c", HANG],
    )
    assert time.monotonic() - start < 15
    assert result.timed_out and not result.ok
    for rank in result.ranks:
        assert "in wait_for_peer" in rank.log_path.read_text()
    assert "timed out after 3s" in result.failure_text()
    assert "in wait_for_peer" in result.failure_text()


def test_first_failure_stops_the_rest_at_once(tmp_path, no_leaked_processes):
    script = "import os, sys, time\nif os.environ['RANK'] == '1':\n    sys.exit('rank one fell over')\ntime.sleep(300)\n"
    start = time.monotonic()
    result = launch_local(
        case_id="crash",
        world_size=3,
        env={"PATH": "/usr/bin:/bin"},
        artifacts_dir=tmp_path,
        timeout_s=120,
        command=[sys.executable, "-c", script],
    )
    assert time.monotonic() - start < 10
    assert result.first_failure == 1 and not result.timed_out
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
    assert crashed.error["phase"] == "rollout"
    assert crashed.error["type"] == "InjectedFault"
    assert (
        result.ranks[0].duration_s - crashed.duration_s < 10
    )  # stopped at once, not at the timeout
    text = result.failure_text()
    assert "phase rollout: InjectedFault: injected crash in rank 1 at phase rollout" in text
    assert "Traceback (most recent call last)" in text
    assert crashed.log_path.is_file() and (result.artifacts_dir / "spec.json").is_file()


def test_two_rank_run_metrics_complete(ppo_run):
    """The issue's acceptance run: 2-rank tiny Qwen3.5, finite equal norms, parameters changed."""
    from pytest_fsdp_turbo import checks

    result = ppo_run("tiny-qwen3_5-fsdp2-deferred")
    checks.check_completed(result)
    norms = [r.metrics["actor/grad_norm"] for r in result.ranks]
    assert norms[0] == norms[1] and norms[0] > 0
    checks.check_optimizer_step(result)
    expected = {
        "actor/grad_norm",
        "actor/pg_loss",
        "actor/pg_clipfrac",
        "actor/ppo_kl",
        "actor/entropy",
        "actor/kl_loss",
        "critic/score/mean",
        "response_length/mean",
        "perf/step_time_s",
        "perf/tokens_per_s",
        "perf/peak_memory_bytes",
        "sync/retained_grad_bytes",
        "comm/reduce_scatter_calls",
        "sync/grad_max_rel_err",
        "sync/replica_max_abs_diff",
        "sync/rollout_logprob_max_abs_diff",
        "comm/reduce_scatter_calls_by_micro_batch",
        "comm/fsdp_units",
        "sync/grad_norm_measured",
        "sync/reference_grad_norm",
        "sync/step_max_err_lr",
        "actor/param_update_max_abs",
    }
    for rank in result.ranks:
        assert expected <= set(rank.metrics), expected - set(rank.metrics)


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
