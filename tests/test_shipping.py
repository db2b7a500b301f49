"""What a Ray case sends to its nodes (launching/shipping.py); the two-node proof, with a node that
lacks the driver's folders, is tests/test_ray_multinode.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pytest_fsdp_turbo.cases import load_cases
from pytest_fsdp_turbo.devices import detect
from pytest_fsdp_turbo.launching import shipping
from pytest_fsdp_turbo.launching.request import RunRequest, shipped_folders
from pytest_fsdp_turbo.turbo.checkout import Checkout

REPO = Path(__file__).resolve().parent.parent


def _folder(root: Path) -> Path:
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text("X = 1\n")
    (root / "run.sh").write_text("#!/bin/sh\n")
    (root / "run.sh").chmod(0o755)
    for junk in (".git/HEAD", "pkg/__pycache__/m.cpython-311.pyc", ".venv/lib/x.py", "m.lock"):
        (root / junk).parent.mkdir(parents=True, exist_ok=True)
        (root / junk).write_text("not sent")
    return root


def test_a_folder_is_sent_by_its_content_and_unpacked_whole(tmp_path):
    a, b = _folder(tmp_path / "a"), _folder(tmp_path / "b")
    packed_a, packed_b = shipping.pack(str(a)), shipping.pack(str(b))
    assert packed_a.digest == packed_b.digest  # the content names it, not the path or the times
    (b / "pkg" / "__init__.py").write_text("X = 2\n")
    assert shipping.pack(str(b)).digest != packed_a.digest
    shipping.unpack(packed_a.data, tmp_path / "node")
    sent = sorted(
        p.relative_to(tmp_path / "node").as_posix() for p in (tmp_path / "node").rglob("*")
    )
    assert sent == ["pkg", "pkg/__init__.py", "run.sh"]
    assert (tmp_path / "node" / "run.sh").stat().st_mode & 0o111  # still executable


def test_a_folder_too_large_or_missing_is_one_line_naming_it(tmp_path, monkeypatch):
    folder = _folder(tmp_path / "engines")
    monkeypatch.setattr(shipping, "SHIP_LIMIT_BYTES", 8)
    with pytest.raises(ValueError) as refused:
        shipping.pack(str(folder))
    assert str(refused.value).startswith(f"{folder}: a Ray case sends this folder to its nodes")
    with pytest.raises(ValueError, match="it is not a folder"):
        shipping.pack(str(tmp_path / "nowhere"))


def test_links_inside_the_folder_are_followed_and_nothing_outside_it_is_reached(tmp_path):
    """A link to a folder out of it (a home folder with .ssh), a link to /dev/zero and a FIFO are
    each one line naming the path, before anything is read: never sent, never a hang."""
    folder = _folder(tmp_path / "engines")
    (folder / "alias").symlink_to(folder / "pkg")  # inside: followed
    shipping.unpack(shipping.pack(str(folder)).data, tmp_path / "node")
    assert (tmp_path / "node" / "alias" / "__init__.py").read_text() == "X = 1\n"
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id_rsa").write_text("secret")
    for name, make, words in [
        ("homelink", lambda p: p.symlink_to(home), f"links out of it, to {home}"),
        ("zero", lambda p: p.symlink_to("/dev/zero"), "links out of it, to /dev/zero"),
        ("fifo", os.mkfifo, "is not a regular file (a FIFO, a device or a socket)"),
    ]:
        hostile = _folder(tmp_path / name)
        make(hostile / name)
        with pytest.raises(ValueError) as refused:
            shipping.pack(str(hostile))
        assert str(refused.value).startswith(f"{hostile}: a Ray case sends this folder"), refused
        assert f"{hostile / name}" in str(refused.value) and words in str(refused.value)


def test_paths_under_a_sent_folder_point_at_its_copy_on_the_node():
    places = {"/drv/models/tiny": "/node/r0/shipped/0", "/drv/engines/": "/node/r0/shipped/1"}
    assert shipping.moved("/drv/models/tiny", places) == "/node/r0/shipped/0"
    assert shipping.moved("/drv/engines/acme/x.py", places) == "/node/r0/shipped/1/acme/x.py"
    assert shipping.moved("/drv/models/tiny2", places) == "/drv/models/tiny2"  # not under it
    search = shipping.moved_search_path("/drv/engines:/opt/site", places)
    assert search == "/node/r0/shipped/1:/opt/site"


def test_a_case_sends_its_tiny_model_pythonpath_and_checkout_never_a_real_model(tmp_path):
    cases = {case.id: case for case in load_cases(REPO / "e2e" / "cases.toml")}
    turbo = next(c for c in cases.values() if c.is_turbo and c.model.startswith("tiny-"))
    real = next(c for c in cases.values() if not c.model.startswith("tiny-"))
    checkout = Checkout(tmp_path / "FSDPTurbo", None, "test")
    request = RunRequest(
        case=turbo,
        model_path=tmp_path / "cache" / "tiny",
        artifacts_dir=tmp_path / "out",
        accelerator=detect("cpu"),  # the kind only: nothing is launched
        checkout=checkout,
        pythonpath=[str(tmp_path / "engines")],
    )
    sent = [str(tmp_path / p) for p in ("cache/tiny", "engines", "FSDPTurbo")]
    assert shipped_folders(request) == sent
    request.case, request.model_path = real, tmp_path / "models" / "big"
    assert str(tmp_path / "models" / "big") not in shipped_folders(request)


def test_a_linked_folder_is_sent_once_and_the_innermost_copy_holds_a_path(tmp_path):
    root = _folder(tmp_path / "engines")
    (root / "linked").symlink_to(root / "pkg", target_is_directory=True)
    (root / "loop").symlink_to(root, target_is_directory=True)  # a link loop ends
    shipping.unpack(shipping.pack(str(root)).data, tmp_path / "node")
    assert (tmp_path / "node" / "linked" / "__init__.py").read_text() == "X = 1\n"
    assert (tmp_path / "node" / "pkg" / "__init__.py").is_file()  # the folder itself too
    assert not (tmp_path / "node" / "loop").exists()
    places = {"/drv/repo": "/node/0", "/drv/repo/FSDPTurbo": "/node/1"}
    assert shipping.moved("/drv/repo/FSDPTurbo/fsdp_turbo", places) == "/node/1/fsdp_turbo"
