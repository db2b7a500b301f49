"""The settings the two FSDP-Turbo migration runs need, generated from their cases."""

from dataclasses import replace
from pathlib import Path

import pytest

from pytest_fsdp_turbo.cases import CaseBook, load_cases
from pytest_fsdp_turbo.devices import Accelerator
from pytest_fsdp_turbo.errors import ConfigError
from pytest_fsdp_turbo.runs import RunRequest, worker_spec
from pytest_fsdp_turbo.turbo_config import build_turbo_config

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def book():
    return CaseBook(REPO / "e2e" / "cases.toml", load_cases(REPO / "e2e" / "cases.toml"))


def test_qwen3_5_2b_npu_fsdp4_sp2(book):
    case = book.get("qwen3_5-2b-fsdp_turbo-fsdp4-sp2")
    assert build_turbo_config(case, "npu") == {
        "distributed": {
            "fully_shard_parallel_size": 4,
            "ulysses_parallel_size": 2,
            "fsdp_plan": {"param_dtype": "bf16", "reduce_dtype": "fp32"},
            "ulysses_plan": {
                "patches": ["qwen3_5.attention", "qwen3_5.gated_delta_net", "causal_lm_loss"],
                "module_patches": ["qwen3_5.model_forward"],
            },
        }
    }


def test_qwen3_5_0_8b_gpu_fsdp8(book):
    case = book.get("qwen3_5-0_8b-fsdp_turbo-fsdp8-vllm")
    assert build_turbo_config(case, "cuda") == {
        "distributed": {
            "fully_shard_parallel_size": 8,
            "ulysses_parallel_size": 1,
            "fsdp_plan": {"param_dtype": "bf16", "reduce_dtype": "fp32"},
        }
    }
    assert case.rollout == "vllm" and case.world_size == 8


def test_spec_carries_the_generated_config(book, tmp_path):
    case = replace(book.get("qwen3_5-2b-fsdp_turbo-fsdp4-sp2"), model="tiny-qwen3_5")
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen3_5_text"}')
    spec = worker_spec(RunRequest(case, model, tmp_path, Accelerator("npu", tuple(range(8)))))
    assert spec["engine"]["turbo_config"]["distributed"]["ulysses_parallel_size"] == 2
    assert spec["engine"]["sp_size"] == 2 and spec["engine"]["fsdp_size"] == 4


def test_contradiction_between_case_and_turbo_config_is_an_error(book):
    case = book.get("qwen3_5-2b-fsdp_turbo-fsdp4-sp2")
    bad = replace(case, turbo_config={"distributed": {"ulysses_parallel_size": 4}})
    with pytest.raises(
        ConfigError, match=r"turbo_config.distributed.ulysses_parallel_size: the case says 2"
    ):
        build_turbo_config(bad, "npu")


def test_sp_without_known_patches_is_an_error(book):
    case = replace(book.get("qwen3_5-2b-fsdp_turbo-fsdp4-sp2"), model="Llama-3-8B")
    with pytest.raises(
        ConfigError, match="needs Ulysses patches, and none are known for model 'Llama-3-8B'"
    ):
        build_turbo_config(case, "npu")
