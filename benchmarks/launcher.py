"""The 2-rank tiny case through the plugin's launcher vs the same worker started bare with torchrun.

Alternates the two so noise hits both alike; prints medians, the ratio (target <= 1.10) and the peak
RSS per rank (target < 1.5 GB).  Usage: python benchmarks/launcher.py [--rounds N] [--case ID]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pytest_fsdp_turbo.devices import detect
from pytest_fsdp_turbo.environ import Timeouts, build_collective_env
from pytest_fsdp_turbo.launching.case_runner import standalone_runner, standalone_settings
from pytest_fsdp_turbo.launching.request import RunRequest, rank_spec
from pytest_fsdp_turbo.processes.supervisor import WORKER_MODULE
from pytest_fsdp_turbo_contract.artifacts import RunFolder
from pytest_fsdp_turbo_contract.records import PerfRecord

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--case", default="tiny-qwen3_5-fsdp2-deferred")
    args = parser.parse_args()
    accel = detect("cpu")
    ours, bare, rss = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        settings = standalone_settings(
            {"fsdp_turbo_device": "cpu", "fsdp_turbo_artifacts": tmp}, cwd=REPO
        )
        runner = standalone_runner(settings, accel)  # the run path ppo_run uses
        case = runner.cases().get(args.case)
        model, _ = runner.gate(case, None)
        book = runner.book
        for round_ in range(args.rounds):
            for mode in ("launcher", "torchrun"):
                out = Path(tmp) / f"{mode}-{round_}"
                start = time.perf_counter()
                if mode == "launcher":  # as users meet it: leases, env, spec, ranks, results
                    ok = runner.run(case, out.name).ok
                else:
                    request = RunRequest(case, model, out, accel)
                    out.mkdir()
                    rank_spec(request).write(RunFolder(out).spec)
                    port = book.port()
                    env = build_collective_env(
                        "cpu",
                        range(case.engine.world_size),
                        port,
                        world_size=case.engine.world_size,
                        timeouts=Timeouts(case.collective_timeout, case.timeout),
                        user_env=os.environ,
                    ).child_env()
                    done = subprocess.run(
                        [
                            sys.executable,
                            "-m",
                            "torch.distributed.run",
                            "--standalone",
                            f"--nproc-per-node={case.engine.world_size}",
                            "-m",
                            WORKER_MODULE,
                            str(RunFolder(out).spec),
                        ],
                        env={**env, "PYTHONPATH": os.pathsep.join(sys.path)},
                        capture_output=True,
                        check=False,
                    )
                    book.release_port(port)
                    ok = done.returncode == 0
                elapsed = time.perf_counter() - start
                if not ok:
                    raise SystemExit(f"{mode} run failed; see {out}")
                (ours if mode == "launcher" else bare).append(elapsed)
                if mode == "launcher":
                    for rank in range(case.engine.world_size):
                        metrics = json.loads(RunFolder(out).metrics(rank).read_text())
                        rss.append(metrics[PerfRecord.key("peak_memory_bytes")])
    a, b = statistics.median(ours), statistics.median(bare)
    print(
        f"{case.id} ({case.engine.world_size} ranks, cpu), median of {args.rounds}: launcher {a:.2f}s, "
        f"torchrun {b:.2f}s, ratio {a / b:.3f} (target <= 1.10)"
    )
    print(f"peak RSS per rank: max {max(rss) / 2**30:.2f} GiB (target < 1.5 GB)")


if __name__ == "__main__":
    main()
