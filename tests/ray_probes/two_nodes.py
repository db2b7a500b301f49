"""A Ray cluster of two nodes on this one machine, for the multi-node tests: a head from Ray's own
test utility (ray.cluster_utils.Cluster) and a second raylet (`ray start --block`), each with one
CPU and a resource of its own, so a 2-rank case cannot fit on one node and its placement group
spreads 1 + 1.

The second node gets folders of its own: it starts in a mount namespace of its own (`unshare
--mount`) where each folder named on the command line is an empty tmpfs, so the driver's files
there (a pytest session's folder, the tiny-model cache) are not on that node, as on a cluster
without a shared filesystem. Where namespaces are not allowed, the node shares every folder and
the first line says so ("hidden": []).

Prints one JSON line ({"address", "nodes": [{"id", "resource"}], "hidden", "why"}), then takes
commands on stdin: "remove" takes the second node out of the cluster (its raylet and every process
on it); end of input shuts the cluster down."""

import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import ray
from ray.cluster_utils import Cluster

NODE_CPUS = 1
RAY = str(Path(sys.executable).parent / "ray")


def hiding(folders: list[str], command: list[str]) -> list[str]:
    """`command` in a mount namespace of its own where each of `folders` is an empty tmpfs."""
    mounts = "; ".join(
        f"mount -t tmpfs fsdp-turbo-node-b {shlex.quote(f)} || exit 97" for f in folders
    )
    return ["unshare", "--mount", "sh", "-c", f'{mounts}; exec "$@"', "sh", *command]


def namespaces_allowed() -> str:
    """'' where a mount namespace with a tmpfs can be had, else why not."""
    with tempfile.TemporaryDirectory() as folder:
        try:
            done = subprocess.run(
                hiding([folder], ["true"]), capture_output=True, text=True, timeout=30
            )
        except OSError as exc:
            return f"unshare: {exc}"
    return "" if done.returncode == 0 else f"unshare --mount: {done.stderr.strip()}"


def second_node(address: str, hidden: list[str]) -> subprocess.Popen:
    start = [
        RAY,
        "start",
        f"--address={address}",
        f"--num-cpus={NODE_CPUS}",
        f"--resources={json.dumps({'fsdp_turbo_node_b': NODE_CPUS})}",
        "--block",
        "--disable-usage-stats",
    ]
    return subprocess.Popen(
        hiding(hidden, start) if hidden else start,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def node_b_id() -> str:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for node in ray.nodes():
            if node.get("Alive") and "fsdp_turbo_node_b" in node.get("Resources", {}):
                return node["NodeID"]
        time.sleep(0.2)
    raise RuntimeError("the second node did not join within 120 s")


def kill_tree(proc: subprocess.Popen) -> None:
    try:
        tree = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        tree = []
    for child in tree:
        child.kill()
    proc.kill()
    proc.wait()


def main(hidden: list[str]) -> None:
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": NODE_CPUS,
            "resources": {"fsdp_turbo_node_a": NODE_CPUS},
            "include_dashboard": False,
            # a node that dies is declared dead within about a second, not the default 30 s
            "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 2},
        },
    )
    why = namespaces_allowed() if hidden else ""
    if why:
        hidden = []
    second = second_node(cluster.address, hidden)
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        nodes = [
            {"id": cluster.head_node.node_id, "resource": "fsdp_turbo_node_a"},
            {"id": node_b_id(), "resource": "fsdp_turbo_node_b"},
        ]
    finally:
        ray.shutdown()
    info = {"address": cluster.address, "nodes": nodes, "hidden": hidden, "why": why}
    print(json.dumps(info), flush=True)
    for line in sys.stdin:
        if line.strip() == "remove":
            kill_tree(second)
            print(json.dumps({"removed": nodes[1]["id"]}), flush=True)
    kill_tree(second)
    cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
