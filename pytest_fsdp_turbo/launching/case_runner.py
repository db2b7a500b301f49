"""One run path: how a case becomes a run, for the `ppo_run` fixture, `pytest-fsdp-turbo run` and
the benchmarks alike. Named steps: resolve the case (with validated overrides), gate it (model,
vLLM, verl, FSDPTurbo checkout and its torch range), build the request, launch it (warm, spawn or
Ray, then its twin). Callers decide what an unavailable case means (skip, or fail under strict).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from pytest_fsdp_turbo.cases import (
    DEFAULT_CASES,
    Case,
    CaseBook,
    CaseParam,
    engine_module_source,
    load_cases,
    with_overrides,
)
from pytest_fsdp_turbo.devices import Accelerator
from pytest_fsdp_turbo.launching.ray_driver import RayDriver, ray_driver
from pytest_fsdp_turbo.launching.request import RunRequest, launcher_for
from pytest_fsdp_turbo.launching.twin import run_with_twin
from pytest_fsdp_turbo.leases import LeaseBook
from pytest_fsdp_turbo.models import ModelUnavailable, resolve_model
from pytest_fsdp_turbo.needs import case_needs, missing_packages
from pytest_fsdp_turbo.options import ini_values
from pytest_fsdp_turbo.processes.progress import Display
from pytest_fsdp_turbo.session import resolve_artifacts
from pytest_fsdp_turbo.settings import Settings, launcher_named, resolve
from pytest_fsdp_turbo.turbo.checkout import Checkout, resolve_checkout
from pytest_fsdp_turbo_contract.engines import BUILT_IN, EngineCatalog
from pytest_fsdp_turbo_contract.errors import ConfigError, Unavailable
from pytest_fsdp_turbo_contract.results import RunResult
from pytest_fsdp_turbo_contract.vocab import CaseKindName


@dataclass
class CaseRunner:
    settings: Settings
    accelerator: Accelerator
    book: LeaseBook
    cases: Callable[[], CaseBook]  # loaded when a case is named by id
    artifacts_root: Path
    checkout: Callable[[], Checkout] = field(default=lambda: None)  # resolved only when needed
    start_ray: Callable[[], RayDriver] = field(default=lambda: None)
    progress: Display | None = None  # where live status goes while the ranks run

    def resolve(
        self, case: Case | CaseParam | str, engines: EngineCatalog, overrides: dict
    ) -> Case:
        if isinstance(case, CaseParam):
            case = case.case
        elif isinstance(case, str):
            case = self.cases().get(case)
        if not isinstance(case, Case):
            raise ConfigError(
                f"ppo_run: {case.id!r} is no [[case]] of the harness's own step; fsdp_turbo_run "
                "runs a case of any kind"
            )
        if not overrides:
            return case
        return with_overrides(case, overrides, engines, self.settings.tiny_models)

    def gate(self, case: Case, checkout: Checkout | None) -> tuple[Path, Checkout | None]:
        try:
            model = resolve_model(
                case.model, self.settings.models, tiny_models=self.settings.tiny_models
            )
        except ModelUnavailable as exc:
            raise Unavailable(f"case {case.id}: {exc}") from None
        for need in missing_packages(case_needs(case, self.accelerator.kind)):
            raise Unavailable(
                f"case {case.id}: {need.reason} needs {need.name}, which is not importable here: "
                f"{need.hint}"
            )
        if not case.is_turbo:
            return model, None
        from pytest_fsdp_turbo.turbo.library import torch_gate  # only turbo cases load packaging

        checkout = checkout or self.checkout()
        torch_gate(case.id, checkout)
        return model, checkout

    def launch(self, request: RunRequest) -> RunResult:
        launcher = launcher_for(request.launcher, self.book, self.start_ray)
        return run_with_twin(request, launcher)

    def run(
        self,
        case: Case | CaseParam | str,
        name: str,
        *,
        engine_modules: Sequence[str] = (),
        pythonpath: Sequence[str] = (),
        extra_env: dict[str, str] | None = None,
        launcher: str | None = None,
        checkout: Checkout | None = None,
        **overrides: object,
    ) -> RunResult:
        for option, value in (("engine_modules", engine_modules), ("pythonpath", pythonpath)):
            _refuse_unless_strings(option, value)
        if extra_env is not None and not (
            isinstance(extra_env, dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in extra_env.items())
        ):
            raise ConfigError(
                f"ppo_run extra_env: expected a dict of str to str; got {_shown(extra_env)}"
            )
        engines = self.settings.engines(engine_modules)
        resolved = self.resolve(case, engines, overrides)
        model, found = self.gate(resolved, checkout)
        _refuse_unimportable(resolved, engines, pythonpath)
        request = RunRequest(
            case=resolved,
            model_path=model,
            artifacts_dir=self.artifacts_root / name,
            accelerator=self.accelerator,
            checkout=found,
            engines=engines,
            pythonpath=[os.path.abspath(entry) for entry in pythonpath],  # as this cwd means
            extra_env=dict(extra_env or {}),
            launcher=launcher_named(launcher, "launcher") if launcher else self.settings.launcher,
            progress=self.progress,
        )
        return self.launch(request)


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _refuse_unless_strings(option: str, value: object) -> None:
    """A list of strings, never a string (which would be taken character by character)."""
    if isinstance(value, str | bytes) or not (
        isinstance(value, list | tuple) and all(isinstance(v, str | Path) for v in value)
    ):
        raise ConfigError(f"ppo_run {option}: expected a list of strings; got {_shown(value)}")


def _refuse_unimportable(case: Case, engines: EngineCatalog, pythonpath: Sequence[str]) -> None:
    """An engine module no rank could import: one line here, not an ImportError in every rank."""
    announced = [e for e in engines.serving(case.engine.backend) if e.where != BUILT_IN]
    for module in (entry.module for entry in announced):  # a built-in's package is a need
        if engine_module_source(module, pythonpath) is None:
            looked = f"the pythonpath given ({', '.join(pythonpath)}) and " if pythonpath else ""
            raise ConfigError(
                f"case {case.id}: engine module {module!r}: expected a module the ranks can "
                f"import; no source for it on {looked}this process's path"
            )


@dataclass(frozen=True)
class IniConfig:
    rootdir: Path
    values: dict[str, Any]  # ini key -> value, as pytest's getini gives it


def read_ini(start: Path) -> IniConfig:
    """Let pytest itself find the configuration (its file precedence: an empty pytest.ini still
    wins over pyproject.toml; its rootdir rules; PYTEST_ADDOPTS), stopping before it collects."""

    class Reader:
        found: IniConfig | None = None

        @pytest.hookimpl(tryfirst=True)
        def pytest_cmdline_main(self, config: pytest.Config) -> int:
            Reader.found = IniConfig(config.rootpath, ini_values(config))
            return 0  # nothing else runs: no configure hooks, no collection

    with open(os.devnull, "w") as sink, contextlib.chdir(start), contextlib.redirect_stdout(sink):
        pytest.main(["--noconftest", "-p", "no:cacheprovider"], plugins=[Reader()])
    return Reader.found or IniConfig(start, {})


def standalone_settings(values: dict[str, Any], cwd: Path | None = None) -> Settings:
    """Settings for `pytest-fsdp-turbo` verbs and benchmarks: their options over the ini pytest
    would read from `cwd`, validated by the same rules as the plugin's."""
    ini = read_ini((cwd or Path.cwd()).resolve())
    return resolve(values, ini=ini.values, rootdir=ini.rootdir)


def case_file(settings: Settings) -> Path:
    """The option's case file, else the rootdir ini's fsdp_turbo_cases, else e2e/cases.toml."""
    return settings.cases or (settings.rootdir or Path.cwd()) / DEFAULT_CASES


def _load(path: Path, settings: Settings) -> CaseBook:
    """The engine cases alone: all a runner of the harness's own step looks up by id."""
    cases = load_cases(path, engines=settings.engines(), tiny_models=settings.tiny_models)
    return CaseBook(path, {CaseKindName.PPO_STEP: cases})


def standalone_runner(settings: Settings, accelerator: Accelerator) -> CaseRunner:
    """The runner `pytest-fsdp-turbo run` and the benchmarks use: the same case file (from the
    option, else the rootdir's ini, else e2e/cases.toml under the rootdir), the ini engine modules,
    the same gates and launchers as the fixture."""
    path = case_file(settings)
    artifacts = resolve_artifacts(settings.artifacts, Path.cwd(), settings.rootdir or Path.cwd())
    return CaseRunner(
        settings=settings,
        accelerator=accelerator,
        book=LeaseBook(),
        cases=lambda: _load(path, settings),
        artifacts_root=artifacts,
        checkout=lambda: resolve_checkout(settings.checkout),
        start_ray=lambda: _start_ray(settings, artifacts),
        progress=_stderr_progress(),
    )


def _stderr_progress() -> Display:
    """Live status on stderr for `pytest-fsdp-turbo run`: rewritten in place on a terminal."""

    def live(text: str) -> None:
        sys.stderr.write("\r\x1b[2K" + text)
        sys.stderr.flush()

    def line(text: str) -> None:
        sys.stderr.write(text + "\n")

    return Display(live if sys.stderr.isatty() else None, line)


def _start_ray(settings: Settings, log_dir: Path) -> RayDriver:
    return ray_driver(settings.ray_address, settings.ray_connect_timeout_s, log_dir)
