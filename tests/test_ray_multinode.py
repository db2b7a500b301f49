"""Cases across two Ray nodes on this one machine: a cluster of Ray's own test utility (two
raylets, one CPU each, a resource per node; tests/ray_probes/two_nodes.py), and a pytest session
of its own pointed at it with --fsdp-turbo-ray-address, as a user points the plugin at theirs. A
2-rank case must spread 1 + 1; a node removed mid-case turns that case red with the node named,
and the session goes on to its summary."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest

from pytest_fsdp_turbo.models import default_model_cache

if importlib.util.find_spec("ray") is None:  # never imported here: the pytest process stays light
    pytest.skip("needs ray: pip install 'pytest-fsdp-turbo[ray]'", allow_module_level=True)

REPO = Path(__file__).resolve().parent.parent
PROBE = Path(__file__).parent / "ray_probes" / "two_nodes.py"

SESSION = '''
import json, os, shutil, time
from pathlib import Path

import psutil
import pytest

from pytest_fsdp_turbo import checks
from pytest_fsdp_turbo.checks import goldens
from pytest_fsdp_turbo.session import goldens_dir
from pytest_fsdp_turbo_contract.spec import RankSpec

CASE = "tiny-llama-fsdp2-deferred"
FAULT = "PYTEST_FSDP_TURBO_FAULT"


def last_spec():
    (spec,) = Path("fsdp-turbo-artifacts").glob("*test_a_case_spread*/spec.json")
    return spec


def rank_folders(result):
    """Where each rank ran: a folder of its own node, said in the run's notes."""
    said = [n.split(" ran in ")[1].split(" on node ")[0] for n in result.notes if " ran in " in n]
    assert len(said) == result.world_size, result.notes
    return said


def alive(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_case_spread_over_two_nodes_passes_every_check_and_its_golden(ppo_run, pytestconfig):
    # with a replay twin: its rank gets the main run's batch through Ray, not through a path. The
    # second node has none of this session's folders (this one, the tiny-model cache): the model
    # and the engine's folder reach it through Ray. Each rank leaves a helper in a session of its
    # own, which its node reaps (the twin runs our own FSDP engine, as every single twin).
    helpers = Path(os.environ["TWO_NODES_HELPERS"])
    result = ppo_run(
        CASE,
        twin="single",
        backend="fsdp_with_helper",
        engine_modules=["fsdp_with_helper = helper_starter"],
        pythonpath=["node_engines"],
        extra_env={"HELPER_PIDS": str(helpers)},
    )
    assert checks.check_all(result).not_applicable() == ["d: no replicas"]
    assert result.twin is not None and result.twin.ok, result.twin
    assert result.twin.folder.metrics(0).is_file() and not result.twin.folder.batch.exists()
    # the numbers of a one-machine run of the case, to 1e-3
    goldens.check_or_record(result, goldens_dir(pytestconfig), record=False, strict=True)
    nodes = [rank.node for rank in result.ranks]
    assert nodes[0] != nodes[1], nodes  # 1 + 1, the node named per rank
    assert json.loads(result.folder.nodes.read_text()) == {str(r): n for r, n in enumerate(nodes)}
    sent = [n for n in result.notes if n.startswith("sent to the nodes: ")]
    model = RankSpec.read(result.folder.spec).model_path
    assert sent == [f"sent to the nodes: {model}, {Path('node_engines').resolve()}"], result.notes
    # every rank ran in a folder of its own node; what it wrote came back through Ray
    for rank, folder in enumerate(rank_folders(result)):
        assert folder != str(result.artifacts_dir) and not Path(folder).exists(), folder
        assert result.folder.metrics(rank).is_file() and result.folder.log(rank).is_file()
        assert result.folder.phases(rank).is_file()
    pids = [int(line) for line in helpers.read_text().split()]
    assert len(pids) == 2 and not [pid for pid in pids if alive(pid)], pids  # one per node


def test_a2_a_local_model_a_node_lacks_is_refused_naming_model_and_node(ppo_run, pytestconfig):
    """A real model is not sent: a node without it refuses before any rank starts."""
    local = Path("models") / "local-llama"
    local.parent.mkdir(exist_ok=True)
    shutil.copytree(RankSpec.read(last_spec()).model_path, local)
    with pytest.raises(pytest.fail.Exception) as refused:
        ppo_run(CASE, model="local-llama")
    message = str(refused.value.msg)
    assert f"model {local.resolve()} is not on node " in message, message
    assert "it must be at the same path on every node (docs/multi-node.md)" in message, message


def test_b_a_rank_that_dies_on_a_node_is_named_with_it_and_its_log_tail(ppo_run, ray_cluster):
    result = ppo_run(CASE, extra_env={FAULT: "crash:1:rollout"})
    assert not result.ok and result.first_failure == 1
    text = result.failure_text()
    head = text.splitlines()[0]
    assert head.startswith(f"case {CASE}: rank 1 on {result.ranks[1].node} failed first"), head
    assert "phase rollout: InjectedFault: injected crash in rank 1" in head
    assert "[rank 1] phase rollout" in text  # its log tail, fetched from its node
    # nothing is left: no rank process, every CPU back (the placement group and actors are gone)
    folders = rank_folders(result)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        alive = [
            p for p in psutil.process_iter(["cmdline"])
            if any(f in " ".join(p.info["cmdline"] or ()) for f in folders)
        ]
        resources = ray_cluster.resources()
        free = resources["available"].get("CPU") == resources["total"]["CPU"]
        if not alive and free:
            break
        time.sleep(0.2)
    assert not alive and free, (alive, resources)


def test_c_a_node_lost_mid_case_fails_the_case_with_the_node_named(ppo_run):
    Path(os.environ["TWO_NODES_SIGNAL"]).write_text("the case with the stalled rank starts")
    result = ppo_run(
        CASE,
        extra_env={FAULT: "stall:1:train", "PYTEST_FSDP_TURBO_FAULT_STALL_S": "120"},
    )
    assert not result.ok
    removed = os.environ["TWO_NODES_REMOVED"][:8]
    head = result.failure_text().splitlines()[0]
    assert f"node {removed}" in head and "left the Ray cluster while rank(s)" in head, head
'''


class TwoNodes:
    """The cluster helper process: its address, its nodes, and the command that removes the
    second node."""

    def __init__(self, hidden: list[str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(PROBE), *hidden],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{PROBE} did not start a cluster (exit {self.proc.wait()})")
        info = json.loads(line)
        self.address, self.nodes = info["address"], info["nodes"]
        self.hidden, self.why_shared = info["hidden"], info["why"]

    def remove_second(self) -> str:
        self.proc.stdin.write("remove\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())["removed"]

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            for child in psutil.Process(self.proc.pid).children(recursive=True):
                child.kill()
            self.proc.kill()


def remove_when_ranks_run(cluster: TwoNodes, signal: Path, stop: threading.Event) -> None:
    """Waits for the node-loss test to start its case, then for its ranks on the second node to
    run (a worker process in a node-local rank folder, held in phase train by the stall), then
    takes that node out of the cluster."""
    while not signal.exists() and not stop.wait(0.2):
        pass
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not stop.is_set():
        workers = [
            p
            for p in psutil.process_iter(["cmdline"])
            if "fsdp-turbo-rank1-" in " ".join(p.info["cmdline"] or ())
        ]
        if workers:
            time.sleep(3.0)  # past its start-up: the ranks are in the case, rank 1 stalled
            cluster.remove_second()
            return
        time.sleep(0.2)


@pytest.fixture
def two_nodes(tmp_path_factory):
    """The two-node cluster for one test: started before it, shut down after it. The second node
    has folders of its own: this session's temporary folders and the tiny-model cache are empty
    there."""
    cache = default_model_cache()
    cache.mkdir(parents=True, exist_ok=True)
    cluster = TwoNodes([str(tmp_path_factory.getbasetemp()), str(cache)])
    try:
        yield cluster
    finally:
        cluster.close()


def test_cases_across_two_ray_nodes(
    two_nodes: TwoNodes, pytester: pytest.Pytester, monkeypatch, tmp_path
):
    cluster = two_nodes
    helpers = Path(tempfile.mkdtemp(prefix="fsdp-turbo-helpers-"))  # seen from both nodes
    stop = threading.Event()
    signal = tmp_path / "node-loss-case-started"
    watcher = threading.Thread(target=remove_when_ranks_run, args=(cluster, signal, stop))
    try:
        watcher.start()
        monkeypatch.setenv("TWO_NODES_SIGNAL", str(signal))
        monkeypatch.setenv("TWO_NODES_REMOVED", cluster.nodes[1]["id"])
        monkeypatch.setenv("TWO_NODES_HELPERS", str(helpers / "pids"))
        monkeypatch.delenv("PYTEST_FSDP_TURBO_WARM_SOCKET", raising=False)
        pytester.makepyfile(test_two_nodes=SESSION)
        engines = pytester.mkdir("node_engines")  # on the driver's machine only
        shutil.copy(Path(__file__).parent / "warm_probes" / "helper_starter.py", engines)
        result = pytester.runpytest_subprocess(
            "-p",
            "no:cacheprovider",
            "--fsdp-turbo-device=cpu",
            "--fsdp-turbo-launcher=ray",
            f"--fsdp-turbo-ray-address={cluster.address}",
            f"--fsdp-turbo-cases={REPO / 'e2e' / 'cases.toml'}",
            f"--fsdp-turbo-goldens={REPO / 'fixtures' / 'goldens'}",
            f"--fsdp-turbo-models={pytester.path / 'models'}",
            timeout=400,
        )
    finally:
        stop.set()
        watcher.join(timeout=30)
        shutil.rmtree(helpers, ignore_errors=True)
    text = result.stdout.str()
    result.assert_outcomes(passed=4)
    assert "fsdp-turbo e2e runs" in text  # the session reached its summary
    spread = [line for line in text.splitlines() if line.startswith("test_a_case_spread")]
    assert len(spread) == 1 and " 2 (2 nodes) " in spread[0], spread
    if not cluster.hidden:
        pytest.skip(
            f"the second node shared this machine's folders ({cluster.why_shared}): what a node "
            "lacks was sent, but no node lacked it"
        )
