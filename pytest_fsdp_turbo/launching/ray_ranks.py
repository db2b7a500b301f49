"""Ray launcher, the driver side: the local launcher's contract (logs, timeouts, cleanup) with one
Ray actor per rank in a placement group. Runs only inside the Ray driver process
(`python -m pytest_fsdp_turbo.launching.ray_ranks [ADDRESS]`, started by pytest_fsdp_turbo.launching.ray_driver), never
in pytest: Ray ends a driver whose cluster dies.

Each actor starts its rank as a subprocess on its node, so faulthandler stack dumps, per-rank logs and
process-tree kills work exactly as locally. Artifacts are written to the same path on every node: a
multi-node cluster needs that folder on a shared filesystem.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
import traceback
from collections.abc import Mapping
from pathlib import Path

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pytest_fsdp_turbo.devices import VISIBLE_DEVICES_VAR
from pytest_fsdp_turbo.launching.supervisor import (
    LocalRank,
    rank_env,
    supervise,
    worker_command,
    wrote_results,
)
from pytest_fsdp_turbo_contract.artifacts import RunFolder
from pytest_fsdp_turbo_contract.errors import ConfigError
from pytest_fsdp_turbo_contract.lifetime import die_with_parent
from pytest_fsdp_turbo_contract.vocab import DeviceKind

RAY_RESOURCE = {"cuda": "GPU", "npu": "NPU"}
PLACEMENT_TIMEOUT_S = 120
CALL_TIMEOUT_S = 60
POLL_S = 0.2
KILLED = -9


def init_ray(address: str | None):
    """Join `address`, or start a local instance with at least 4 CPU slots (a 4-rank CPU case
    fits a 2-core box). ray.init() exports variables into the driver's environment; they are put
    back at once, so the ranks see the environment pytest gave the driver."""
    from pytest_fsdp_turbo.environ import restored_environ

    with restored_environ():
        if address:
            return ray.init(address=address, log_to_driver=False)
        return ray.init(
            num_cpus=max(4, os.cpu_count() or 1), include_dashboard=False, log_to_driver=False
        )


@ray.remote
class RankActor:
    """Lives on the rank's node; owns the rank's process."""

    def __init__(self) -> None:
        self.rank: LocalRank | None = None

    def node_address(self) -> tuple[str, int]:
        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def visible_devices(self, kind: str) -> list[str]:
        resource = RAY_RESOURCE.get(kind)
        if resource is None:
            return []
        return [str(i) for i in ray.get_runtime_context().get_accelerator_ids().get(resource, [])]

    def start(self, rank: int, world_size: int, overrides: dict, kind: str, out: str) -> int:
        env = rank_env({**os.environ, **overrides}, rank, world_size)
        var = VISIBLE_DEVICES_VAR.get(kind)
        if var:  # Ray's assignment, also when RAY_EXPERIMENTAL_NOSET_* kept Ray from exporting it
            env[var] = ",".join(self.visible_devices(kind))
            env["LOCAL_RANK"] = "0"
        folder = Path(out)
        self.rank = LocalRank(rank, worker_command(folder), env, RunFolder(folder).log(rank))
        return self.rank.proc.pid

    def poll(self) -> int | None:
        return self.rank.poll() if self.rank else None

    def dump_stacks(self) -> None:
        if self.rank:
            self.rank.dump_stacks()

    def kill(self) -> None:
        if self.rank:
            self.rank.kill()


class RayRank:
    """The pytest-side handle of one actor; remembers the exit code once seen."""

    def __init__(self, rank: int, actor, log_path: Path):
        self.rank, self.actor, self.log_path = rank, actor, log_path
        self.code: int | None = None

    def poll(self) -> int | None:
        if self.code is None:
            try:
                self.code = ray.get(self.actor.poll.remote(), timeout=CALL_TIMEOUT_S)
            except (RayActorError, GetTimeoutError):
                self.code = KILLED
        return self.code

    def dump_stacks(self) -> None:
        with contextlib.suppress(RayActorError, GetTimeoutError):
            ray.get(self.actor.dump_stacks.remote(), timeout=CALL_TIMEOUT_S)

    def kill(self) -> None:
        with contextlib.suppress(RayActorError, GetTimeoutError):
            ray.get(self.actor.kill.remote(), timeout=CALL_TIMEOUT_S)
        self.poll()
        ray.kill(self.actor, no_restart=True)


def launch_ray(
    *,
    case_id: str,
    world_size: int,
    kind: str,
    env_overrides: Mapping[str, str],
    artifacts_dir: str,
    timeout_s: float,
) -> dict:
    """Place, start and supervise one group; the outcome as JSON for the pytest side, which reads
    the artifacts itself (collect_result)."""
    out = Path(artifacts_dir)
    bundle = {"CPU": 1.0, **({RAY_RESOURCE[kind]: 1.0} if kind in RAY_RESOURCE else {})}
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
            if kind == DeviceKind.CUDA:
                options["num_gpus"] = 1
            elif kind == DeviceKind.NPU:
                options["resources"] = {"NPU": 1}
            actors.append(RankActor.options(**options).remote())
        address, port = ray.get(actors[0].node_address.remote(), timeout=CALL_TIMEOUT_S)
        overrides = {**env_overrides, "MASTER_ADDR": address, "MASTER_PORT": str(port)}
        if overrides.get("GLOO_SOCKET_IFNAME") == "lo":  # ranks may sit on several nodes
            del overrides["GLOO_SOCKET_IFNAME"]
        start = time.monotonic()
        ray.get(
            [
                actor.start.remote(rank, world_size, overrides, kind, str(out))
                for rank, actor in enumerate(actors)
            ],
            timeout=CALL_TIMEOUT_S,
        )
        handles = [
            RayRank(rank, actor, RunFolder(out).log(rank)) for rank, actor in enumerate(actors)
        ]
        actors = []  # owned by the handles now: supervise() kills them
        timed_out, first_failure, ends = supervise(
            handles, timeout_s, POLL_S, completed=wrote_results(out)
        )
        return {
            "start": start,
            "timed_out": timed_out,
            "first_failure": first_failure,
            "ends": ends,
            "codes": {handle.rank: handle.poll() for handle in handles},
            "notes": [f"ranks ran as Ray actors; rendezvous at {address}:{port}"],
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
