"""The e2e suite as users drive it: markers on this CPU box, strict mode, goldens, junit."""

import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from pytest_fsdp_turbo.cases import FIXTURES_DIR
from pytest_fsdp_turbo_contract.records import LossRecord, OptimizerRecord, RankRecord

REPO = Path(__file__).resolve().parent.parent


def pytest_run(*args, cwd=REPO):
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=600,
    )


def test_gpu_and_npu_cases_skip_here_with_reasons():
    for marker, kind in (("gpu_e2e", "cuda"), ("npu_e2e", "npu")):
        done = pytest_run("e2e", "-m", marker, "-rs", "--fsdp-turbo-device=cpu")
        assert done.returncode == 0, done.stdout[-1500:]
        assert " passed" not in done.stdout.splitlines()[-1]
        assert f"needs {kind} ({marker}); detected cpu" in done.stdout
        strict = pytest_run("e2e", "-m", marker, "--fsdp-turbo-strict", "--fsdp-turbo-device=cpu")
        assert strict.returncode != 0
        errors = [line for line in strict.stderr.splitlines() if line.startswith("ERROR:")]
        assert len(errors) == 1 and "none can run here" in errors[0]


def test_record_golden_then_check_and_junit_properties(tmp_path):
    (tmp_path / "cases.toml").write_text(
        '[[case]]\nid = "one"\nmodel = "tiny-qwen3"\nworld_size = 1\ngolden_tier = "exact"\n'
        "[case.not_exercised]\n"  # the shipped test holds every case to check_exercised
        'second_update = "a golden round trip"\ngrad_clip = "a golden round trip"\n'
        'kl_reference = "a golden round trip"\n'
    )
    shutil.copy(REPO / "e2e" / "test_ppo_e2e.py", tmp_path / "test_ppo_e2e.py")
    common = [
        "-k",
        "test_ppo_one_step",
        f"--fsdp-turbo-cases={tmp_path / 'cases.toml'}",
        f"--fsdp-turbo-artifacts={tmp_path / 'art'}",
        str(tmp_path / "test_ppo_e2e.py"),
        f"--rootdir={tmp_path}",
    ]
    junit = tmp_path / "junit.xml"
    first = pytest_run(*common, "--fsdp-turbo-record-golden", f"--junitxml={junit}", cwd=tmp_path)
    assert first.returncode == 0, first.stdout[-2000:]
    # under the rootdir's fixtures/goldens by default, never in the installed package
    golden = tmp_path / "fixtures" / "goldens" / "one" / "cpu-fp32-ws1.json"
    assert golden.is_file()
    assert not (FIXTURES_DIR / "goldens" / "one").exists()
    props = {p.get("name"): p.get("value") for p in ET.parse(junit).iter("property")}
    assert float(props[OptimizerRecord.key("grad_norm")]) > 0
    assert props["fsdp_turbo/run"] == "completed"
    assert (
        LossRecord.key("entropy") not in props and RankRecord.key("device") not in props
    )  # a handful, not all
    assert len([n for n in props if "/" in n]) <= 12
    assert props["fsdp_turbo/golden"].startswith("recorded ")
    assert "fsdp-turbo e2e runs" in first.stdout and "one" in first.stdout
    assert (tmp_path / "art" / "test_ppo_e2e.test_ppo_one_step-one-cpu" / "rank0.log").is_file()
    # a matching golden passes in every e2e case of the main suite; here: a tampered one fails
    golden.write_text(
        golden.read_text().replace(
            f'"{OptimizerRecord.key("grad_norm")}": ', f'"{OptimizerRecord.key("grad_norm")}": 1'
        )
    )
    tampered = pytest_run(*common, cwd=tmp_path)
    assert tampered.returncode == 1
    assert "check g: metric actor/grad_norm" in tampered.stdout


def test_summary_has_one_row_per_run_with_the_worst_outcome(pytester):
    pytester.makepyfile(
        "import os\n"
        "def test_run_then_leak(ppo_run):\n"
        "    ppo_run('tiny-qwen3-single-rank')\n"
        "    os.environ['LEAKED_AFTER_THE_RUN'] = '1'  # the guard errors at teardown\n"
    )
    result = pytester.runpytest(f"--fsdp-turbo-cases={REPO / 'e2e' / 'cases.toml'}")
    result.assert_outcomes(passed=1, errors=1)
    table = result.stdout.str().split("fsdp-turbo e2e runs")[1].splitlines()
    rows = [line for line in table if line.startswith("test_run_then_leak")]
    assert len(rows) == 1, table
    assert " tiny-qwen3-single-rank " in rows[0]
    assert " error: " in rows[0] and "LEAKED_AFTER_THE_RUN" in rows[0], rows[0]
