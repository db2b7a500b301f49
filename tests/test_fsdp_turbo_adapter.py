"""What can be tested of the fsdp_turbo backend without the library: selection, errors, config keys."""

from dataclasses import dataclass, field

import pytest

pytest.importorskip("torch")

from pytest_fsdp_turbo_engine import registry  # noqa: E402
from pytest_fsdp_turbo_engine.fsdp_turbo_engine import (  # noqa: E402
    CHECKOUT_VAR,
    import_fsdp_turbo,
    unknown_config_keys,
)


@dataclass
class FsdpPlan:
    param_dtype: str = "bf16"
    reduce_dtype: str = "fp32"


@dataclass
class Distributed:
    fully_shard_parallel_size: int = 1
    ulysses_parallel_size: int = 1
    fsdp_plan: FsdpPlan = field(default_factory=FsdpPlan)


@dataclass
class TurboConfig:
    distributed: Distributed = field(default_factory=Distributed)
    recompute: bool = False


def test_unknown_keys_are_listed_with_their_path():
    given = {
        "distributed": {
            "fully_shard_parallel_size": 4,
            "ulysses_size": 2,
            "fsdp_plan": {"param_dtype": "bf16", "reduce_dtyp": "fp32"},
        },
        "recompute": True,
        "offload": True,
    }
    assert unknown_config_keys(TurboConfig, given) == [
        "distributed.ulysses_size",
        "distributed.fsdp_plan.reduce_dtyp",
        "offload",
    ]
    assert unknown_config_keys(TurboConfig, {"distributed": {"ulysses_parallel_size": 2}}) == []


def test_missing_library_error_names_checkout_and_pythonpath(monkeypatch):
    monkeypatch.setenv(CHECKOUT_VAR, "/cache/FSDPTurbo-abc")
    monkeypatch.setenv("PYTHONPATH", "/cache/FSDPTurbo-abc")
    with pytest.raises(ImportError) as info:
        import_fsdp_turbo()
    message = str(info.value)
    assert "backend fsdp_turbo needs the fsdp_turbo library" in message
    assert "tried checkout /cache/FSDPTurbo-abc" in message
    assert "PYTHONPATH='/cache/FSDPTurbo-abc'" in message


def test_turbo_backend_is_registered_for_accelerators_only():
    engine = registry.lookup("qwen3_5_text", "fsdp_turbo", "npu")
    assert engine.__name__ == "FSDPTurboEngineWithLMHead"
    assert registry.lookup("qwen3_5_text", "fsdp_turbo", "cuda") is engine
    with pytest.raises(registry.RegistryError, match="backend='fsdp_turbo', device='cpu'"):
        registry.lookup("qwen3_5_text", "fsdp_turbo", "cpu")


def test_turbo_case_skips_without_checkout_and_fails_under_strict(pytester, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    pytester.makefile(
        ".toml",
        cases='[[case]]\nid = "turbo"\nmodel = "tiny-qwen3"\nbackend = "fsdp_turbo"\n'
        'world_size = 1\ndevices = ["npu"]\n',
    )
    pytester.makepyfile("def test_run(fsdp_turbo_case, ppo_run):\n    ppo_run(fsdp_turbo_case)\n")
    url = f"file://{tmp_path}/no-FSDPTurbo.git"
    args = [
        "-rs",
        "--fsdp-turbo-cases=cases.toml",
        "--fsdp-turbo-device=npu:1",
        f"--fsdp-turbo-repo={url}",
    ]
    result = pytester.runpytest(*args)
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines([f"*FSDPTurbo from {url}@HEAD: git clone failed*"])


def test_vllm_rollout_case_skips_without_vllm(pytester):
    pytester.makefile(
        ".toml",
        cases='[[case]]\nid = "vl"\nmodel = "tiny-qwen3"\nrollout = "vllm"\nworld_size = 1\n',
    )
    pytester.makepyfile("def test_run(fsdp_turbo_case, ppo_run):\n    ppo_run(fsdp_turbo_case)\n")
    result = pytester.runpytest("-rs", "--fsdp-turbo-cases=cases.toml", "--fsdp-turbo-device=cpu")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(
        ["*case vl: rollout vllm needs vllm (or vllm-ascend); not importable here*"]
    )


def test_verl_case_skips_without_verl_and_fails_under_strict(pytester, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "verl" else real(name, *a)
    )
    pytester.makefile(
        ".toml",
        cases='[[case]]\nid = "v"\nmodel = "tiny-qwen3"\nbackend = "verl:fsdp2"\nworld_size = 1\n',
    )
    pytester.makepyfile("def test_run(fsdp_turbo_case, ppo_run):\n    ppo_run(fsdp_turbo_case)\n")
    args = ["-rs", "--fsdp-turbo-cases=cases.toml", "--fsdp-turbo-device=cpu"]
    result = pytester.runpytest(*args)
    result.assert_outcomes(skipped=1)
    reason = "*case v: backend verl:fsdp2 needs verl, which is not importable here*"
    result.stdout.fnmatch_lines([reason])
    strict = pytester.runpytest(*args, "--fsdp-turbo-strict")
    strict.assert_outcomes(failed=1)
    strict.stdout.fnmatch_lines(["*--fsdp-turbo-strict: case v: backend verl:fsdp2 needs verl*"])


def test_vllm_adapter_import_error_is_clear():
    from pytest_fsdp_turbo_engine.vllm_rollout import _import_vllm

    with pytest.raises(
        ImportError, match=r"rollout 'vllm' needs vllm \(CUDA\) or vllm-ascend \(NPU\)"
    ):
        _import_vllm()
