"""Entry point of one rank: `python -m pytest_fsdp_turbo_engine.worker SPEC.json`.

Writes rankN.metrics.json on success, rankN.error.json (phase and traceback) on failure, and exits
non-zero on failure without waiting on collectives that may never complete.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

from pytest_fsdp_turbo_contract.artifacts import RunFolder
from pytest_fsdp_turbo_contract.records import PARTIAL_METRICS_ATTR
from pytest_fsdp_turbo_contract.results import UNWRITABLE_REPORT, RankError
from pytest_fsdp_turbo_contract.spec import RankSpec
from pytest_fsdp_turbo_engine.rank_env import RankEnv


def _write_json(path: Path, payload: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=1, sort_keys=True, default=str))
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec_path = Path(argv[0])
    spec = RankSpec.read(spec_path)
    out = spec_path.parent
    folder = RunFolder(out)
    place = RankEnv.read()  # torch's rendezvous variables; everything else: the spec
    rank = place.rank
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

    from pytest_fsdp_turbo_engine.faults import Fault
    from pytest_fsdp_turbo_engine.step.phases import Phase

    phase = Phase(rank, report=folder.phases(rank))
    try:
        phase.fault = Fault.of(spec.fault)
        # the start-up (torch, transformers, the harness's step), before the first phase: the
        # launcher starts the case timeout once every rank has recorded one (a forked rank has
        # them already); an engine's own modules (verl's) are imported in load, its errors there
        import torch.distributed as dist

        from pytest_fsdp_turbo_contract.device_profiles import profile_of
        from pytest_fsdp_turbo_engine.step.run import run_ppo_step

        phase.enter("init")
        backend = profile_of(spec.device_kind).collective_backend
        timeout = timedelta(seconds=spec.collective_timeout_s)
        dist.init_process_group(backend, timeout=timeout)
        if dist.get_world_size() != spec.engine.world_size:
            raise RuntimeError(
                f"the process group has {dist.get_world_size()} ranks; the spec asks for "
                f"{spec.engine.world_size}"
            )
        output = run_ppo_step(spec, place, phase, out)
        phase.enter("write")
        if output.grads_fingerprint is not None:
            _write_json(folder.grads(rank), output.grads_fingerprint)
        _write_json(folder.metrics(rank), output.metrics.to_json())
        dist.barrier()
        dist.destroy_process_group()
        return 0
    except BaseException as exc:  # noqa: BLE001 - every failure must be reported, then exit
        text = traceback.format_exc()
        error = RankError(rank, phase.name, type(exc).__name__, str(exc), text, time.time())
        try:
            _write_json(folder.error(rank), error.to_json())
            partial = getattr(exc, PARTIAL_METRICS_ATTR, None)
            if partial is not None and partial.to_json():
                _write_json(folder.partial_metrics(rank), partial.to_json())
            print(text, file=sys.stderr, flush=True)
            sys.stdout.flush()
        except OSError as unwritable:  # a full disk: the exit code says why, nothing else can
            os._exit(UNWRITABLE_REPORT + min(unwritable.errno or 5, 191))
        os._exit(1)


if __name__ == "__main__":
    code = main()
    # Results are written and the process group is gone: skip interpreter teardown, where C++
    # threads left by a broken engine (seen: "terminate called without an active exception" after
    # a step that never synced) can abort a rank whose work is already complete.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
