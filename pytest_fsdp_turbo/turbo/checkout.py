"""FSDPTurbo checkout provisioning: an explicit path, the CI convention /FSDPTurbo, or a cached clone.

A clone is made once per cache key under a lock shared by all xdist workers, in a scratch folder that
is renamed into place only when complete and verified, so a clone killed half-way is never used.
git runs without a shell and without ever prompting for credentials.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from pytest_fsdp_turbo.checkout_request import (
    _SCP_LIKE,
    CheckoutRequest,
    validate_ref,
    validate_repo,
)
from pytest_fsdp_turbo.private_dirs import private_dir
from pytest_fsdp_turbo.settings import HarnessEnv
from pytest_fsdp_turbo_contract.errors import CheckoutUnavailable, ConfigError

PACKAGE = "fsdp_turbo"
COMPLETE_MARKER = ".pytest-fsdp-turbo-complete"
_FULL_SHA = re.compile(r"^[0-9a-f]{40}$")
_GIT_ENV = {
    "GIT_TERMINAL_PROMPT": "0",
    "GIT_ASKPASS": "/bin/false",
    "SSH_ASKPASS": "/bin/false",
    "GIT_SSH_COMMAND": "ssh -o BatchMode=yes",
    "GCM_INTERACTIVE": "never",
    # the transports the harness means, whatever the environment allows (GIT_ALLOW_PROTOCOL=ext
    # would let a crafted URL run a command)
    "GIT_ALLOW_PROTOCOL": "file:https:ssh:git",
}


@dataclass(frozen=True)
class Checkout:
    path: Path
    commit: str | None
    source: str
    # a test double of the library (a stand-in): on a torch outside the range it declares it still
    # runs, with a warning that the run is no evidence for that torch; the library itself never does
    stand_in: bool = False

    @property
    def pythonpath(self) -> str:
        """The entry child processes put on PYTHONPATH to import `fsdp_turbo`."""
        return str(self.path)


# the variables that point git at a repository (`git rev-parse --local-env-vars`, less the
# configuration ones a CI image sets on purpose: safe.directory, CA bundles)
_REPOSITORY_VARS = (
    "GIT_ALTERNATE_OBJECT_DIRECTORIES",
    "GIT_COMMON_DIR",
    "GIT_DIR",
    "GIT_GRAFT_FILE",
    "GIT_IMPLICIT_WORK_TREE",
    "GIT_INDEX_FILE",
    "GIT_NO_REPLACE_OBJECTS",
    "GIT_OBJECT_DIRECTORY",
    "GIT_PREFIX",
    "GIT_REPLACE_REF_BASE",
    "GIT_SHALLOW_FILE",
    "GIT_WORK_TREE",
    "GIT_QUARANTINE_PATH",
    "GIT_NAMESPACE",
)


def git_environment() -> dict[str, str]:
    """This process's environment without the variables that locate a repository: run from a
    hook (`git commit -a` sets GIT_INDEX_FILE, GIT_DIR and friends), the harness's git would
    otherwise act on the user's repository instead of the checkout it was pointed at. Then the
    harness's own."""
    kept = {k: v for k, v in os.environ.items() if k not in _REPOSITORY_VARS}
    return {**kept, **_GIT_ENV}


def _git(args: list[str], cwd: Path | None, timeout_s: float) -> str:
    env = git_environment()
    try:
        done = subprocess.run(
            ["git", "-c", "credential.helper=", "-c", "core.askPass=", *args],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise CheckoutUnavailable(f"git {args[0]} timed out after {timeout_s:g}s") from None
    except FileNotFoundError:
        raise CheckoutUnavailable("git is not installed") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        raise CheckoutUnavailable(f"git {args[0]} failed: {last}")
    return done.stdout.strip()


def _has_package(path: Path) -> bool:
    return (path / PACKAGE / "__init__.py").is_file()


def _commit_of(path: Path) -> str | None:
    if not (path / ".git").exists():
        return None
    try:
        return _git(["rev-parse", "HEAD"], path, 30)
    except CheckoutUnavailable:
        return None


def default_cache_dir() -> Path:
    return HarnessEnv.read().cache_home / "pytest-fsdp-turbo" / "checkouts"


def cache_key(repo: str, ref: str | None) -> str:
    return hashlib.sha256(f"{repo}\n{ref or 'HEAD'}".encode()).hexdigest()[:16]


def _local_repo_path(repo: str) -> Path | None:
    """The folder a file:// URL or a plain path names; None for a remote URL."""
    if repo.startswith("file://"):
        return Path(repo.removeprefix("file://"))
    if "://" in repo or re.match(_SCP_LIKE, repo):
        return None
    return Path(repo)


def _clone_once(repo: str, ref: str | None, scratch: Path, timeout_s: float) -> str:
    _git(["clone", "--quiet", "--no-checkout", "--", repo, str(scratch)], None, timeout_s)
    if ref is None:
        target = "HEAD"
    elif _FULL_SHA.match(ref):
        target = ref
    else:
        target = None
        for candidate in (f"refs/tags/{ref}", f"refs/remotes/origin/{ref}", ref):
            try:
                target = _git(
                    ["rev-parse", "--verify", "--quiet", f"{candidate}^{{commit}}"], scratch, 60
                )
                break
            except CheckoutUnavailable:
                continue
        if target is None:
            raise CheckoutUnavailable(f"ref {ref!r} not found in {repo}")
    _git(
        ["-c", "advice.detachedHead=false", "checkout", "--quiet", "--detach", target],
        scratch,
        timeout_s,
    )
    commit = _git(["rev-parse", "HEAD"], scratch, 60)
    if _FULL_SHA.match(ref or "") and commit != ref:
        raise CheckoutUnavailable(f"checked out {commit}, expected {ref}")
    if not _has_package(scratch):
        raise CheckoutUnavailable(f"{repo}@{ref or 'HEAD'} has no {PACKAGE}/ package")
    return commit


def _foreign_owner(final: Path) -> str | None:
    """A cache entry (or anything in it) another user owns: git's safe.directory=* would let the
    harness use it as if it were its own clone. One line naming the path and its owner."""
    me = os.getuid()
    for path in (final, *final.rglob("*")):
        owner = path.lstat().st_uid
        if owner != me:
            return f"{path} is owned by uid {owner}, not by this user (uid {me})"
    return None


def _verified_cached(final: Path, ref: str | None) -> str | None:
    """The commit of a complete, unedited, own cache entry; None: clone it again."""
    marker = final / COMPLETE_MARKER
    if not marker.is_file() or not _has_package(final):
        return None
    if foreign := _foreign_owner(final):
        raise CheckoutUnavailable(
            f"FSDPTurbo cache entry {final} is not this user's: {foreign}; remove it or set "
            "XDG_CACHE_HOME to a cache of your own"
        )
    commit = marker.read_text().strip()
    if _FULL_SHA.match(ref or "") and commit != ref:
        return None
    if _commit_of(final) != commit:
        return None
    try:  # files edited after the clone (tracked ones changed, or new ones added)
        edited = _git(["status", "--porcelain", "--ignored=no"], final, 60)
    except CheckoutUnavailable:
        return None
    changed = [
        line
        for line in edited.splitlines()
        if line[3:] != COMPLETE_MARKER and "__pycache__/" not in line  # what imports leave
    ]
    return None if changed else commit


def clone_cached(request: CheckoutRequest, clone: bool = True) -> Checkout:
    from filelock import FileLock  # when cloning: the header's lookup stays light

    repo = validate_repo(request.repo)
    ref = validate_ref(request.ref)
    cache = private_dir(
        request.cache_dir or default_cache_dir(), "FSDPTurbo checkout cache", "XDG_CACHE_HOME"
    )
    key = cache_key(repo, ref)
    final = cache / key
    source = f"{repo}@{ref or 'HEAD'}"
    with FileLock(str(cache / f"{key}.lock")):
        commit = _verified_cached(final, ref)
        if commit:
            return Checkout(final, commit, f"cached clone of {source}")
        if not clone:
            raise CheckoutUnavailable(f"{source} is not cloned yet (cache {cache})")
        shutil.rmtree(final, ignore_errors=True)
        for stale in cache.glob(f"{key}.partial-*"):
            shutil.rmtree(stale, ignore_errors=True)
        local = _local_repo_path(repo)
        if local is not None and not local.exists():  # no retry can make it appear
            raise CheckoutUnavailable(
                f"FSDPTurbo from {source}: git clone failed: {local} does not exist"
            )
        last_error, tries = "", 0
        for attempt in range(request.attempts):
            tries = attempt + 1
            scratch = cache / f"{key}.partial-{os.getpid()}"
            shutil.rmtree(scratch, ignore_errors=True)
            try:
                commit = _clone_once(repo, ref, scratch, request.git_timeout_s)
            except CheckoutUnavailable as exc:
                last_error = str(exc)
                shutil.rmtree(scratch, ignore_errors=True)
                if "not found" in last_error or f"no {PACKAGE}/" in last_error:
                    break  # retrying cannot make a missing ref appear
                if attempt + 1 < request.attempts:
                    time.sleep(request.backoff_s * (2**attempt))
                continue
            (scratch / COMPLETE_MARKER).write_text(commit + "\n")
            os.replace(scratch, final)
            return Checkout(final, commit, f"clone of {source}")
    raise CheckoutUnavailable(f"FSDPTurbo from {source}: {last_error} (after {tries} attempt(s))")


def find_checkout(request: CheckoutRequest) -> Checkout | None:
    """A checkout that is already there (path, /FSDPTurbo, complete cached clone), or None.

    Takes no lock and creates nothing: safe for the report header of any pytest session."""
    if request.path:
        path = Path(request.path)
        return Checkout(path, _commit_of(path), f"path {path}") if _has_package(path) else None
    if _has_package(request.ci_path):
        return Checkout(
            request.ci_path, _commit_of(request.ci_path), f"CI checkout {request.ci_path}"
        )
    try:
        repo, ref = validate_repo(request.repo), validate_ref(request.ref)
    except ConfigError:
        return None
    final = (request.cache_dir or default_cache_dir()) / cache_key(repo, ref)
    try:  # a foreign or half-removed entry is no checkout here; resolving it says why
        commit = _verified_cached(final, ref) if final.is_dir() else None
    except (CheckoutUnavailable, OSError):
        return None
    return Checkout(final, commit, f"cached clone of {repo}@{ref or 'HEAD'}") if commit else None


def resolve_checkout(request: CheckoutRequest, clone: bool = True) -> Checkout:
    """Explicit path, then the CI convention, then a cached clone (made now unless clone=False)."""
    if request.path:
        path = Path(request.path)
        if not _has_package(path):
            raise CheckoutUnavailable(
                f"FSDP_TURBO_PATH / --fsdp-turbo-path {path}: no {PACKAGE}/__init__.py there"
            )
        return Checkout(path, _commit_of(path), f"path {path}")
    if _has_package(request.ci_path):
        return Checkout(
            request.ci_path, _commit_of(request.ci_path), f"CI checkout {request.ci_path}"
        )
    return clone_cached(request, clone)
