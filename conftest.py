"""Repository root conftest: the plugin itself arrives through its pytest11 entry point."""

import os
from pathlib import Path

import pytest

NO_HYDRA = "-p no:hydra_pytest"
STANDIN = Path(__file__).parent / "tests" / "standin_fsdp_turbo"
STANDIN_ALLOW_CPU = "FSDP_TURBO_STANDIN_ALLOW_CPU"  # the stand-in, like the library, refuses CPU


def pytest_configure(config):
    """Inner pytest sessions (pytester) get a fresh HOME; pinning the cache root here lets them
    reuse the tiny models this session built instead of rebuilding each (about 6 s a family).
    Tests that need an empty cache still set XDG_CACHE_HOME themselves."""
    os.environ.setdefault("XDG_CACHE_HOME", str(Path.home() / ".cache"))
    # read only by the stand-in fsdp_turbo, which this repository's cpu cases run on (below)
    os.environ.setdefault(STANDIN_ALLOW_CPU, "1")
    # hydra-core (verl brings it) registers a pytest plugin that costs about 0.6 s at every start;
    # nothing here uses it, and inner sessions inherit the variable
    addopts = os.environ.get("PYTEST_ADDOPTS", "")
    if NO_HYDRA not in addopts:
        os.environ["PYTEST_ADDOPTS"] = f"{addopts} {NO_HYDRA}".strip()
    _one_warm_parent_for_every_worker(config)


def _one_warm_parent_for_every_worker(config) -> None:
    """Under xdist the controller starts one warm parent and advertises its socket
    (PYTEST_FSDP_TURBO_WARM_SOCKET) before it spawns the workers: every worker forks its ranks
    from it, as an inner session does, instead of paying the imports in a parent of its own. The
    parent listens at once and greets each worker once its imports are done; the controller does
    not wait for them (it runs no case)."""
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
        return
    from pytest_fsdp_turbo.leases import LeaseBook
    from pytest_fsdp_turbo.processes.session_processes import own, session_processes
    from pytest_fsdp_turbo.processes.warm import SOCKET_VAR, WarmParent, fork_unavailable_reason

    if fork_unavailable_reason() is not None:
        return  # each worker finds out and says why, as without this
    state, me = LeaseBook().state_dir, os.getpid()
    # started from this (main) thread: its parent-death signal follows the thread that forked it
    parent = WarmParent(state / f"warm-parent-{me}.log", state / f"warm-parent-{me}.sock", False)
    session_processes().warm = parent  # closed when the session ends
    own(parent.pid, "warm parent")
    os.environ[SOCKET_VAR] = str(parent.socket)


# The suite's longest tests (see --durations), started first under xdist so the other worker fills
# in around them instead of waiting on one at the end of the run (with --dist worksteal, the idle
# worker then takes what is left from the busy one's queue: measured 225 s against 244-248 s with
# the default load scheduling, same code, same box). Four workers on the two cores: much of the
# suite waits (Ray start-up, inner pytest sessions, timeouts, stalls), and the extra workers fill
# that time (249 s with four against 277 s with three, 2026-12-04, same code; the box was busy
# 494 of 498 CPU-seconds with four).
LONGEST_FIRST = (
    # CI's stage 2 (-m vllm, two workers): the trainer runs first, the 4-rank one at their head,
    # so the vLLM engine cases on the other worker run beside them. Trainer runs take turns
    # (pytest_fsdp_turbo/trainer/host_turns.py); in CI the 4-rank run did not always start first
    # (2026-12-07: a 2-rank run started before it twice)
    "e2e/test_verl_trainer.py::test_verl_trainer_one_step[tiny-qwen3-verl-trainer-fsdp_turbo",
    "e2e/test_trainer_mutations.py",
    "e2e/test_verl_trainer.py",
    "tests/test_ray_multinode.py",
    "tests/test_session_safety.py::test_faults_end_tests_never_the_session",
    "tests/test_warm_ranks.py::test_forked_and_spawned_ranks_give_identical_results",
    "tests/test_progress.py",
    "tests/test_session_safety.py::test_ctrl_c_during_a_case",
    # the 4-rank runs next, so that no worker is left with them at the end while the other idles
    "e2e/test_ppo_e2e.py::test_ppo_one_step[tiny-qwen3_5-verl-fsdp_turbo",
    "e2e/test_ppo_e2e.py::test_ppo_one_step[tiny-qwen3_5-fsdp_turbo",
    "e2e/test_mutations.py::test_check_catches_broken_engine[broken_turbo",
    "e2e/test_mutations.py::test_verl",
    "e2e/test_mutations.py::test_a_downstream_subclass",
    "tests/test_warm_ranks.py::test_a_stopped_warm_parent",
    "e2e/test_mutations.py::test_sp_loss",
    "e2e/test_mutations.py::test_packed_rows",
    "e2e/test_mutations.py::test_units_that_never",
    "e2e/test_mutations.py::test_head_gradients",
    "e2e/test_mutations.py::test_check_catches_broken_engine[fsdp_data_rank_from_shard",
    "tests/test_leases.py::test_concurrent_leases_under_xdist_never_overlap",
)


def pytest_collection_modifyitems(config, items):
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    rank = {prefix: i for i, prefix in enumerate(LONGEST_FIRST)}

    def order(item):
        hit = next((p for p in LONGEST_FIRST if item.nodeid.startswith(p)), None)
        return rank[hit] if hit is not None else len(LONGEST_FIRST)

    items.sort(key=order)  # stable: every other test keeps its place


@pytest.fixture(autouse=True)
def _every_test_restores_env_and_cwd(fsdp_turbo_env_guard):
    """This repository holds all of its own tests to the harness's env/cwd guard."""


@pytest.fixture(scope="session", autouse=True)
def _warm_parent_up_front(request):
    """Under xdist (how the whole suite runs), connect each worker to the controller's warm parent
    (or start its own) before its first test, not at its first case: the CLI runs, inner sessions
    and helpers of earlier tests then fork from it instead of importing torch. A single-file run
    stays light (no 5 s start)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    from pytest_fsdp_turbo.processes.warm import warm_parent

    warm_parent(request.getfixturevalue("fsdp_turbo_lease_book").state_dir)


@pytest.fixture(scope="session")
def fsdp_turbo_checkout(pytestconfig, accelerator):
    """In this repository, fsdp_turbo cases on a CPU box run on the STAND-IN fsdp_turbo
    (tests/standin_fsdp_turbo, a test double of the library's contract, never evidence about
    hardware) unless FSDP_TURBO_PATH / --fsdp-turbo-path names a checkout. On cuda and npu the
    plugin's own resolution (path, /FSDPTurbo, pinned clone) is used unchanged."""
    from pytest_fsdp_turbo.fixtures import session_checkout
    from pytest_fsdp_turbo.session import settings_of
    from pytest_fsdp_turbo.turbo.checkout import Checkout

    if accelerator.kind == "cpu" and not settings_of(pytestconfig).checkout.path:
        layout = STANDIN / "function_patches"
        return Checkout(
            layout, None, f"stand-in fsdp_turbo at {layout}, tests only (cpu)", stand_in=True
        )
    return session_checkout(pytestconfig)
