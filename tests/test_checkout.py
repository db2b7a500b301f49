"""Real git against repositories made here: bare repos served over file:// URLs."""

import contextlib
import multiprocessing
import os
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from pytest_fsdp_turbo.turbo.checkout import (
    COMPLETE_MARKER,
    CheckoutRequest,
    cache_key,
    clone_cached,
    resolve_checkout,
    validate_ref,
    validate_repo,
)
from pytest_fsdp_turbo_contract.errors import CheckoutUnavailable, ConfigError


def git(*args, cwd=None):
    return subprocess.run(
        ["git", *args],
        cwd=cwd,
        check=True,
        capture_output=True,
        text=True,
        env={
            **os.environ,
            "GIT_AUTHOR_NAME": "t",
            "GIT_AUTHOR_EMAIL": "t@t",
            "GIT_COMMITTER_NAME": "t",
            "GIT_COMMITTER_EMAIL": "t@t",
        },
    ).stdout.strip()


@pytest.fixture
def upstream(tmp_path) -> dict:
    work = tmp_path / "work"
    (work / "fsdp_turbo").mkdir(parents=True)
    (work / "fsdp_turbo/__init__.py").write_text("VERSION = 1\n")
    git("init", "-q", "-b", "main", cwd=work)
    git("add", ".", cwd=work)
    git("commit", "-q", "-m", "v1", cwd=work)
    first = git("rev-parse", "HEAD", cwd=work)
    git("tag", "v1", cwd=work)
    (work / "fsdp_turbo/__init__.py").write_text("VERSION = 2\n")
    git("commit", "-q", "-am", "v2", cwd=work)
    second = git("rev-parse", "HEAD", cwd=work)
    bare = tmp_path / "FSDPTurbo.git"
    git("clone", "-q", "--bare", str(work), str(bare))
    return {"url": f"file://{bare}", "first": first, "second": second, "bare": bare}


def request(url, ref=None, cache=None, **kw):
    return CheckoutRequest(
        repo=url, ref=ref, cache_dir=cache, ci_path=Path("/nonexistent"), backoff_s=0.01, **kw
    )


def test_full_commit_is_checked_out_exactly(upstream, tmp_path):
    got = clone_cached(request(upstream["url"], upstream["first"], tmp_path / "cache"))
    assert got.commit == upstream["first"]
    assert (got.path / "fsdp_turbo/__init__.py").read_text() == "VERSION = 1\n"
    assert got.pythonpath == str(got.path)


def test_branch_and_tag_refs(upstream, tmp_path):
    assert (
        clone_cached(request(upstream["url"], "main", tmp_path / "c")).commit == upstream["second"]
    )
    assert clone_cached(request(upstream["url"], "v1", tmp_path / "c")).commit == upstream["first"]


def test_cache_is_reused_without_git_fetch(upstream, tmp_path):
    cache = tmp_path / "cache"
    first = clone_cached(request(upstream["url"], "v1", cache))
    upstream["bare"].rename(upstream["bare"].with_suffix(".moved"))  # the network is gone
    again = clone_cached(request(upstream["url"], "v1", cache))
    assert again.path == first.path and "cached" in again.source


def test_missing_ref_fails_with_git_reason(upstream, tmp_path):
    with pytest.raises(CheckoutUnavailable, match=r"ref 'nope' not found.*after 1 attempt"):
        clone_cached(request(upstream["url"], "nope", tmp_path / "cache"))


def test_missing_local_repository_fails_at_once(tmp_path):
    url = f"file://{tmp_path}/absent.git"
    with pytest.raises(CheckoutUnavailable, match=r"absent.git does not exist$"):
        clone_cached(request(url, "main", tmp_path / "cache", attempts=3, git_timeout_s=30))


def test_unreachable_url_retries_then_reports(tmp_path):
    url = "git://127.0.0.1:1/absent.git"  # connection refused: a transient failure, retried
    start = time.monotonic()
    with pytest.raises(CheckoutUnavailable) as info:
        clone_cached(request(url, "main", tmp_path / "cache", attempts=3))
    message = str(info.value)
    assert url in message and "after 3 attempt(s)" in message and "git clone failed" in message
    assert time.monotonic() - start >= 0.03  # backoff 0.01 + 0.02 between attempts
    assert not list((tmp_path / "cache").glob("*.partial-*"))


def test_corrupt_or_partial_cache_is_never_used(upstream, tmp_path):
    cache = tmp_path / "cache"
    key = cache_key(upstream["url"], "v1")
    broken = cache / key
    (broken / "fsdp_turbo").mkdir(parents=True)
    (broken / "fsdp_turbo/__init__.py").write_text("HALF = True\n")  # no completion marker
    (cache / f"{key}.partial-99999").mkdir()
    got = clone_cached(request(upstream["url"], "v1", cache))
    assert (got.path / "fsdp_turbo/__init__.py").read_text() == "VERSION = 1\n"
    assert (got.path / COMPLETE_MARKER).is_file()
    assert not (cache / f"{key}.partial-99999").exists()


def _clone_into(url, ref, cache, out_queue):
    got = clone_cached(request(url, ref, Path(cache)))
    out_queue.put((str(got.path), got.commit))


def test_two_processes_clone_at_once_share_one_clone(upstream, tmp_path):
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_clone_into,
            args=(upstream["url"], upstream["second"], str(tmp_path / "cache"), results),
        )
        for _ in range(2)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(60)
        assert proc.exitcode == 0
    got = {results.get(timeout=5) for _ in procs}
    assert got == {
        (
            str(tmp_path / "cache" / cache_key(upstream["url"], upstream["second"])),
            upstream["second"],
        )
    }


def test_clone_killed_half_way_is_not_used_later(upstream, tmp_path):
    """A clone stopped mid-way (SIGKILL) leaves only a partial folder that the next run replaces."""
    cache = tmp_path / "cache"
    hook_dir = tmp_path / "slowgit"
    hook_dir.mkdir()
    slow = hook_dir / "git"
    # git -c credential.helper= -c core.askPass= clone ...: clone, then stall before checkout
    slow.write_text(
        f'#!/bin/sh\nif [ "$5" = "clone" ]; then '
        f'{_real_git()} "$@"; sleep 30; fi\nexec {_real_git()} "$@"\n'
    )
    slow.chmod(0o755)
    ctx = multiprocessing.get_context("spawn")
    env_path = f"{hook_dir}:{os.environ['PATH']}"
    proc = ctx.Process(target=_clone_with_path, args=(upstream["url"], str(cache), env_path))
    proc.start()
    deadline = time.monotonic() + 30
    while (
        time.monotonic() < deadline
        and not list(cache.glob("*.partial-*/fsdp_turbo"))
        and not list(cache.glob("*.partial-*/.git"))
    ):
        time.sleep(0.05)
    # the whole clone dies at once, its git included: a git left running would keep writing into
    # the partial folder after the next run has cleared it
    clone = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    for started in clone:
        with contextlib.suppress(psutil.NoSuchProcess):  # a git helper that just finished
            started.kill()
    psutil.wait_procs(clone, timeout=10)
    proc.join(10)
    assert list(cache.glob("*.partial-*")), "the clone should have been caught half-way"
    assert not (cache / cache_key(upstream["url"], "main")).exists()
    got = clone_cached(request(upstream["url"], "main", cache))
    assert got.commit == upstream["second"] and (got.path / COMPLETE_MARKER).is_file()
    assert not list(cache.glob("*.partial-*"))


def _real_git():
    return subprocess.run(
        ["sh", "-c", "command -v git"], capture_output=True, text=True
    ).stdout.strip()


def _clone_with_path(url, cache, path):
    os.environ["PATH"] = path
    clone_cached(request(url, "main", Path(cache)))


def test_explicit_path_then_ci_path(upstream, tmp_path):
    checkout = clone_cached(request(upstream["url"], "v1", tmp_path / "cache"))
    explicit = resolve_checkout(CheckoutRequest(path=str(checkout.path)))
    assert explicit.path == checkout.path and explicit.commit == upstream["first"]
    ci = resolve_checkout(CheckoutRequest(ci_path=checkout.path, repo="file:///absent"))
    assert ci.source.startswith("CI checkout")
    with pytest.raises(CheckoutUnavailable, match="FSDP_TURBO_PATH / --fsdp-turbo-path"):
        resolve_checkout(CheckoutRequest(path=str(tmp_path)))


@pytest.mark.parametrize(
    "url", ["-uhttps://x", "http://example.com/r.git", "ext::sh -c x", "ftp://host/r.git"]
)
def test_bad_urls_rejected(url):
    with pytest.raises(ConfigError, match=r"^--fsdp-turbo-repo: "):
        validate_repo(url)


@pytest.mark.parametrize(
    "url",
    [
        "https://gitcode.com/Ascend/FSDPTurbo.git",
        "git@host:o/r.git",
        "ssh://git@host/r.git",
        "file:///srv/r.git",
        "/srv/r.git",
    ],
)
def test_good_urls_accepted(url):
    assert validate_repo(url) == url


@pytest.mark.parametrize("ref", ["--upload-pack=x", "-x", "a b", "a..b"])
def test_bad_refs_rejected(ref):
    with pytest.raises(ConfigError, match=r"^--fsdp-turbo-ref: expected"):
        validate_ref(ref)


def test_a_transport_address_is_refused_even_where_it_exists_as_a_folder(tmp_path, monkeypatch):
    """`ext::sh -c ...` named as FSDP_TURBO_REPO: refused before git runs, also when a folder of
    that name exists in the working directory (the old check took it for a local path)."""
    payload = f"ext::sh -c touch% {tmp_path / 'ran'}"
    monkeypatch.chdir(tmp_path)
    (tmp_path / payload.split("/")[0]).mkdir()
    with pytest.raises(ConfigError, match=r"^FSDP_TURBO_REPO: git's <transport>::<address> form"):
        validate_repo(payload, "FSDP_TURBO_REPO")


def test_git_runs_only_the_transports_the_harness_means(tmp_path, monkeypatch):
    """Past the check (here called directly), git itself refuses the ext transport even when the
    environment allows it: the harness pins GIT_ALLOW_PROTOCOL for its own git calls."""
    from pytest_fsdp_turbo.turbo.checkout import _clone_once

    marker = tmp_path / "ran"
    monkeypatch.setenv("GIT_ALLOW_PROTOCOL", "ext:file")
    with pytest.raises(CheckoutUnavailable, match="git clone failed"):
        _clone_once(f"ext::sh -c touch% {marker}", None, tmp_path / "scratch", 30)
    assert not marker.exists()


def test_an_edited_cache_entry_is_cloned_again(upstream, tmp_path):
    """The marker and HEAD are not enough: a tracked file changed (or a file added) after the
    clone makes the entry stale, and the next resolve clones it afresh."""
    cache = tmp_path / "cache"
    first = clone_cached(request(upstream["url"], "v1", cache))
    (first.path / "fsdp_turbo/__init__.py").write_text("import os  # edited\n")
    again = clone_cached(request(upstream["url"], "v1", cache))
    assert (again.path / "fsdp_turbo/__init__.py").read_text() == "VERSION = 1\n"
    (again.path / "fsdp_turbo/extra.py").write_text("planted = True\n")
    third = clone_cached(request(upstream["url"], "v1", cache))
    assert not (third.path / "fsdp_turbo/extra.py").exists()


@pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user needs root")
def test_a_cache_entry_another_user_owns_is_refused_even_with_safe_directory_star(
    upstream, tmp_path, monkeypatch
):
    cache = tmp_path / "cache"
    got = clone_cached(request(upstream["url"], "v1", cache))
    os.chown(got.path / "fsdp_turbo/__init__.py", 12345, 12345)
    monkeypatch.setenv("GIT_CONFIG_COUNT", "1")  # safe.directory=*, as many CI images set it
    monkeypatch.setenv("GIT_CONFIG_KEY_0", "safe.directory")
    monkeypatch.setenv("GIT_CONFIG_VALUE_0", "*")
    with pytest.raises(CheckoutUnavailable) as refused:
        clone_cached(request(upstream["url"], "v1", cache))
    message = str(refused.value)
    assert f"FSDPTurbo cache entry {got.path} is not this user's: " in message
    assert "is owned by uid 12345, not by this user (uid 0)" in message and "\n" not in message


def test_the_harness_git_ignores_the_git_variables_of_a_hook(upstream, tmp_path, monkeypatch):
    """Run from a pre-commit hook of `git commit -a`, the environment names the user's index and
    repository; the harness's git must neither touch them nor read the checkout through them."""
    user = tmp_path / "user-repo"
    user.mkdir()
    git("init", "-q", cwd=user)
    (user / "a.txt").write_text("a\n")
    git("add", "a.txt", cwd=user)
    index = user / ".git" / "index"
    before = index.read_bytes()
    monkeypatch.setenv("GIT_INDEX_FILE", str(index))
    monkeypatch.setenv("GIT_DIR", str(user / ".git"))
    monkeypatch.setenv("GIT_WORK_TREE", str(user))
    got = clone_cached(request(upstream["url"], "v1", tmp_path / "cache"))
    assert (got.path / "fsdp_turbo/__init__.py").read_text() == "VERSION = 1\n"
    assert clone_cached(request(upstream["url"], "v1", tmp_path / "cache")).path == got.path
    assert index.read_bytes() == before


def test_what_imports_leave_in_a_cached_checkout_keeps_it(upstream, tmp_path):
    cache = tmp_path / "cache"
    first = clone_cached(request(upstream["url"], "v1", cache))
    (first.path / "fsdp_turbo" / "__pycache__").mkdir()
    (first.path / "fsdp_turbo" / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"\0")
    again = clone_cached(request(upstream["url"], "v1", cache))
    assert "cached" in again.source  # used as it is, not cloned again under running ranks
