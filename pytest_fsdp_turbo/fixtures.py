"""The public fixtures; registered by the plugin, usable from any downstream test suite."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import psutil
import pytest

from pytest_fsdp_turbo.checkout import Checkout, resolve_checkout
from pytest_fsdp_turbo.devices import Accelerator
from pytest_fsdp_turbo.environ import CollectiveEnv, build_collective_env
from pytest_fsdp_turbo.errors import CheckoutUnavailable, ConfigError, LeaseTimeout
from pytest_fsdp_turbo.leases import DeviceLease, LeaseBook
from pytest_fsdp_turbo.session import accelerator_of, settings_of


@pytest.fixture(scope="session")
def accelerator(pytestconfig: pytest.Config) -> Accelerator:
    return accelerator_of(pytestconfig)


@pytest.fixture(scope="session")
def fsdp_turbo_lease_book() -> LeaseBook:
    return LeaseBook()


@pytest.fixture
def free_port(fsdp_turbo_lease_book: LeaseBook) -> Iterator[int]:
    port = fsdp_turbo_lease_book.port()
    yield port
    fsdp_turbo_lease_book.release_port(port)


@pytest.fixture
def device_lease(
    accelerator: Accelerator, fsdp_turbo_lease_book: LeaseBook
) -> Iterator[Callable[..., DeviceLease]]:
    held: list[DeviceLease] = []

    def lease(n: int, timeout_s: float = 300.0) -> DeviceLease:
        try:
            taken = fsdp_turbo_lease_book.devices(
                accelerator.kind, accelerator.ids, n, timeout_s=timeout_s
            )
        except LeaseTimeout as exc:
            pytest.fail(f"device_lease({n}): {exc}", pytrace=False)
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
    """Env for one group sized by the test's devices(n) marker (1 when absent)."""
    marker = request.node.get_closest_marker("devices")
    world_size = marker.args[0] if marker else 1
    lease = device_lease(world_size)
    slot, ranges = (None, None)
    if accelerator.kind == "npu":
        slot, ranges = fsdp_turbo_lease_book.port_ranges()
    try:
        env = build_collective_env(
            accelerator.kind, lease.ids, free_port, world_size=world_size, port_ranges=ranges
        )
    except ConfigError as exc:
        pytest.fail(str(exc), pytrace=False)
    yield env
    if slot is not None:
        fsdp_turbo_lease_book.release_port_ranges(slot)


@pytest.fixture(scope="session")
def fsdp_turbo_checkout(pytestconfig: pytest.Config) -> Checkout:
    """Skips (fails under --fsdp-turbo-strict) with the source and git's last error."""
    settings = settings_of(pytestconfig)
    try:
        return resolve_checkout(settings.checkout)
    except (CheckoutUnavailable, ConfigError) as exc:
        if settings.strict:
            pytest.fail(f"--fsdp-turbo-strict: {exc}", pytrace=False)
        pytest.skip(str(exc))


@pytest.fixture
def no_leaked_processes() -> Iterator[None]:
    """Fails the test if a process it started is still alive shortly after it ends."""
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    yield
    deadline = time.monotonic() + 5.0
    leaked: list[psutil.Process] = []
    while time.monotonic() < deadline:
        leaked = [p for p in me.children(recursive=True) if p.pid not in before and _alive(p)]
        if not leaked:
            return
        time.sleep(0.1)
    described = ", ".join(f"pid {p.pid} ({_cmd(p)})" for p in leaked)
    for proc in leaked:
        proc.kill()
    pytest.fail(f"processes outlived the test: {described}", pytrace=False)


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _cmd(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())[:120]
    except psutil.Error:
        return "?"
