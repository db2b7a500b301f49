"""The plugin as users meet it: options, markers, skips with reasons, strict mode, header."""

import re
import textwrap
from pathlib import Path

import pytest

from tests.helpers import env_with_path, fake_tool, nvidia_smi_listing

REPO = Path(__file__).resolve().parent.parent

E2E_SUITE = textwrap.dedent(
    """
    import pytest

    @pytest.mark.e2e
    @pytest.mark.gpu_e2e
    @pytest.mark.devices(2)
    def test_on_gpu():
        pass

    @pytest.mark.e2e
    @pytest.mark.npu_e2e
    def test_on_npu():
        pass

    @pytest.mark.e2e
    @pytest.mark.cpu_e2e
    @pytest.mark.devices(2)
    def test_on_cpu(accelerator):
        assert accelerator.kind == "cpu"

    @pytest.mark.cpu_e2e
    @pytest.mark.devices(64)
    def test_too_many_cpu_ranks():
        pass
    """
)


@pytest.fixture
def no_gpu_path(pytester, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", env_with_path(tmp_path / "bin")["PATH"])
    for var in ("PYTEST_FSDP_TURBO_DEVICE", "PYTEST_FSDP_TURBO_STRICT", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(var, raising=False)
    return tmp_path / "bin"


def test_options_have_their_own_help_group(pytester):
    result = pytester.runpytest("--help")
    text = result.stdout.str()
    assert "pytest-fsdp-turbo (distributed e2e harness):" in text
    for flag in (
        "--fsdp-turbo-device",
        "--fsdp-turbo-strict",
        "--fsdp-turbo-path",
        "--fsdp-turbo-repo",
        "--fsdp-turbo-ref",
        "--fsdp-turbo-cases",
        "--fsdp-turbo-models",
        "--fsdp-turbo-artifacts",
        "--fsdp-turbo-record-golden",
        "--fsdp-turbo-launcher",
        "--fsdp-turbo-ray-address",
    ):
        assert flag in text


def test_markers_listed_and_strict_markers_pass(pytester):
    result = pytester.runpytest("--markers")
    for marker in ("@pytest.mark.e2e:", "cpu_e2e", "gpu_e2e", "npu_e2e", "devices(n)"):
        assert marker in result.stdout.str()
    pytester.makepyfile(E2E_SUITE)
    assert pytester.runpytest("--strict-markers", "-p", "no:cacheprovider").ret == 0


def test_skips_say_what_was_looked_for_and_found(pytester, no_gpu_path):
    pytester.makepyfile(E2E_SUITE)
    result = pytester.runpytest("-rs", "--fsdp-turbo-device=cpu:4")
    result.assert_outcomes(passed=1, skipped=3)
    out = result.stdout.str()
    assert "needs cuda (gpu_e2e); detected cpu: 4 rank slots" in out
    assert "needs npu (npu_e2e)" in out
    assert "needs 64 rank slots; found 4" in out


def test_header_shows_detection(pytester, no_gpu_path):
    fake_tool(no_gpu_path, "nvidia-smi", nvidia_smi_listing(4))
    pytester.makepyfile("def test_x(): pass")
    result = pytester.runpytest()
    result.stdout.fnmatch_lines(
        ["fsdp-turbo: cuda: 4 devices (NVIDIA H200), backend nccl, via nvidia-smi -L"]
    )


def test_header_says_how_ranks_start(pytester, monkeypatch):
    pytester.makepyfile("def test_x(): pass")
    pytester.runpytest().stdout.fnmatch_lines(
        ["fsdp-turbo: launcher local: ranks forked from a warm parent per pytest process"]
    )
    monkeypatch.setenv("PYTEST_FSDP_TURBO_NO_FORK", "1")
    pytester.runpytest().stdout.fnmatch_lines(
        [
            "fsdp-turbo: launcher local: ranks spawned as fresh interpreters "
            "(PYTEST_FSDP_TURBO_NO_FORK is set)"
        ]
    )
    pytester.runpytest("--fsdp-turbo-launcher=spawn").stdout.fnmatch_lines(
        ["fsdp-turbo: launcher spawn"]
    )


def test_fake_gpus_let_gpu_tests_run(pytester, no_gpu_path):
    fake_tool(no_gpu_path, "nvidia-smi", nvidia_smi_listing(2))
    pytester.makepyfile(E2E_SUITE)
    result = pytester.runpytest("-m", "gpu_e2e")
    result.assert_outcomes(passed=1)


def test_strict_fails_session_when_no_selected_e2e_can_run(pytester, no_gpu_path):
    pytester.makepyfile(E2E_SUITE)
    result = pytester.runpytest("-m", "gpu_e2e or npu_e2e", "--fsdp-turbo-strict")
    assert result.ret != 0
    result.stderr.fnmatch_lines(
        ["ERROR: --fsdp-turbo-strict: 2 e2e test(s) selected and none can run here: needs *"]
    )
    relaxed = pytester.runpytest("-m", "gpu_e2e or npu_e2e")
    relaxed.assert_outcomes(skipped=2)


def test_strict_from_env_and_passes_when_something_runs(pytester, no_gpu_path, monkeypatch):
    pytester.makepyfile(E2E_SUITE)
    monkeypatch.setenv("PYTEST_FSDP_TURBO_STRICT", "1")
    assert pytester.runpytest("-m", "npu_e2e").ret != 0
    assert pytester.runpytest("-m", "cpu_e2e", "--fsdp-turbo-device=cpu:4").ret == 0


@pytest.mark.parametrize(
    ("args", "env", "expected"),
    [
        (
            ["--fsdp-turbo-device=tpu"],
            {},
            "ERROR: --fsdp-turbo-device: expected one of cpu|cuda|npu*",
        ),
        ([], {"PYTEST_FSDP_TURBO_DEVICE": "gpu"}, "ERROR: PYTEST_FSDP_TURBO_DEVICE: expected*"),
        (["--fsdp-turbo-ref=-x"], {}, "ERROR: --fsdp-turbo-ref: expected a branch*"),
        (
            [],
            {"FSDP_TURBO_REPO": "http://x/y.git"},
            "ERROR: FSDP_TURBO_REPO: expected an https://*",
        ),
        (
            ["--fsdp-turbo-launcher=slurm"],
            {},
            "ERROR: --fsdp-turbo-launcher: expected one of local, spawn, ray; got *slurm*",
        ),
        (
            [],
            {"PYTEST_FSDP_TURBO_STRICT": "maybe"},
            "ERROR: PYTEST_FSDP_TURBO_STRICT: expected 1 or 0*",
        ),
        (  # retired: refused, never silently ignored
            [],
            {"PYTEST_FSDP_TURBO_ENGINE_MODULES": "mine = my_engines"},
            "ERROR: PYTEST_FSDP_TURBO_ENGINE_MODULES is no longer read; announce engines in the "
            "ini fsdp_turbo_engine_modules (one entry a line)*",
        ),
    ],
)
def test_bad_options_are_one_clear_line(pytester, monkeypatch, args, env, expected):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    pytester.makepyfile("def test_x(): pass")
    result = pytester.runpytest(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([expected])
    assert "Traceback" not in result.stderr.str()


def test_bad_devices_marker_argument(pytester):
    pytester.makepyfile("import pytest\n@pytest.mark.devices('two')\ndef test_x(): pass\n")
    result = pytester.runpytest()
    result.stderr.fnmatch_lines(["ERROR: *test_x: devices(n) expects one positive integer*"])


def test_pytest_process_never_imports_torch(pytester):
    pytester.makepyfile(
        """
        import sys
        def test_light(accelerator, free_port):
            assert accelerator.kind
            assert "torch" not in sys.modules
        """
    )
    pytester.makeconftest(
        "import sys\n"
        "def pytest_collection_finish(session):\n"
        "    assert 'torch' not in sys.modules, 'torch imported during collection'\n"
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


START_UP_MODULES = {
    "pytest_fsdp_turbo",
    "pytest_fsdp_turbo_contract",
    "pytest_fsdp_turbo_contract.errors",
    "pytest_fsdp_turbo.outcomes",
    "pytest_fsdp_turbo.options",
    "pytest_fsdp_turbo.session",
    "pytest_fsdp_turbo.fixtures",
    "pytest_fsdp_turbo.plugin",
    "pytest_fsdp_turbo.parametrize",  # the collection hook's half of plugin.py, as light
}


def test_a_suite_that_never_uses_the_harness_loads_only_the_start_up_modules(pytester):
    """The collection benchmark's budget: no settings dataclasses, no vocabulary, no detection."""
    pytester.makepyfile("def test_plain(): pass")
    pytester.makeconftest(
        "import sys\n"
        "def pytest_collection_finish(session):\n"
        "    loaded = sorted(m for m in sys.modules if m.startswith('pytest_fsdp_turbo'))\n"
        "    print('LOADED', ' '.join(loaded))\n"
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q", "-s")
    result.assert_outcomes(passed=1)
    line = next(line for line in result.stdout.lines if line.startswith("LOADED"))
    assert set(line.split()[1:]) == START_UP_MODULES


def test_settings_given_nothing_are_the_defaults_and_an_env_var_makes_them_strict(
    pytester, monkeypatch
):
    from pytest_fsdp_turbo.options import OPTIONS

    for opt in OPTIONS:
        if opt.env:
            monkeypatch.delenv(opt.env, raising=False)
    pytester.makepyfile(
        """
        from pytest_fsdp_turbo.session import settings_of, strict_of
        from pytest_fsdp_turbo.settings import resolve

        def test_settings(pytestconfig):
            defaults = resolve({}, env={}, rootdir=pytestconfig.rootpath)
            assert settings_of(pytestconfig) == defaults
            assert strict_of(pytestconfig) is False
        """
    )
    pytester.runpytest().assert_outcomes(passed=1)
    monkeypatch.setenv("PYTEST_FSDP_TURBO_STRICT", "1")
    pytester.makepyfile(
        """
        from pytest_fsdp_turbo.session import settings_of, strict_of

        def test_settings(pytestconfig):
            assert strict_of(pytestconfig) and settings_of(pytestconfig).strict
        """
    )
    pytester.runpytest().assert_outcomes(passed=1)


def test_collective_env_fixture_uses_the_lease(pytester, no_gpu_path, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTEST_FSDP_TURBO_STATE_DIR", str(tmp_path / "state"))
    pytester.makepyfile(
        """
        import os, pytest

        @pytest.mark.devices(2)
        def test_env(collective_env, accelerator):
            assert accelerator.kind == "npu"
            env = collective_env.env
            assert env["ASCEND_RT_VISIBLE_DEVICES"] == ",".join(map(str, collective_env.device_ids))
            assert len(collective_env.device_ids) == 2
            assert int(env["MASTER_PORT"]) == collective_env.master_port
            assert "HCCL_HOST_SOCKET_PORT_RANGE" not in os.environ
        """
    )
    pytester.runpytest("--fsdp-turbo-device=npu:4").assert_outcomes(passed=1)


def test_checkout_fixture_skips_with_source_and_fails_under_strict(pytester, tmp_path, monkeypatch):
    pytester.makepyfile("def test_needs(fsdp_turbo_checkout):\n    pass\n")
    url = f"file://{tmp_path}/missing.git"
    result = pytester.runpytest("-rs", f"--fsdp-turbo-repo={url}", "--fsdp-turbo-ref=main")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines([f"*FSDPTurbo from {url}@main: git clone failed*"])
    strict = pytester.runpytest(f"--fsdp-turbo-repo={url}", "--fsdp-turbo-strict")
    strict.assert_outcomes(errors=1)
    strict.stdout.fnmatch_lines(["*--fsdp-turbo-strict: FSDPTurbo from*"])


def test_header_shows_a_resolved_checkout(pytester, tmp_path):
    repo = tmp_path / "FSDPTurbo"
    (repo / "fsdp_turbo").mkdir(parents=True)
    (repo / "fsdp_turbo" / "__init__.py").write_text("")
    pytester.makepyfile("def test_x(): pass")
    result = pytester.runpytest(f"--fsdp-turbo-path={repo}")
    result.stdout.fnmatch_lines([f"fsdp-turbo: FSDPTurbo {repo} @ ? (path {repo})"])


def test_engine_modules_ini_reaches_the_ranks(pytester, tmp_path):
    pytester.makeini(
        f"[pytest]\nfsdp_turbo_engine_modules =\n    broken_engines\nfsdp_turbo_cases = {REPO / 'e2e' / 'cases.toml'}\n"
    )
    pytester.makepyfile(
        f"""
        def test_run(ppo_run):
            result = ppo_run("tiny-qwen3-single-rank", backend="fsdp_off_by_one_sync",
                             pythonpath=[{str(REPO / "e2e")!r}])
            assert result.ok, result.failure_text()
        """
    )
    pytester.runpytest("--fsdp-turbo-device=cpu").assert_outcomes(passed=1)


def test_strict_under_xdist_fails_every_blocked_test_with_the_message(pytester, no_gpu_path):
    pytester.makepyfile(E2E_SUITE)
    result = pytester.runpytest_subprocess(
        "-n", "2", "-m", "gpu_e2e or npu_e2e", "--fsdp-turbo-strict"
    )
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(errors=2)
    result.stdout.fnmatch_lines(
        ["*--fsdp-turbo-strict: 2 e2e test(s) selected and none can run here*"]
    )
    assert "INTERNALERROR" not in result.stdout.str()


def test_every_fixture_in_the_fixtures_module_is_registered_through_the_plugin(pytester):
    from pytest_fsdp_turbo import fixtures

    defined = sorted(
        name
        for name, value in vars(fixtures).items()
        if type(value).__name__ == "FixtureFunctionDefinition"
    )
    assert "ppo_run" in defined and "accelerator" in defined
    result = pytester.runpytest("--fixtures", "-p", "no:cacheprovider")
    listed = {line.split()[0] for line in result.stdout.lines if line and not line[0].isspace()}
    missing = [name for name in defined if name not in listed]
    assert not missing, f"fixtures.py defines fixtures pytest does not see: {missing}"


@pytest.mark.parametrize(
    ("ini", "said"),
    [
        (
            "fsdp_turbo_stall_share = half",
            "ini fsdp_turbo_stall_share: expected a number in (0, 1]; got 'half'",
        ),
        (
            "fsdp_turbo_quiet_s = ten",
            "ini fsdp_turbo_quiet_s: expected a number in [0, 86400]; got 'ten'",
        ),
        (
            "fsdp_turbo_quiet_s = nan",
            "ini fsdp_turbo_quiet_s: expected a number in [0, 86400]; got 'nan'",
        ),
        (
            "fsdp_turbo_env_guard = maybe",
            "ini fsdp_turbo_env_guard: expected true or false (",
        ),
    ],
)
def test_a_bad_progress_ini_value_is_one_line_also_under_xdist(pytester, ini, said):
    pytester.makeini(f"[pytest]\n{ini}\n")
    pytester.makepyfile("def test_plain(): pass")
    xdist = [("-n", "2")] if "half" in ini else []  # was an INTERNALERROR there: once is enough
    for args in ((), *xdist):
        result = pytester.runpytest_subprocess("-p", "no:cacheprovider", *args)
        assert result.ret == pytest.ExitCode.USAGE_ERROR, args
        assert said in result.stderr.str()
        assert "INTERNALERROR" not in result.stdout.str() + result.stderr.str()


@pytest.mark.parametrize(
    ("variable", "value", "said"),
    [
        ("PYTEST_FSDP_TURBO_RAY_CONNECT_TIMEOUT_S", "1e10", "expected a number in (0, 86400]"),
        ("PYTEST_FSDP_TURBO_RAY_CONNECT_TIMEOUT_S", "nan", "expected a number in (0, 86400]"),
        (
            "PYTEST_FSDP_TURBO_DEVICE",
            "cpu:1000000000000",
            "expected a device count from 1 to 4096 after ':'",
        ),
    ],
)
def test_bad_numbers_in_variables_are_one_line_naming_the_variable(
    pytester, monkeypatch, variable, value, said
):
    monkeypatch.setenv(variable, value)
    pytester.makepyfile("def test_plain(): pass")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert f"{variable}: {said}; got {value!r}" in result.stderr.str()
    assert "Traceback" not in result.stderr.str()


@pytest.mark.parametrize("value", ["nan", "-5", "inf"])
def test_a_bad_collective_timeout_names_its_variable(value):
    from pytest_fsdp_turbo.environ import build_collective_env
    from pytest_fsdp_turbo_contract.errors import ConfigError

    with pytest.raises(
        ConfigError,
        match=rf"^PYTEST_FSDP_TURBO_COLLECTIVE_TIMEOUT_S: expected a number in \(0, 604800\]; got '{value}'",
    ):
        build_collective_env(
            "cpu",
            (0, 1),
            29555,
            world_size=2,
            user_env={"PYTEST_FSDP_TURBO_COLLECTIVE_TIMEOUT_S": value},
        )


def test_a_bad_stall_fault_duration_names_its_variable():
    from pytest_fsdp_turbo.settings import RunEnv
    from pytest_fsdp_turbo_contract.errors import ConfigError

    env = {"PYTEST_FSDP_TURBO_FAULT": "stall:0", "PYTEST_FSDP_TURBO_FAULT_STALL_S": "abc"}
    with pytest.raises(
        ConfigError,
        match=r"^PYTEST_FSDP_TURBO_FAULT_STALL_S: expected a number in \[0, 86400\]; got 'abc'",
    ):
        RunEnv.read(env, {}, 2)


def test_the_summary_row_names_the_test_its_overrides_and_the_first_cause(pytester, monkeypatch):
    repo = Path(__file__).resolve().parent.parent
    pytester.makepyfile(
        "from pytest_fsdp_turbo import checks\n"
        "def test_crashes(ppo_run):\n"
        "    checks.check_completed(ppo_run('tiny-qwen3-single-rank', micro_batches=1))\n"
    )
    monkeypatch.setenv("PYTEST_FSDP_TURBO_FAULT", "crash:0:train")
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--fsdp-turbo-device=cpu",
        f"--fsdp-turbo-cases={repo / 'e2e' / 'cases.toml'}",
    )  # fmt: skip
    result.assert_outcomes(failed=1)
    table = result.stdout.str().split("fsdp-turbo e2e runs")[1]
    row = next(line for line in table.splitlines() if line.startswith("test_crashes"))
    assert "tiny-qwen3-single-rank [micro_batches=1]" in row
    assert "failed: rank 0 train: InjectedFault" in row


def test_the_summary_verdict_says_what_the_checks_judged(pytester):
    """A run no check judged is "ran, unchecked", never "passed"; a failed check shows its letter
    and numbers in the verdict column; a check the test expects to fail says so."""
    repo = Path(__file__).resolve().parent.parent
    pytester.makepyfile(
        "import pytest\n"
        "from pytest_fsdp_turbo import checks\n"
        "CASE = 'tiny-qwen3-single-rank'\n"
        "def test_unchecked(ppo_run):\n"
        "    assert ppo_run(CASE).ok\n"
        "def test_checked(ppo_run):\n"
        "    checks.check_all(ppo_run(CASE))\n"
        "def test_over_budget(ppo_run):\n"
        "    checks.check_memory(ppo_run(CASE), budget_mb=1)\n"
        "def test_expects_red(ppo_run):\n"
        "    with pytest.raises(checks.CheckFailure):\n"
        "        checks.check_memory(ppo_run(CASE), budget_mb=1)\n"
    )
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--fsdp-turbo-device=cpu",
        f"--fsdp-turbo-cases={repo / 'e2e' / 'cases.toml'}",
    )  # fmt: skip
    result.assert_outcomes(passed=3, failed=1)
    table = result.stdout.str().split("fsdp-turbo e2e runs")[1].splitlines()
    rows = {line.split()[0]: line for line in table if line.startswith("test_")}
    assert "  ran, unchecked" in rows["test_unchecked"], rows
    # the checks the run was judged by, in the row; why the others could not apply, once below
    assert "  passed: a b c e f h i k l  " in rows["test_checked"] + "  ", rows
    assert rows["test_checked"].rstrip().endswith("  d, j"), rows
    below = [line for line in table if line.startswith("not applicable, ")]
    assert below == ["not applicable, d: no replicas", "not applicable, j: one rank"], table
    over = re.search(
        r"failed: f: rank 0: \S+ = ([\d.]+) MiB, budget 1 MiB", rows["test_over_budget"]
    )
    assert over and float(over.group(1)) > 1, rows["test_over_budget"]
    assert "passed (red as the test expects: f)" in rows["test_expects_red"], rows


KNOWN_FAILURES = """
[[case]]
id = "{id}"
model = "tiny-qwen3"
world_size = {ranks}

[case.known_failure.cpu]
reason = "the engine's bug, tracked upstream as #1"
match = "{match}"
"""


def test_a_known_failure_is_a_strict_expected_failure_that_must_fail_as_itself(pytester):
    """Case field known_failure: a crash known on a device kind runs (never a skip) as a strict
    expected failure, shown in the summary; red when it fails otherwise or starts passing. On two
    ranks the known crash on rank 0 stays expected: rank 1 only lost its peer (gloo's words)."""
    cases = "".join(
        KNOWN_FAILURES.format(id=case_id, match=match, ranks=ranks)
        for case_id, match, ranks in (
            ("as-known", "injected crash in rank 0 at phase train", 2),
            ("otherwise", "some other error", 1),
            ("now-passes", "injected crash", 1),
        )
    )
    pytester.makefile(".toml", cases=cases)
    pytester.makepyfile(
        "from pytest_fsdp_turbo import checks\n"
        "def test_run(fsdp_turbo_case, ppo_run):\n"
        "    crash = fsdp_turbo_case.case.id != 'now-passes'\n"
        "    env = {'PYTEST_FSDP_TURBO_FAULT': 'crash:0:train'} if crash else {}\n"
        "    checks.check_all(ppo_run(fsdp_turbo_case, extra_env=env))\n"
    )
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--fsdp-turbo-device=cpu", "--fsdp-turbo-cases=cases.toml", "-rxX"
    )  # fmt: skip
    result.assert_outcomes(xfailed=1, failed=2)
    out = result.stdout.str()
    assert "XFAIL test_a_known_failure" in out and "tracked upstream as #1" in out
    assert (
        "known failure expected ('some other error': the engine's bug, tracked upstream as" in out
    )
    assert "case otherwise: rank 0 failed first in phase train" in out
    assert "[XPASS(strict)] the engine's bug" in out
    table = out.split("fsdp-turbo e2e runs")[1]
    row = next(line for line in table.splitlines() if "[as-known-cpu]" in line)
    assert "xfailed: rank 0 train: InjectedFault" in row, row


def test_skipped_e2e_tests_list_their_reasons_once_each(pytester):
    """`pytest -m e2e` ending in "N skipped" says why, grouped, without -rs."""
    pytester.makefile(
        ".toml",
        cases='[[case]]\nid = "gpu-only"\nmodel = "tiny-qwen3"\nworld_size = 1\n'
        'devices = ["cuda"]\n[[case]]\nid = "npu-only"\nmodel = "tiny-qwen3"\n'
        'world_size = 1\ndevices = ["npu"]\n',
    )
    pytester.makepyfile("def test_run(fsdp_turbo_case, ppo_run):\n    ppo_run(fsdp_turbo_case)\n")
    result = pytester.runpytest("--fsdp-turbo-cases=cases.toml", "--fsdp-turbo-device=cpu")
    result.assert_outcomes(skipped=2)
    section = result.stdout.str().split("fsdp-turbo e2e skips")[1]
    lines = [line for line in section.splitlines() if " x " in line]
    assert len(lines) == 2 and all(line.startswith("1 x ") for line in lines), lines


def test_ini_keys_are_settings_validated_once_with_the_options(tmp_path):
    """Every ini key the plugin reads lands in the one Settings object, with the option-backed
    paths made absolute from the rootdir and the numbers bounded, naming the key when not."""
    from pytest_fsdp_turbo.settings import resolve
    from pytest_fsdp_turbo_contract.errors import ConfigError

    ini = {
        "fsdp_turbo_engine_modules": ["my_engines", " ", "more_engines "],
        "fsdp_turbo_stall_share": "0.25",
        "fsdp_turbo_quiet_s": "3",
        "fsdp_turbo_env_guard": False,
        "fsdp_turbo_cases": "e2e/mine.toml",
    }
    settings = resolve({}, env={}, ini=ini, rootdir=tmp_path)
    assert (settings.engine_modules, settings.stall_share, settings.quiet_s) == (
        ("my_engines", "more_engines"),
        0.25,
        3.0,
    )
    assert settings.env_guard is False and settings.cases == tmp_path / "e2e" / "mine.toml"
    given = resolve({"fsdp_turbo_cases": "other.toml"}, env={}, ini=ini, rootdir=tmp_path)
    assert given.cases == Path("other.toml")  # the option wins over the ini
    with pytest.raises(ConfigError, match=r"^ini fsdp_turbo_stall_share: expected a number in"):
        resolve({}, env={}, ini={**ini, "fsdp_turbo_stall_share": "0"}, rootdir=tmp_path)


def test_the_session_variables_a_run_hands_on_are_read_once_by_harness_env():
    """PYTHONPATH, verl's external modules and what a warm parent imports under are read by
    HarnessEnv, from the environment it is given; the rest of the plugin asks it."""
    from pytest_fsdp_turbo.settings import HarnessEnv

    env = {
        "PYTHONPATH": "/a:/b",
        "VERL_USE_EXTERNAL_MODULES": "mine,,plugin",
        "OMP_NUM_THREADS": "3",
    }
    harness = HarnessEnv.read(env)
    assert harness.pythonpath == "/a:/b"
    assert harness.verl_external_modules == ("mine", "plugin")
    assert harness.import_env["OMP_NUM_THREADS"] == "3"  # the user's, where set
    assert harness.import_env["HF_HUB_OFFLINE"] == "1"  # the harness's default, else
    bare = HarnessEnv.read({})
    assert (bare.pythonpath, bare.verl_external_modules) == ("", ())


def test_a_yes_no_variable_reads_false_as_no_and_a_folder_option_refuses_a_file(tmp_path):
    from pytest_fsdp_turbo.settings import HarnessEnv, resolve
    from pytest_fsdp_turbo_contract.errors import ConfigError

    for value, fork_off in (("false", False), ("0", False), ("", False), ("1", True), ("on", True)):
        assert HarnessEnv.read({"PYTEST_FSDP_TURBO_NO_FORK": value}).no_fork is fork_off, value
    with pytest.raises(ConfigError, match="PYTEST_FSDP_TURBO_NO_FORK: expected 1 or 0"):
        HarnessEnv.read({"PYTEST_FSDP_TURBO_NO_FORK": "maybe"})
    specs = tmp_path / "specs.json"
    specs.write_text("{}")
    with pytest.raises(ConfigError, match=f"expected a folder; got {specs}, a file"):
        resolve({"fsdp_turbo_tiny_models": str(specs)}, env={}, rootdir=tmp_path)


def test_a_runs_thread_count_and_interfaces_say_where_they_came_from():
    from pytest_fsdp_turbo.settings import RunEnv
    from pytest_fsdp_turbo_contract.errors import ConfigError

    run = RunEnv.read({"GLOO_SOCKET_IFNAME": "eth0,lo"}, {"OMP_NUM_THREADS": "4,2"}, 2)
    assert run.omp_threads == "4,2"
    assert run.gloo_origin == "environment GLOO_SOCKET_IFNAME"
    assert RunEnv.read({}, {"GLOO_SOCKET_IFNAME": "lo"}, 2).gloo_origin == (
        "ppo_run extra_env GLOO_SOCKET_IFNAME"
    )
    assert RunEnv.read({}, {}, 2).gloo_origin is None  # the collective profile's
    assert RunEnv.read({}, {}, 2).omp_threads is None  # the collective profile's share
    with pytest.raises(ConfigError, match=r"^environment OMP_NUM_THREADS: expected a positive"):
        RunEnv.read({"OMP_NUM_THREADS": "0"}, {}, 2)


def test_a_strict_kind_selection_with_no_case_of_that_kind_says_so(pytester):
    """`pytest -m npu_e2e --fsdp-turbo-strict` where no case lists npu: one line, not exit 5."""
    pytester.makefile(".toml", cases='[[case]]\nid = "c"\nmodel = "tiny-qwen3"\n')
    pytester.makepyfile("def test_t(fsdp_turbo_case, ppo_run):\n    ppo_run(fsdp_turbo_case)\n")
    args = ["--fsdp-turbo-cases=cases.toml", "-p", "no:cacheprovider", "-m", "npu_e2e"]
    result = pytester.runpytest(*args, "--fsdp-turbo-strict")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*selected no e2e test: no case of the case file lists npu*"])
    assert pytester.runpytest(*args).ret == pytest.ExitCode.NO_TESTS_COLLECTED  # not strict
