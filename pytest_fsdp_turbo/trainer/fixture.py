"""The object behind the `verl_trainer_run` fixture: a trainer case (parameter, case or id) to its
run's result, with what belongs to pytest: an artifact folder per test and call, skip (or a strict
failure) when the case cannot run here, one line for bad input, junit properties and the summary
row, as `ppo_run` does for engine cases."""

from __future__ import annotations

import contextlib

import pytest

from pytest_fsdp_turbo.cases import CaseParam, TrainerCase
from pytest_fsdp_turbo.outcomes import fail_line, skip_or_fail
from pytest_fsdp_turbo.report import call_artifact_name, note_run
from pytest_fsdp_turbo.trainer.run import TrainerRunner
from pytest_fsdp_turbo_contract.errors import ConfigError, LeaseTimeout, Unavailable
from pytest_fsdp_turbo_contract.results import RunResult


class TrainerRun:
    def __init__(self, request: pytest.FixtureRequest, runner: TrainerRunner, book, strict: bool):
        self.request, self.runner, self.book, self.strict = request, runner, book, strict
        self.calls = 0

    def __call__(self, case: CaseParam | TrainerCase | str) -> RunResult:
        given = case.case if isinstance(case, CaseParam) else case
        self.calls += 1
        name = call_artifact_name(self.request.node.nodeid, self.calls)
        try:
            resolved = self.book().get_trainer(given) if isinstance(given, str) else given
            if not isinstance(resolved, TrainerCase):
                raise ConfigError(
                    f"verl_trainer_run: {resolved.id!r} is no trainer case; fsdp_turbo_run runs "
                    "a case of any kind"
                )
            result = self.runner.run(resolved, name)
        except Unavailable as why:
            skip_or_fail(self.strict, str(why))
        except (ConfigError, LeaseTimeout) as exc:
            fail_line(str(exc))
        note_run(self.request.node, result)
        return result


def progress_lines(config: pytest.Config):
    """Plain lines past the test's output capture (pytest's terminal reporter), as ppo_run's
    progress writes them in CI logs; None without a terminal reporter."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return None
    capture = config.pluginmanager.getplugin("capturemanager")

    def say(text: str) -> None:
        with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
            reporter.ensure_newline()
            reporter.write_line(text)

    return say
