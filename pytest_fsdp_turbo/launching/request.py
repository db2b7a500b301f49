"""One case on one device kind: spec, leases, env, launch. Shared by the ppo_run fixture and the CLI."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

from pytest_fsdp_turbo.cases import TINY_PREFIX, Case
from pytest_fsdp_turbo.devices import Accelerator
from pytest_fsdp_turbo.environ import (
    CollectiveEnv,
    Timeouts,
    build_collective_env,
    collective_timeout_s,
    mask_secrets,
)
from pytest_fsdp_turbo.leases import LeaseBook, hccl_port_ranges
from pytest_fsdp_turbo.models import model_type_of
from pytest_fsdp_turbo.processes.progress import Display, Progress
from pytest_fsdp_turbo.processes.supervisor import launch_local
from pytest_fsdp_turbo.processes.warm import WarmParentSilent, warm_parent
from pytest_fsdp_turbo.settings import HarnessEnv, RunEnv
from pytest_fsdp_turbo.turbo.checkout import Checkout
from pytest_fsdp_turbo_contract.artifacts import RunFolder
from pytest_fsdp_turbo_contract.device_profiles import profile_of
from pytest_fsdp_turbo_contract.engines import EngineCatalog
from pytest_fsdp_turbo_contract.errors import ConfigError, Unavailable
from pytest_fsdp_turbo_contract.results import RunResult
from pytest_fsdp_turbo_contract.spec import RankSpec
from pytest_fsdp_turbo_contract.vocab import (
    DeviceKind,
    Env,
    Launcher,
)

if TYPE_CHECKING:
    from pytest_fsdp_turbo.launching.ray_driver import RayDriver

VLLM_MEMORY_VAR = Env.VLLM_MEMORY  # a vLLM rollout's share of the device memory
PORT_ATTEMPTS = 3
PORT_CLASH = re.compile(r"EADDRINUSE|address already in use", re.IGNORECASE)


@dataclass
class RunRequest:
    case: Case
    model_path: Path
    artifacts_dir: Path
    accelerator: Accelerator
    checkout: Checkout | None = None
    engines: EngineCatalog = field(default_factory=EngineCatalog)  # what the ranks may import
    pythonpath: list[str] = field(default_factory=list)
    extra_env: dict[str, str] = field(default_factory=dict)
    replay: Path | None = None  # twin runs: the main run's artifacts, whose batch is replayed
    turbo_config: dict | None = None  # fsdp_turbo cases: the exact config, see with_turbo_config
    launcher: Launcher = Launcher.LOCAL  # see launcher_for
    progress: Display | None = None  # where live status goes while the ranks run


def rank_spec(request: RunRequest) -> RankSpec:
    """The case's spec plus this run's part: every input a rank reads, validated here (a rank
    reads no setting from its environment)."""
    case = request.case
    spec = case.rank_spec(
        request.accelerator.kind,
        model_path=str(request.model_path),
        model_type=model_type_of(request.model_path),
    )
    run = run_env(request)
    checkout = str(request.checkout.path) if request.checkout is not None else ""
    engine = replace(spec.engine, turbo_config=request.turbo_config or {}, turbo_checkout=checkout)
    ppo = replace(
        spec.ppo,
        replay=str(request.replay) if request.replay else "",
        vllm_memory_share=run.vllm_memory_share,
    )
    return replace(
        spec,
        engine=engine,
        ppo=ppo,
        engine_modules=request.engines.for_ranks(),
        collective_timeout_s=collective_timeout_s(
            Timeouts(case.collective_timeout, case.timeout), run.collective_timeout_s
        ),
        fault=run.fault,
    )


def run_env(request: RunRequest) -> RunEnv:
    """What the run's environment asks of its ranks (the session's, ppo_run's extra_env over it):
    the vLLM memory share, a fault the harness's own tests inject, the collective timeout, and
    the thread count and gloo interfaces it checks before any rank starts."""
    return RunEnv.read(os.environ, request.extra_env, request.case.engine.world_size)


def _port_clash(result: RunResult) -> bool:
    if result.ok:
        return False
    for rank in result.ranks:
        text = (rank.error.message if rank.error else "") + rank.log_tail(80)
        if PORT_CLASH.search(text):
            return True
    return False


def _env_overrides(
    request: RunRequest, lease_ids, port: int, ranges, on_this_host: bool = True
) -> dict[str, str]:
    """What the ranks' environment adds to the environment they start from; `on_this_host`:
    the ranks run here, so the interfaces gloo is told to use must be this host's."""
    case, accel = request.case, request.accelerator
    group = build_collective_env(
        accel.kind,
        lease_ids,
        port,
        world_size=case.engine.world_size,
        port_ranges=ranges,
        timeouts=Timeouts(case.collective_timeout, case.timeout),
        user_env={**os.environ, **request.extra_env},  # the run's, as run_env reads it
    )
    if on_this_host:
        _refuse_missing_interfaces(group, run_env(request))
    env = dict(group.env)
    paths = [*request.pythonpath]
    if request.checkout is not None:
        paths.append(request.checkout.pythonpath)
    if session := HarnessEnv.read().pythonpath:
        paths.append(session)
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(paths)
    env.update(request.extra_env)
    return env


def _refuse_missing_interfaces(group: CollectiveEnv, run: RunEnv) -> None:
    """GLOO_SOCKET_IFNAME naming an interface this host lacks (the user's, or the profile's lo):
    gloo's own error names neither the variable nor the interfaces there are; said here, before
    any rank starts."""
    present = sorted(psutil.net_if_addrs())
    if missing := [name for name in group.gloo_interfaces() if name not in present]:
        origin = run.gloo_origin or "collective profile GLOO_SOCKET_IFNAME"
        raise ConfigError(
            f"{origin}: expected network interfaces of this host "
            f"({', '.join(present)}); {', '.join(missing)} is not one"
        )


def _set_aside(out: Path, folder: Path) -> None:
    folder.mkdir()
    for path in out.glob(RunFolder.RANK_FILES):
        path.rename(folder / path.name)


def refuse_missing_hardware(request: RunRequest) -> None:
    """What the accelerator (detected, or forced by --fsdp-turbo-device) lacks for the case, said
    before any rank starts and after every other gate (so a box that pretends to be an NPU box
    still meets those): a forced npu without torch_npu (its ranks would die on an unknown hccl
    backend), fewer devices than ranks (the lease would wait them out)."""
    accel, case = request.accelerator, request.case
    lacking = [m for m in profile_of(accel.kind).device_imports if not importlib.util.find_spec(m)]
    if lacking:
        problem = (
            f"{accel.describe()}; its backend needs {lacking[0]}, which is not importable here"
        )
    elif accel.kind != DeviceKind.CPU and accel.count < case.engine.world_size:
        problem = f"needs {case.engine.world_size} {accel.kind} devices; {accel.describe()}"
    else:
        return
    raise Unavailable(f"case {case.id}: {problem}")


def _prepare(request: RunRequest, *, local: bool) -> tuple[Path, RankSpec]:
    """A fresh run folder with the ranks' spec written in it (both returned), or one line naming
    the folder. `local`: the ranks start on this machine, so its hardware must be there (Ray
    places them itself, possibly on nodes that have what this one lacks)."""
    out = request.artifacts_dir
    spec = rank_spec(request)  # a turbo_config that does not fit fails here, before anything else
    if local:
        refuse_missing_hardware(request)
    fix = "choose another folder with --fsdp-turbo-artifacts"
    if out.is_symlink():  # the folder is replaced for each run: never through a link
        raise ConfigError(f"artifacts folder {out} is a symlink; remove it or {fix}")
    try:
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        folder = RunFolder(out)
        spec.write(folder.spec)
    except OSError as exc:  # below a regular file, not writable, the disk full
        where = exc.filename or out
        raise ConfigError(
            f"artifacts folder {out}: cannot write {where}: {exc.strerror or exc}; {fix}"
        ) from None
    return out, spec


def _progress(request: RunRequest, spec: RankSpec, out: Path) -> Progress | None:
    """The run's live status, from the spec its ranks were just handed."""
    return request.progress.follow(spec, out) if request.progress is not None else None


def _finish(progress: Progress | None, result: RunResult) -> RunResult:
    if progress is not None:
        progress.close()
        result.notes += progress.warnings
    return result


def run_case_on_ray(request: RunRequest, driver: RayDriver) -> RunResult:
    """Ray places the ranks and assigns their devices; rank 0's node gives the rendezvous."""
    case, kind = request.case, request.accelerator.kind
    out, spec = _prepare(request, local=False)
    ranges = hccl_port_ranges(0) if profile_of(kind).port_ranges else None
    overrides = _env_overrides(request, (), 0, ranges, on_this_host=False)  # Ray places them
    for name in ("MASTER_ADDR", "MASTER_PORT"):  # rank 0's node decides these
        overrides.pop(name)
    RunFolder(out).env.write_text(json.dumps(mask_secrets(overrides), indent=1, sort_keys=True))
    progress = _progress(request, spec, out)
    result = driver.launch(
        case_id=case.id,
        world_size=case.engine.world_size,
        kind=kind,
        env_overrides=overrides,
        artifacts_dir=out,
        timeout_s=case.timeout,
        ship=shipped_folders(request),
        watch=progress.tick if progress else None,
    )
    return _finish(progress, result)


def shipped_folders(request: RunRequest) -> list[str]:
    """What the ranks read from this machine, sent to their nodes: the tiny model the harness
    built, the case's pythonpath folders and the FSDPTurbo checkout (never a real model)."""
    folders = [str(request.model_path)] if request.case.model.startswith(TINY_PREFIX) else []
    folders += request.pythonpath
    if request.checkout is not None:
        folders.append(str(request.checkout.path))
    return list(dict.fromkeys(folders))


RankLauncher = Callable[[RunRequest], RunResult]  # starts one request's ranks, hands back the run


def launcher_for(
    kind: Launcher, book: LeaseBook, start_ray: Callable[[], RayDriver]
) -> RankLauncher:
    """The one place the launcher kind is decided: Ray actors, or processes on this machine,
    forked from the warm parent (local) or fresh interpreters (spawn)."""
    if kind == Launcher.RAY:
        driver = start_ray()
        return lambda request: run_case_on_ray(request, driver)
    warm = kind == Launcher.LOCAL
    return lambda request: run_case(request, book, warm=warm)


def run_case(
    request: RunRequest,
    book: LeaseBook,
    lease_timeout_s: float = 600.0,
    port_attempts: int = PORT_ATTEMPTS,
    *,
    warm: bool = True,
) -> RunResult:
    """Lease devices and ports, write the spec, start the ranks (forked from the warm parent when
    `warm` and one can start, else fresh interpreters); leases are freed whatever happens."""
    out, spec = _prepare(request, local=True)
    progress = _progress(request, spec, out)
    parent, notes = _warm_parent(book, warm)
    with _leased(request, book, lease_timeout_s) as (ids, ranges):

        def launch_on(port: int) -> RunResult:
            return _launch_once(request, ids, ranges, port, parent, progress)

        result = _retrying_port_clashes(out, book, port_attempts, notes, launch_on)
    result.notes = notes + result.notes
    return _finish(progress, result)


def _warm_parent(book: LeaseBook, warm: bool):
    """The warm parent to fork ranks from (None: spawn them), and a note when one was wanted but
    could not start."""
    if not warm:
        return None, []
    parent, why = warm_parent(book.state_dir)
    return parent, [] if parent is not None else [f"ranks spawned as fresh interpreters: {why}"]


@contextmanager
def _leased(request: RunRequest, book: LeaseBook, timeout_s: float):
    """The case's devices, and on NPU a block of HCCL port ranges, freed whatever happens."""
    accel = request.accelerator
    lease = book.devices(accel.kind, accel.ids, request.case.engine.world_size, timeout_s=timeout_s)
    slot, ranges = None, None
    try:
        if profile_of(accel.kind).port_ranges:
            slot, ranges = book.port_ranges()
        yield lease.ids, ranges
    finally:
        book.release(lease)
        if slot is not None:
            book.release_port_ranges(slot)


def _launch_once(request: RunRequest, ids, ranges, port: int, parent, progress) -> RunResult:
    """One launch of the case's ranks on `port`, its environment kept in env.json."""
    case, out = request.case, request.artifacts_dir
    env = {**os.environ, **_env_overrides(request, ids, port, ranges)}
    RunFolder(out).env.write_text(json.dumps(mask_secrets(env), indent=1, sort_keys=True))

    def launch(warm_parent) -> RunResult:
        return launch_local(
            case_id=case.id,
            world_size=case.engine.world_size,
            env=env,
            artifacts_dir=out,
            timeout_s=case.timeout,
            warm_parent=warm_parent,
            preload=f"verl:{request.accelerator.kind}" if case.is_verl else None,
            watch=progress.tick if progress else None,
        )

    if parent is not None and getattr(parent, "silent", False):
        parent = None  # given up on an earlier attempt (a port retry): spawn, as that one did
    try:
        return launch(parent)
    except WarmParentSilent as silent:  # no rank of this launch ran: spawn them all instead
        # what a rank forked before the silence wrote (its first phase: it would start the
        # spawned ranks' timeout at once) is kept apart, as a port clash's attempt is
        _set_aside(out, out / "forked-before-the-parent-went-silent")
        result = launch(None)
        result.notes.append(f"ranks spawned as fresh interpreters: {silent}")
        return result


def _retrying_port_clashes(
    out: Path,
    book: LeaseBook,
    attempts: int,
    notes: list[str],
    launch_on: Callable[[int], RunResult],
) -> RunResult:
    """A port taken by someone else between the lease and rank 0's bind is retried on a fresh
    port, a bounded number of times; each retry is noted and logged, and the failed attempt's
    logs are kept beside the run's."""
    for attempt in range(1, attempts + 1):
        port = book.port()
        try:
            result = launch_on(port)
        finally:
            book.release_port(port)
        if attempt == attempts or not _port_clash(result):
            break
        kept = out / f"attempt{attempt}-port{port}"
        _set_aside(out, kept)
        note = (
            f"port {port} was taken before rank 0 could bind it; retrying on a fresh port "
            f"(attempt {attempt + 1} of {attempts}); the failed attempt's logs are in {kept}"
        )
        notes.append(note)
        with open(RunFolder(out).launcher_log, "a") as log:
            log.write(note + "\n")
    return result
