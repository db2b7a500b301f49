"""c's per-parameter rule in bf16, measured: healthy engines over seeds, and broken engines that
get one small parameter's gradient wrong, side by side in units of the tolerance (above 1: red).

Each run is the NPU target's mode on the tiny Qwen3.5 (bf16, fp32 reduce, FSDP 2 x Ulysses SP 2)
with the in-rank reference and a single twin at once, so one run gives both modes' margins: the
engine's gradient against the reference's computed in bf16 (per parameter, relative L2), and its
gradient norm against the twin's (pytest_fsdp_turbo.checks.rounding_margins). Our FSDP-Turbo
engine runs on the stand-in fsdp_turbo (tests/standin_fsdp_turbo); verl's needs the verl extra.
CPU bf16 kernels, not CUDA or NPU ones: figures for docs/checks.md.

Usage: python benchmarks/bf16_parameters.py [--seeds 1,2,3,4,5] [--engines ours,verl]
    [--bugs 0,0.5,2] [--parameter layers.0.linear_attn.dt_bias]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from pytest_fsdp_turbo import checks
from pytest_fsdp_turbo.devices import detect
from pytest_fsdp_turbo.launching.case_runner import standalone_runner, standalone_settings
from pytest_fsdp_turbo.turbo.checkout import Checkout

REPO = Path(__file__).resolve().parent.parent
E2E = REPO / "e2e"
STANDIN = Checkout(
    REPO / "tests" / "standin_fsdp_turbo" / "function_patches",
    None,
    "stand-in fsdp_turbo (function_patches layout), tests only",
    stand_in=True,
)
ENGINES = {  # case, healthy options, broken options (e2e/broken_small_gradient.py)
    "ours": (
        "tiny-qwen3_5-fsdp_turbo-fsdp2-sp2-deferred-twin",
        {"checkout": STANDIN},
        {"engine_modules": ["broken_turbo_small_gradient"]},
    ),
    "verl": (
        "tiny-qwen3_5-verl-fsdp_turbo-fsdp2-sp2-twin",
        {"checkout": STANDIN},
        {
            "backend": "verl:turbo_small_gradient_wrong",
            "engine_modules": [
                "verl:turbo_small_gradient_wrong = broken_verl_turbo_small_gradient "
                "[sp, turbo_config, own_loop, always_packs]"
            ],
        },
    ),
}


def margins(runner, engine: str, seed: int, bug: str | None, parameter: str) -> str:
    case, healthy, broken = ENGINES[engine]
    env = {"FSDP_TURBO_STANDIN_ALLOW_CPU": "1"}
    options = dict(healthy)
    if bug is not None:
        env["SMALL_GRADIENT_BUG"] = f"{parameter}*{bug}"
        options.update(broken)
    result = runner.run(
        runner.cases().get(case),
        f"{engine}-{seed}-{bug}",
        reference_checks=True,
        twin="single",
        seed=seed,
        extra_env=env,
        pythonpath=[str(E2E)],
        **options,
    )
    if not result.ok:
        return f"failed: {result.failure_text().splitlines()[0]}"
    said = []
    for mode, worst in checks.rounding_margins(result).items():
        said.append(f"{mode} {worst.ratio:6.2f} ({worst.name.removeprefix('model.')})")
    return "  ".join(said)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", default="1,2,3,4,5")
    parser.add_argument("--engines", default="ours,verl")
    parser.add_argument("--bugs", default="0,0.5,2", help="factors on the parameter's gradient")
    parser.add_argument("--parameter", default="layers.0.linear_attn.dt_bias")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        settings = standalone_settings(
            {"fsdp_turbo_device": "cpu", "fsdp_turbo_artifacts": tmp}, cwd=REPO
        )
        runner = standalone_runner(settings, detect("cpu"))
        print("worst parameter, in units of its tolerance (REFERENCE_NOISE_FACTOR x its noise)")
        for engine in args.engines.split(","):
            for seed in map(int, args.seeds.split(",")):
                for bug in (None, *(b for b in args.bugs.split(",") if b)):
                    what = "healthy" if bug is None else f"{args.parameter} x {bug}"
                    line = margins(runner, engine, seed, bug, args.parameter)
                    print(f"{engine:5s} seed {seed}  {what:38s} {line}", flush=True)


if __name__ == "__main__":
    main()
