"""Live progress while a case runs: phases per rank, elapsed time, stalls; the timeline after."""

import json
import time
from pathlib import Path

from pytest_fsdp_turbo.processes.progress import Progress, group_ranks
from pytest_fsdp_turbo_contract.artifacts import RunFolder

REPO = Path(__file__).resolve().parent.parent


def write_phase(folder: Path, rank: int, phase: str, at: float) -> None:
    with open(RunFolder(folder).phases(rank), "a") as out:
        out.write(json.dumps({"phase": phase, "t": at}) + "\n")


def test_ranks_in_the_same_phase_are_grouped():
    assert group_ranks({0: "train", 1: "train", 2: "train", 3: "train", 4: "reference"}) == (
        "r0-3 train  r4 reference"
    )
    assert group_ranks({0: "load"}) == "r0 load"


def test_terminal_status_is_rewritten_and_logs_get_a_line_per_change(tmp_path):
    now = time.time()
    for rank in (0, 1):
        write_phase(tmp_path, rank, "train", now)
    shown, lines = [], []
    live = Progress("c", 2, 300, tmp_path, shown.append, lines.append, quiet_s=0)
    live.tick(12.0)
    live.tick(13.0)
    live.close()
    assert shown == ["c 12s  r0-1 train", "c 13s  r0-1 train", ""] and lines == []
    plain = Progress("c", 2, 300, tmp_path, None, lines.append, quiet_s=0, every_s=30)
    plain.tick(12.0)
    plain.tick(13.0)  # no change, well within every_s: no new line
    write_phase(tmp_path, 1, "reference", time.time())
    plain.tick(14.0)
    assert lines == ["fsdp-turbo: c 12s  r0-1 train", "fsdp-turbo: c 14s  r0 train  r1 reference"]


def test_quick_case_prints_nothing_and_a_stall_warns_once(tmp_path):
    write_phase(tmp_path, 0, "load", time.time() - 200)
    lines = []
    quiet = Progress("c", 1, 1000, tmp_path, None, lines.append, quiet_s=10)
    quiet.tick(5.0)
    assert lines == []  # under quiet_s and no stall
    stalled = Progress("c", 1, 300, tmp_path, None, lines.append, quiet_s=10, stall_share=0.5)
    stalled.tick(5.0)
    stalled.tick(6.0)
    assert len(lines) == 1 and lines[0].startswith(
        "fsdp-turbo: stall: case c rank 0 has been in phase load for 20"
    )
    assert "over 0.5 of the 300s timeout" in lines[0] and stalled.warnings == lines
    # a hang in a collective fails at the collective timeout: the warning comes before it
    lines.clear()
    write_phase(tmp_path, 0, "train", time.time() - 70)
    hung = Progress("c", 1, 300, tmp_path, None, lines.append, quiet_s=10, collective_timeout_s=120)
    hung.tick(5.0)
    assert len(lines) == 1 and "over 0.5 of the 120s collective timeout" in lines[0]


def test_a_slowed_case_shows_its_phases_and_a_stall_warning_then_a_timeline(pytester, tmp_path):
    pytester.makeini(
        f"[pytest]\nfsdp_turbo_cases = {REPO / 'e2e' / 'cases.toml'}\nfsdp_turbo_stall_share = 0.1\nfsdp_turbo_quiet_s = 2\n"
    )
    module = pytester.makepyfile(
        "from pytest_fsdp_turbo import checks\n"
        "def test_slow(ppo_run):\n"
        "    r = ppo_run('tiny-llama-fsdp2-deferred', timeout=20.0, collective_timeout=15.0,\n"
        "                extra_env={'PYTEST_FSDP_TURBO_FAULT': 'stall:1:rollout',\n"
        "                           'PYTEST_FSDP_TURBO_FAULT_STALL_S': '3.5'})\n"
        "    checks.check_completed(r)\n"
    )
    result = pytester.runpytest_subprocess(f"--fsdp-turbo-artifacts={tmp_path / 'art'}")
    result.assert_outcomes(passed=1)
    out = result.stdout.str()
    assert (
        "fsdp-turbo: stall: case tiny-llama-fsdp2-deferred rank 1 has been in phase rollout" in out
    )
    status = [line for line in out.splitlines() if line.startswith("fsdp-turbo: tiny-llama")]
    assert status and any("r1 rollout" in line for line in status), out[-3000:]
    # (a quick case's silence is test_quick_case_prints_nothing_and_a_stall_warns_once's, without
    # the wall clock of a loaded box deciding it)
    from pytest_fsdp_turbo.report import artifact_name

    folder = tmp_path / "art" / artifact_name(f"{module.name}::test_slow")
    rows = json.loads((folder / "timeline.json").read_text())
    stalled = [r for r in rows if r["rank"] == 1 and r["phase"] == "rollout"]
    assert stalled and stalled[0]["end"] - stalled[0]["start"] >= 3.5


def test_under_xdist_the_controller_reports_its_workers_runs(pytester, tmp_path):
    pytester.makeini(
        f"[pytest]\nfsdp_turbo_cases = {REPO / 'e2e' / 'cases.toml'}\nfsdp_turbo_stall_share = 0.1\nfsdp_turbo_quiet_s = 2\n"
    )
    pytester.makepyfile(
        "from pytest_fsdp_turbo import checks\n"
        "def test_first():\n"  # its progress dot is on the line when the status lines come
        "    pass\n"
        "def test_slow(ppo_run):\n"
        "    r = ppo_run('tiny-qwen3-single-rank', timeout=30.0, collective_timeout=20.0,\n"
        "                extra_env={'PYTEST_FSDP_TURBO_FAULT': 'stall:0:rollout',\n"
        "                           'PYTEST_FSDP_TURBO_FAULT_STALL_S': '5'})\n"
        "    checks.check_completed(r)\n"
    )
    result = pytester.runpytest_subprocess("-n", "1", f"--fsdp-turbo-artifacts={tmp_path / 'art'}")
    result.assert_outcomes(passed=2)
    lines = result.stdout.str().splitlines()
    stall = "fsdp-turbo: stall: case tiny-qwen3-single-rank rank 0 has been in phase rollout"
    assert any(line.startswith(stall) for line in lines), lines  # each on a line of its own
    status = [line for line in lines if line.startswith("fsdp-turbo: tiny-qwen3-single-rank ")]
    assert any(" r0 rollout" in line for line in status), lines
    assert not [line for line in lines if "fsdp-turbo:" in line and not line.startswith("fsdp")]


def test_only_the_rank_behind_is_stalled_and_the_status_line_is_cleared_first(tmp_path):
    """Rank 0 stalls in rollout; rank 1 went on to logprobs and waits there for it: one warning,
    for rank 0, written after the live status line was cleared."""
    now, long_ago = time.time(), time.time() - 200
    write_phase(tmp_path, 0, "rollout", now)
    write_phase(tmp_path, 1, "logprobs", long_ago)
    events = []
    live = Progress(
        "c", 2, 300, tmp_path, lambda s: events.append(("live", s)),
        lambda s: events.append(("line", s)), quiet_s=0, stall_share=0.5,
    )  # fmt: skip
    live.tick(1.0)  # rank 0 fresh in rollout; rank 1 ahead, waiting: no warning, a status
    assert [kind for kind, _ in events] == ["live"]
    write_phase(tmp_path, 0, "rollout", long_ago)  # now rank 0 has been there 200 s
    live.tick(2.0)
    kinds = [kind for kind, _ in events]
    assert kinds == ["live", "live", "line", "live"], events  # status, cleared, warning, status
    assert events[1] == ("live", "")
    assert events[2][1].startswith("fsdp-turbo: stall: case c rank 0 has been in phase rollout")
