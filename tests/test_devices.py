from pathlib import Path

import pytest

from pytest_fsdp_turbo.devices import default_cpu_slots, detect, parse_device_override
from pytest_fsdp_turbo.settings import DetectionEnv
from pytest_fsdp_turbo_contract.errors import ConfigError
from tests.helpers import davinci_nodes, env_with_path, fake_tool, npu_smi_table, nvidia_smi_listing


def test_cuda_from_nvidia_smi(tmp_path):
    fake_tool(tmp_path / "bin", "nvidia-smi", nvidia_smi_listing(8))
    accel = detect(env=env_with_path(tmp_path / "bin"), root=tmp_path)
    assert (accel.kind, accel.count, accel.backend) == ("cuda", 8, "nccl")
    assert accel.names[0] == "NVIDIA H200"
    assert accel.visible_devices_var == "CUDA_VISIBLE_DEVICES"
    assert "nvidia-smi -L" in accel.source


def test_cuda_visible_devices_narrows_by_index_and_uuid(tmp_path):
    fake_tool(tmp_path / "bin", "nvidia-smi", nvidia_smi_listing(8))
    env = env_with_path(tmp_path / "bin", CUDA_VISIBLE_DEVICES="6,GPU-0002-fake")
    accel = detect(env=env, root=tmp_path)
    assert accel.ids == (6, 2)
    assert "narrowed by CUDA_VISIBLE_DEVICES" in accel.source


def test_cuda_from_proc_driver_when_tool_missing(tmp_path):
    for i in range(2):
        (tmp_path / f"proc/driver/nvidia/gpus/0000:0{i}:00.0").mkdir(parents=True)
    accel = detect(env=env_with_path(tmp_path / "empty-bin"), root=tmp_path)
    assert (accel.kind, accel.count) == ("cuda", 2)
    assert accel.source == "/proc/driver/nvidia/gpus"


def test_failing_nvidia_smi_is_not_a_gpu(tmp_path):
    fake_tool(tmp_path / "bin", "nvidia-smi", "", exit_code=9)
    accel = detect(env=env_with_path(tmp_path / "bin"), root=tmp_path)
    assert accel.kind == "cpu"


def test_sixteen_ascend_nodes_all_counted(tmp_path):
    davinci_nodes(tmp_path, 16)
    fake_tool(tmp_path / "bin", "npu-smi", npu_smi_table(16))
    accel = detect(env=env_with_path(tmp_path / "bin"), root=tmp_path)
    assert (accel.kind, accel.backend) == ("npu", "hccl")
    assert accel.ids == tuple(range(16))  # davinci10..15 included, davinci_manager excluded
    assert accel.names[15] == "910B3"
    assert "/dev/davinci*" in accel.source and "npu-smi info" in accel.source


def test_ascend_visible_devices_narrows(tmp_path):
    davinci_nodes(tmp_path, 16)
    env = env_with_path(tmp_path / "bin", ASCEND_RT_VISIBLE_DEVICES="12,13,14,15")
    accel = detect(env=env, root=tmp_path)
    assert accel.ids == (12, 13, 14, 15)
    assert accel.visible_devices_var == "ASCEND_RT_VISIBLE_DEVICES"


def test_ascend_from_npu_smi_only_and_cann_note(tmp_path):
    fake_tool(tmp_path / "bin", "npu-smi", npu_smi_table(8))
    (tmp_path / "usr/local/Ascend/ascend-toolkit").mkdir(parents=True)
    accel = detect(env=env_with_path(tmp_path / "bin"), root=tmp_path)
    assert (accel.kind, accel.count) == ("npu", 8)
    assert any("CANN at" in note for note in accel.notes)


def test_malformed_visible_devices_is_one_clear_line(tmp_path):
    davinci_nodes(tmp_path, 2)
    env = env_with_path(tmp_path / "bin", ASCEND_RT_VISIBLE_DEVICES="0;1")
    with pytest.raises(ConfigError, match=r"^ASCEND_RT_VISIBLE_DEVICES: expected comma-separated"):
        detect(env=env, root=tmp_path)


def test_cpu_fallback_has_rank_slots_for_four_ranks(tmp_path):
    accel = detect(env=env_with_path(tmp_path / "bin"), root=tmp_path)
    assert accel.kind == "cpu" and accel.backend == "gloo"
    assert accel.count == default_cpu_slots() >= 4
    assert detect(env=env_with_path(tmp_path), root=tmp_path, cpu_slots=6).count == 6


@pytest.mark.parametrize(
    ("value", "kind", "count"), [("cuda", "cuda", None), ("npu:8", "npu", 8), ("cpu:3", "cpu", 3)]
)
def test_override_parsing(value, kind, count):
    assert parse_device_override(value, "--fsdp-turbo-device") == (kind, count)


@pytest.mark.parametrize("value", ["tpu", "cuda:0", "cuda:x", "npu:-1"])
def test_override_rejects_bad_values(value):
    with pytest.raises(ConfigError, match=r"^--fsdp-turbo-device: expected"):
        parse_device_override(value, "--fsdp-turbo-device")


def test_override_beats_detection(tmp_path):
    fake_tool(tmp_path / "bin", "nvidia-smi", nvidia_smi_listing(2))
    env = env_with_path(tmp_path / "bin")
    assert detect("cpu:2", env=env, root=tmp_path).ids == (0, 1)
    assert detect("npu:4", env=env, root=tmp_path).count == 4
    missing = detect("npu", env=env, root=Path(tmp_path / "nothing"))
    assert missing.count == 0 and "none found" in missing.source


def test_an_nvidia_smi_printing_bytes_that_are_not_utf8_is_still_read(tmp_path):
    """A localised GPU name in Latin-1 once made every session's start an INTERNALERROR."""
    fake_tool(tmp_path / "bin", "nvidia-smi", "")
    (tmp_path / "bin" / "nvidia-smi.out").write_bytes(
        b"GPU 0: NVIDIA H200 \xe9\xff (UUID: GPU-0000-fake)\nGPU 1: NVIDIA H200 (UUID: GPU-0001-fake)\n"
    )
    accel = detect(env=env_with_path(tmp_path / "bin"), root=tmp_path)
    assert (accel.kind, accel.count) == ("cuda", 2)


def test_a_hung_vendor_tool_is_cut_off_with_everything_it_started(tmp_path, monkeypatch):
    """The tool and the helper it started are both gone when detection gives up on it."""
    import time

    import psutil

    from pytest_fsdp_turbo import devices

    monkeypatch.setattr(devices, "TOOL_TIMEOUT_S", 1.0)
    marker = tmp_path / "helper.pid"
    tool = tmp_path / "bin" / "npu-smi"
    tool.parent.mkdir()
    tool.write_text(f"#!/bin/sh\nsleep 300 &\necho $! > '{marker}'\nsleep 300\n")
    tool.chmod(0o755)
    out, said = devices._run_tool(
        "npu-smi", ["info"], DetectionEnv.read(env_with_path(tmp_path / "bin"))
    )
    assert out is None and said == "npu-smi did not answer within 1s"
    helper = int(marker.read_text())
    deadline = time.monotonic() + 5
    while psutil.pid_exists(helper) and time.monotonic() < deadline:
        try:
            if psutil.Process(helper).status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        time.sleep(0.05)
    alive = psutil.pid_exists(helper) and psutil.Process(helper).status() != "zombie"
    assert not alive, f"the tool's helper {helper} outlived it"


def test_each_device_kind_has_one_profile_and_the_start_up_markers_agree_with_it():
    """A new device kind is its DeviceKind member, its profile, its detection and its marker;
    options.py spells the markers out (it loads at start-up, before the contract), so this test
    holds the two spellings together."""
    from pytest_fsdp_turbo.options import KIND_BY_MARKER, MARKER_BY_KIND
    from pytest_fsdp_turbo_contract.device_profiles import PROFILES
    from pytest_fsdp_turbo_contract.vocab import DeviceKind

    assert set(PROFILES) == set(DeviceKind)
    assert {str(kind): p.marker for kind, p in PROFILES.items()} == MARKER_BY_KIND
    assert {p.marker: str(kind) for kind, p in PROFILES.items()} == KIND_BY_MARKER
    assert {p.collective_backend for p in PROFILES.values()} == {"gloo", "nccl", "hccl"}
    assert detect("npu:2").backend == "hccl" and detect("cuda:1").visible_devices_var == (
        "CUDA_VISIBLE_DEVICES"
    )
