"""A third case kind in one module, as a downstream repository would add one: `[[toy_case]]`
tables read by the harness's reader from `ToyCase`'s fields, each case run as real rank processes
under the harness's supervisor, its run folder read back into a `RunResult` whose spec.json names
the kind, and judged by the kind's own check set. Imported by a conftest, it registers itself."""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from pytest_fsdp_turbo.cases.table import ReadContext, TableReader, check_known_failure
from pytest_fsdp_turbo.checks.check_sets import CheckSet, register_check_set
from pytest_fsdp_turbo.checks.verdicts import CheckFailure
from pytest_fsdp_turbo.kinds.registry import register_kind
from pytest_fsdp_turbo.processes.supervisor import launch_local
from pytest_fsdp_turbo.report import artifact_name, note_run
from pytest_fsdp_turbo.session import artifacts_root
from pytest_fsdp_turbo_contract.artifacts import RunFolder
from pytest_fsdp_turbo_contract.results import RunResult
from pytest_fsdp_turbo_contract.spec import BOUNDS, Bounds
from pytest_fsdp_turbo_contract.vocab import DeviceKind

KIND = "toy"
# each rank reports a gradient norm of 1 + skew x its rank: a skew is a rank out of step
RANK = """
import json, os, sys
from pytest_fsdp_turbo_contract.records import OptimizerRecord, RankRecord, StepMetrics
rank, skew = int(os.environ["RANK"]), float(sys.argv[2])
metrics = StepMetrics()
metrics.rank = RankRecord(rank=rank, device="cpu", replicas=1)
metrics.optimizer = OptimizerRecord(grad_norm=1.0 + skew * rank, grad_norm_finite=True)
path = os.path.join(sys.argv[1], f"rank{rank}.metrics.json")
json.dump({k: v for k, v in metrics.to_json().items() if v is not None}, open(path, "w"))
"""


@dataclass(frozen=True)
class ToyCase:
    id: str
    world_size: int = field(default=2, metadata={BOUNDS: Bounds(1, 8)})
    skew: float = 0.0
    devices: tuple[DeviceKind, ...] = (DeviceKind.CPU,)
    known_failure: dict = field(default_factory=dict)


READER = TableReader("toy case", {"case": ToyCase})


class ToyKind:
    name = KIND
    table = "toy_case"
    fixture = "toy_case"

    def read(self, data: dict, path: Path, context: ReadContext) -> list[ToyCase]:
        cases = []
        for row in data.get(self.table, []):
            where = READER.where(row, path)
            case = ToyCase(**READER.read(row, where)["case"])
            check_known_failure(where, case.known_failure, case.devices)
            cases.append(case)
        return cases

    def owns(self, case: object) -> bool:
        return isinstance(case, ToyCase)

    def marks(self, case: ToyCase) -> list[str]:
        return []

    def missing(self, case: ToyCase, device_kind: str, settings: Any) -> list[str]:
        return []

    def run(self, request: pytest.FixtureRequest, case: ToyCase, **options: Any) -> RunResult:
        folder = artifacts_root(request.config) / artifact_name(request.node.nodeid)
        folder.mkdir(parents=True, exist_ok=True)
        spec = {
            "kind": KIND,
            "case_id": case.id,
            "device_kind": DeviceKind.CPU,
            "engine": {"world_size": case.world_size},
            "timeout_s": 60.0,
        }
        RunFolder(folder).spec.write_text(json.dumps(spec))
        result = launch_local(
            case_id=case.id,
            world_size=case.world_size,
            env=dict(os.environ),
            artifacts_dir=folder,
            timeout_s=60.0,
            command=[sys.executable, "-c", RANK, str(folder), str(case.skew)],
        )
        note_run(request.node, result)
        return result


def check_ranks_agree(result: RunResult, budget_mb: float | None) -> None:
    """z: each of the spec's ranks reported one finite gradient norm, the same on every rank."""
    declared = result.spec()
    assert declared is not None
    norms = [rank.step.optimizer.grad_norm for rank in result.ranks]
    if len(norms) != declared.engine.world_size or any(n is None for n in norms):
        raise CheckFailure(
            f"check z: {len(norms)} rank(s) reported of {declared.engine.world_size}"
        )
    if any(not math.isfinite(n) or n != norms[0] for n in norms):
        raise CheckFailure(f"check z: the ranks' gradient norms differ: {norms}")


register_kind(ToyKind())
register_check_set(CheckSet(KIND, (("z", check_ranks_agree),), {"a": "a toy has no gradients"}))
