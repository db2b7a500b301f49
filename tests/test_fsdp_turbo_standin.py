"""The FSDP-Turbo adapter wired end to end on CPU, against the STAND-IN fsdp_turbo library in
tests/standin_fsdp_turbo (a test double reproducing the library's observable contract, not the
library, never evidence about hardware), for the newest and the middle config layout."""

import json
import os
from pathlib import Path

import pytest

from pytest_fsdp_turbo import checks
from pytest_fsdp_turbo.turbo.checkout import Checkout
from pytest_fsdp_turbo_contract.records import TrainRecord

STANDIN = Path(__file__).parent / "standin_fsdp_turbo"
ALLOW_CPU = {"FSDP_TURBO_STANDIN_ALLOW_CPU": "1"}  # the stand-in, like the library, refuses CPU
LAYOUTS = ("function_patches", "core_attention")


def standin(layout: str) -> Checkout:
    return Checkout(
        STANDIN / layout, None, f"stand-in fsdp_turbo ({layout} layout), tests only", stand_in=True
    )


@pytest.mark.devices(2)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fsdp_turbo_backend_passes_every_check_on_the_standin(ppo_run, layout):
    result = ppo_run(
        "tiny-qwen3_5-fsdp2-deferred",
        backend="fsdp_turbo",
        checkout=standin(layout),
        extra_env=ALLOW_CPU,
    )
    assert checks.check_all(result).not_applicable() == ["d: no replicas"]
    config = result.spec().engine.turbo_config
    plan = config["distributed"]["fsdp_plan"]
    assert plan["apply_modules"] == {
        "model.language_model.layers.{*}": {},
        "model.visual.blocks.{*}": {},
        "model.language_model.embed_tokens": {},
        "lm_head": {},
        "model.visual.patch_embed": {},
        "model.visual.pos_embed": {},
        "model.visual.merger": {},
    }
    assert plan["hook_modules"] == ["model.language_model.layers.{*}"]
    # the units that ran on a text batch: 4 decoder layers, embeddings, LM head and the root
    # (norm); the vision tower's units never run forward, so they reduce-scatter nothing
    assert result.metrics[TrainRecord.key("fsdp_units")] == 7
    assert result.metrics[TrainRecord.key("reduce_scatter_calls_by_micro_batch")] == [0, 7]


@pytest.mark.devices(2)
@pytest.mark.verl
def test_verl_fsdp_turbo_engine_on_the_standin_keeps_deferred_sync(ppo_run):
    """verl's own FSDPTurboEngineWithLMHead, the class the seed changed, as verl ships it
    (ppo_run skips it, with the reason, where verl is not installed)."""
    result = ppo_run(
        "tiny-qwen3-verl-fsdp2-deferred",
        backend="verl:fsdp_turbo",
        checkout=standin("function_patches"),  # verl's adapter calls the newest layout's getters
        extra_env=ALLOW_CPU,
        # verl's FSDP-Turbo engine keeps verl's default bf16 autocast (it skips the FSDP builder
        # that would set it from mixed_precision), so it is checked as the bf16 engine it is
        dtype="bf16",
        # its log-probs are bf16: the case's clip range (0.01) would be crossed by rounding
        clip_ratio=0.2,
    )
    checks.check_all(result)  # h included: deferred, [0, units], unsharded gradients retained
    units = result.metrics[TrainRecord.key("fsdp_units")]
    assert result.metrics[TrainRecord.key("reduce_scatter_calls_by_micro_batch")] == [0, units]
    assert result.metrics[TrainRecord.key("retained_grad_bytes")] > 0


def test_standin_follows_the_librarys_matching_patching_and_loading_rules():
    """Each rule as the library's source has it (FACTS-fsdp_turbo.md, "Matching rules"): the
    stand-in refuses what the library refuses and accepts what it accepts."""
    from pytest_fsdp_turbo.processes.warm import run_module

    probe = Path(__file__).parent / "standin_fsdp_turbo"
    done = run_module("contract_probe", [], timeout_s=120, env={"PYTHONPATH": str(probe)})
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {
        "one_pattern_matching_is_enough": ["layers.0", "layers.1"],  # the other matches nothing
        "none_matching_raises": "RuntimeError: [FSDP2] No module named ['not.there'] (test)",
        "star_is_any_text": ["layers.0", "layers.0.proj", "layers.1", "layers.1.proj"],
        "range": ["layers.1"],
        "class_absent": 0,  # FSDPTurbo raises "Configured module patch did not match the model"
        "member_absent": "AttributeError: 'Block' object has no attribute 'nowhere'",
        "class_present": 2,  # one per instance
        "instances_patched": True,
        "class_untouched": True,
        "colon_refused": "ValueError: module_patches entry needs a dotted replacement; got "
        "{'target': 'a.b', 'replacement': 'pkg:fn'}",
        "coerced": ["true", 2],  # the loader coerces int and float, never bool
        "not_a_number_kept": "two",  # kept as the string, with a warning
    }


@pytest.mark.devices(2)
def test_standin_ulysses_shards_the_sequence_and_matches_the_whole_sequence(tmp_path):
    """The stand-in's Ulysses (fsdp_turbo_standin_ulysses.py, a test double, not the library): its
    wrappers (full_attention on transformers' eager attention, gated_delta_net on
    Qwen3_5GatedDeltaNet.forward) over gloo, on the tiny Qwen3.5's layers: with the sequence split
    over two ranks, outputs, input gradients and summed parameter gradients equal the
    whole-sequence layer at fp32 precision; unpatched, each rank's chunk runs sequence-local and
    all three differ (the bug a patch that misses the layer would hide on a real run)."""
    from pytest_fsdp_turbo.processes.warm import run_module

    path = os.pathsep.join([str(STANDIN), str(STANDIN / "function_patches")])
    env = {**ALLOW_CPU, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, "WORLD_SIZE": "2"}
    done = run_module("ulysses_probe", [str(tmp_path / "store")], timeout_s=180, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    for layer in ("gated_delta_net", "full_attention"):
        assert found[f"{layer}/params_with_grad"], layer
        for what in ("output", "input_grad", "param_grad"):
            assert found[f"{layer}/{what}"] <= 1e-5, (layer, what, found)
            assert found[f"{layer}_unpatched/{what}"] > 1e-3, (layer, what, found)
    # the whole model through FSDPTurbo with the SP config the harness generates for Qwen3.5:
    # each rank computes its half of the sequence, and together they are the unsharded step
    assert found["model/local_logits_shape"] == [2, 6, 64]
    assert found["model/logits"] <= 1e-5 and found["model/param_grad"] <= 1e-4, found
    assert found["model/loss"] <= 1e-5, found  # causal_lm_loss: chunk sums reduced over the group


@pytest.mark.devices(2)
def test_standin_attention_follows_the_published_middle_layout(tmp_path):
    """Over two gloo ranks, against the middle layout's published wrapper (not the stand-in's own
    output): K/V repeated to the query's head count before the exchange, the caller's mask and
    keywords handed on as the same objects, a [B, H, S, D] output exchanged back, and each rank's
    output its chunk of plain attention over the whole sequence. The newest layout's full_attention
    (source unpublished; verl aims it at transformers' eager function) must give the same whole-
    sequence attention whether its function returns [B, H, S, D] or eager's [B, S, H, D]."""
    from pytest_fsdp_turbo.processes.warm import run_module

    env = {**ALLOW_CPU, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(STANDIN)}
    done = run_module("attention_layout_probe", [str(tmp_path / "store")], timeout_s=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["middle/output"] <= 1e-6, found
    assert found["middle/output_shape"] == [2, 4, 4, 4]  # [B, H, S/2, D]: heads gathered back
    # 4 query heads over 2 ranks: 2 each; 2 K/V heads repeated to 4 first, so 2 each as well
    assert found["middle/fn_saw"] == {"query_heads": 2, "key_heads": 2, "seq": 8}
    assert found["middle/mask_passed_through"] and found["middle/kwargs_passed_through"]
    for layout in ("bhsd", "bshd"):
        assert found[f"newest/{layout}/output"] <= 1e-6, (layout, found)
        assert found[f"newest/{layout}/kwargs_passed_through"], layout
    # the middle layout's FSDPTurbo applies its attention-type rules itself
    assert found["rules/gdn"] == (
        "ValueError: [Context Parallel] Invalid ulysses_attention_type: 'GDN'. Expected "
        "'default', 'with_compressor', or a callable."
    )
    assert found["rules/compressor"].startswith("NotModelledByStandIn: ")
    assert "not modelled by the stand-in" in found["rules/compressor"]
    assert found["rules/no_function"] == "built" and found["rules/untouched_without_function"]
    assert found["rules/missing_function"] == (
        "AttributeError: [Context Parallel] Function 'nowhere' not found in module "
        "'attention_layout_probe'."
    )
    assert found["rules/default"] == "built" and found["rules/default_replaced"]


@pytest.mark.devices(2)
def test_standin_applies_or_refuses_every_setting_as_the_library_does(tmp_path):
    """Each fsdp_plan and memory setting verl's turbo_config passes, on a sharded model over two gloo
    ranks, against the library's published behaviour (its FSDPTurbo, fsdp and recompute modules,
    read 2026-12-05): recompute checkpoints exactly the recompute_plan's matches; cpu_offload is
    torch's CPUOffloadPolicy(pin_memory); output_dtype and cast_forward_inputs reach the mixed
    precision policy; ignored_modules' parameters stay out of FSDP; each unit prefetches the next
    (forward) and previous (backward) units in module order; per-module options are fully_shard's
    keyword arguments; the dtype names, patterns and implementations the library refuses are
    refused with its words; what the stand-in cannot apply on CPU is refused by name."""
    from pytest_fsdp_turbo.processes.warm import run_module

    env = {**ALLOW_CPU, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(STANDIN)}
    done = run_module("settings_probe", [str(tmp_path / "store")], timeout_s=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["recompute"] == [2, 2] and found["no_recompute"] == [1, 1]
    assert found["recompute_nothing_matches"] == (
        "RuntimeError: [Recompute] No module named ['blocks.{*}']."
    )
    assert found["recompute_without_plan"] == "RuntimeError: [Recompute] No module named []."
    assert found["bf16_params"] == {"unit_input": "torch.bfloat16", "unit_output": "torch.bfloat16"}
    assert found["bf16_params_fp32_output"]["unit_output"] == "torch.float32"
    assert found["inputs_not_cast"].startswith("RuntimeError: mat1 and mat2 must have the same")
    assert found["offload"] == "CPUOffloadPolicy(pin_memory=False)"
    assert found["no_offload"] == "OffloadPolicy(pin_memory=None)"
    not_modelled = "not modelled by the stand-in"
    assert found["pinned_offload_on_cpu"].startswith("NotModelledByStandIn: turbo_config.")
    assert found["ignored_head_is_dtensor"] is False and found["kept_layer_is_dtensor"] is True
    assert found["ignored_nothing_matches"] is True  # the library checks no ignored pattern
    assert found["prefetch"] == {
        "layers.0": {"forward": ["layers.1"], "backward": []},
        "layers.1": {"forward": ["head"], "backward": ["layers.0"]},
        "head": {"forward": [], "backward": ["layers.1"]},
    }
    assert all(v == {"forward": [], "backward": []} for v in found["no_prefetch"].values())
    assert found["per_module_keeps_unsharded"] is True and found["default_reshards"] is True
    assert "unexpected keyword argument 'param_dtype'" in found["per_module_unknown_key"]
    assert found["dtype_bfloat16"] == "ValueError: Unsupported dtype: bfloat16"
    assert found["apply_modules_list"] == "AttributeError: 'list' object has no attribute 'items'"
    assert found["reversed_range"] == "ValueError: Invalid range: 1-0 (low > high)"
    assert found["non_integer_range"] == "ValueError: Non-integer in range: a-b"
    assert found["bare_number"] == "ValueError: Unrecognized brace pattern: {3}"
    assert found["double_dot_only"].startswith("RuntimeError: [FSDP2] No module named")
    assert found["unknown_fsdp"] == (
        "ValueError: Unknown FSDP implementation: fast. Supported: ['custom', 'native']"
    )
    for key in ("custom_fsdp", "tensor_parallel", "expert_parallel", "chunk_batch"):
        assert found[key].startswith("NotModelledByStandIn: ") and not_modelled in found[key]
    assert found["clip"] == {"without_group": 3.0, "over_the_group": 5.0}  # sqrt(3² + 4²)
    assert found["meshes"] == {"cp": 1, "ep": [2, 1, 1], "dp_fsdp": [1, 2], "edp_efsdp": [2, 1]}


def test_a_setting_the_standin_cannot_apply_skips_the_case_naming_it(ppo_run):
    """Refused before any rank starts, through the checkout's declared NOT_MODELLED table: the
    case skips with the key and "not modelled by the stand-in" (fails so under
    --fsdp-turbo-strict), never passes without it."""
    with pytest.raises((pytest.skip.Exception, pytest.fail.Exception)) as skipped:
        ppo_run(
            "tiny-qwen3_5-fsdp2-deferred",
            backend="fsdp_turbo",
            turbo_config={"distributed": {"tensor_parallel_size": 2}},
        )
    assert str(skipped.value.msg).endswith(
        "turbo_config.distributed.tensor_parallel_size = 2: tensor parallel, not modelled by the "
        "stand-in"
    ), skipped.value.msg
