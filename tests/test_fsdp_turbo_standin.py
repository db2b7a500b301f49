"""The FSDP-Turbo adapter wired end to end on CPU, against the STAND-IN fsdp_turbo library in
tests/standin_fsdp_turbo (a test double reproducing the library's observable contract, not the
library, never evidence about hardware), for the newest and the middle config layout."""

import json
from pathlib import Path

import pytest

from pytest_fsdp_turbo import checks
from pytest_fsdp_turbo.checkout import Checkout

STANDIN = Path(__file__).parent / "standin_fsdp_turbo"
ALLOW_CPU = {"FSDP_TURBO_STANDIN_ALLOW_CPU": "1"}  # the stand-in, like the library, refuses CPU
LAYOUTS = ("function_patches", "core_attention")


def standin(layout: str) -> Checkout:
    return Checkout(STANDIN / layout, None, f"stand-in fsdp_turbo ({layout} layout), tests only")


@pytest.mark.devices(2)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fsdp_turbo_backend_passes_every_check_on_the_standin(ppo_run, layout):
    result = ppo_run(
        "tiny-qwen3_5-fsdp2-deferred",
        backend="fsdp_turbo",
        devices=("cpu",),
        checkout=standin(layout),
        extra_env=ALLOW_CPU,
    )
    assert checks.check_all(result).not_applicable() == ["d: no replicas"]
    config = json.loads((result.artifacts_dir / "spec.json").read_text())["engine"]["turbo_config"]
    plan = config["distributed"]["fsdp_plan"]
    assert plan["apply_modules"] == {
        "model.layers.{*}": {},
        "model.embed_tokens": {},
        "lm_head": {},
    }
    assert plan["hook_modules"] == ["model.layers.{*}"]
    # apply_modules became FSDP units: 4 decoder layers, embeddings, LM head, and the root (norm)
    assert result.metrics["comm/fsdp_units"] == 7
    assert result.metrics["comm/reduce_scatter_calls_by_micro_batch"] == [0, 7]
