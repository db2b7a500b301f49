"""A downstream repository that installs the plugin from its wheel (not this checkout) and uses it
as the README says: its own engine by entry point and by ini, its own case file, goldens recorded
then checked, and a collective_env job of its own. Minutes, not seconds (a fresh venv): CI runs it
as its own stage (`.ci/run`, stage 3) with PYTEST_FSDP_TURBO_WHEEL_TRIAL=1; elsewhere it skips."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TRIAL_VAR = "PYTEST_FSDP_TURBO_WHEEL_TRIAL"
TORCH = "torch==2.13.0"  # the CPU wheel the README pins

pytestmark = pytest.mark.skipif(
    os.environ.get(TRIAL_VAR) != "1", reason=f"the wheel trial runs in CI's stage 3 ({TRIAL_VAR}=1)"
)

FILES = {
    "pyproject.toml": """
        [project]
        name = "downstream-rl"
        version = "0.1"

        [project.entry-points."pytest_fsdp_turbo.engines"]
        ds_engine = "ds_rl.engines"

        [tool.setuptools]
        packages = ["ds_rl"]

        [tool.pytest.ini_options]
        fsdp_turbo_cases = "tests/e2e/cases.toml"
        fsdp_turbo_engine_modules = ["ini_engine = ds_rl.ini_engines"]
        """,
    "ds_rl/__init__.py": "",
    "ds_rl/engines.py": """
        from pytest_fsdp_turbo_engine.engines.fsdp2 import FSDPEngineWithLMHead
        from pytest_fsdp_turbo_engine.engines.registry import register


        @register(backend="ds_engine", device=["cpu", "cuda", "npu"])
        class DownstreamEngine(FSDPEngineWithLMHead):
            pass
        """,
    "ds_rl/ini_engines.py": """
        from pytest_fsdp_turbo_engine.engines.fsdp2 import FSDPEngineWithLMHead
        from pytest_fsdp_turbo_engine.engines.registry import register


        @register(backend="ini_engine", device=["cpu", "cuda", "npu"])
        class IniEngine(FSDPEngineWithLMHead):
            pass
        """,
    "tests/e2e/cases.toml": """
        [[case]]
        id = "ds-engine-fsdp2"
        model = "tiny-qwen3"
        backend = "ds_engine"
        world_size = 2

        [[case]]
        id = "ini-engine-single"
        model = "tiny-qwen3"
        backend = "ini_engine"
        world_size = 1
        """,
    "tests/e2e/test_cases.py": """
        from pytest_fsdp_turbo import checks


        def test_one_step(fsdp_turbo_case, ppo_run, fsdp_turbo_golden):
            result = ppo_run(fsdp_turbo_case)
            checks.check_all(result)
            print("golden:", fsdp_turbo_golden(result, fsdp_turbo_case))
        """,
    "tests/test_collective.py": """
        import subprocess
        import sys

        import pytest

        JOB = (
            "import os, torch, torch.distributed as dist\\n"
            "dist.init_process_group('gloo')\\n"
            "t = torch.ones(1) * (dist.get_rank() + 1)\\n"
            "dist.all_reduce(t)\\n"
            "assert t.item() == 3.0, t\\n"
            "dist.destroy_process_group()\\n"
        )


        @pytest.mark.devices(2)
        def test_my_own_two_rank_job(collective_env):
            env = collective_env.child_env()
            ranks = [
                subprocess.Popen([sys.executable, "-c", JOB], env={**env, "RANK": str(r)})
                for r in range(collective_env.world_size)
            ]
            assert [p.wait(timeout=120) for p in ranks] == [0, 0]
        """,
}


def run(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    done = subprocess.run(args, cwd=cwd, capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, f"{' '.join(args)}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def test_a_downstream_repository_runs_on_the_installed_wheel(tmp_path):
    wheels = tmp_path / "dist"
    run(
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "-q",
        "--no-deps",
        "-w",
        str(wheels),
        str(REPO),
        cwd=tmp_path,
    )
    (wheel,) = wheels.glob("pytest_fsdp_turbo-*.whl")
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", str(venv), cwd=tmp_path)
    pip, python = venv / "bin" / "pip", venv / "bin" / "python"
    run(str(pip), "install", "-q", TORCH, f"{wheel}[test]", cwd=tmp_path)
    project = tmp_path / "downstream"
    for name, text in FILES.items():
        (project / name).parent.mkdir(parents=True, exist_ok=True)
        (project / name).write_text(textwrap.dedent(text).lstrip())
    run(str(pip), "install", "-q", "--no-deps", "-e", str(project), cwd=tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "FSDP_TURBO_"))}
    env["PATH"] = f"{venv / 'bin'}:{env.get('PATH', '')}"

    # the plugin and its engine package come from site-packages, not from this checkout
    where = run(str(python), "-c", "import pytest_fsdp_turbo as p; print(p.__file__)", cwd=project)
    assert "site-packages" in where.stdout and str(REPO) not in where.stdout

    doctor = run(str(venv / "bin" / "pytest-fsdp-turbo"), "doctor", cwd=project, env=env).stdout
    assert f"cases:     {project / 'tests' / 'e2e' / 'cases.toml'} (ini fsdp_turbo_cases)" in doctor
    assert "engine:    ds_engine  [entry point ds_engine: ds_rl.engines]" in doctor
    assert "engine:    ini_engine  [ini fsdp_turbo_engine_modules: ds_rl.ini_engines]" in doctor

    pytest_cmd = [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2"]
    run(*pytest_cmd, "--fsdp-turbo-record-golden", cwd=project / "tests" / "e2e", env=env)
    goldens = project / "fixtures" / "goldens"  # under the rootdir, wherever pytest started
    assert sorted(p.parent.name for p in goldens.glob("*/cpu-fp32-ws*.json")) == [
        "ds-engine-fsdp2",
        "ini-engine-single",
    ]
    assert (project / "fsdp-turbo-artifacts").is_dir()
    checked = run(
        *pytest_cmd, "--fsdp-turbo-strict", "-m", "cpu_e2e or not e2e", cwd=project, env=env
    )
    assert "3 passed" in checked.stdout, checked.stdout[-2000:]
