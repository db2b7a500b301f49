import json
import multiprocessing
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from pytest_fsdp_turbo.leases import LeaseBook
from pytest_fsdp_turbo_contract.errors import LeaseTimeout


def test_port_is_bindable_and_unique(tmp_path):
    book = LeaseBook(tmp_path)
    ports = [book.port() for _ in range(20)]
    assert len(set(ports)) == 20
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports[0]))
    assert set(book.holders()["ports"]) == {str(p) for p in ports}
    for port in ports:
        book.release_port(port)
    assert book.holders()["ports"] == {}


def test_device_leases_are_disjoint_and_wait(tmp_path):
    book = LeaseBook(tmp_path)
    first = book.devices("cuda", range(4), 3)
    with pytest.raises(LeaseTimeout, match=r"waited 0.3s for 2 cuda devices.*held by live owners"):
        book.devices("cuda", range(4), 2, timeout_s=0.3)
    book.release(first)
    second = book.devices("cuda", range(4), 2, timeout_s=0.3)
    assert len(second.ids) == 2


def test_asking_for_more_than_exist_fails_at_once(tmp_path):
    with pytest.raises(LeaseTimeout, match="only 2 exist"):
        LeaseBook(tmp_path).devices("npu", [0, 1], 3, timeout_s=60)


def _hold_and_die(state_dir, ready):
    book = LeaseBook(state_dir)
    book.devices("npu", range(2), 2)
    book.port()
    book.port_ranges()
    ready.set()  # exits without releasing: a killed worker


def _die_in_a_child(target, state_dir) -> None:
    """`target(state_dir, ready)` in a spawned process that leaves its state behind as it ends."""
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=target, args=(str(state_dir), ready))
    proc.start()
    proc.join(30)
    assert ready.is_set()


def test_dead_holder_is_reclaimed(tmp_path):
    _die_in_a_child(_hold_and_die, tmp_path)
    raw = json.loads((tmp_path / "leases.json").read_text())
    assert len(raw["devices"]) == 2 and len(raw["ports"]) == 1
    book = LeaseBook(tmp_path)
    assert book.devices("npu", range(2), 2, timeout_s=1).ids == (0, 1)
    assert book.holders()["ports"] == {}


def test_a_waiter_in_the_queue_is_served_before_a_holder_that_asks_again(tmp_path):
    """Polling alone let a worker that released and asked again win every time (CI: a 4-rank
    trainer run starved 900 s); a turn taken while waiting is served first."""
    holder, waiter = LeaseBook(tmp_path), LeaseBook(tmp_path)
    held = holder.devices("slot", range(2), 2)
    with waiter.turn("slot") as waiting:
        with pytest.raises(LeaseTimeout, match=r"held by live owners"):
            waiter.devices("slot", range(2), 2, timeout_s=0.2, turn=waiting)
        holder.release(held)
        with holder.turn("slot") as again:
            with pytest.raises(LeaseTimeout, match=r"1 waiter\(s\) ahead in the queue"):
                holder.devices("slot", range(2), 1, timeout_s=0.2, turn=again)
            first = waiter.devices("slot", range(2), 2, timeout_s=0.2, turn=waiting)
            assert first.ids == (0, 1)
            waiter.release(first)
            assert holder.devices("slot", range(2), 1, timeout_s=0.2, turn=again).ids == (0,)
    assert holder.holders()["turns"] == {}


def test_a_granted_turns_exit_never_gives_back_a_later_turn_of_the_same_number(tmp_path):
    """The queue emptied by a grant numbers the next turn 1 again: the first's exit, from the
    same process (threads of one xdist worker), leaves the second's in the queue."""
    book = LeaseBook(tmp_path)
    first = book.turn("slot")
    granted = first.__enter__()
    book.release(book.devices("slot", range(1), 1, timeout_s=0.2, turn=granted))
    second = book.turn("slot")
    waiting = second.__enter__()
    assert granted.split("-")[0] == waiting.split("-")[0] == "slot:000000000001"
    first.__exit__(None, None, None)
    assert waiting in book.holders()["turns"]
    second.__exit__(None, None, None)
    assert book.holders()["turns"] == {}


def _queue_and_die(state_dir, ready):
    waiting = LeaseBook(state_dir).turn("slot")
    waiting.__enter__()
    ready.set()
    os._exit(0)  # a killed worker that was waiting: its turn is never given back


def test_a_dead_waiters_turn_is_skipped(tmp_path):
    _die_in_a_child(_queue_and_die, tmp_path)
    assert len(json.loads((tmp_path / "leases.json").read_text())["turns"]) == 1
    book = LeaseBook(tmp_path)
    with book.turn("slot") as turn:
        assert turn.startswith("slot:000000000001-")  # numbered after the live turns only
        assert book.devices("slot", range(1), 1, timeout_s=0.5, turn=turn).ids == (0,)


def test_hccl_port_range_slots_are_disjoint(tmp_path):
    book = LeaseBook(tmp_path)
    (slot_a, ranges_a), (slot_b, ranges_b) = book.port_ranges(), book.port_ranges()
    assert slot_a != slot_b
    ports_a = {p for lo, hi in ranges_a for p in range(lo, hi + 1)}
    ports_b = {p for lo, hi in ranges_b for p in range(lo, hi + 1)}
    assert not ports_a & ports_b
    book.release_port_ranges(slot_a)
    assert book.port_ranges()[0] == slot_a


def test_concurrent_leases_under_xdist_never_overlap(pytester, tmp_path):
    """Twenty tests on two xdist workers lease ports and devices; the log proves no overlap."""
    log = tmp_path / "lease-log.jsonl"
    held = tmp_path / "held"
    held.mkdir()
    pytester.makepyfile(
        textwrap.dedent(
            f"""
            import json, os
            import pytest

            HELD = {str(held)!r}

            @pytest.mark.parametrize("i", range(20))
            def test_lease(i, device_lease, free_port):
                # while leased, each device and the port is marked held by a file only one
                # process can create: an overlapping lease fails here, whatever the timing
                lease = device_lease(2, timeout_s=60)
                marks = [os.path.join(HELD, f"device{{d}}") for d in lease.ids]
                marks.append(os.path.join(HELD, f"port{{free_port}}"))
                for mark in marks:
                    os.close(os.open(mark, os.O_CREAT | os.O_EXCL))
                with open({str(log)!r}, "a") as f:
                    f.write(json.dumps({{"ids": lease.ids, "pid": os.getpid()}}) + "\\n")
                for mark in marks:
                    os.remove(mark)
            """
        )
    )
    env_state = tmp_path / "state"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-n",
            "2",
            "-q",
            "-p",
            "no:cacheprovider",
            "--fsdp-turbo-device=cpu:4",
            str(pytester.path),
        ],
        env={**__import__("os").environ, "PYTEST_FSDP_TURBO_STATE_DIR": str(env_state)},
        capture_output=True,
        text=True,
        timeout=300,
        cwd=pytester.path,
    )
    assert result.returncode == 0, result.stdout[-2000:]
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(rows) == 20 and len({r["pid"] for r in rows}) > 1
    assert list(held.iterdir()) == []  # every mark made was released by its holder


def test_leases_are_released_when_the_test_fails(pytester, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTEST_FSDP_TURBO_STATE_DIR", str(tmp_path / "state"))
    pytester.makepyfile(
        """
        def test_fails_holding_everything(device_lease, free_port):
            device_lease(4)
            raise RuntimeError("boom")

        def test_then_gets_everything(device_lease):
            assert device_lease(4, timeout_s=2).ids == (0, 1, 2, 3)
        """
    )
    result = pytester.runpytest("--fsdp-turbo-device=cpu:4", "-p", "no:randomly")
    result.assert_outcomes(passed=1, failed=1)
    assert LeaseBook(tmp_path / "state").holders() == {
        "ports": {},
        "devices": {},
        "ranges": {},
        "turns": {},
    }


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (b"[1, 2]", "expected a JSON object of tables ports, devices, ranges"),
        (b'{"ports": {"80": "me"}}', "expected a JSON object of tables"),
        (b"\xff\xfe not text", "is not UTF-8 text"),
    ],
)
def test_a_foreign_lease_state_file_is_one_line_naming_it(tmp_path, content, said):
    from pytest_fsdp_turbo_contract.errors import ConfigError

    (tmp_path / "leases.json").write_bytes(content)
    with pytest.raises(ConfigError) as refused:
        LeaseBook(tmp_path).port()
    message = str(refused.value)
    assert message.startswith(f"lease state file {tmp_path / 'leases.json'} ")
    assert said in message and "\n" not in message


def test_a_fifo_at_the_lease_state_file_is_refused_not_waited_on(tmp_path):
    """Opened for reading, a FIFO with no writer blocks forever: every session on the folder hung.
    Checked in a subprocess with a deadline, so a regression fails instead of hanging the suite."""
    import os

    os.mkfifo(tmp_path / "leases.json")
    code = (
        "import sys; from pytest_fsdp_turbo.leases import LeaseBook\n"
        "try:\n    LeaseBook(sys.argv[1]).port()\n"
        "except Exception as exc:\n    print(type(exc).__name__, exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert done.stdout.startswith(
        f"ConfigError lease state file {tmp_path / 'leases.json'} is not a regular file"
    )


def test_a_symlink_at_the_lease_lock_is_refused(tmp_path):
    from pytest_fsdp_turbo_contract.errors import ConfigError

    victim = tmp_path / "victim"
    victim.write_text("keep me")
    (tmp_path / "leases.lock").symlink_to(victim)
    with pytest.raises(ConfigError, match=r"^lease lock .*leases.lock: expected a regular file"):
        LeaseBook(tmp_path)
    assert victim.read_text() == "keep me"
