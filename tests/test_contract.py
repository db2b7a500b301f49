"""The rank contract: one torch-free module, and types that write exactly the files runs wrote."""

import json
import re
import subprocess
import sys
from dataclasses import fields

import pytest

from pytest_fsdp_turbo_contract.artifacts import RunFolder
from pytest_fsdp_turbo_contract.records import Metric, StepMetrics
from pytest_fsdp_turbo_contract.results import RankError
from pytest_fsdp_turbo_contract.spec import RankSpec
from pytest_fsdp_turbo_contract.vocab import DeviceKind


def metric_keys() -> list[str]:
    return [v for k, v in vars(Metric).items() if k.isupper() and not k.endswith("_PREFIX")]


def test_metric_keys_are_unique_and_named_as_the_training_world_names_them():
    values = metric_keys()
    assert len(values) == len(set(values))
    assert all(re.fullmatch(r"[a-z_]+(/[a-z0-9_]+)+", v) for v in values), values
    assert json.dumps({Metric.ACTOR_GRAD_NORM: 1.0}) == f'{{"{Metric.ACTOR_GRAD_NORM}": 1.0}}'


def test_every_metric_key_has_exactly_one_record_field_that_writes_it():
    owners = [f.metadata["key"] for kind in StepMetrics.RECORDS.values() for f in fields(kind)]
    assert len(owners) == len(set(owners)), owners
    # start-up is a phase timing (timing_s/<phase>), the rest belong to a record
    assert set(metric_keys()) - set(owners) == {Metric.TIMING_S_STARTUP}


@pytest.mark.parametrize(
    "module", ["vocab", "spec", "records", "results", "artifacts", "warm_protocol", "turbo_config"]
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
    assert spec.to_json() == {**written, "engine_modules": tuple(written["engine_modules"])}
    assert spec.engine.world_size == 2 and spec.device_kind is DeviceKind.CPU
    for rank in result.ranks:
        on_disk = json.loads(folder.metrics(rank.rank).read_text())
        step = rank.step  # the typed view of what the rank wrote
        assert step is not None and step.to_json() == on_disk
        assert step.case.rank == rank.rank and step.reference is not None
        assert step.optimizer.grad_norm == on_disk[Metric.ACTOR_GRAD_NORM]
        assert step.post_step.twin_post_step_logprob_max_abs_diff is None  # not a twin


def test_a_rank_error_file_reads_back_or_is_none_when_unreadable(tmp_path):
    error = RankError(1, "train", "RuntimeError", "boom", "Traceback ...", 12.5)
    path = tmp_path / "rank1.error.json"
    path.write_text(json.dumps(error.to_json()))
    assert RankError.from_json(json.loads(path.read_text())) == error
    assert RankError.from_json({"rank": 1}) is None  # half a file: no fields to report
    assert RankError.from_json(None) is None
