"""One case on one device kind: spec, leases, env, launch. Shared by the ppo_run fixture and the CLI."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pytest_fsdp_turbo.cases import Case
from pytest_fsdp_turbo.checkout import Checkout
from pytest_fsdp_turbo.devices import Accelerator
from pytest_fsdp_turbo.environ import Timeouts, build_collective_env
from pytest_fsdp_turbo.launch import RunResult, launch_local
from pytest_fsdp_turbo.leases import LeaseBook
from pytest_fsdp_turbo.models import model_type_of

CHECKOUT_VAR = "PYTEST_FSDP_TURBO_CHECKOUT"


@dataclass
class RunRequest:
    case: Case
    model_path: Path
    artifacts_dir: Path
    accelerator: Accelerator
    checkout: Checkout | None = None
    engine_modules: list[str] = field(default_factory=list)
    pythonpath: list[str] = field(default_factory=list)
    extra_env: dict[str, str] = field(default_factory=dict)


def worker_spec(request: RunRequest) -> dict:
    case, kind = request.case, request.accelerator.kind
    return {
        "case_id": case.id,
        "model_path": str(request.model_path),
        "model_type": model_type_of(request.model_path),
        "device_kind": kind,
        "engine_modules": request.engine_modules,
        "engine": {
            "backend": case.backend,
            "world_size": case.world_size,
            "fsdp_size": case.shard_size,
            "sp_size": case.sp_size,
            "dtype": case.dtype_on(kind),
            "sync_policy": case.gradient_sync,
            "lr": case.lr,
            "turbo_config": case.turbo_config,
        },
        "ppo": {
            "num_prompts": case.num_prompts,
            "n": case.n,
            "max_new_tokens": case.max_new_tokens,
            "micro_batches": case.micro_batches,
            "rollout": case.rollout,
            "reference_checks": case.with_reference_checks(),
        },
    }


def run_case(request: RunRequest, book: LeaseBook, lease_timeout_s: float = 600.0) -> RunResult:
    """Lease devices and ports, write the spec, start the ranks; leases are freed whatever happens."""
    case, accel = request.case, request.accelerator
    out = request.artifacts_dir
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    spec = worker_spec(request)
    (out / "spec.json").write_text(json.dumps(spec, indent=1))
    (out / "case.json").write_text(json.dumps(asdict(case), indent=1, default=list))
    lease = book.devices(accel.kind, accel.ids, case.world_size, timeout_s=lease_timeout_s)
    port = book.port()
    slot, ranges = book.port_ranges() if accel.kind == "npu" else (None, None)
    try:
        group = build_collective_env(
            accel.kind,
            lease.ids,
            port,
            world_size=case.world_size,
            port_ranges=ranges,
            timeouts=Timeouts(case.collective_timeout, case.timeout),
        )
        env = group.child_env()
        paths = [*request.pythonpath]
        if request.checkout is not None:
            paths.append(request.checkout.pythonpath)
            env[CHECKOUT_VAR] = str(request.checkout.path)
        if env.get("PYTHONPATH"):
            paths.append(env["PYTHONPATH"])
        if paths:
            env["PYTHONPATH"] = os.pathsep.join(paths)
        env.update(request.extra_env)
        return launch_local(
            case_id=case.id,
            world_size=case.world_size,
            env=env,
            artifacts_dir=out,
            timeout_s=case.timeout,
        )
    finally:
        book.release(lease)
        book.release_port(port)
        if slot is not None:
            book.release_port_ranges(slot)
