"""The vocabulary is one torch-free module that plugin and ranks share."""

import json
import re
import subprocess
import sys

from pytest_fsdp_turbo.vocab import Metric, metric_keys


def test_metric_keys_are_unique_and_named_as_the_training_world_names_them():
    values = metric_keys()
    assert len(values) == len(set(values))
    assert all(re.fullmatch(r"[a-z_]+(/[a-z0-9_]+)+", v) for v in values), values
    assert json.dumps({Metric.ACTOR_GRAD_NORM: 1.0}) == '{"actor/grad_norm": 1.0}'


def test_vocabulary_imports_no_torch():
    code = "import sys, pytest_fsdp_turbo.vocab; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
