"""What the train-phase probe costs: the same 2-rank FSDP2 train phase (two micro-batches, deferred
sync) with no probe, with the harness's probe (collective counter, unsharded-gradient reading), and
with the torch.profiler trace the probe used before, timed side by side in one run.

Usage: python benchmarks/probe_overhead.py [--models tiny-qwen3_5,tiny-qwen3] [--rounds 5]
Prints, per model, the median seconds of each arm and the ratios to the plain arm (target for the
probe: <= 1.15).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from pytest_fsdp_turbo.models import build_tiny_model

ARMS = ("plain", "probe", "profiler")

RANK = textwrap.dedent(
    """
    import contextlib, json, os, sys, time
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM
    from pytest_fsdp_turbo_engine.step import fsdp_probe

    model_dir, store, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}",
                            rank=int(os.environ["RANK"]), world_size=2)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    torch.manual_seed(0)
    batch = torch.randint(0, model.config.vocab_size, (8, 32))

    def train(arm):
        if arm == "probe":
            probe = fsdp_probe.CollectiveCounter()
        elif arm == "profiler":
            probe = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        else:
            probe = contextlib.nullcontext()
        start = time.perf_counter()
        with probe:
            for i, rows in enumerate(batch.chunk(2)):
                model.set_requires_gradient_sync(i == 1)
                loss = model(rows).logits.float().mean()
                if arm == "probe":
                    if i:
                        fsdp_probe.unsharded_grad_bytes(model)
                    probe.next_micro_batch()
                elif arm == "profiler":
                    with torch.profiler.record_function("micro_batch"):
                        pass
                loss.backward()
        if arm == "profiler":
            probe.events()  # the old probe read the trace back
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    arms = ("plain", "probe", "profiler")
    for arm in arms:  # warm-up
        train(arm)
    times = {arm: [] for arm in arms}
    for r in range(rounds):
        for arm in arms[r % 3:] + arms[:r % 3]:  # rotate the order each round
            times[arm].append(train(arm))
    if dist.get_rank() == 0:
        print(json.dumps(times))
    dist.destroy_process_group()
    """
)


def measure(model: str, rounds: int) -> dict[str, list[float]]:
    model_dir = build_tiny_model(model)
    with tempfile.TemporaryDirectory() as scratch:
        script = Path(scratch) / "rank.py"
        script.write_text(RANK)
        store = Path(scratch) / "store"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
        ranks = [
            subprocess.Popen(
                [sys.executable, str(script), str(model_dir), str(store), str(rounds)],
                env={**env, "RANK": str(rank)},
                stdout=subprocess.PIPE,
                text=True,
            )
            for rank in range(2)
        ]
        out = [rank.communicate()[0] for rank in ranks]
    if any(rank.returncode for rank in ranks):
        raise SystemExit(f"{model}: a rank failed")
    return json.loads(out[0].strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny-qwen3_5,tiny-qwen3")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(
        f"{'model':<14} {'plain s':>8} {'probe s':>8} {'profiler s':>10}  probe/plain  profiler/plain"
    )
    for model in args.models.split(","):
        start = time.monotonic()
        with contextlib.redirect_stderr(sys.stderr):
            times = measure(model, args.rounds)
        median = {arm: statistics.median(times[arm]) for arm in ARMS}
        print(
            f"{model:<14} {median['plain']:>8.3f} {median['probe']:>8.3f} "
            f"{median['profiler']:>10.3f}  {median['probe'] / median['plain']:>11.3f}  "
            f"{median['profiler'] / median['plain']:>14.2f}   ({time.monotonic() - start:.0f} s)"
        )


if __name__ == "__main__":
    main()
