"""The Ray launcher's node side: `RankActor` lives on a rank's node, starts the rank there as a
subprocess (so stack dumps, per-rank logs and process-tree kills work as locally), and hands back
every file the rank wrote. Its inputs arrive through Ray; nothing is shared through a filesystem."""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

import ray

from pytest_fsdp_turbo.environ import node_env
from pytest_fsdp_turbo.launching.shipping import moved, moved_search_path, unpack
from pytest_fsdp_turbo.processes.reaping import CASE_TOKEN_VAR, reap_case
from pytest_fsdp_turbo.processes.supervisor import LocalRank, rank_env, worker_command
from pytest_fsdp_turbo_contract.artifacts import RunFolder
from pytest_fsdp_turbo_contract.device_profiles import profile_of
from pytest_fsdp_turbo_contract.spec import RankSpec

REPLAYED = "replay"  # a twin's inputs from its main run, under the rank's own folder
SHIPPED = "shipped"  # the driver's folders this rank needs, under the rank's own folder


def node_of() -> dict:
    """Where this process runs: the Ray node (its id) and that node's address."""
    return {"id": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address()}


def node_name(node: dict) -> str:
    return f"node {node['id'][:8]} ({node['ip']})"


def settle_inputs(
    folder: Path, inputs: dict[str, bytes], shipped: dict[str, list]
) -> tuple[RankSpec, dict[str, str]]:
    """The rank's inputs and the driver's folders it needs (`shipped`: driver path -> [the
    archive's object]) written into its node folder; its spec, pointed at them there, and where
    each driver folder now is."""
    for name, data in inputs.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    places = {}
    for index, (origin, (archive,)) in enumerate(shipped.items()):
        places[origin] = str(folder / SHIPPED / str(index))
        unpack(ray.get(archive), Path(places[origin]))
    spec = RankSpec.read(RunFolder(folder).spec)
    engine = dataclasses.replace(
        spec.engine, turbo_checkout=moved(spec.engine.turbo_checkout, places)
    )
    spec = dataclasses.replace(spec, model_path=moved(spec.model_path, places), engine=engine)
    if spec.ppo.replay:  # a twin replays its main run's batch from the copy sent here only
        spec = dataclasses.replace(
            spec, ppo=dataclasses.replace(spec.ppo, replay=str(folder / REPLAYED))
        )
    spec.write(RunFolder(folder).spec)
    return spec, places


@ray.remote
class RankActor:
    """Lives on the rank's node; owns the rank's process and the folder it runs in."""

    def __init__(self) -> None:
        self.rank: LocalRank | None = None
        self.folder: Path | None = None
        self.token = ""

    def node_address(self) -> tuple[str, int]:
        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def visible_devices(self, kind: str) -> list[str]:
        resource = profile_of(kind).ray_resource
        if resource is None:
            return []
        return [str(i) for i in ray.get_runtime_context().get_accelerator_ids().get(resource, [])]

    def start(
        self,
        rank: int,
        world_size: int,
        overrides: dict,
        kind: str,
        inputs: dict[str, bytes],
        shipped: dict[str, list],
    ) -> dict:
        """The rank's process, in a folder of this node holding `inputs` and the driver's folders
        it needs (`shipped`: driver path -> [the archive's object]); where it runs, or what this
        node lacks."""
        node = node_of()
        self.folder = folder = Path(tempfile.mkdtemp(prefix=f"fsdp-turbo-rank{rank}-"))
        try:
            spec, places = settle_inputs(folder, inputs, shipped)
            if not (Path(spec.model_path) / "config.json").is_file():
                return {
                    **node,
                    "refused": f"model {spec.model_path} is not on {node_name(node)}: a local "
                    "model is not sent to the nodes; it must be at the same path on every node "
                    "(docs/multi-node.md)",
                }
            base = {**os.environ, **overrides}
            if "PYTHONPATH" in overrides:
                base["PYTHONPATH"] = moved_search_path(overrides["PYTHONPATH"], places)
            env = rank_env({**base, **node_env(kind, node["ip"], base)}, rank, world_size)
            var = profile_of(kind).visible_devices_var
            if var:  # Ray's assignment, also when RAY_EXPERIMENTAL_NOSET_* kept Ray from exporting
                env[var] = ",".join(self.visible_devices(kind))
                env["LOCAL_RANK"] = "0"
            self.token = env[CASE_TOKEN_VAR] = f"{os.getpid()}-{rank}-{time.time_ns()}"
            self.rank = LocalRank(rank, worker_command(folder), env, RunFolder(folder).log(rank))
        except BaseException:
            self.files()  # whatever started is reaped, and the node keeps nothing
            raise
        return {**node, "pid": self.rank.proc.pid, "folder": str(folder)}

    def reap(self) -> None:
        """Whatever the rank started that outlived it, on this node (the local launcher's rule)."""
        if self.rank is not None:
            reap_case(self.token, {self.rank.pid: self.rank.started})

    def poll(self) -> int | None:
        return self.rank.poll() if self.rank else None

    def finished(self) -> bool:
        """The worker's success marker, in this node's folder."""
        return self.rank is not None and RunFolder(self.folder).metrics(self.rank.rank).is_file()

    def dump_stacks(self) -> None:
        if self.rank:
            self.rank.dump_stacks()

    def kill(self) -> None:
        if self.rank:
            self.rank.kill()

    def phases(self, offset: int) -> bytes:
        """What the rank has added to its phase record since `offset` (live progress)."""
        if self.rank is None:
            return b""
        try:
            with open(RunFolder(self.folder).phases(self.rank.rank), "rb") as record:
                record.seek(offset)
                return record.read()
        except OSError:
            return b""

    def files(self) -> dict[str, bytes]:
        """Every file the rank wrote (log, metrics or error, partial metrics, phases, rank 0's
        batch and gradients), then the folder is removed: its node keeps nothing."""
        if self.folder is None:
            return {}
        self.reap()
        out = {}
        inputs = (REPLAYED + "/", SHIPPED + "/")
        for path in sorted(self.folder.rglob("*")):
            name = path.relative_to(self.folder).as_posix()
            if path.is_file() and name != RunFolder.spec and not name.startswith(inputs):
                out[name] = path.read_bytes()
        shutil.rmtree(self.folder, ignore_errors=True)
        return out
