"""A Ray cluster of two nodes on this one machine, for the multi-node tests: Ray's own test
utility (ray.cluster_utils.Cluster) starts a head and a second raylet, each with one CPU and a
resource of its own, so a 2-rank case cannot fit on one node and its placement group spreads
1 + 1. Prints one JSON line ({"address", "nodes": [{"id", "resource"}]}), then takes commands on
stdin: "remove" takes the second node out of the cluster (its raylet and every process on it);
end of input shuts the cluster down."""

import json
import sys

from ray.cluster_utils import Cluster

NODE_CPUS = 1


def main() -> None:
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
    second = cluster.add_node(num_cpus=NODE_CPUS, resources={"fsdp_turbo_node_b": NODE_CPUS})
    cluster.wait_for_nodes()
    nodes = [
        {"id": cluster.head_node.node_id, "resource": "fsdp_turbo_node_a"},
        {"id": second.node_id, "resource": "fsdp_turbo_node_b"},
    ]
    print(json.dumps({"address": cluster.address, "nodes": nodes}), flush=True)
    for line in sys.stdin:
        if line.strip() == "remove":
            cluster.remove_node(second, allow_graceful=False)
            print(json.dumps({"removed": second.node_id}), flush=True)
    cluster.shutdown()


if __name__ == "__main__":
    main()
