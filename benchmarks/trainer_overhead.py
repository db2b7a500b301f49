"""What a verl trainer case costs beyond its steps: the whole run (the pytest test, Ray, verl's
actors, the vLLM servers, the harness's checks) against verl's own `timing_s/step` of each step.

Runs one tiny trainer case with `steps = 2` through pytest in the vLLM and trainer environment
(a case file beside e2e/cases.toml that extends it, removed after), then reads verl's step
metrics from the run folder. verl starts its agent-loop and reward workers inside its first step,
so step 1 holds start-up too; step 2 is what a step costs once everything is up. The overhead is
the test's wall time less both steps. Target (issue 58): the overhead at most 3 x the step.
Usage: .venv-vllm/bin/python benchmarks/trainer_overhead.py [--case ID]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from trainer_test import one_trainer_run  # benchmarks/, beside this script

from pytest_fsdp_turbo_contract.trainer_files import TrainerFolder

REPO = Path(__file__).resolve().parent.parent
CASES = REPO / "e2e" / "cases.toml"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", default="tiny-qwen3-verl-trainer-fsdp2")
    args = parser.parse_args()
    bench = f"{args.case}-bench-2-steps"
    cases = CASES.with_name(".benchmark-cases.toml")  # beside the original: its scripts resolve
    cases.write_text(
        CASES.read_text()
        + f'\n[[trainer_case]]\nid = "{bench}"\nextends = "{args.case}"\nsteps = 2\n'
    )
    test = f"e2e/test_verl_trainer.py::test_verl_trainer_one_step[{bench}-cpu]"
    try:
        with one_trainer_run([f"--fsdp-turbo-cases={cases}", test]) as (folder, wall):
            report(folder, args.case, wall)
    finally:
        cases.unlink(missing_ok=True)


def report(folder: TrainerFolder, case: str, wall: float) -> None:
    logged = json.loads(folder.step_metrics.read_text())
    steps = [logged[key]["timing_s/step"] for key in sorted(logged, key=int)]
    if len(steps) != 2:
        raise SystemExit(f"{folder.step_metrics}: expected 2 steps' timing_s/step; got {steps}")
    overhead = wall - sum(steps)
    print(f"case {case}, 2 training steps: the test {wall:.1f} s")
    print(
        f"  verl's step 1 {steps[0]:.2f} s (with the workers verl starts in it), step 2 {steps[1]:.2f} s"
    )
    print(f"  overhead (the test less its steps): {overhead:.1f} s")
    print(f"  = {overhead / steps[0]:.2f} x step 1 (<= 3), {overhead / steps[1]:.1f} x step 2")
    print(json.dumps({"wall_s": wall, "steps_s": steps, "overhead_s": overhead}))


if __name__ == "__main__":
    main()
