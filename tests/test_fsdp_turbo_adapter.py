"""What can be tested of the fsdp_turbo backend without the library: selection, errors, config keys."""

import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest

pytest.importorskip("torch")

from pytest_fsdp_turbo_engine.engines import registry  # noqa: E402
from pytest_fsdp_turbo_engine.engines.turbo import (  # noqa: E402
    FSDPTurboAPIChanged,
    import_fsdp_turbo,
    reset_parallel_state,
)
from pytest_fsdp_turbo_engine.engines.turbo_inspect import schema_of  # noqa: E402

STANDIN = Path(__file__).parent / "standin_fsdp_turbo"


@dataclass
class FsdpPlan:
    apply_modules: dict = None


@dataclass
class Distributed:
    seed: int
    fsdp_plan: FsdpPlan | None = None


@dataclass
class TurboConfig:
    distributed: Distributed = field(default_factory=lambda: Distributed(0))


def test_schema_of_follows_nested_and_optional_dataclasses():
    assert schema_of(TurboConfig) == {
        "distributed": {
            "required": False,
            "fields": {
                "seed": {"required": True, "fields": None},
                "fsdp_plan": {
                    "required": False,
                    "fields": {"apply_modules": {"required": False, "fields": None}},
                },
            },
        }
    }


def test_parallel_state_reset_drops_the_singleton_and_names_a_changed_api():
    sys.path.insert(0, str(STANDIN))
    try:
        from fsdp_turbo_standin_core import Singleton
    finally:
        sys.path.remove(str(STANDIN))

    class State(metaclass=Singleton):
        pass

    module = type("parallel_state", (), {"ParallelState": State})
    first = State()
    assert State() is first
    reset_parallel_state(module)
    assert State() is not first
    module.ParallelState = type("Plain", (), {})
    with pytest.raises(FSDPTurboAPIChanged, match="_instances"):
        reset_parallel_state(module)


def test_standin_refuses_a_cpu_box_unless_allowed(monkeypatch):
    sys.path.insert(0, str(STANDIN))
    try:
        from fsdp_turbo_standin_core import ALLOW_CPU_VAR, get_accelerator_name
    finally:
        sys.path.remove(str(STANDIN))
    monkeypatch.delenv(ALLOW_CPU_VAR, raising=False)
    with pytest.raises(RuntimeError, match=r"No available accelerator \(NPU/CUDA\)"):
        get_accelerator_name()
    monkeypatch.setenv(ALLOW_CPU_VAR, "1")
    assert get_accelerator_name() == "cpu"


def test_config_drift_fails_the_case_before_any_rank_starts(pytester, tmp_path):
    checkout = tmp_path / "FSDPTurbo"
    (checkout / "fsdp_turbo").mkdir(parents=True)
    (checkout / "fsdp_turbo" / "__init__.py").write_text("")
    (checkout / "requirements.txt").write_text("torch>=2.0\n")
    (checkout / "fsdp_turbo" / "fsdp_turbo_config.py").write_text(
        textwrap.dedent(
            """
            from dataclasses import dataclass, field

            @dataclass
            class FSDPPlanConfig:
                apply_modules: dict = None

            @dataclass
            class DistributedConfig:
                fully_shard_parallel_size: int = 1
                ulysses_parallel_size: int = 1
                fsdp_plan: FSDPPlanConfig = None

            @dataclass
            class FSDPTurboConfig:
                distributed: DistributedConfig = field(default_factory=DistributedConfig)
            """
        )
    )
    pytester.makefile(
        ".toml",
        cases='[[case]]\nid = "turbo"\nmodel = "tiny-qwen3_5"\nbackend = "fsdp_turbo"\n'
        'world_size = 2\ndevices = ["npu"]\n',
    )
    pytester.makepyfile("def test_run(fsdp_turbo_case, ppo_run):\n    ppo_run(fsdp_turbo_case)\n")
    result = pytester.runpytest(
        "--fsdp-turbo-cases=cases.toml",
        "--fsdp-turbo-device=npu:2",
        f"--fsdp-turbo-path={checkout}",
        f"--fsdp-turbo-artifacts={tmp_path / 'artifacts'}",
    )
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*turbo_config does not fit the FSDPTurbo checkout:*",
            "*turbo_config.distributed.fsdp_plan.param_dtype: not in the library's schema*",
            "*turbo_config.distributed.fsdp_plan.hook_modules: not in the library's schema*",
        ]
    )
    assert not list((tmp_path / "artifacts").rglob("rank*.log"))  # no rank was started


def test_missing_library_error_names_checkout_and_pythonpath(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/cache/FSDPTurbo-abc")
    with pytest.raises(ImportError) as info:
        import_fsdp_turbo("/cache/FSDPTurbo-abc")  # the checkout the rank's spec names
    message = str(info.value)
    assert "backend fsdp_turbo needs the fsdp_turbo library" in message
    assert "tried checkout /cache/FSDPTurbo-abc" in message
    assert "PYTHONPATH='/cache/FSDPTurbo-abc'" in message


def test_turbo_backend_is_registered_everywhere_and_the_library_decides():
    """cpu too: the library itself refuses a CPU box (the stand-in reproduces that)."""
    engine = registry.lookup("qwen3_5", "fsdp_turbo", "npu")
    assert engine.__name__ == "FSDPTurboEngineWithLMHead"
    for kind in ("cuda", "cpu"):
        assert registry.lookup("qwen3_5", "fsdp_turbo", kind) is engine


def test_turbo_case_skips_without_checkout_and_fails_under_strict(pytester, tmp_path, monkeypatch):
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
        ["*case vl: rollout vllm needs vllm, which is not importable here*"]
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
    reason = (
        "*case v: backend verl:fsdp2 needs verl, which is not importable here: pip install "
        "'pytest-fsdp-turbo?verl?' (verl 0.9.1 needs transformers >= 5.5.3, < 5.11; installed: "
        "torch *, transformers *)"
    )
    result.stdout.fnmatch_lines([reason])
    # strict: the pre-flight at collection refuses the session before any case starts
    strict = pytester.runpytest(*args, "--fsdp-turbo-strict")
    assert strict.ret == pytest.ExitCode.USAGE_ERROR
    strict.stderr.fnmatch_lines(
        [
            "*--fsdp-turbo-strict pre-flight: 1 selected case(s) would skip here:",
            "*v-cpu: backend verl:fsdp2 needs verl: pip install 'pytest-fsdp-turbo?verl?' (verl 0.9.1*",
        ]
    )


def test_strict_preflight_names_a_missing_model_folder_before_any_case_starts(pytester, tmp_path):
    pytester.makefile(
        ".toml",
        cases='[[case]]\nid = "real"\nmodel = "Qwen3.5-2B"\nworld_size = 1\n',
    )
    pytester.makepyfile("def test_run(fsdp_turbo_case, ppo_run):\n    ppo_run(fsdp_turbo_case)\n")
    args = ["--fsdp-turbo-cases=cases.toml", "--fsdp-turbo-device=cpu", "--fsdp-turbo-strict"]
    strict = pytester.runpytest(*args, f"--fsdp-turbo-models={tmp_path}", "--collect-only")
    assert strict.ret == pytest.ExitCode.USAGE_ERROR
    strict.stderr.fnmatch_lines(
        [f"*real-cpu: model directory {tmp_path}/Qwen3.5-2B does not exist"]
    )


def test_vllm_adapter_import_error_is_clear():
    from pytest_fsdp_turbo_engine.rollout.vllm_rollout import _import_vllm

    with pytest.raises(
        ImportError, match=r"rollout 'vllm' needs vllm \(CUDA\) or vllm-ascend \(NPU\)"
    ):
        _import_vllm()


class RecordingLLM:
    """A stand-in for vLLM's LLM object (tests only): records which weight-push API was used."""

    def __init__(self, *apis: str):
        self.calls: list[tuple] = []
        for api in apis:
            setattr(self, api, getattr(self, f"_{api}"))

    def _collective_rpc(self, method, args=()):
        self.calls.append(("collective_rpc", method, [name for name, _ in args[0]]))

    def _apply_model(self, func):
        model = type(
            "M",
            (),
            {
                "load_weights": lambda _, weights: self.calls.append(
                    ("apply_model", [name for name, _ in weights])
                )
            },
        )()
        func(model)


def test_vllm_weight_push_uses_the_supported_api_the_release_offers():
    import torch

    from pytest_fsdp_turbo_engine.rollout.vllm_rollout import push_weights

    weights = {"lm_head.weight": torch.zeros(2)}
    both = RecordingLLM("collective_rpc", "apply_model")
    assert push_weights(both, weights, via_extension=True) == "collective_rpc"
    assert both.calls == [("collective_rpc", "load_trainer_weights", ["lm_head.weight"])]
    assert push_weights(both, weights, via_extension=False) == "apply_model"
    older = RecordingLLM("apply_model")
    assert push_weights(older, weights, via_extension=True) == "apply_model"
    with pytest.raises(RuntimeError, match="offers neither collective_rpc .* nor apply_model"):
        push_weights(RecordingLLM(), weights, via_extension=True)


def test_ulysses_patches_are_lifted_around_unsharded_models_and_restored(tmp_path, monkeypatch):
    """The library replaces the functions cp_plan names in place (every model of the class sees
    them): the harness swaps in the originals its wrappers keep in __wrapped__, only with SP."""
    import functools
    import sys

    from pytest_fsdp_turbo_engine.engines.ulysses_lift import (
        CannotLiftPatch,
        library_patches_lifted,
    )

    (tmp_path / "lift_target.py").write_text(
        "def attention(x):\n    return 'whole'\n\nclass Layer:\n    def forward(self):\n"
        "        return 'whole'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import lift_target

    def sharded(fn):
        @functools.wraps(fn)
        def wrapper(*args):
            return "sharded"

        return wrapper

    monkeypatch.setattr(lift_target, "attention", sharded(lift_target.attention))
    monkeypatch.setattr(lift_target.Layer, "forward", sharded(lift_target.Layer.forward))
    entries = [
        {"target_functions": ["lift_target.attention"], "type": "full_attention"},
        {"target_functions": ["lift_target.Layer.forward"], "type": "gated_delta_net"},
    ]
    config = {"distributed": {"ulysses_parallel_size": 2, "cp_plan": {}}}
    config["distributed"]["cp_plan"]["ulysses_function_patches"] = entries
    with library_patches_lifted(config):
        assert lift_target.attention(1) == lift_target.Layer().forward() == "whole"
    assert lift_target.attention(1) == lift_target.Layer().forward() == "sharded"
    config["distributed"]["ulysses_parallel_size"] = 1
    with library_patches_lifted(config):  # no SP: nothing is lifted
        assert lift_target.attention(1) == "sharded"
    config["distributed"]["ulysses_parallel_size"] = 2
    monkeypatch.setattr(lift_target, "attention", lambda x: "sharded, no __wrapped__")
    lifting = library_patches_lifted(config)
    with pytest.raises(CannotLiftPatch, match="lift_target.attention has no __wrapped__"):
        lifting.__enter__()
    assert lift_target.Layer().forward() == "sharded"  # what was swapped before the error is back
    sys.modules.pop("lift_target", None)
