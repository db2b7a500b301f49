"""The collective counter against real FSDP2 on a 2-rank gloo group: if torch moves or renames the
functions FSDP2 issues its reduce-scatters through, this fails naming the torch version."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from importlib import metadata

import pytest

pytest.importorskip("torch")

RANK_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from pytest_fsdp_turbo_engine.step.fsdp_probe import CollectiveCounter, fsdp_units

    dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}",
                            rank=int(os.environ["RANK"]), world_size=2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    for layer in model[:2]:
        fully_shard(layer)
    fully_shard(model)
    out = {"units": fsdp_units(model)}
    for policy in ("deferred", "every_micro_batch"):
        with CollectiveCounter() as counter:
            for i in range(3):
                model.set_requires_gradient_sync(policy == "every_micro_batch" or i == 2)
                loss = model(torch.randn(4, 8)).sum()
                counter.next_micro_batch()  # as the harness's probe does when the loss is known
                loss.backward()
        out[policy] = counter.reduce_scatters
        out[policy + "_all_gathers"] = counter.all_gathers_total
    if dist.get_rank() == 0:
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()
    os._exit(0)  # as the harness's ranks do: no interpreter teardown with gloo threads about
    """
)


def test_counter_sees_every_fsdp2_reduce_scatter_by_micro_batch(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    store = tmp_path / "store"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ranks = [
        subprocess.Popen(
            [sys.executable, str(script), str(store)],
            env={**env, "RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = [rank.communicate(timeout=120) for rank in ranks]
    for rank, (_, err) in zip(ranks, outputs):
        assert rank.returncode == 0, err[-2000:]
    found = json.loads(outputs[0][0].strip().splitlines()[-1])
    units, torch_version = found["units"], metadata.version("torch")
    hint = (
        f"torch {torch_version}: FSDP2 no longer issues its collectives through the "
        "torch.distributed functions pytest_fsdp_turbo_engine.step.fsdp_probe hooks; update it"
    )
    assert units == 3, found
    assert found["deferred"] == [0, 0, units], hint
    assert found["every_micro_batch"] == [units, units, units], hint
    assert found["deferred_all_gathers"] >= units, hint  # every forward gathers each unit
