"""`pytest-fsdp-turbo doctor | run | compare`: the harness without writing pytest commands."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from importlib import metadata

from pytest_fsdp_turbo.checkout import resolve_checkout
from pytest_fsdp_turbo.devices import KINDS, detect
from pytest_fsdp_turbo.environ import build_collective_env, mask_secrets
from pytest_fsdp_turbo.errors import CheckoutUnavailable, ConfigError
from pytest_fsdp_turbo.settings import resolve

VERSIONED = ("torch", "torch_npu", "transformers", "vllm", "vllm-ascend", "ray", "fsdp_turbo")


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def doctor(args: argparse.Namespace) -> int:
    settings = resolve({"fsdp_turbo_device": args.device})
    accel = detect(settings.device)
    print(f"devices:   {accel.describe()}")
    print(
        f"ids:       {list(accel.ids)}" + (f"  names: {list(accel.names)}" if accel.names else "")
    )
    for note in accel.notes:
        print(f"note:      {note}")
    world = 2
    group = build_collective_env(
        accel.kind,
        accel.ids[:world],
        29500,
        world_size=world,
        port_ranges=((61000, 61063), (61064, 61127)) if accel.kind == "npu" else None,
    )
    print(f"env for a {world}-rank group ({accel.backend}):")
    for name, value in sorted(mask_secrets(group.env).items()):
        mark = "  (set by user)" if name in group.from_user else ""
        print(f"  {name}={value}{mark}")
    try:
        found = resolve_checkout(settings.checkout, clone=args.clone)
        print(f"FSDPTurbo: {found.path} @ {found.commit or 'unknown commit'} ({found.source})")
    except CheckoutUnavailable as exc:
        hint = "" if args.clone else " (pass --clone to fetch it now)"
        print(f"FSDPTurbo: not available: {exc}{hint}")
    print("versions:  " + ", ".join(f"{d} {_version(d)}" for d in VERSIONED))
    if args.require and accel.kind != args.require:
        print(f"doctor --require {args.require}: detected {accel.kind}", file=sys.stderr)
        return 1
    if args.require and accel.count == 0:
        print(f"doctor --require {args.require}: no devices found", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pytest-fsdp-turbo")
    verbs = parser.add_subparsers(dest="verb", required=True)
    doc = verbs.add_parser("doctor", help="show detected hardware, env, FSDPTurbo and versions")
    doc.add_argument("--device", help="override detection: cpu|cuda|npu[:N]")
    doc.add_argument("--require", choices=KINDS, help="exit 1 unless this device kind is present")
    doc.add_argument("--clone", action="store_true", help="clone FSDPTurbo if not yet cached")
    doc.set_defaults(func=doctor)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, CheckoutUnavailable) as exc:
        print(f"pytest-fsdp-turbo: {exc}", file=sys.stderr)
        return 2
