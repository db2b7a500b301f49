"""The case-kind seam: a third kind, added in one module (toy_kind.py), goes through collection
(its table, its parameter, its marks, strict pre-flight), the summary table and the verdict of its
own check set, as the two built-in kinds do."""

from __future__ import annotations

import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from pytest_fsdp_turbo.cases.table import ReadContext
from pytest_fsdp_turbo.kinds.registry import case_kinds, register_kind
from pytest_fsdp_turbo_contract.errors import ConfigError

TOY = Path(__file__).with_name("toy_kind.py")
CASES = """
[[toy_case]]
id = "toy-even"

[[toy_case]]
id = "toy-skewed"
skew = 0.5
"""
TEST = """
from pytest_fsdp_turbo import checks

def test_toy(toy_case, fsdp_turbo_run):
    result = fsdp_turbo_run(toy_case)
    checks.check_completed(result)
    checks.check_all(result)
"""


def _project(pytester: pytest.Pytester, cases: str = CASES) -> None:
    pytester.makepyfile(toy_kind=TOY.read_text(), test_toy=TEST)
    pytester.makeconftest("import toy_kind  # registers the toy kind and its check set\n")
    pytester.path.joinpath("cases.toml").write_text(textwrap.dedent(cases))


def test_a_toy_kind_in_one_module_runs_through_collection_summary_and_verdict(pytester):
    _project(pytester)
    junit = pytester.path / "junit.xml"
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--fsdp-turbo-cases=cases.toml", "-m", "cpu_e2e",
        f"--junitxml={junit}", "-rf",
    )  # fmt: skip
    result.assert_outcomes(passed=1, failed=1)
    text = result.stdout.str()
    assert "FAILED test_toy.py::test_toy[toy-skewed-cpu]" in text
    assert "test_toy[toy-even-cpu]" not in text.split("short test summary info")[-1]
    assert "check z: the ranks' gradient norms differ: [1.0, 1.5]" in text
    table = text[text.index("fsdp-turbo e2e runs") :]
    rows = [line for line in table.splitlines() if line.startswith("test_toy")]
    assert len(rows) == 2 and all("toy-" in row for row in rows), table
    assert any("toy-skewed" in row and "check z" in row for row in rows), table
    cases = {c.get("name"): c for c in ET.parse(junit).getroot().iter("testcase")}
    assert set(cases) == {"test_toy[toy-even-cpu]", "test_toy[toy-skewed-cpu]"}
    assert cases["test_toy[toy-skewed-cpu]"].find("failure") is not None
    assert cases["test_toy[toy-even-cpu]"].find("failure") is None
    # strict pre-flight asks the toy kind what this machine lacks (nothing), then runs both
    strict = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--fsdp-turbo-cases=cases.toml", "--fsdp-turbo-strict"
    )  # fmt: skip
    strict.assert_outcomes(passed=1, failed=1)


def test_a_toy_case_file_error_is_one_line_naming_the_kind_and_field(pytester):
    _project(pytester, '[[toy_case]]\nid = "t"\nworld_size = 9\n')
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--fsdp-turbo-cases=cases.toml", "--collect-only"
    )
    assert result.ret != 0
    assert "toy case 't': field 'world_size': expected an integer from 1 to 8; got 9" in (
        result.stdout.str() + result.stderr.str()
    )


def test_a_kind_may_not_take_another_kinds_table_or_parameter():
    ppo = next(kind for kind in case_kinds() if kind.name == "ppo_step")

    class Imposter:
        name, table, fixture = "imposter", ppo.table, "imposter_case"

        def read(self, data: dict, path: Path, context: ReadContext) -> list:
            return []

    with pytest.raises(ConfigError, match="its table 'case' is case kind 'ppo_step''s already"):
        register_kind(Imposter())  # type: ignore[arg-type]
