"""The CI workflows: actionlint-clean, and saying what the jobs must do."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
WORKFLOWS = REPO / ".github" / "workflows"


def _actionlint() -> str | None:
    beside_python = Path(sys.executable).parent / "actionlint"
    return str(beside_python) if beside_python.is_file() else shutil.which("actionlint")


def test_workflows_pass_actionlint():
    binary = _actionlint()
    if binary is None:
        pytest.skip("actionlint not installed (the test extra installs it on linux x86_64)")
    files = sorted(str(p) for p in WORKFLOWS.glob("*.yml"))
    assert len(files) == 3
    done = subprocess.run(
        [binary, "-shellcheck=", "-pyflakes=", *files], capture_output=True, text=True, cwd=REPO
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_actionlint_catches_a_broken_workflow(tmp_path):
    binary = _actionlint()
    if binary is None:
        pytest.skip("actionlint not installed")
    broken = tmp_path / "broken.yml"
    broken.write_text(
        "on: push\njobs:\n  x:\n    runs-on: ubuntu-latest\n    steps:\n      - run: echo ${{ matrix.nope }}\n"
    )
    assert subprocess.run([binary, str(broken)], capture_output=True).returncode != 0


def test_jobs_select_by_marker_strictly_after_a_doctor_preflight():
    for name, kind, marker in (("gpu.yml", "cuda", "gpu_e2e"), ("npu.yml", "npu", "npu_e2e")):
        text = (WORKFLOWS / name).read_text()
        assert f"doctor --require {kind}" in text
        selections = (
            f'-m "{marker} and not vllm"',
            f'-m "{marker} and vllm and not verl_trainer"',
            f'-m "{marker} and verl_trainer"',
        )
        for selection in selections:
            run = f"{selection} --fsdp-turbo-strict --junitxml"
            preflight = f"{selection} --fsdp-turbo-strict --collect-only"
            assert run in text and preflight in text, (name, selection)
            assert text.index("doctor --require") < text.index(preflight) < text.index(run)
    cpu = (WORKFLOWS / "cpu.yml").read_text()
    assert "pull_request" in cpu and '-m "cpu_e2e and not vllm" --fsdp-turbo-strict' in cpu
    assert "-m vllm --fsdp-turbo-strict --junitxml" in cpu


def test_npu_job_pins_fsdpturbo_and_leaves_hccl_to_the_plugin():
    text = (WORKFLOWS / "npu.yml").read_text()
    assert "FSDP_TURBO_REF: ${{ vars.FSDP_TURBO_REF }}" in text
    assert "^[0-9a-f]{40}$" in text, "the job must refuse a ref that is not a full commit id"
    assert "git clone" not in text
    assert not re.search(r"^\s*(export )?HCCL_\w+[:=]", text, re.MULTILINE)
    assert "container:" in text and "/dev/davinci_manager" in text


def test_entry_scripts(tmp_path):
    bad = subprocess.run(
        ["bash", str(REPO / "e2e/scripts/run_suite.sh"), "tpu"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "expected cpu, gpu or npu; got 'tpu'" in bad.stderr
    env_path = f"{Path(sys.executable).parent}:/usr/bin:/bin"
    unknown = subprocess.run(
        ["bash", str(REPO / "e2e/scripts/run_case.sh"), "no-such-case"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={"PATH": env_path},
    )
    assert unknown.returncode == 2 and "no case 'no-such-case'" in unknown.stderr


def test_ci_runs_the_readme_test_command_requiring_verl_and_the_wheel_trial_strictly():
    """Stage 1 is the README's test command as written, which requires verl (its cases would
    otherwise skip, green, where verl cannot be imported); stage 3's one test may not skip."""
    readme = (REPO / "README.md").read_text()
    block = readme.split("```bash\n", 1)[1].split("```", 1)[0]
    command = block.splitlines()[1]
    assert (
        command.startswith(".venv/bin/python -m pytest") and "--fsdp-turbo-require=verl" in command
    )
    ci = " ".join((REPO / ".ci" / "run").read_text().replace("\\\n", " ").split())
    assert f"stage1=0 run_pytest {command} " in ci
    assert "--fsdp-turbo-strict tests/test_downstream_wheel.py" in ci
