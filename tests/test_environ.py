import os

import pytest

from pytest_fsdp_turbo.environ import (
    COLLECTIVE_TIMEOUT_VAR,
    Timeouts,
    build_collective_env,
    interface_of,
    mask_secrets,
    node_env,
    parse_port_range,
    restored_environ,
)
from pytest_fsdp_turbo_contract.errors import ConfigError

RANGES = ((61000, 61063), (61064, 61127))


def test_gloo_profile_and_rendezvous():
    group = build_collective_env("cpu", (0, 1), 29555, world_size=2, user_env={}, cpu_count=8)
    assert group.env["MASTER_ADDR"] == "127.0.0.1"
    assert group.env["MASTER_PORT"] == "29555"
    assert group.env["GLOO_SOCKET_IFNAME"] == "lo"
    assert group.env["OMP_NUM_THREADS"] == "4"
    assert "CUDA_VISIBLE_DEVICES" not in group.env


def test_nccl_profile_sets_visible_devices_and_error_handling():
    group = build_collective_env("cuda", (2, 3), 1234, world_size=2, user_env={})
    assert group.env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert group.env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert group.collective_timeout_s < Timeouts().case_s
    assert COLLECTIVE_TIMEOUT_VAR not in group.env  # the ranks read it from their spec


def test_hccl_profile():
    group = build_collective_env(
        "npu", (4, 5, 6, 7), 1234, world_size=4, port_ranges=RANGES, user_env={}
    )
    env = group.env
    assert env["ASCEND_RT_VISIBLE_DEVICES"] == "4,5,6,7"
    assert env["HCCL_CONNECT_TIMEOUT"] == "1500"
    assert int(env["HCCL_EXEC_TIMEOUT"]) == int(Timeouts().collective_s)
    assert env["HCCL_HOST_SOCKET_PORT_RANGE"] == "61000-61063"
    assert env["HCCL_NPU_SOCKET_PORT_RANGE"] == "61064-61127"
    assert env["RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES"] == "1"


def test_user_value_wins_and_is_reported():
    user = {"HCCL_CONNECT_TIMEOUT": "7200", "OMP_NUM_THREADS": "3"}
    group = build_collective_env("npu", (0,), 1, world_size=1, port_ranges=RANGES, user_env=user)
    assert group.env["HCCL_CONNECT_TIMEOUT"] == "7200"
    assert set(group.from_user) == {"HCCL_CONNECT_TIMEOUT", "OMP_NUM_THREADS"}


def test_bad_user_port_range_names_the_variable():
    user = {"HCCL_HOST_SOCKET_PORT_RANGE": "70000-80000"}
    with pytest.raises(ConfigError, match=r"^HCCL_HOST_SOCKET_PORT_RANGE: expected LOW-HIGH"):
        build_collective_env("npu", (0,), 1, world_size=1, port_ranges=RANGES, user_env=user)


@pytest.mark.parametrize("value", ["", "1-", "9000-8000", "a-b", "80-90", "61000"])
def test_port_range_parse_rejects(value):
    with pytest.raises(ConfigError):
        parse_port_range(value, "X")
    assert parse_port_range("61000-61001", "X") == (61000, 61001)


def test_timeout_order_is_enforced():
    with pytest.raises(ConfigError, match="must be shorter than the case timeout"):
        Timeouts(collective_s=600, case_s=300)
    with pytest.raises(ConfigError, match=COLLECTIVE_TIMEOUT_VAR):
        build_collective_env(
            "cpu",
            (0,),
            1,
            world_size=1,
            timeouts=Timeouts(60, 300),
            user_env={COLLECTIVE_TIMEOUT_VAR: "900"},
        )


def test_secrets_masked():
    masked = mask_secrets({"HF_TOKEN": "abc", "AWS_SECRET_ACCESS_KEY": "x", "PATH": "/bin"})
    assert masked == {"HF_TOKEN": "***", "AWS_SECRET_ACCESS_KEY": "***", "PATH": "/bin"}


def test_builder_never_touches_os_environ():
    before = dict(os.environ)
    build_collective_env("npu", (0,), 5, world_size=1, port_ranges=RANGES, user_env=os.environ)
    assert dict(os.environ) == before


def test_restored_environ_undoes_changes():
    before = dict(os.environ)
    with restored_environ():
        os.environ["PYTEST_FSDP_TURBO_PROBE"] = "1"
        os.environ.pop("PATH")
    assert dict(os.environ) == before


def test_rank_threads_share_the_cores_with_the_other_xdist_workers():
    import os

    cores = os.cpu_count() or 1
    alone = build_collective_env("cpu", (0,), 29555, world_size=1, user_env={})
    assert alone.env["OMP_NUM_THREADS"] == str(cores)
    shared = build_collective_env(
        "cpu", (0,), 29555, world_size=1, user_env={"PYTEST_XDIST_WORKER_COUNT": "2"}
    )
    assert shared.env["OMP_NUM_THREADS"] == str(max(1, cores // 2))


def this_machines_address() -> tuple[str, str]:
    """A real (non-loopback) IPv4 address of this machine and the interface holding it."""
    import socket

    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        for address in addresses:
            if address.family == socket.AF_INET and not address.address.startswith("127."):
                return address.address, name
    pytest.skip("no non-loopback IPv4 address on this machine")


def test_the_per_node_env_names_the_nodes_address_and_interface_for_each_backend():
    """What a rank on one node of several gets (Ray's rank actors build it on their node)."""
    ip, interface = this_machines_address()
    assert interface_of(ip) == interface and interface_of("203.0.113.77") is None
    assert node_env("npu", ip, user_env={}) == {
        "HCCL_IF_IP": ip,
        "HCCL_SOCKET_IFNAME": interface,
        "GLOO_SOCKET_IFNAME": interface,
    }
    assert node_env("cuda", ip, user_env={}) == {
        "NCCL_SOCKET_IFNAME": interface,
        "GLOO_SOCKET_IFNAME": interface,
    }
    assert node_env("cpu", ip, user_env={}) == {"GLOO_SOCKET_IFNAME": interface}
    # a value set on the node wins; an address no interface holds still pins HCCL's
    assert node_env("npu", ip, user_env={"HCCL_SOCKET_IFNAME": "ib0"}) == {
        "HCCL_IF_IP": ip,
        "GLOO_SOCKET_IFNAME": interface,
    }
    assert node_env("npu", "203.0.113.77", user_env={}) == {"HCCL_IF_IP": "203.0.113.77"}
