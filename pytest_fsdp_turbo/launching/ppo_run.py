"""The object behind the ppo_run fixture, loaded when a test first asks for it (the fixtures module
stays small because pytest imports it on every start)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from pytest_fsdp_turbo.outcomes import fail_line, skip_or_fail
from pytest_fsdp_turbo.processes.progress import Display
from pytest_fsdp_turbo.report import call_artifact_name, note_run
from pytest_fsdp_turbo.session import settings_of
from pytest_fsdp_turbo_contract.errors import ConfigError, LeaseTimeout, Unavailable

if TYPE_CHECKING:
    from pytest_fsdp_turbo.cases import Case, CaseParam
    from pytest_fsdp_turbo_contract.results import RunResult


class PPORun:
    """The ppo_run fixture: the shared run path (pytest_fsdp_turbo.launching.case_runner.CaseRunner) plus what
    belongs to pytest: an artifact folder per test and call, skip or strict failure when a case
    cannot run here, one-line failures for bad input, junit properties and the summary row."""

    def __init__(self, request: pytest.FixtureRequest, runner):
        self.request, self.runner, self.calls = request, runner, 0

    def artifact_name(self) -> str:
        self.calls += 1
        return call_artifact_name(self.request.node.nodeid, self.calls)

    def interrupted(self, case: Case | CaseParam | str, folder: Path) -> None:
        case_id = case if isinstance(case, str) else case.id
        line = f"fsdp-turbo: interrupted during case {case_id}; its logs so far: {folder}"
        reporter = self.request.config.pluginmanager.get_plugin("terminalreporter")
        capture = self.request.config.pluginmanager.getplugin("capturemanager")
        with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
            if reporter is not None:
                reporter.ensure_newline()
                reporter.write_line(line)

    def record(self, result: RunResult, options: dict) -> None:
        note_run(self.request.node, result, options)
        for note in result.notes:
            if note.startswith("fsdp-turbo: stall:"):
                self.request.node.user_properties.append(("fsdp_turbo/stall", note))

    def __call__(self, case: Case | CaseParam | str, **options: object) -> RunResult:
        name = self.artifact_name()
        try:
            result = self.runner.run(case, name, **options)
        except (
            KeyboardInterrupt
        ):  # pytest's summary follows: say which case and where its files are
            self.interrupted(case, self.runner.artifacts_root / name)
            raise
        except Unavailable as why:
            skip_or_fail(self.runner.settings.strict, str(why))
        except (ConfigError, LeaseTimeout) as exc:
            fail_line(str(exc))
        self.record(result, options)
        return result


def terminal_progress(config: pytest.Config):
    """Live status through pytest's own terminal reporter: one line rewritten in place on a
    terminal, plain lines on a phase change (at most every 30 s) in CI logs."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return None
    settings = settings_of(config)
    share, quiet = settings.stall_share, settings.quiet_s
    capture = config.pluginmanager.getplugin("capturemanager")

    def uncaptured():  # as pytest's live logging does: past the test's output capture
        return capture.global_and_fixture_disabled() if capture else contextlib.nullcontext()

    def live(text: str) -> None:
        with uncaptured():
            if text:
                reporter.ensure_newline()
            reporter.rewrite(text, erase=True)

    def line(text: str) -> None:
        with uncaptured():
            reporter.write_line(text)

    return Display(live if getattr(reporter, "isatty", False) else None, line, share, quiet)
