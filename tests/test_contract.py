"""The rank contract: one torch-free module, and types that write exactly the files runs wrote."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_fsdp_turbo_contract.artifacts import RunFolder
from pytest_fsdp_turbo_contract.records import (
    STARTUP,
    TIMING_PREFIX,
    LossRecord,
    OptimizerRecord,
    RankRecord,
    Reading,
    ReferenceRecord,
    RolloutRecord,
    StepMetrics,
    TrainRecord,
)
from pytest_fsdp_turbo_contract.results import RankError
from pytest_fsdp_turbo_contract.spec import RankSpec
from pytest_fsdp_turbo_contract.vocab import DeviceKind

REPO = Path(__file__).resolve().parents[1]


def metric_keys() -> list[str]:
    return [key for kind in StepMetrics.RECORDS.values() for key in kind.metric_keys()]


def test_metric_keys_are_derived_unique_and_named_as_the_training_world_names_them():
    values = metric_keys()
    assert len(values) == len(set(values)), values  # one field writes each key
    assert all(re.fullmatch(r"rank|[a-z_]+(/[a-z0-9_]+)+", v) for v in values), values
    # derived from the record's namespace and the field, unless the field names another
    assert OptimizerRecord.key("grad_norm") == "actor/grad_norm"
    assert OptimizerRecord.key("grad_norm_measured") == "sync/grad_norm_measured"
    assert RolloutRecord.key("score_mean") == "critic/score/mean"  # verl's spelling, declared
    with pytest.raises(KeyError):
        OptimizerRecord.key("grad_nrom")


def test_a_step_of_several_updates_takes_each_field_as_its_record_declares():
    first = TrainRecord(
        reduce_scatter_calls=5, loss_grad_max_rel_err=1e-7, grad_sketch={"w": [1.0]}
    )
    later = TrainRecord(
        reduce_scatter_calls=9, loss_grad_max_rel_err=float("nan"), grad_sketch={"w": [2.0]}
    )
    merged = TrainRecord.over_updates([first, later])
    assert merged.reduce_scatter_calls == 5  # the first, on-policy update's
    assert merged.loss_grad_max_rel_err == float("inf")  # the worst, NaN counted as infinite
    assert merged.grad_sketch == {"w": [1.0], "w (update 2)": [2.0]}
    references = [
        ReferenceRecord(grad_max_rel_err=1e-6, grad_max_rel_err_param="a", grad_rel_l2_err=3e-7),
        ReferenceRecord(grad_max_rel_err=2e-6, grad_max_rel_err_param="b", grad_rel_l2_err=1e-7),
    ]
    worst = ReferenceRecord.over_updates(references)
    assert (worst.grad_max_rel_err, worst.grad_max_rel_err_param) == (2e-6, "b")
    assert worst.grad_rel_l2_err == 3e-7
    losses = [
        LossRecord(loss=1.0, pg_clipfrac=0.0),
        LossRecord(loss=2.0, pg_clipfrac=0.5, ppo_kl=0.1),
    ]
    last = LossRecord.over_updates(losses)
    assert (last.loss, last.pg_clipfrac_last_update, last.ppo_kl_last_update) == (1.0, 0.5, 0.1)


def test_a_record_nothing_was_measured_in_is_not_written():
    """Partial metrics hold the phases that ran; a completed record writes its not-applicable
    fields as null, so a reader tells 'not applicable' from 'never measured'."""
    step = StepMetrics(rank=RankRecord(rank=0, device="cpu"), timings={"load": 1.5})
    written = step.to_json()
    assert written["rank/device"] == "cpu" and written["rank/replicas"] is None
    assert "actor/grad_norm" not in written and written[TIMING_PREFIX + "load"] == 1.5
    assert StepMetrics.from_json(written) == step


@pytest.mark.parametrize(
    "module",
    [
        "vocab",
        "spec",
        "records",
        "results",
        "artifacts",
        "warm_protocol",
        "turbo_config",
        "engines",
    ],
)
def test_the_shared_modules_import_no_torch(module):
    code = f"import sys, pytest_fsdp_turbo_contract.{module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.cpu_e2e
def test_a_real_runs_files_read_back_into_the_types_unchanged(ppo_run):
    """What the ranks wrote (spec.json, rankN.metrics.json) round-trips through the contract's
    types key for key, so goldens, junit and older artifacts stay readable."""
    result = ppo_run("tiny-llama-fsdp2-deferred")
    assert result.ok, result.failure_text()
    folder = RunFolder(result.artifacts_dir)
    written = json.loads(folder.spec.read_text())
    spec = RankSpec.from_json(written)
    engine = {**written["engine"], "capabilities": tuple(written["engine"]["capabilities"])}
    tuples = {"engine_modules": tuple(written["engine_modules"]), "engine": engine}
    assert spec.to_json() == {**written, **tuples}
    assert spec.engine.world_size == 2 and spec.device_kind is DeviceKind.CPU
    for rank in result.ranks:
        on_disk = json.loads(folder.metrics(rank.rank).read_text())
        step = rank.step  # the typed view of what the rank wrote
        assert step.to_json() == on_disk
        assert step.rank.rank == rank.rank and step.reference.measured()
        assert step.optimizer.grad_norm == on_disk[OptimizerRecord.key("grad_norm")]
        assert step.post_step.post_step_logprob_max_abs_diff is None  # not a twin
        assert STARTUP in step.timings


def test_a_rank_error_file_reads_back_or_is_none_when_unreadable(tmp_path):
    error = RankError(1, "train", "RuntimeError", "boom", "Traceback ...", 12.5)
    path = tmp_path / "rank1.error.json"
    path.write_text(json.dumps(error.to_json()))
    assert RankError.from_json(json.loads(path.read_text())) == error
    assert RankError.from_json({"rank": 1}) is None  # half a file: no fields to report
    assert RankError.from_json(None) is None


def test_a_twenty_megabyte_exception_message_is_cut_in_the_failure(tmp_path):
    """The head line names the cause; it never prints a message whole when it is megabytes."""
    from pytest_fsdp_turbo_contract.results import MESSAGE_CHARS, RankError, RankResult, RunResult

    huge = "x" * 20_000_000
    error = RankError(0, "train", "RuntimeError", huge, f"Traceback\nRuntimeError: {huge}")
    log = tmp_path / "rank0.log"
    log.write_text("started\n")
    result = RunResult(
        "c", 1, [RankResult(0, 1, 1.0, log, error=error)], tmp_path, 1.0, first_failure=0
    )
    text = result.failure_text()
    head = text.splitlines()[0]
    assert head.startswith("case c: rank 0 failed first in phase train: RuntimeError: xxx")
    assert head.endswith(f"(... {len(huge) - MESSAGE_CHARS} characters cut)")
    assert len(text) < 20_000


def test_a_rank_that_cannot_write_its_report_says_why_through_its_exit_code(tmp_path, monkeypatch):
    """On a full disk the rank's error report cannot be written: it exits with 64 + errno, and the
    failure reads "No space left on device" instead of a bare exit 1."""
    import errno
    import os

    from pytest_fsdp_turbo.cases import load_cases
    from pytest_fsdp_turbo_contract.results import UNWRITABLE_REPORT, RankResult
    from pytest_fsdp_turbo_engine import faults, worker

    case = next(
        c for c in load_cases(REPO / "e2e" / "cases.toml") if c.id == "tiny-qwen3-single-rank"
    )
    spec_path = tmp_path / "spec.json"
    case.rank_spec("cpu", model_path=str(tmp_path), model_type="qwen3").write(spec_path)
    monkeypatch.setenv("RANK", "0")
    for name in ("TRANSFORMERS_VERBOSITY", "HF_HUB_OFFLINE", "HF_HUB_DISABLE_PROGRESS_BARS"):
        monkeypatch.setenv(name, "1")  # the worker sets them for itself; put back after

    def full(path, payload):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def failing_fault(spec):
        raise RuntimeError("the step failed")

    def exit_now(code):
        raise SystemExit(code)

    monkeypatch.setattr(worker.faulthandler, "register", lambda *args, **kwargs: None)
    monkeypatch.setattr(worker, "_write_json", full)
    monkeypatch.setattr(faults.Fault, "of", staticmethod(failing_fault))
    monkeypatch.setattr(os, "_exit", exit_now)
    with pytest.raises(SystemExit) as ended:
        worker.main([str(spec_path)])
    assert ended.value.code == UNWRITABLE_REPORT + errno.ENOSPC
    rank = RankResult(0, ended.value.code, 1.0, tmp_path / "rank0.log")
    assert rank.ending() == (
        f"exited {UNWRITABLE_REPORT + errno.ENOSPC}: it could not write its report to its folder "
        "(No space left on device)"
    )


def test_the_contract_reads_no_environment_variable():
    """Settings are read in the plugin's settings module (docs/environment.md); what a rank needs
    reaches it in its spec. The contract, shared by both sides, never looks at the environment."""
    import pytest_fsdp_turbo_contract

    package = Path(pytest_fsdp_turbo_contract.__file__).parent
    reads = re.compile(r"os\.environ|os\.getenv|environ\.get")
    readers = [p.name for p in package.glob("*.py") if reads.search(p.read_text())]
    assert readers == [], readers


def test_a_reading_is_an_attribute_path_that_knows_its_key_and_phase():
    """The checks name what they read by attribute (mypy checks the path), and a missing reading's
    message still names its metric key and the phase that writes it."""
    norm = Reading(lambda m: m.optimizer.grad_norm)
    rows = Reading(lambda m: m.rollout.response_length_mean)  # a key spelled verl's way
    assert (norm.key, norm.record, norm.name) == ("actor/grad_norm", OptimizerRecord, "grad_norm")
    assert rows.key == "response_length/mean" and rows.record.PHASE == "rollout"
    step = StepMetrics.from_json({"actor/grad_norm": 0.5})
    assert norm.of(step) == 0.5 and rows.of(step) is None
    # a reader that computes is refused: its key would name whichever field it touched first
    for computes in (
        lambda m: m.loss.loss or m.loss.ppo_kl,
        lambda m: abs(m.loss.loss),
        lambda m: m.loss,
        lambda m: m.timings["train"],
    ):
        with pytest.raises(TypeError, match=r"reads one field, as `lambda m: m.<record>.<field>`"):
            Reading(computes)


def test_the_step_reads_its_environment_in_rank_env_alone():
    """A rank's step reads what it is asked from its spec; where it sits in the group and when it
    was launched, from RankEnv (pytest_fsdp_turbo_engine/rank_env.py), the one reader."""
    engine = REPO / "pytest_fsdp_turbo_engine"
    reads = re.compile(r"os\.environ\.get|os\.environ\[|os\.getenv|in os\.environ")
    modules = [*sorted((engine / "step").glob("*.py")), engine / "worker.py"]
    assert [p.name for p in modules if reads.search(p.read_text())] == []
    assert "RankEnv.read()" in (engine / "worker.py").read_text()
    from pytest_fsdp_turbo_engine.rank_env import RankEnv

    launched = {"RANK": "3", "LOCAL_RANK": "1", "PYTEST_FSDP_TURBO_LAUNCHED_AT": "12.5"}
    assert RankEnv.read(launched) == RankEnv(rank=3, local_rank=1, launched_at=12.5)
    assert RankEnv.read({"RANK": "2"}) == RankEnv(rank=2, local_rank=2, launched_at=None)


# A read of a named variable: os.environ's, an environment mapping's (`env`, `user_env`, ...),
# another process's, or an expansion; a write is not a read, nor an environment handed on whole
NAMED_READ = re.compile(
    r"getenv|expandvars|environ\(\)\.get|\benviron\.get|\bin os\.environ(?![.\w])"
    r"|\benviron\[[^\]]+\](?!\s*=[^=])|\b\w*env\.get\(|\b\w*env\[[^\]]+\](?!\s*=[^=])"
    r"|\bin \w*env\b(?![.\w(])"
)
# Where the plugin reads variables: the settings, with the options' table (detection's too:
# DetectionEnv); the collective profile, which yields to any of its variables the run's
# environment sets; reaping, which finds what a case started by the token in its environment;
# and a trainer case's overrides, whose $HOME and ${VAR} are expanded as the script's shell did
# (its world size counted so at collection, its config resolved so for `config`).
PLUGIN_READERS = {
    "settings.py",
    "options.py",
    "environ.py",
    "processes/reaping.py",  # a process carrying the case token, found when reaping
    "cases/trainer_case.py",
    "trainer/verl_config.py",
}
# Where the rank side does, besides rank_env.py: a warm fork applies the environment a rank starts
# with (its PYTHONPATH and thread count, as a fresh interpreter would); our FSDP-Turbo engine holds
# WORLD_SIZE, which the library reads, to the process group; the trainer's entry, its observer and
# the CPU platform run inside verl's own processes, which verl and Ray start (the entry expands
# the overrides as the script's shell did).
ENGINE_READERS = {
    "rank_env.py",
    "warm/fork.py",
    "engines/turbo.py",
    "trainer/main.py",
    "trainer/observer.py",
    "verl_cpu_platform.py",
}


def named_readers(package: Path) -> set[str]:
    return {
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if NAMED_READ.search(path.read_text())
    }


def test_every_variable_is_read_where_docs_environment_says():
    """The plugin reads its variables in settings.py alone (Settings, HarnessEnv, RunEnv,
    DetectionEnv); other modules get what they need from those, or an environment handed on."""
    assert named_readers(REPO / "pytest_fsdp_turbo") == PLUGIN_READERS
    assert named_readers(REPO / "pytest_fsdp_turbo_engine") == ENGINE_READERS
    assert named_readers(REPO / "pytest_fsdp_turbo_contract") == set()
    assert NAMED_READ.search('os.environ["X"] = "1"') is None
    assert NAMED_READ.search('x = os.environ["X"]') and NAMED_READ.search('env.get("X")')
    assert NAMED_READ.search("{k: v for k, v in os.environ.items()}") is None  # handed on whole
    for read in ("if name in user_env:", "proc.environ().get(X)", "expandvars(o)", "getenv(X)"):
        assert NAMED_READ.search(read), read


def plugin_imports() -> dict[str, set[str]]:
    """Each plugin module -> the plugin modules it imports, anywhere in it (inside functions and
    under TYPE_CHECKING too): what a circle would run through."""
    import ast

    root = REPO / "pytest_fsdp_turbo"
    names = {
        ".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"): p
        for p in root.rglob("*.py")
    }
    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found |= {f"{node.module}.{a.name}" for a in node.names} | {node.module}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
        graph[name] = {m for m in found if m in names and m != name}
    return graph


def test_the_plugin_has_floors_no_circle_and_no_module_over_400_lines():
    """The import-linter layers (pyproject.toml) keep each floor below the ones that use it; this
    holds what they cannot see: no circle anywhere, not even through a package's own modules."""
    graph = plugin_imports()
    state: dict[str, int] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for nxt in graph[module]:
            if state.get(nxt) == 1:
                raise AssertionError("import circle: " + " -> ".join([*path, module, nxt]))
            if nxt not in state:
                visit(nxt, [*path, module])
        state[module] = 2

    for module in graph:
        if module not in state:
            visit(module, [])
    long = {
        str(p.relative_to(REPO)): n
        for p in (REPO / "pytest_fsdp_turbo").rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 400
    }
    assert not long, long
