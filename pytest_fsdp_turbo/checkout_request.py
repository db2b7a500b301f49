"""Where FSDPTurbo should come from, as the options say it, and their validation. Light on purpose:
the plugin reads it at start-up; cloning and verifying live in checkout.py."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from pytest_fsdp_turbo.options import DEFAULT_REPO
from pytest_fsdp_turbo_contract.errors import ConfigError

__all__ = ["DEFAULT_REPO", "CheckoutRequest", "validate_ref", "validate_repo"]
CI_PATH = Path("/FSDPTurbo")
_SCP_LIKE = r"^[\w.-]+@[\w.-]+:[^-]"  # compiled on first use: start-up stays light
_ALLOWED_SCHEMES = ("https://", "ssh://", "git://", "file://")


@dataclass(frozen=True)
class CheckoutRequest:
    path: str | None = None
    repo: str = DEFAULT_REPO
    ref: str | None = None
    cache_dir: Path | None = None
    ci_path: Path = CI_PATH
    attempts: int = 3
    backoff_s: float = 2.0
    git_timeout_s: float = 600.0


def validate_repo(url: str, origin: str = "--fsdp-turbo-repo") -> str:
    if url.startswith("-"):
        raise ConfigError(f"{origin}: must not start with '-'; got {url!r}")
    if "::" in url.split("/")[0]:  # git's <transport>::<address> (ext:: runs a command)
        raise ConfigError(
            f"{origin}: git's <transport>::<address> form is refused; expected an https://, "
            f"ssh://, git:// or file:// URL or a local path; got {url!r}"
        )
    if "://" in url:
        if not url.startswith(_ALLOWED_SCHEMES):
            raise ConfigError(
                f"{origin}: expected an https://, ssh://, git:// or file:// URL or a local path; "
                f"got {url!r}"
            )
    elif not re.match(_SCP_LIKE, url) and ":" in url.split("/")[0] and not Path(url).exists():
        raise ConfigError(f"{origin}: expected a URL or a local path; got {url!r}")
    return url


def validate_ref(ref: str | None, origin: str = "--fsdp-turbo-ref") -> str | None:
    if ref is None or ref == "":
        return None
    if ref.startswith("-") or any(c.isspace() for c in ref) or ".." in ref:
        raise ConfigError(f"{origin}: expected a branch, tag or commit id; got {ref!r}")
    return ref
