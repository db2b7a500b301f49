"""Ray launcher, the driver side: the local launcher's contract (logs, timeouts, cleanup) with one
Ray actor per rank in a placement group. Runs only inside the Ray driver process
(`python -m pytest_fsdp_turbo.launching.ray_ranks [ADDRESS]`, started by pytest_fsdp_turbo.launching.ray_driver), never
in pytest: Ray ends a driver whose cluster dies.

Each actor starts its rank as a subprocess on its node, so faulthandler stack dumps, per-rank logs and
process-tree kills work exactly as locally. Nothing is shared through a filesystem: the actor gets
the rank's inputs (spec.json, a twin's replayed batch) through Ray, runs the rank in a folder of its
own node, and hands every file the rank wrote back through Ray when the rank has ended, failed or
not; this driver writes them into the run folder. A rank whose node left the cluster is named with
that node.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback
from collections.abc import Mapping
from pathlib import Path

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pytest_fsdp_turbo.environ import restored_environ
from pytest_fsdp_turbo.launching.ray_actor import REPLAYED, RankActor, node_name
from pytest_fsdp_turbo.launching.shipping import Packed, pack
from pytest_fsdp_turbo.processes.supervisor import began_phases, supervise
from pytest_fsdp_turbo_contract.artifacts import RunFolder
from pytest_fsdp_turbo_contract.device_profiles import profile_of
from pytest_fsdp_turbo_contract.errors import ConfigError
from pytest_fsdp_turbo_contract.lifetime import die_with_parent
from pytest_fsdp_turbo_contract.spec import RankSpec

PLACEMENT_TIMEOUT_S = 120
CALL_TIMEOUT_S = 60
START_TIMEOUT_S = 300  # a start fetches and unpacks what the ranks need (up to SHIP_LIMIT each)
NODE_DEATH_S = 30.0  # how long a lost actor's node may take to be declared dead
POLL_S = 0.2
KILLED = -9


def init_ray(address: str | None):
    """Join `address`, or start a local instance with at least 4 CPU slots (a 4-rank CPU case
    fits a 2-core box). ray.init() exports variables into the driver's environment; they are put
    back at once, so the ranks see the environment pytest gave the driver."""
    with restored_environ():
        if address:
            return ray.init(address=address, log_to_driver=False)
        return ray.init(
            num_cpus=max(4, os.cpu_count() or 1), include_dashboard=False, log_to_driver=False
        )


class RayRank:
    """The driver-side handle of one actor; remembers the exit code once seen, and whether the
    actor (its node) was lost."""

    def __init__(self, rank: int, actor, log_path: Path, node: dict):
        self.rank, self.actor, self.log_path, self.node = rank, actor, log_path, node
        self.code: int | None = None
        self.lost = False
        self.followed = 0  # bytes of its phase record already in the run folder

    def poll(self) -> int | None:
        if self.code is None:
            try:
                self.code = ray.get(self.actor.poll.remote(), timeout=CALL_TIMEOUT_S)
            except (RayActorError, GetTimeoutError):
                self.code, self.lost = KILLED, True
        return self.code

    def finished(self) -> bool:
        try:
            return bool(ray.get(self.actor.finished.remote(), timeout=CALL_TIMEOUT_S))
        except (RayActorError, GetTimeoutError):
            return False

    def dump_stacks(self) -> None:
        with contextlib.suppress(RayActorError, GetTimeoutError):
            ray.get(self.actor.dump_stacks.remote(), timeout=CALL_TIMEOUT_S)

    def kill(self) -> None:
        """The rank's process; the actor stays until its files are fetched."""
        with contextlib.suppress(RayActorError, GetTimeoutError):
            ray.get(self.actor.kill.remote(), timeout=CALL_TIMEOUT_S)
        self.poll()

    def follow_phases(self, out: Path) -> None:
        """Appends the rank's new phase lines to the run folder, where live progress reads them."""
        try:
            new = ray.get(self.actor.phases.remote(self.followed), timeout=CALL_TIMEOUT_S)
        except (RayActorError, GetTimeoutError):
            return
        if new:
            with open(RunFolder(out).phases(self.rank), "ab") as record:
                record.write(new)
            self.followed += len(new)

    def fetch_files(self, out: Path) -> str | None:
        """The rank's files into the run folder; what was lost instead, in words (None: nothing)."""
        try:
            files = ray.get(self.actor.files.remote(), timeout=CALL_TIMEOUT_S)
        except (RayActorError, GetTimeoutError) as exc:
            self.lost = True
            return (
                f"rank {self.rank}'s files stayed on {node_name(self.node)}: {type(exc).__name__}"
            )
        for name, data in files.items():
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            (out / name).write_bytes(data)
        return None


def lost_nodes(handles: list[RayRank]) -> dict[str, list[int]]:
    """Nodes that left the cluster while ranks ran on them: node name -> those ranks. A rank whose
    actor was lost gives the cluster a moment to declare its node dead (Ray's health check)."""
    deadline = time.monotonic() + NODE_DEATH_S
    while True:
        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        waiting = [h for h in handles if h.lost and h.node["id"] in alive]
        if not waiting or time.monotonic() > deadline:
            break
        time.sleep(POLL_S)
    gone: dict[str, list[int]] = {}
    for handle in handles:
        if handle.node["id"] not in alive:
            gone.setdefault(node_name(handle.node), []).append(handle.rank)
    return gone


def rank_inputs(out: Path) -> dict[str, bytes]:
    """What a rank reads from the run folder, as bytes for Ray: its spec, and for a twin the
    batch and post-step log-probabilities of the main run it replays."""
    folder = RunFolder(out)
    inputs = {RunFolder.spec: folder.spec.read_bytes()}
    replay = RankSpec.read(folder.spec).ppo.replay
    if replay:
        main = RunFolder(Path(replay))
        for path in (main.batch, main.post_step):
            if path.is_file():
                inputs[f"{REPLAYED}/{path.name}"] = path.read_bytes()
    return inputs


_sent: dict[str, ray.ObjectRef] = {}  # archive digest -> the archive in the object store


def shipments(folders: list[str]) -> dict[str, list]:
    """Each folder's archive in Ray's object store (put once per content this session), wrapped
    in a list so the actor gets the reference and fetches it on its own node."""
    out = {}
    for folder in folders:
        try:
            packed: Packed = pack(folder)
        except (OSError, ValueError) as exc:
            raise ConfigError(str(exc)) from None
        if packed.digest not in _sent:
            _sent[packed.digest] = ray.put(packed.data)
        out[folder] = [_sent[packed.digest]]
    return out


def launch_ray(
    *,
    case_id: str,
    world_size: int,
    kind: str,
    env_overrides: Mapping[str, str],
    artifacts_dir: str,
    timeout_s: float,
    ship: list[str] = (),
) -> dict:
    """Place, start and supervise one group; the outcome as JSON for the pytest side, which reads
    the artifacts itself (collect_result). `ship`: the driver's folders the ranks need."""
    out = Path(artifacts_dir)
    shipped = shipments(list(ship))
    resource = profile_of(kind).ray_resource
    bundle = {"CPU": 1.0, **({resource: 1.0} if resource else {})}
    group = placement_group([dict(bundle) for _ in range(world_size)], strategy="PACK")
    actors = []
    try:
        try:
            ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except GetTimeoutError:
            raise ConfigError(
                f"Ray cluster cannot place {world_size} ranks of {bundle} each within "
                f"{PLACEMENT_TIMEOUT_S}s; available: {ray.available_resources()}"
            ) from None
        for index in range(world_size):
            options = {
                "num_cpus": 1,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=index
                ),
            }
            if resource == "GPU":  # Ray's own name for it, not a custom resource
                options["num_gpus"] = 1
            elif resource:
                options["resources"] = {resource: 1}
            actors.append(RankActor.options(**options).remote())
        address, port = ray.get(actors[0].node_address.remote(), timeout=CALL_TIMEOUT_S)
        overrides = {**env_overrides, "MASTER_ADDR": address, "MASTER_PORT": str(port)}
        if overrides.get("GLOO_SOCKET_IFNAME") == "lo":  # ranks may sit on several nodes
            del overrides["GLOO_SOCKET_IFNAME"]
        inputs = rank_inputs(out)
        start = time.monotonic()
        try:
            started = ray.get(
                [
                    actor.start.remote(rank, world_size, overrides, kind, inputs, shipped)
                    for rank, actor in enumerate(actors)
                ],
                timeout=START_TIMEOUT_S,
            )
            if refused := [node["refused"] for node in started if "refused" in node]:
                raise ConfigError(refused[0])
        except BaseException:
            for actor in actors:  # the ranks that did start, and every node's folder, go
                with contextlib.suppress(Exception):
                    ray.get([actor.kill.remote(), actor.files.remote()], timeout=CALL_TIMEOUT_S)
            raise
        handles = [
            RayRank(rank, actor, RunFolder(out).log(rank), node)
            for rank, (actor, node) in enumerate(zip(actors, started))
        ]
        try:
            # the timeout counts from the ranks' first phases (a fresh rank's imports: not in it)
            outcome = supervise(
                handles,
                timeout_s,
                POLL_S,
                watch=lambda _elapsed: [handle.follow_phases(out) for handle in handles],
                completed=lambda handle: handle.finished(),
                started=began_phases(out),
            )
        finally:
            lost_files = [why for h in handles if (why := h.fetch_files(out)) is not None]
        gone = lost_nodes(handles)
        nodes = {handle.rank: node_name(handle.node) for handle in handles}
        RunFolder(out).nodes.write_text(json.dumps(nodes, indent=1))
        spread = len(set(nodes.values()))
        return {
            "start": start,
            "timed_out": outcome.timed_out,
            "first_failure": outcome.first_failure,
            "ends": outcome.ends,
            "start_up_s": outcome.start_up_s,
            "codes": {handle.rank: handle.poll() for handle in handles},
            "nodes": nodes,
            "lost_nodes": gone,
            "notes": [
                f"ranks ran as Ray actors on {spread} node(s); rendezvous at {address}:{port}",
                *(f"rank {h.rank} ran in {h.node['folder']} on {nodes[h.rank]}" for h in handles),
                *([f"sent to the nodes: {', '.join(ship)}"] if ship else []),
                *lost_files,
            ],
        }
    finally:
        for actor in actors:
            ray.kill(actor, no_restart=True)
        remove_placement_group(group)


def _serve(request: dict) -> dict:
    if request["op"] == "launch":
        return launch_ray(**request["args"])
    if request["op"] == "resources":
        return {"available": ray.available_resources(), "total": ray.cluster_resources()}
    raise ConfigError(f"unknown request {request['op']!r}")


def main(argv: list[str]) -> int:
    """The Ray driver process (pytest_fsdp_turbo.launching.ray_driver starts it): one JSON request per line
    on stdin, one reply per line on the protocol stream. Ray ends a driver whose cluster dies;
    running here, that takes this process, never pytest."""
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever Ray prints goes to the log, not into the protocol

    def send(message: dict) -> None:
        protocol.write(json.dumps(message, default=str) + "\n")

    die_with_parent()
    address = argv[0] if argv else ""
    try:
        info = init_ray(address or None)
    except Exception as exc:  # noqa: BLE001 - reported as one line by the pytest side
        send({"error": f"{type(exc).__name__}: {exc}"})
        return 1
    send({"ready": True, "address": info.address_info.get("address"), "started": not address})
    for line in sys.stdin:
        try:
            send(_serve(json.loads(line)))
        except ConfigError as exc:
            send({"error": str(exc)})
        except Exception as exc:  # noqa: BLE001 - the case fails with it, the driver goes on
            send({"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})
    with contextlib.suppress(Exception):
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
