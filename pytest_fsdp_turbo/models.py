"""Model directories for cases: tiny models built once (in a subprocess: torch stays out of pytest)
and cached under a lock, or local real-model directories checked for completeness."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from importlib import metadata
from pathlib import Path

from filelock import FileLock

from pytest_fsdp_turbo.cases import (
    FIXTURES_DIR,
    MODEL_NAME,
    TINY_PREFIX,
    tiny_spec_dirs,
    tiny_spec_path,
    tiny_specs,
)
from pytest_fsdp_turbo.private_dirs import private_dir
from pytest_fsdp_turbo.processes.warm import run_module
from pytest_fsdp_turbo.settings import HarnessEnv
from pytest_fsdp_turbo_contract.errors import SPEC_ERROR_EXIT, ConfigError

BUILDER_MODULE = "pytest_fsdp_turbo_engine.tiny_models"
BUILD_TIMEOUT_S = 300
REQUIRED_FILES = ("config.json",)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
SAFETENSORS_HEADER_MAX = 100 << 20  # safetensors' own bound on a header


class ModelUnavailable(LookupError):
    """A case's model cannot be had here; the message names the path that was tried."""


def default_model_cache() -> Path:
    return HarnessEnv.read().cache_home / "pytest-fsdp-turbo" / "models"


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "none"


def tiny_model_key(name: str, spec_path: Path) -> str:
    spec = spec_path.read_bytes()
    builder = Path(importlib.util.find_spec("pytest_fsdp_turbo_engine.tiny_models").origin)
    digest = hashlib.sha256(
        spec
        + builder.read_bytes()  # read, not imported: the pytest process stays torch-free
        + _version("transformers").encode()
        + _version("torch").encode()
    )
    return f"{name}-{digest.hexdigest()[:12]}"


def build_tiny_model(
    name: str,
    cache_dir: Path | None = None,
    tiny_models: Path | None = None,
    fixtures_dir: Path = FIXTURES_DIR,
) -> Path:
    """Build (once per spec, transformers and torch version) and return the HF model directory;
    the spec comes from the downstream's --fsdp-turbo-tiny-models folder, else the built-ins."""
    dirs = tiny_spec_dirs(tiny_models, fixtures_dir)
    spec_path = tiny_spec_path(name, dirs)
    if spec_path is None:
        known = tiny_specs(tiny_models, fixtures_dir)
        where = ", ".join(str(d) for d in dirs)
        raise ModelUnavailable(f"tiny model spec {name}.json is in none of {where}; known: {known}")
    cache = private_dir(cache_dir or default_model_cache(), "tiny model cache", "XDG_CACHE_HOME")
    final = cache / tiny_model_key(name, spec_path)
    with FileLock(str(final) + ".lock"):
        if (final / "config.json").is_file():
            return final
        scratch = Path(f"{final}.partial-{os.getpid()}")
        shutil.rmtree(scratch, ignore_errors=True)
        done = run_module(  # forked from a warm parent when this process tree has one
            BUILDER_MODULE,
            [name, str(scratch), "--spec-dir", str(spec_path.parent)],
            timeout_s=BUILD_TIMEOUT_S,
            env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"},
        )
        if done.returncode == SPEC_ERROR_EXIT:  # the spec is wrong: one line, and a failure
            shutil.rmtree(scratch, ignore_errors=True)
            raise ConfigError((done.stderr.strip().splitlines() or ["(no output)"])[-1])
        if done.returncode != 0:
            shutil.rmtree(scratch, ignore_errors=True)
            tail = "\n".join(done.stderr.strip().splitlines()[-15:])
            raise ModelUnavailable(f"building tiny model {name!r} failed:\n{tail}")
        os.replace(scratch, final)
    return final


def missing_model(name: str, models_dir: Path | None) -> list[str]:
    """A real model's folder as collection finds it: [] when it is there, else the one line why."""
    try:
        local_model_dir(name, models_dir)
    except ModelUnavailable as exc:
        return [str(exc)]
    return []


def local_model_dir(name: str, models_dir: Path | None) -> Path:
    """A real model the user keeps locally; missing or incomplete is a skip, with the path."""
    if models_dir is None:
        raise ModelUnavailable(
            f"model {name!r} is a local model; set --fsdp-turbo-models / PYTEST_FSDP_TURBO_MODELS "
            "to the folder that holds it"
        )
    path = models_dir / name
    if not MODEL_NAME.fullmatch(name):  # the case file's own rule, for callers that skip it
        raise ModelUnavailable(f"model {name!r}: not a folder name inside {models_dir}")
    if not path.is_dir():  # a folder inside, or a link placed there on purpose (shared storage)
        raise ModelUnavailable(f"model directory {path} does not exist")
    missing = [f for f in REQUIRED_FILES if not (path / f).is_file()]
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        missing.append("weights (*.safetensors)")
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        missing.append(f"a tokenizer (one of {', '.join(TOKENIZER_FILES)})")
    if missing:
        raise ModelUnavailable(
            f"model directory {path} is incomplete: missing {', '.join(missing)}"
        )
    for weights in sorted(path.glob("*.safetensors")):
        if problem := safetensors_problem(weights):
            raise ModelUnavailable(f"model directory {path}: {weights.name} {problem}")
    return path


def safetensors_problem(path: Path) -> str | None:
    """What is wrong with a safetensors file's header (its length, then a JSON object), read
    without loading a tensor; None when it reads."""
    try:
        with open(path, "rb") as weights:
            size = os.fstat(weights.fileno()).st_size
            length = int.from_bytes(weights.read(8), "little")
            if size < 8 or not 2 <= length <= min(size - 8, SAFETENSORS_HEADER_MAX):
                return f"is not a safetensors file (header of {length} bytes in {size})"
            header = json.loads(weights.read(length))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return f"is not a safetensors file ({exc})"
    return (
        None if isinstance(header, dict) else "is not a safetensors file (its header is no object)"
    )


def model_type_of(path: Path) -> str:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelUnavailable(f"{path / 'config.json'}: unreadable: {exc}") from None
    if not isinstance(config, dict):
        raise ModelUnavailable(
            f"{path / 'config.json'}: expected a JSON object (a model config); got a "
            f"{type(config).__name__}"
        )
    return str(config.get("model_type", "*"))


def resolve_model(
    name: str, models_dir: Path | None, cache_dir: Path | None = None, tiny_models=None
) -> Path:
    if name.startswith(TINY_PREFIX):
        return build_tiny_model(name, cache_dir, tiny_models)
    return local_model_dir(name, models_dir)
