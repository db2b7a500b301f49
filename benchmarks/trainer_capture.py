"""What the single-process reference and the micro-batch pair cost a verl trainer run, beside the
step they judge.

Runs one tiny trainer case (reference on) through pytest in the vLLM and trainer environment, then
reads from its run folder, for every optimizer step: the capture's own seconds on each rank (the
observer times its own work: the batch, the loss gradients, the parameters and gradients
gathered whole), the micro-batch pair's own seconds on each rank (one more pass of the
mini-batch), the replay's seconds (replay.json), and verl's own `timing_s/step` and
`timing_s/update_actor` for the training step. Target: capture, pair and replay together at most
the step's own time.
Usage: .venv-vllm/bin/python benchmarks/trainer_capture.py [--case ID]
"""

from __future__ import annotations

import argparse
import json

from trainer_test import one_trainer_run  # benchmarks/, beside this script

from pytest_fsdp_turbo_contract.trainer_files import TrainerFolder
from pytest_fsdp_turbo_contract.trainer_records import first_step_metrics, read_ranks, read_replay


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", default="tiny-qwen3-verl-trainer-fsdp2-deferred")
    args = parser.parse_args()
    selection = ["-m", "verl_trainer", "-k", f"{args.case}-cpu", "e2e/test_verl_trainer.py"]
    with one_trainer_run(selection) as (folder, _wall):
        report(folder, args.case)


def report(folder: TrainerFolder, case: str) -> None:
    ranks = read_ranks(folder.ranks())
    replay = read_replay(folder.replay)
    verl = first_step_metrics(folder.step_metrics)
    step, update = verl.get("timing_s/step"), verl.get("timing_s/update_actor")
    if replay is None or not isinstance(step, int | float):
        raise SystemExit(f"{folder.path}: no replay record or no timing_s/step")
    count = max(len(rank.steps) for rank in ranks.values())
    capture = [
        max(rank.steps[i].capture_seconds or 0.0 for rank in ranks.values() if len(rank.steps) > i)
        for i in range(count)
    ]
    pair = [
        max(rank.steps[i].pair_seconds or 0.0 for rank in ranks.values() if len(rank.steps) > i)
        for i in range(count)
    ]
    replayed = [s.seconds for s in replay.steps]
    print(f"case {case}: {count} optimizer step(s) in one training step")
    print(f"  verl's training step: {step:.2f} s (its actor update {update or 0:.2f} s)")
    for i in range(count):
        said = f"{replayed[i]:.2f} s" if i < len(replayed) else "-"
        print(
            f"  optimizer step {i}: capture {capture[i]:.3f} s, micro-batch pair {pair[i]:.3f} s "
            f"(slowest rank), replay {said}"
        )
    total = sum(capture) + sum(pair) + sum(replayed)
    print(f"  together: {total:.2f} s = {total / step:.2f} x the step (<= 1)")
    print(json.dumps({"step_s": step, "capture_s": capture, "pair_s": pair, "replay_s": replayed}))


if __name__ == "__main__":
    main()
