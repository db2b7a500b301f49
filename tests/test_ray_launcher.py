"""The Ray launcher on a local Ray instance: same checks as the local launcher, same cleanup."""

import importlib.util
import time

import psutil
import pytest

if importlib.util.find_spec("ray") is None:  # never imported here: the pytest process stays light
    pytest.skip("needs ray: pip install 'pytest-fsdp-turbo[ray]'", allow_module_level=True)


CASE = "tiny-llama-fsdp2-deferred"  # two ranks, the quickest family: the launcher is under test


def _live(marker: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if (
                marker in " ".join(proc.info["cmdline"] or ())
                and proc.status() != psutil.STATUS_ZOMBIE
            ):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def test_rank_crash_under_ray_fails_fast_and_leaves_nothing(ray_cluster, ppo_run):
    result = ppo_run(
        "tiny-qwen3-single-rank",
        world_size=2,
        launcher="ray",
        extra_env={"PYTEST_FSDP_TURBO_FAULT": "crash:1:rollout"},
    )
    assert not result.ok and result.first_failure == 1
    text = result.failure_text()
    assert "phase rollout: InjectedFault: injected crash in rank 1" in text
    assert "Traceback (most recent call last)" in text
    mine = str(result.artifacts_dir)  # other tests may run ranks at the same time (xdist)
    _, alive = psutil.wait_procs(_live(mine), timeout=15)  # Ray reaps its workers a moment later
    assert not alive, "rank processes outlived the case"
    deadline = time.monotonic() + 15

    # The rank actors lived in the case's placement group: all CPUs back means group and actors are gone.
    def cpus() -> tuple[float, float]:
        resources = ray_cluster.resources()
        return resources["available"].get("CPU"), resources["total"]["CPU"]

    while time.monotonic() < deadline and cpus()[0] != cpus()[1]:
        time.sleep(0.2)
    assert cpus()[0] == cpus()[1]
