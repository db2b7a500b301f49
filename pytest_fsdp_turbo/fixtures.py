"""The public fixtures; registered by the plugin, usable from any downstream test suite."""

from __future__ import annotations

import importlib.util
import os
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from pytest_fsdp_turbo.outcomes import fail_line, skip_or_fail
from pytest_fsdp_turbo.session import (
    accelerator_of,
    artifacts_root,
    goldens_dir,
    settings_of,
)
from pytest_fsdp_turbo_contract.errors import CheckoutUnavailable, ConfigError, LeaseTimeout

if TYPE_CHECKING:  # the heavier modules load on first use, so installing the plugin costs nothing
    import psutil

    from pytest_fsdp_turbo.checks.goldens import GoldenOutcome
    from pytest_fsdp_turbo.devices import Accelerator
    from pytest_fsdp_turbo.environ import CollectiveEnv
    from pytest_fsdp_turbo.launching.ppo_run import PPORun
    from pytest_fsdp_turbo.launching.ray_driver import RayDriver
    from pytest_fsdp_turbo.leases import DeviceLease, LeaseBook
    from pytest_fsdp_turbo.trainer.fixture import TrainerRun
    from pytest_fsdp_turbo.turbo.checkout import Checkout
    from pytest_fsdp_turbo_contract.results import RunResult


ENV_GUARD_INI = "fsdp_turbo_env_guard"
# pytest's own, and the warm parent's socket (Env.WARM_SOCKET), advertised once by whichever test
# started it; spelled out here so a suite that never uses the harness does not load the vocabulary
_PYTEST_OWN = ("PYTEST_CURRENT_TEST", "PYTEST_FSDP_TURBO_WARM_SOCKET")


@pytest.fixture
def fsdp_turbo_env_guard(request: pytest.FixtureRequest) -> Iterator[None]:
    """The test leaves os.environ and the working directory as it found them.

    Active on every test that uses the harness's fixtures (they depend on it), not imposed on the
    rest of a downstream suite; a conftest opts every test in with an autouse fixture that
    requests it (this repository does)."""
    if not settings_of(request.config).env_guard:
        yield
        return
    env, cwd = dict(os.environ), os.getcwd()
    yield
    # funcargs is None once pytest has torn the test down early (Ctrl-C during the test)
    patcher = (getattr(request.node, "funcargs", None) or {}).get("monkeypatch")
    if patcher is not None:
        # what monkeypatch set, it restores: let it do so now, whichever of the two pytest set up
        # first (torn down first, the guard would otherwise see its changes as the test's); a
        # second undo, by its own teardown, finds nothing left to undo
        patcher.undo()
    now = {k: v for k, v in os.environ.items() if k not in _PYTEST_OWN}
    before = {k: v for k, v in env.items() if k not in _PYTEST_OWN}
    changed = sorted(k for k in before.keys() | now.keys() if before.get(k) != now.get(k))
    moved = os.getcwd() != cwd
    if not changed and not moved:
        return
    for name in changed:
        if name in before:
            os.environ[name] = before[name]
        else:
            os.environ.pop(name, None)
    os.chdir(cwd)
    what = [f"environment variable {name}" for name in changed] + (
        ["working directory"] if moved else []
    )
    pytest.fail(
        f"test changed {', '.join(what)} and did not restore it (restored now; "
        f"ini {ENV_GUARD_INI} = false turns this check off)",
        pytrace=False,
    )


@pytest.fixture(scope="session")
def accelerator(pytestconfig: pytest.Config) -> Accelerator:
    return accelerator_of(pytestconfig)


@pytest.fixture(scope="session")
def fsdp_turbo_lease_book() -> LeaseBook:
    from pytest_fsdp_turbo.leases import LeaseBook  # on first use: start stays light

    try:
        return LeaseBook()
    except ConfigError as exc:  # a state folder another user controls
        fail_line(str(exc))


@pytest.fixture
def free_port(fsdp_turbo_lease_book: LeaseBook) -> Iterator[int]:
    port = fsdp_turbo_lease_book.port()
    yield port
    fsdp_turbo_lease_book.release_port(port)


@pytest.fixture
def device_lease(
    accelerator: Accelerator, fsdp_turbo_lease_book: LeaseBook, fsdp_turbo_env_guard: None
) -> Iterator[Callable[..., DeviceLease]]:
    held: list[DeviceLease] = []

    def lease(n: int, timeout_s: float = 300.0) -> DeviceLease:
        try:
            taken = fsdp_turbo_lease_book.devices(
                accelerator.kind, accelerator.ids, n, timeout_s=timeout_s
            )
        except (LeaseTimeout, ConfigError) as exc:
            fail_line(f"device_lease({n}): {exc}")
        held.append(taken)
        return taken

    yield lease
    for taken in held:
        fsdp_turbo_lease_book.release(taken)


@pytest.fixture
def collective_env(
    request: pytest.FixtureRequest,
    accelerator: Accelerator,
    device_lease: Callable[..., DeviceLease],
    free_port: int,
    fsdp_turbo_lease_book: LeaseBook,
) -> Iterator[CollectiveEnv]:
    """Env for one group sized by the test's devices(n) marker (1 when absent): a CollectiveEnv
    with `.env` (the variables every rank of the group shares: MASTER_ADDR, MASTER_PORT,
    WORLD_SIZE, the backend's NCCL / HCCL / gloo settings and device visibility), `.child_env()`
    (os.environ with `.env` over it, for subprocess ranks), `.from_user` (the names your own
    environment decided), `.device_ids`, `.master_port` and `.world_size`. Per-rank variables
    (RANK, LOCAL_RANK) are not in it: each rank sets its own."""
    # on first use: start stays light
    from pytest_fsdp_turbo.environ import build_collective_env
    from pytest_fsdp_turbo_contract.device_profiles import profile_of

    marker = request.node.get_closest_marker("devices")
    world_size = marker.args[0] if marker else 1
    lease = device_lease(world_size)
    slot, ranges = (None, None)
    if profile_of(accelerator.kind).port_ranges:
        slot, ranges = fsdp_turbo_lease_book.port_ranges()
    try:
        env = build_collective_env(
            accelerator.kind,
            lease.ids,
            free_port,
            world_size=world_size,
            port_ranges=ranges,
            user_env=os.environ,
        )
    except ConfigError as exc:
        fail_line(str(exc))
    yield env
    if slot is not None:
        fsdp_turbo_lease_book.release_port_ranges(slot)


@pytest.fixture(scope="session")
def fsdp_turbo_checkout(pytestconfig: pytest.Config) -> Checkout:
    """Skips (fails under --fsdp-turbo-strict) with the source and git's last error."""
    return session_checkout(pytestconfig)


def session_checkout(config: pytest.Config) -> Checkout:
    """The checkout the session's settings name (path, /FSDPTurbo, pinned clone), or a skip (a
    failure under --fsdp-turbo-strict) naming the source and git's last error; a conftest that
    overrides fsdp_turbo_checkout calls it for the cases it does not serve itself."""
    from pytest_fsdp_turbo.turbo.checkout import resolve_checkout  # on first use: start stays light

    settings = settings_of(config)
    try:
        return resolve_checkout(settings.checkout)
    except (CheckoutUnavailable, ConfigError) as exc:
        skip_or_fail(settings.strict, str(exc))


@pytest.fixture(scope="session")
def tiny_model(pytestconfig: pytest.Config) -> Callable[[str], Path]:
    """Factory: tiny spec name -> HF model directory (built once, shared by xdist workers)."""
    # on first use: start stays light
    from pytest_fsdp_turbo.models import ModelUnavailable, build_tiny_model

    def build(name: str) -> Path:
        try:
            return build_tiny_model(name, tiny_models=settings_of(pytestconfig).tiny_models)
        except (ModelUnavailable, ConfigError) as exc:
            fail_line(str(exc))

    return build


@pytest.fixture(scope="session")
def ray_cluster(
    pytestconfig: pytest.Config, fsdp_turbo_lease_book: LeaseBook
) -> Iterator[RayDriver]:
    """The session's Ray driver process: it joins --fsdp-turbo-ray-address (bounded by
    --fsdp-turbo-ray-connect-timeout) or starts a local Ray instance, stopped at the end.

    The driver is a subprocess: Ray ends a driver whose cluster dies, and that is never pytest.
    """
    if importlib.util.find_spec("ray") is None:
        pytest.skip("the ray launcher needs ray: pip install 'pytest-fsdp-turbo[ray]'")
    # on first use: start stays light
    from pytest_fsdp_turbo.launching.ray_driver import ray_driver, stop_ray_driver

    settings = settings_of(pytestconfig)
    try:
        driver = ray_driver(
            settings.ray_address, settings.ray_connect_timeout_s, fsdp_turbo_lease_book.state_dir
        )
    except ConfigError as exc:
        fail_line(str(exc))
    yield driver
    stop_ray_driver()


@pytest.fixture
def ppo_run(
    request: pytest.FixtureRequest,
    accelerator: Accelerator,
    fsdp_turbo_lease_book: LeaseBook,
    fsdp_turbo_env_guard: None,
) -> PPORun:
    """Factory: a case (object, parameter or id) plus field overrides -> the run's result.

    Keywords: engine_modules, pythonpath, extra_env, launcher, checkout (an FSDPTurbo checkout other
    than the session's), and any case field (validated like the case file). It does not assert:
    call pytest_fsdp_turbo.checks on the result. A case that cannot run here (model directory,
    vLLM, verl, FSDPTurbo checkout or its torch range) skips, and fails under --fsdp-turbo-strict,
    naming what was looked for.
    """
    # on first use: start stays light
    from pytest_fsdp_turbo.kinds.registry import cases_of  # the case machinery, on first use
    from pytest_fsdp_turbo.launching.case_runner import CaseRunner
    from pytest_fsdp_turbo.launching.ppo_run import PPORun, terminal_progress

    config = request.config
    runner = CaseRunner(
        settings=settings_of(config),
        accelerator=accelerator,
        book=fsdp_turbo_lease_book,
        cases=lambda: cases_of(config),
        artifacts_root=artifacts_root(config),
        checkout=lambda: request.getfixturevalue("fsdp_turbo_checkout"),
        start_ray=lambda: request.getfixturevalue("ray_cluster"),
        progress=terminal_progress(config),
    )
    return PPORun(request, runner)


@pytest.fixture
def verl_trainer_run(
    request: pytest.FixtureRequest,
    accelerator: Accelerator,
    fsdp_turbo_lease_book: LeaseBook,
    fsdp_turbo_env_guard: None,
) -> TrainerRun:
    """Factory: a trainer case (the `fsdp_turbo_trainer_case` parameter, a TrainerCase or an id)
    -> the run of verl's own `main_ppo` for one step, observed by the harness. It does not assert:
    `pytest_fsdp_turbo.checks.check_all(result)` judges it. Skips (fails under strict) where verl,
    vLLM or the model cannot be had, naming what was looked for."""
    # on first use: start stays light
    from pytest_fsdp_turbo.kinds.registry import cases_of  # the case machinery, on first use
    from pytest_fsdp_turbo.trainer.fixture import TrainerRun, progress_lines
    from pytest_fsdp_turbo.trainer.run import TrainerRunner

    config = request.config
    settings = settings_of(config)
    runner = TrainerRunner(
        accelerator=accelerator,
        book=fsdp_turbo_lease_book,
        artifacts_root=artifacts_root(config),
        models=settings.models,
        tiny_models=settings.tiny_models,
        pythonpath=(str(config.rootpath),),
        say=progress_lines(config),
        checkout=lambda: request.getfixturevalue("fsdp_turbo_checkout"),
    )
    return TrainerRun(request, runner, lambda: cases_of(config), settings.strict)


@pytest.fixture
def fsdp_turbo_run(request: pytest.FixtureRequest) -> Callable[..., RunResult]:
    """Factory: a case of any kind (its test parameter, the case, or its id) plus its kind's
    options -> the run's result, through the case's kind (`ppo_run` for the harness's own step,
    `verl_trainer_run` for verl's trainer, or a downstream kind's own run). It does not assert:
    `pytest_fsdp_turbo.checks.check_all(result)` judges it by the checks of its kind."""
    # on first use: start stays light
    from pytest_fsdp_turbo.cases import CaseParam
    from pytest_fsdp_turbo.kinds.registry import cases_of, kind_of

    def run(case, **options) -> RunResult:
        if isinstance(case, CaseParam):
            case = case.case
        elif isinstance(case, str):
            try:
                case = cases_of(request.config).find(case)
            except ConfigError as exc:
                fail_line(str(exc))
        try:
            kind = kind_of(case)
        except ConfigError as exc:
            fail_line(f"fsdp_turbo_run: {exc}")
        return kind.run(request, case, **options)

    return run


@pytest.fixture
def fsdp_turbo_golden(pytestconfig: pytest.Config) -> Callable[..., GoldenOutcome]:
    """Check g for a downstream test: `fsdp_turbo_golden(result, case)` checks the run against
    its recorded golden, or records it under --fsdp-turbo-record-golden, in the session's goldens
    folder (never an installed package); strict turns a missing golden into a failure, otherwise
    it warns. The golden is keyed by what the run's spec.json declares; `case` (the
    `fsdp_turbo_case` parameter, a trainer case, or a Case) is optional and, when given, must be
    the case the run ran."""
    # on first use: start stays light
    from pytest_fsdp_turbo.checks import goldens
    from pytest_fsdp_turbo.checks.verdicts import CheckFailure
    from pytest_fsdp_turbo_contract.vocab import GoldenStatus

    settings = settings_of(pytestconfig)

    def check(result, case=None) -> GoldenOutcome:
        # a parameter (CaseParam, CaseParam) holds its case; a case, or its id, names itself
        named = case if isinstance(case, str) else getattr(getattr(case, "case", case), "id", None)
        if named is not None and named != result.case_id:
            raise CheckFailure(
                f"fsdp_turbo_golden: the result is a run of case {result.case_id}, not of case "
                f"{named}"
            )
        outcome = goldens.check_or_record(
            result, goldens_dir(pytestconfig), settings.record_golden, strict=settings.strict
        )
        if outcome.status == GoldenStatus.MISSING:
            warnings.warn(f"golden {outcome}; record it: {goldens.RECORD_COMMAND}", stacklevel=2)
        return outcome

    return check


@pytest.fixture
def no_leaked_processes() -> Iterator[None]:
    """Fails the test if a process it started is still alive shortly after it ends (and kills it).

    Processes the session owns by design (the warm parent, the Ray driver and the cluster it
    started) are never counted, even when this test started them."""
    import psutil  # on first use: start stays light

    # on first use: start stays light
    from pytest_fsdp_turbo.processes.session_processes import belongs_to_session

    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    yield
    deadline = time.monotonic() + 5.0
    leaked: list[psutil.Process] = []
    while time.monotonic() < deadline:
        # the warm parent, the Ray driver and its cluster live for the session by design,
        # whichever test started them; a case's ranks and actors do not
        leaked = [
            p
            for p in me.children(recursive=True)
            if p.pid not in before and _alive(p) and not belongs_to_session(p)
        ]
        if not leaked:
            return
        time.sleep(0.1)
    described = ", ".join(f"pid {p.pid} ({_cmd(p)})" for p in leaked)
    for proc in leaked:
        proc.kill()
    fail_line(f"processes outlived the test: {described}")


def _alive(proc: psutil.Process) -> bool:
    import psutil  # module level only for type checking: keep the plugin import light

    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _cmd(proc: psutil.Process) -> str:
    import psutil  # on first use: start stays light

    try:
        return " ".join(proc.cmdline())[:120]
    except psutil.Error:
        return "?"
