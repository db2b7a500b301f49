"""turbo_config generation per library layout, and validation against a checkout's schema
(torch-free here; the schema and module tree come from pytest_fsdp_turbo_engine/engines/turbo_inspect in a subprocess)."""

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest

from pytest_fsdp_turbo.cases import CaseBook, load_cases
from pytest_fsdp_turbo.devices import Accelerator
from pytest_fsdp_turbo.launching.request import RunRequest, rank_spec
from pytest_fsdp_turbo.turbo.library import inspect, torch_outside_range, torch_requirement
from pytest_fsdp_turbo_contract.errors import ConfigError
from pytest_fsdp_turbo_contract.turbo_config import (
    CORE_ATTENTION,
    FUNCTION_PATCHES,
    LEGACY,
    ModulePlan,
    build_turbo_config,
    detect_layout,
    pattern_matches,
    pattern_problems,
    schema_problems,
)

REPO = Path(__file__).resolve().parent.parent
STANDIN = REPO / "tests" / "standin_fsdp_turbo"
QWEN = "transformers.models.qwen3_5.modeling_qwen3_5"
TEXT_MODEL = ModulePlan(
    "Qwen3_5ForCausalLM", ("model.layers.{*}",), ("model.embed_tokens", "lm_head")
)
MODULE_PATCH = [
    {
        "target": f"{QWEN}.Qwen3_5Model.forward",
        "replacement": "fsdp_turbo.models.qwen.qwen3_5.qwen3_5_model_forward",
    }
]


@pytest.fixture
def book():
    return CaseBook(
        REPO / "e2e" / "cases.toml", {"ppo_step": load_cases(REPO / "e2e" / "cases.toml")}
    )


def test_npu_sp2_case_in_the_newest_layout(book):
    case = book.get("qwen3_5-2b-fsdp_turbo-fsdp4-sp2")
    config = build_turbo_config(case.engine, "npu", case.model, FUNCTION_PATCHES, TEXT_MODEL)
    assert config == {
        "distributed": {
            "fully_shard_parallel_size": 4,
            "ulysses_parallel_size": 2,
            "fsdp_plan": {
                "param_dtype": "bf16",
                "reduce_dtype": "fp32",
                "apply_modules": {"model.layers.{*}": {}, "model.embed_tokens": {}, "lm_head": {}},
                "hook_modules": ["model.layers.{*}"],
            },
            "cp_plan": {
                "ulysses_function_patches": [
                    {
                        "target_functions": [f"{QWEN}.eager_attention_forward"],
                        "type": "full_attention",
                    },
                    {
                        "target_functions": [f"{QWEN}.Qwen3_5GatedDeltaNet.forward"],
                        "type": "gated_delta_net",
                    },
                ],
                "loss_function_patches": [
                    {
                        "target_functions": ["transformers.loss.loss_utils.ForCausalLMLoss"],
                        "type": "causal_lm_loss",
                    }
                ],
            },
        },
        "module_patches": MODULE_PATCH,
    }


def test_middle_layout_refuses_sp_on_a_model_with_gated_delta_net_layers(book):
    """Its ulysses_attention_type has no gated-delta-net kind: 3 of 4 Qwen3.5 layers would run
    on each rank's chunk of the sequence, silently."""
    case = book.get("qwen3_5-2b-fsdp_turbo-fsdp4-sp2")
    with pytest.raises(
        ConfigError,
        match=r"core_attention config layout, which cannot shard qwen3_5 layers of type "
        r"gated_delta_net over the sequence",
    ):
        build_turbo_config(case.engine, "npu", case.model, CORE_ATTENTION, TEXT_MODEL)


def test_sp_on_the_legacy_layout_is_an_error(book):
    case = book.get("qwen3_5-2b-fsdp_turbo-fsdp4-sp2")
    with pytest.raises(
        ConfigError, match="legacy config layout, which has no Ulysses patch fields"
    ):
        build_turbo_config(case.engine, "npu", case.model, LEGACY, TEXT_MODEL)


def test_gpu_case_without_sp_has_no_patches(book):
    case = book.get("qwen3_5-0_8b-fsdp_turbo-fsdp8-vllm")
    config = build_turbo_config(case.engine, "cuda", case.model, FUNCTION_PATCHES, TEXT_MODEL)
    assert "cp_plan" not in config["distributed"] and "module_patches" not in config
    assert config["distributed"]["fully_shard_parallel_size"] == 8
    assert config["distributed"]["fsdp_plan"]["apply_modules"]


def test_module_plan_follows_the_class_actually_loaded(tmp_path):
    text = json.dumps(
        {
            "model_type": "qwen3_5_text",
            "vocab_size": 64,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 8,
            "layer_types": ["linear_attention", "full_attention"],
        }
    )
    (tmp_path / "config.json").write_text(text)
    plan = inspect(tmp_path, None).modules
    assert replace(plan, classes=(), functions=(), names=()) == ModulePlan(
        "Qwen3_5ForCausalLM", ("model.layers.{*}",), ("model.embed_tokens", "lm_head")
    )
    assert {"", "model.layers.0.linear_attn", "lm_head"} <= set(plan.names)  # for patterns
    # what the loaded model instantiates, for patch targets: the text model, not Qwen3_5Model
    assert {f"{QWEN}.Qwen3_5TextModel", f"{QWEN}.Qwen3_5GatedDeltaNet"} <= set(plan.classes)
    assert f"{QWEN}.Qwen3_5Model" not in plan.classes
    # and the module-level functions the patch sets name exist in this transformers
    assert dict(plan.functions) == {
        f"{QWEN}.eager_attention_forward": True,
        "transformers.loss.loss_utils.ForCausalLMLoss": True,
    }


@pytest.mark.parametrize(
    ("layout", "cp_fields"),
    [
        (FUNCTION_PATCHES, ["ulysses_function_patches", "loss_function_patches"]),
        (CORE_ATTENTION, ["ulysses_core_attention_function"]),
    ],
)
def test_layout_is_detected_from_the_checkout_dataclasses(layout, cp_fields):
    found = inspect(None, STANDIN / layout)
    assert found.layout == layout
    cp_plan = found.schema["distributed"]["fields"]["cp_plan"]["fields"]
    assert set(cp_fields) <= set(cp_plan)
    assert detect_layout({"distributed": {"fields": {"cp_plan": {"fields": {}}}}}) == LEGACY


def test_schema_problems_name_dropped_keys_and_missing_required_fields():
    schema = {
        "distributed": {
            "required": False,
            "fields": {
                "fsdp_plan": {
                    "required": False,
                    "fields": {"apply_modules": {"required": False, "fields": None}},
                },
                "seed": {"required": True, "fields": None},
            },
        }
    }
    config = {"distributed": {"fsdp_plan": {"hook_modules": ["x"]}, "ulysses_plan": {}}}
    assert schema_problems(schema, config) == [
        "turbo_config.distributed.fsdp_plan.hook_modules: not in the library's schema "
        "(known: apply_modules); its loader would drop it",
        "turbo_config.distributed.ulysses_plan: not in the library's schema "
        "(known: fsdp_plan, seed); its loader would drop it",
        "turbo_config.distributed.seed: required by the library, missing",
        "turbo_config.distributed.fsdp_plan.apply_modules: required by the library (None raises), "
        "missing",
    ]


DRIFTED = """
    from dataclasses import dataclass, field

    @dataclass
    class FSDPPlanConfig:
        apply_modules: dict = None
        param_dtype: str = None

    @dataclass
    class DistributedConfig:
        seed: int
        fully_shard_parallel_size: int = 1
        ulysses_parallel_size: int = 1
        fsdp_plan: FSDPPlanConfig = None
        launcher_token: str = field(default=None)

    @dataclass
    class FSDPTurboConfig:
        distributed: DistributedConfig = field(default_factory=lambda: None)
"""


def drifted_checkout(root: Path) -> Path:
    package = root / "fsdp_turbo"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(
        "raise ImportError('the package itself is never imported')\n"
    )
    (package / "fsdp_turbo_config.py").write_text(textwrap.dedent(DRIFTED))
    (root / "requirements.txt").write_text("torch>=2.0\n")
    return root


def test_config_verb_prints_the_config_and_flags_drift(tmp_path, monkeypatch):
    models = tmp_path / "models"
    models.mkdir()
    tiny = (
        subprocess.run(
            [
                sys.executable,
                "-c",
                "from pytest_fsdp_turbo.models import build_tiny_model; print(build_tiny_model('tiny-qwen3_5'))",
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    (models / "Qwen3.5-0.8B").symlink_to(tiny)
    env = {
        "PYTEST_FSDP_TURBO_MODELS": str(models),
        "FSDP_TURBO_PATH": str(STANDIN / FUNCTION_PATCHES),
    }
    cli = str(Path(sys.executable).parent / "pytest-fsdp-turbo")
    argv = [cli, "config", "qwen3_5-0_8b-fsdp_turbo-fsdp8-vllm"]
    good = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, env={**os.environ, **env})
    assert good.returncode == 0, good.stderr
    printed = json.loads(good.stdout)
    assert printed["distributed"]["fsdp_plan"]["apply_modules"] == {  # what verl's runs list
        "model.language_model.layers.{*}": {},
        "model.language_model.embed_tokens": {},
        "lm_head": {},
        "model.visual.blocks.{*}": {},
        "model.visual.patch_embed": {},
        "model.visual.pos_embed": {},
        "model.visual.merger": {},
    }
    env["FSDP_TURBO_PATH"] = str(drifted_checkout(tmp_path / "drifted"))
    bad = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, env={**os.environ, **env})
    assert bad.returncode == 1
    lines = bad.stderr.strip().splitlines()
    assert (
        "turbo_config.distributed.fsdp_plan.reduce_dtype: not in the library's schema" in lines[0]
    )
    assert any(
        line.startswith("turbo_config.distributed.fsdp_plan.hook_modules: not in") for line in lines
    )
    assert "turbo_config.distributed.seed: required by the library, missing" in lines


def test_spec_carries_the_config_the_run_path_made(book, tmp_path):
    case = replace(book.get("qwen3_5-2b-fsdp_turbo-fsdp4-sp2"), model="tiny-qwen3_5")
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen3_5_text"}')
    config = build_turbo_config(case.engine, "npu", case.model, FUNCTION_PATCHES, TEXT_MODEL)
    request = RunRequest(
        case, model, tmp_path, Accelerator("npu", tuple(range(8))), turbo_config=config
    )
    engine = rank_spec(request).engine
    assert engine.turbo_config == config
    assert engine.sp_size == 2 and engine.fsdp_size == 4


def test_every_input_a_rank_reads_is_in_its_spec(book, tmp_path, monkeypatch):
    """The variables the user sets are read here, validated, and handed over in spec.json."""
    from pytest_fsdp_turbo.turbo.checkout import Checkout
    from pytest_fsdp_turbo_contract.errors import ConfigError
    from pytest_fsdp_turbo_contract.faults import FaultSpec

    single = book.get("tiny-qwen3-single-rank")
    case = replace(single, engine=replace(single.engine, world_size=2))
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen3"}')
    monkeypatch.setenv("PYTEST_FSDP_TURBO_VLLM_MEMORY", "0.5")
    monkeypatch.setenv("PYTEST_FSDP_TURBO_COLLECTIVE_TIMEOUT_S", "30")
    checkout = Checkout(tmp_path / "FSDPTurbo", "abc", "path")
    request = RunRequest(
        case,
        model,
        tmp_path,
        Accelerator("cpu", (0, 1)),
        checkout=checkout,
        extra_env={
            "PYTEST_FSDP_TURBO_FAULT": "stall:1:train",
            "PYTEST_FSDP_TURBO_FAULT_STALL_S": "2",
        },
    )
    spec = rank_spec(request)
    assert spec.ppo.vllm_memory_share == 0.5 and spec.collective_timeout_s == 30.0
    assert spec.fault == FaultSpec("stall", 1, "train", 2.0)
    assert spec.engine.turbo_checkout == str(tmp_path / "FSDPTurbo")
    monkeypatch.setenv("PYTEST_FSDP_TURBO_VLLM_MEMORY", "2")
    with pytest.raises(ConfigError, match=r"^PYTEST_FSDP_TURBO_VLLM_MEMORY: expected a number in"):
        rank_spec(request)


def test_contradiction_between_case_and_turbo_config_is_an_error(book):
    case = book.get("qwen3_5-2b-fsdp_turbo-fsdp4-sp2")
    bad = replace(case.engine, turbo_config={"distributed": {"ulysses_parallel_size": 4}})
    with pytest.raises(
        ConfigError, match=r"turbo_config.distributed.ulysses_parallel_size: the case says 2"
    ):
        build_turbo_config(bad, "npu", case.model)


def test_sp_without_known_patches_is_an_error(book):
    case = replace(book.get("qwen3_5-2b-fsdp_turbo-fsdp4-sp2"), model="Llama-3-8B")
    with pytest.raises(
        ConfigError, match="needs Ulysses patches, and none are known for model 'Llama-3-8B'"
    ):
        build_turbo_config(case.engine, "npu", case.model)


def test_torch_outside_the_library_range_is_one_line(tmp_path):
    # the stand-in declares the library's own range, as strict as the library
    assert torch_requirement(STANDIN / FUNCTION_PATCHES) == (">=2.9,<2.12", "the checkout")
    (tmp_path / "requirements.txt").write_text("torch>=2.9,<2.12\n")
    line = torch_outside_range(tmp_path)
    from importlib import metadata

    assert line == (
        f"fsdp_turbo supports torch >=2.9,<2.12; installed torch {metadata.version('torch')} "
        "(from the checkout)"
    )


TYPO_CASE = """
[[case]]
id = "tiny-turbo-typo"
model = "tiny-qwen3_5"
backend = "fsdp_turbo"
world_size = 2
fsdp_size = 2
devices = ["npu"]

[case.turbo_config.distributed.fsdp_plan]
not_a_field = 1
"""


def test_config_verb_checks_without_a_checkout_and_refuses_a_path_that_is_not_one(
    tmp_path, monkeypatch, capsys
):
    """No checkout: the published schema of the layout it emits names every unknown key (exit 1);
    a checkout path that is not one is an error (exit 2), never a quiet fallback."""
    from pytest_fsdp_turbo.cli import main

    cases = tmp_path / "cases.toml"
    cases.write_text(TYPO_CASE)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # no cached clone either
    monkeypatch.delenv("FSDP_TURBO_PATH", raising=False)
    argv = ["config", "tiny-turbo-typo", "--cases", str(cases), "--device", "npu"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "turbo_config.distributed.fsdp_plan.not_a_field: not in the library's schema" in err
    monkeypatch.setenv("FSDP_TURBO_PATH", str(tmp_path / "nonexistent"))
    assert main(argv) == 2
    assert f"--fsdp-turbo-path {tmp_path / 'nonexistent'}: no fsdp_turbo/__init__.py" in (
        capsys.readouterr().err
    )


def test_published_schema_names_unknown_keys_per_layout():
    from pytest_fsdp_turbo.turbo.schema import published_schema

    config = {"distributed": {"fsdp_plan": {"apply_modules": {"x": {}}, "not_a_field": 1}}}
    problems = schema_problems(published_schema(FUNCTION_PATCHES), config)
    assert problems == [
        "turbo_config.distributed.fsdp_plan.not_a_field: not in the library's schema (known: "
        + ", ".join(
            sorted(
                published_schema(FUNCTION_PATCHES)["distributed"]["fields"]["fsdp_plan"]["fields"]
            )
        )
        + "); its loader would drop it"
    ]
    middle = {
        "distributed": {
            "fsdp_plan": {"apply_modules": {}},
            "cp_plan": {"ulysses_function_patches": []},
        }
    }
    assert any(
        "cp_plan.ulysses_function_patches: not in" in p
        for p in schema_problems(published_schema(CORE_ATTENTION), middle)
    )
    assert not schema_problems(published_schema(FUNCTION_PATCHES), middle)


def test_an_inspection_is_paid_once_per_model_checkout_and_versions(tmp_path, monkeypatch):
    """The subprocess that imports torch runs once; the next process asking reads the answer."""
    import pytest_fsdp_turbo.turbo.library as library

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    checkout = STANDIN / FUNCTION_PATCHES
    library.inspect.cache_clear()
    first = library.inspect(None, checkout)
    assert first.layout == FUNCTION_PATCHES
    stored = list((tmp_path / "cache" / "pytest-fsdp-turbo" / "inspections").glob("*.json"))
    assert len(stored) == 1

    def no_subprocess(*args):
        raise AssertionError("inspected again although the answer was cached")

    monkeypatch.setattr(library, "_inspect_now", no_subprocess)
    library.inspect.cache_clear()  # as a new process would start
    assert library.inspect(None, checkout) == first
    other = drifted_checkout(tmp_path / "drifted")  # other source: another key, inspected anew
    library.inspect.cache_clear()
    with pytest.raises(AssertionError, match="inspected again"):
        library.inspect(None, other)
    library.inspect.cache_clear()


def test_list_entries_and_values_the_library_refuses_are_named_one_per_line(book):
    from pytest_fsdp_turbo_contract.turbo_config import entry_problems

    config = {
        "module_patches": [
            {"target": f"{QWEN}.Qwen3_5Model.forward", "replacement": "pkg:function"},
            {"target": "x.y"},
        ],
        "distributed": {
            "fsdp_plan": {"apply_modules": {}},
            "cp_plan": {
                "ulysses_function_patches": [
                    {"target_functions": [f"{QWEN}.eager_attention_forward"], "type": "full"},
                    {"target_functions": "not-a-list", "type": "gated_delta_net"},
                    {"target_functions": ["a.b"], "type": "full_attention", "extra": 1},
                ],
                "ulysses_attention_type": "gated_delta_net",
            },
        },
    }
    assert entry_problems(config) == [
        "turbo_config.distributed.fsdp_plan.apply_modules: empty; the library needs at least one "
        "module-name pattern that matches the model",
        "turbo_config.module_patches[0].replacement: expected a dotted path; got 'pkg:function'",
        "turbo_config.module_patches[1]: expected exactly the keys target and replacement",
        "turbo_config.distributed.cp_plan.ulysses_function_patches[0].type: 'full' is not one the "
        "library knows (full_attention, gated_delta_net, compressor_full_attention_transposed)",
        "turbo_config.distributed.cp_plan.ulysses_function_patches[1].target_functions: expected "
        "a list of dotted paths",
        "turbo_config.distributed.cp_plan.ulysses_function_patches[2]: expected exactly the keys "
        "target_functions and type",
        "turbo_config.distributed.cp_plan.ulysses_attention_type: 'gated_delta_net'; the library "
        "takes default, with_compressor or a callable",
    ]
    case = book.get("qwen3_5-2b-fsdp_turbo-fsdp4-sp2")
    good = build_turbo_config(case.engine, "npu", case.model, FUNCTION_PATCHES, TEXT_MODEL)
    assert entry_problems(good) == []  # what the adapter emits passes its own rules


def test_patch_targets_must_match_a_module_of_the_loaded_model(book):
    from pytest_fsdp_turbo_contract.turbo_config import resolved_targets, target_problems

    case = book.get("qwen3_5-2b-fsdp_turbo-fsdp4-sp2")
    text = replace(
        TEXT_MODEL,
        classes=tuple(
            f"{QWEN}.{c}"
            for c in ("Qwen3_5ForCausalLM", "Qwen3_5TextModel", "Qwen3_5GatedDeltaNet")
        ),
    )
    config = build_turbo_config(case.engine, "npu", case.model, FUNCTION_PATCHES, text)
    assert target_problems(config, text) == [
        f"turbo_config.module_patches[0].target: {QWEN}.Qwen3_5Model.forward matches nothing in "
        "the model the engine loads (Qwen3_5ForCausalLM has no Qwen3_5Model module)"
    ]
    with_vision = replace(text, classes=(*text.classes, f"{QWEN}.Qwen3_5Model"))
    assert target_problems(config, with_vision) == []
    assert resolved_targets(config, with_vision) == [
        f"{QWEN}.Qwen3_5Model.forward",
        f"{QWEN}.Qwen3_5GatedDeltaNet.forward",
    ]
    loss = "transformers.loss.loss_utils.ForCausalLMLoss"
    renamed = replace(
        with_vision, functions=((f"{QWEN}.eager_attention_forward", False), (loss, True))
    )
    assert target_problems(config, renamed) == [
        "turbo_config.distributed.cp_plan.ulysses_function_patches[0][0]: "
        f"{QWEN}.eager_attention_forward does not exist in the installed transformers; the "
        "patch would have nothing to replace"
    ]
    assert loss in resolved_targets(config, renamed)


def _config_verb_on_the_npu_sp2_case(models: Path, capsys) -> tuple[int, list[str]]:
    from pytest_fsdp_turbo.cli import main

    argv = ["config", "qwen3_5-2b-fsdp_turbo-fsdp4-sp2", "--device", "npu"]
    argv += ["--fsdp-turbo-models", str(models)]
    capsys.readouterr()  # what building the model printed
    code = main([*argv, "--fsdp-turbo-path", str(STANDIN / FUNCTION_PATCHES)])
    return code, capsys.readouterr().err.strip().splitlines()


def test_config_verb_resolves_every_patch_target_of_the_npu_sp2_case_in_the_loaded_model(
    tmp_path, monkeypatch, capsys
):
    """The tiny Qwen3.5 is vision-language like the real checkpoints, and the engine loads it as
    verl does (Qwen3_5ForConditionalGeneration): every patch target and module pattern of the NPU
    SP2 case resolves in that model, and the verb lists each target."""
    from pytest_fsdp_turbo.models import build_tiny_model

    (tmp_path / "Qwen3.5-2B").symlink_to(build_tiny_model("tiny-qwen3_5"))
    monkeypatch.delenv("PYTEST_FSDP_TURBO_MODELS", raising=False)
    code, err = _config_verb_on_the_npu_sp2_case(tmp_path, capsys)
    assert code == 0, err
    where = "resolves in Qwen3_5ForConditionalGeneration"
    assert err == [
        f"note: patch target {QWEN}.Qwen3_5Model.forward {where}",
        f"note: patch target {QWEN}.eager_attention_forward {where}",
        f"note: patch target {QWEN}.Qwen3_5GatedDeltaNet.forward {where}",
        f"note: patch target transformers.loss.loss_utils.ForCausalLMLoss {where}",
    ]


def test_config_verb_refuses_a_module_patch_the_loaded_model_lacks(tmp_path, monkeypatch, capsys):
    """A text-only Qwen3.5 checkpoint loads as Qwen3_5ForCausalLM around a Qwen3_5TextModel: the
    library's Qwen3_5Model.forward patch would raise in FSDPTurbo.__init__ on the first NPU run.
    The harness says so before launch, from the real (tiny, meta) model."""
    from pytest_fsdp_turbo.models import FIXTURES_DIR, build_tiny_model

    qwen3_5 = json.loads((FIXTURES_DIR / "models" / "tiny-qwen3_5.json").read_text())
    text_only = {"model_type": "qwen3_5_text", "config": qwen3_5["config"]["text_config"]}
    (tmp_path / "fixtures" / "models").mkdir(parents=True)
    (tmp_path / "fixtures" / "models" / "text-only.json").write_text(json.dumps(text_only))
    (tmp_path / "models").mkdir()
    built = build_tiny_model("text-only", tmp_path / "cache", tmp_path / "fixtures" / "models")
    (tmp_path / "models" / "Qwen3.5-2B").symlink_to(built)
    monkeypatch.delenv("PYTEST_FSDP_TURBO_MODELS", raising=False)
    code, err = _config_verb_on_the_npu_sp2_case(tmp_path / "models", capsys)
    assert code == 1
    assert err == [
        f"turbo_config.module_patches[0].target: {QWEN}.Qwen3_5Model.forward matches nothing in "
        "the model the engine loads (Qwen3_5ForCausalLM has no Qwen3_5Model module)"
    ]


def test_a_module_pattern_that_matches_nothing_is_refused_by_name():
    modules = ModulePlan(
        "M", ("model.layers.{*}",), names=("", "model", "model.layers", "model.layers.0", "lm_head")
    )
    config = {
        "distributed": {
            "fsdp_plan": {
                "apply_modules": {"model.layers.{*}": {}, "model.layer.{*}": {}, "lm_head": {}},
                "hook_modules": ["model.layers.{0-1}", "model.layers.{2-9}"],
            }
        }
    }
    assert pattern_problems(config, modules) == [
        "turbo_config.distributed.fsdp_plan.apply_modules: pattern 'model.layer.{*}' matches no "
        "module of the model the engine loads (M)",
        "turbo_config.distributed.fsdp_plan.hook_modules: pattern 'model.layers.{2-9}' matches no "
        "module of the model the engine loads (M)",
    ]
    assert pattern_matches("*", "") and pattern_matches("model.?ayers.0", "model.layers.0")


def test_the_model_is_loaded_with_the_attention_the_ulysses_patch_targets(book):
    from pytest_fsdp_turbo_contract.turbo_config import attention_implementation

    sp2 = book.get("qwen3_5-2b-fsdp_turbo-fsdp4-sp2")
    assert (
        attention_implementation(build_turbo_config(sp2.engine, "npu", sp2.model, FUNCTION_PATCHES))
        == "eager"
    )
    no_sp = replace(sp2, engine=replace(sp2.engine, world_size=4, sp_size=1))
    assert (
        attention_implementation(
            build_turbo_config(no_sp.engine, "npu", no_sp.model, FUNCTION_PATCHES)
        )
        is None
    )
    middle = {
        "distributed": {
            "ulysses_parallel_size": 2,
            "cp_plan": {"ulysses_core_attention_function": f"{QWEN}.eager_attention_forward"},
        }
    }
    assert attention_implementation(middle) == "eager"


def test_config_verb_reads_the_rootdir_ini_case_file_as_run_does(tmp_path, monkeypatch, capsys):
    from pytest_fsdp_turbo.cli import main

    (tmp_path / "mine.toml").write_text(TYPO_CASE)
    (tmp_path / "pytest.ini").write_text("[pytest]\nfsdp_turbo_cases = mine.toml\n")
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")  # the rootdir is found upwards, as pytest finds it
    monkeypatch.delenv("FSDP_TURBO_PATH", raising=False)
    assert main(["config", "tiny-turbo-typo", "--device", "npu"]) == 1  # found, then checked
    assert "fsdp_plan.not_a_field: not in the library's schema" in capsys.readouterr().err


def test_outside_its_torch_range_the_library_is_unavailable_and_a_stand_in_warns(tmp_path):
    """The gate every case built on the library passes: a checkout whose torch range excludes the
    installed torch is unavailable (a skip, or red under strict), naming both; a stand-in runs,
    warning that the run is no evidence for the library on this torch."""
    from pytest_fsdp_turbo.turbo.checkout import Checkout
    from pytest_fsdp_turbo.turbo.library import StandInOutsideTorchRange, torch_gate
    from pytest_fsdp_turbo_contract.errors import Unavailable

    (tmp_path / "requirements.txt").write_text("torch<1\n")
    with pytest.raises(Unavailable, match=r"^case c: fsdp_turbo supports torch <1; installed"):
        torch_gate("c", Checkout(tmp_path, "abc", "path"))
    with pytest.warns(
        StandInOutsideTorchRange, match=r"running on the stand-in x anyway: no evidence"
    ):
        torch_gate("c", Checkout(tmp_path, None, "stand-in x", stand_in=True))
    (tmp_path / "requirements.txt").write_text("torch>=1\n")
    torch_gate("c", Checkout(tmp_path, "abc", "path"))  # inside: nothing to say
